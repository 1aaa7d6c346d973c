"""The old Flax guide API's shared plumbing: one `GuideCall` per `__call__` / `_generate` of the guide classes
(diffusers' `FlaxStableDiffusionPipeline` and its siblings), checked, run (`pmap` with `jit=True`, the mesh
otherwise, or traced inside a user's own `pmap`) and safety-checked. The argument orders and `prepare_inputs` live
in the family modules and the task subclasses; this mixin of `DiffusionPipeline` runs the same program as the user
API.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sdjax import rng
from sdjax.core.tasks import TaskRequest
from sdjax.pipelines import common
from sdjax.pipelines.common import PipelineOutput


class FlaxGuideMixin:
    """The guide API's shared methods of `DiffusionPipeline` (see the module docstring)."""

    returns_nsfw = False  # the old API's tuple output: (images, nsfw flags) for SD, (images,) for SDXL

    def _guide(self, call: GuideCall):
        """One old-Flax call, whatever the class's argument order: traced inside a user's `pmap` -> the program on
        this device's slice; else checked, run (`pmap` with `jit=True`, the mesh otherwise), safety-checked."""
        if call.traced:
            out = self._traced(call)
            return PipelineOutput(out) if call.return_dict else (out,)
        self._validate_guide_call(call)
        out = self._guide_run(call)
        nsfw = self._run_safety_checker(out, call.params, call.jit) if call.output == "images" else None
        if not call.return_dict:
            return (out, nsfw) if self.returns_nsfw else (out,)
        return PipelineOutput(out, nsfw)

    def _run_safety_checker(self, images: np.ndarray, params, jit: bool):
        """Per-image NSFW flags (blacking flagged images in place); None without a safety checker."""
        return None

    def _static_shape(self, steps, height, width) -> tuple[int, int, int]:
        steps = common.check_static("num_inference_steps", steps)
        dh, dw = self.default_size
        height = dh if height is None else common.check_static("height", height)
        width = dw if width is None else common.check_static("width", width)
        return steps, height, width

    def _guide_run(self, call: GuideCall) -> np.ndarray:
        """`jit=True`: per-device inputs `(ndev, bs, ...)` under `pmap` (params replicated, one key per device);
        else a global batch on the mesh, one key for the call."""
        gen = self.generator
        task, steps, height, width = call.task, call.steps, call.height, call.width
        lead = np.shape(call.prompt_ids)[: 2 if call.jit else 1]
        n = int(np.prod(lead))
        keys = np.asarray(rng.as_key_array(call.prng_seed))
        keys = np.stack([np.asarray(rng.image_keys(jnp.asarray(k), lead[-1])) for k in keys.reshape(-1, 2)])
        negatives = [None if call.neg_prompt_ids is None else "ids"] * n
        if not call.jit:
            g = np.broadcast_to(np.asarray(call.guidance_scale, np.float32).reshape(-1), (n,))
            out = gen.run(
                prompts=[""] * n,
                negative_prompts=negatives,
                keys=keys.reshape(n, 2),
                guidance_scales=g,
                steps=steps,
                height=height,
                width=width,
                sampler=self.scheduler,
                task=task,
                noise=call.noise,
                params=call.params,
                output=call.output,
                ids=np.asarray(call.prompt_ids),
                cfg=True,
                neg_ids=None if call.neg_prompt_ids is None else np.asarray(call.neg_prompt_ids),
                features=call.features,
            )
            return np.array(out)
        ndev, bs = lead
        flat = np.asarray(call.prompt_ids).reshape((n,) + self.ids_suffix)
        host = {
            "ids": flat,
            "neg_ids": (
                gen.models.conditioning.tokenize([""] * n)
                if call.neg_prompt_ids is None
                else np.asarray(call.neg_prompt_ids).reshape(flat.shape)
            ),
            "keys": keys.reshape(n, 2),
            "guidance": np.broadcast_to(
                np.asarray(common.per_device_guidance(call.guidance_scale, ndev, bs)), (ndev, bs)
            )
            .reshape(-1)
            .astype(np.float32),
            **gen.models.conditioning.host_inputs(
                negative_prompts=negatives, height=height, width=width, task=task.spec.name
            ),
        }
        for name in task.spec.inputs:
            host[name] = np.asarray(task.arrays[name], np.float32).reshape((n,) + np.shape(task.arrays[name])[2:])
        if call.noise is not None:
            host["noise"] = np.asarray(call.noise, np.float32).reshape((n,) + np.shape(call.noise)[2:])
        spec = gen.spec(
            task=task.spec,
            batch=bs,
            height=height,
            width=width,
            steps=steps,
            sampler=self.scheduler,
            explicit_noise=call.noise is not None,
            output=call.output,
            features=tuple(r.spec for r in call.features),
            vae_slice=1,  # a per-device program
        )
        start, end = gen.window(spec, task)
        host.update(gen.feature_inputs(spec, call.features, start=start, end=end, taken=host))
        inputs = {k: v.reshape((ndev, bs) + v.shape[1:]) for k, v in host.items()}
        win = {"start": np.int32(start), "end": np.int32(end)}
        params = gen.check_params(call.params, features=spec.features)
        out, _ = gen.pmapped(spec)(params, inputs, win)
        return np.array(out)

    def _traced(self, call: GuideCall):
        """The program traced inside a user's own `pmap` (the per-device `_generate`)."""
        from sdjax.core import program

        gen = self.generator
        steps, height, width = self._static_shape(call.steps, call.height, call.width)
        batch = call.prompt_ids.shape[0]
        negatives = [None if call.neg_prompt_ids is None else "ids"] * batch
        neg = (
            jnp.broadcast_to(jnp.asarray(gen.models.conditioning.tokenize([""])), call.prompt_ids.shape)
            if call.neg_prompt_ids is None
            else call.neg_prompt_ids
        )
        host = gen.models.conditioning.host_inputs(
            negative_prompts=negatives, height=height, width=width, task=call.task.spec.name
        )
        inputs = {
            "ids": call.prompt_ids,
            "neg_ids": neg,
            "keys": rng.image_keys(rng.as_key_array(call.prng_seed), batch),
            "guidance": common.guidance_per_image(call.guidance_scale, batch),
            **{k: jnp.asarray(v) for k, v in host.items()},
            **{k: jnp.asarray(v) for k, v in call.task.arrays.items()},
        }
        if call.noise is not None:
            inputs["noise"] = call.noise
        spec = gen.spec(
            task=call.task.spec,
            batch=batch,
            height=height,
            width=width,
            steps=steps,
            sampler=self.scheduler,
            explicit_noise=call.noise is not None,
            output=call.output,
            features=tuple(r.spec for r in call.features),
            vae_slice=1,  # a per-device program
        )
        start, end = gen.window(spec, call.task)
        if call.start is not None:
            start = call.start
        inputs.update(gen.feature_inputs(spec, call.features, start=start, end=end, taken=inputs))
        win = {"start": jnp.asarray(start, jnp.int32), "end": jnp.int32(end)}
        out, _ = program(gen.models, spec, call.params, inputs, win)
        return out

    def _validate_guide_call(self, call: GuideCall) -> None:
        jit, steps, height, width = call.jit, call.steps, call.height, call.width
        for name, v in (("num_inference_steps", steps), ("height", height), ("width", width)):
            common.check_static(name, v)
        common.check_steps(steps)
        common.check_size(height, width, self._size_multiple())
        self.generator.check_params(call.params, features=tuple(r.spec for r in call.features))
        if jit:
            leaf = jax.tree_util.tree_leaves(call.params[self.denoiser.component])[0]
            if leaf.ndim == 0 or leaf.shape[0] != jax.local_device_count():
                raise ValueError("with jit=True params must be replicated per device: p_params = replicate(params)")
        ids = tuple(np.shape(call.prompt_ids))
        suffix = self.ids_suffix
        lead = ids[: len(ids) - len(suffix)]
        if ids[len(lead) :] != suffix or len(lead) != (2 if jit else 1):
            want = (
                f"(num_devices, batch_per_device, {', '.join(map(str, suffix))})"
                if jit
                else f"(N, {', '.join(map(str, suffix))})"
            )
            how = "shard(pipeline.prepare_inputs(prompts))" if jit else "pipeline.prepare_inputs(prompts)"
            raise ValueError(
                f"prompt_ids has shape {ids}; with jit={jit} {type(self).__name__} expects {want}, as made by {how}"
            )
        g = np.shape(call.guidance_scale)
        if jit:
            ndev = jax.local_device_count()
            if lead[0] != ndev:
                raise ValueError(
                    f"prompt_ids has {lead[0]} device slices but there are {ndev} local devices: "
                    f"the prompt count must be divisible by {ndev} (shard() splits it per device)"
                )
            if np.shape(call.prng_seed)[:1] != (ndev,):
                raise ValueError(
                    f"prng_seed has shape {np.shape(call.prng_seed)}; with jit=True pass one key per "
                    f"device: jax.random.split(key, {ndev})"
                )
            if g not in ((), (ndev,), (ndev, 1), (ndev, lead[1])):
                raise ValueError(
                    f"guidance_scale has shape {g}; with jit=True use a float or an array of shape "
                    f"({ndev},), ({ndev}, 1) or ({ndev}, {lead[1]})"
                )
        elif g not in ((), (1,), (lead[0],)):
            raise ValueError(f"guidance_scale has shape {g}; use a float or one value per prompt ({lead[0]},)")
        if call.neg_prompt_ids is not None and np.shape(call.neg_prompt_ids) != ids:
            raise ValueError(
                f"neg_prompt_ids has shape {np.shape(call.neg_prompt_ids)} but prompt_ids has shape "
                f"{ids}: pass one negative prompt per prompt"
            )
        if call.noise is not None:
            want = lead + (
                self.vae.config.latent_channels,
                height // self.vae_scale_factor,
                width // self.vae_scale_factor,
            )
            if tuple(np.shape(call.noise)) != want:
                raise ValueError(
                    f"{call.noise_name} has shape {np.shape(call.noise)}; expected {want} for {height}x{width}"
                )
        for name, x in call.task.arrays.items():
            if tuple(np.shape(x)[: len(lead)]) != tuple(lead):
                label = {"image": call.image_name, "mask": "mask"}.get(name, name)
                raise ValueError(
                    f"{label} has shape {np.shape(x)}; its leading dimensions must match prompt_ids' {lead}"
                )

    @property
    def ids_suffix(self) -> tuple[int, ...]:
        return tuple(self.generator.models.conditioning.ids_suffix)


@dataclasses.dataclass
class GuideCall:
    """One call of the old Flax API, whatever the class's argument order."""

    prompt_ids: Any
    params: Any
    prng_seed: Any
    steps: int
    height: int
    width: int
    guidance_scale: Any
    neg_prompt_ids: Any
    task: TaskRequest
    jit: bool = False
    return_dict: bool = True
    noise: Any = None
    noise_name: str = "latents"
    image_name: str = "image"
    output: str = "images"
    start: Any = None  # an explicit first model call (the traced `_generate(start_timestep)`)
    traced: bool = False
    features: tuple = ()  # `core.protocols.FeatureRequest`s (the ControlNet guide class: its ControlRequest)
