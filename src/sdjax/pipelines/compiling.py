"""Compiling ahead of time: `compile` (what `generate_arrays` runs for one setting), `warmup` and `aot_compile` (a
callable over the compiled text-to-image executables). A mixin of `DiffusionPipeline`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sdjax.core.tasks import TaskRequest


class CompileMixin:
    """The ahead-of-time methods of `DiffusionPipeline` (see the module docstring)."""

    def compile(
        self,
        *,
        batch_size: int,
        height: int | None = None,
        width: int | None = None,
        steps: int | None = None,
        sampler=None,
        task: str = "txt2img",
        guidance: bool = True,
        interactive: bool = False,
        previews: bool = False,
        guidance_rescale: float = 0.0,
        output: str = "images",
        controlnet=None,
        guess_mode: bool = False,
    ):
        """Compile (or fetch from the cache) what `generate_arrays` runs for this setting, so the first request of
        that shape does not wait for XLA. Returns `(main, decode)` (`Generator.executables`: the program up to the
        latents and the VAE decode, or the whole program and None). `controlnet` (as for `generate`; True for the
        pipeline's own net) and `guess_mode` compile the ControlNet program."""
        from sdjax.core.tasks import TASKS

        dh, dw = self.default_size
        height, width = height or dh, width or dw
        steps = self.default_steps if steps is None else steps
        self.validate(steps=steps, height=height, width=width, sampler=sampler)
        if task not in TASKS:
            raise ValueError(f"task={task!r} must be one of {sorted(TASKS)}")
        mesh = self.generator.get_mesh()
        ndata = mesh.shape["data"]
        total = -(-batch_size // ndata) * ndata
        spec = self.generator.spec(
            task=TASKS[task](),
            batch=total,
            height=height,
            width=width,
            steps=steps,
            sampler=self._sampler(sampler),
            cfg=guidance,
            interactive=interactive,
            previews=previews,
            guidance_rescale=guidance_rescale,
            output=output,
        )
        params = None
        if controlnet is not None:
            from sdjax.pipelines.controlnet import control_spec

            control, trees = control_spec(self, None if controlnet is True else controlnet, None, guess_mode)
            spec = dataclasses.replace(spec, features=(control,))
            params = {**self.generator.check_params(self.params), control.params_key: trees}
        return self.generator.executables(spec, params=params)

    def warmup(
        self, batch_size: int, height: int, width: int, steps: int, sampler=None, interactive: bool = False
    ) -> None:
        """Compile the text-to-image program of this shape ahead of time."""
        self.compile(
            batch_size=batch_size, height=height, width=width, steps=steps, sampler=sampler, interactive=interactive
        )

    def aot_compile(
        self,
        *,
        batch_size: int,
        height: int | None = None,
        width: int | None = None,
        steps: int | None = None,
        sampler=None,
        params: dict | None = None,
        guidance_rescale: float = 0.0,
    ):
        """Compile text-to-image for one static setting ahead of time (`jit(...).lower(...).compile()`).

        Returns `fn(prompt_ids, neg_prompt_ids, keys, guidance_scales, extra=None) -> images (B, H, W, 3)` float32
        that runs the compiled executables (`fn.compiled`, and `fn.decode` for the VAE decode when the generator
        splits it off; `Generator.executables`) with the params placed on the pipeline's mesh; `keys` are
        per-image raw keys `(B, 2)`; `extra` overrides the family's micro-conditioning inputs (a dict; SDXL's
        `time_ids`, `neg_time_ids`, `zero_neg`). `batch_size` must divide by the mesh's data axis.
        """
        from sdjax.parallel import sharding as sharding_lib

        dh, dw = self.default_size
        height, width = height or dh, width or dw
        steps = self.default_steps if steps is None else steps
        self.validate(steps=steps, height=height, width=width, sampler=sampler)
        gen = self.generator
        mesh = gen.get_mesh()
        if batch_size % mesh.shape[sharding_lib.DATA]:
            raise ValueError(
                f"batch_size={batch_size} must be a multiple of the mesh's data axis "
                f"({mesh.shape[sharding_lib.DATA]} devices)"
            )
        spec = gen.spec(
            batch=batch_size,
            height=height,
            width=width,
            steps=steps,
            sampler=self._sampler(sampler),
            guidance_rescale=guidance_rescale,
        )
        params = gen.check_params(self.params if params is None else params)
        compiled, decode = gen.executables(spec, params=params)
        placed = gen.place_params(params, mesh)
        start, end = gen.window(spec, TaskRequest(spec.task))
        defaults = gen.example_inputs(spec)

        def run(prompt_ids, neg_prompt_ids, keys, guidance_scales, extra_values=None):
            host = {
                **defaults,
                "ids": np.asarray(prompt_ids, np.int32),
                "neg_ids": np.asarray(neg_prompt_ids, np.int32),
                "keys": np.asarray(keys, np.uint32),
                "guidance": np.asarray(guidance_scales, np.float32),
                **(extra_values or {}),
            }
            inputs = {k: sharding_lib.put_global_batch(v, mesh) for k, v in host.items()}
            win = {"start": np.int32(start), "end": np.int32(end), "run": np.int32(0)}
            out, _ = compiled(placed, inputs, win)
            return out if decode is None else decode(placed["vae"], out)

        run.compiled = compiled
        run.decode = decode
        return run
