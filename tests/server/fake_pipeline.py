"""A stand-in pipeline with the high-level interface of `StableDiffusionPipeline`, for CLI and server tests.

Image `i` is a pure function of (prompt, negative prompt, seeds[i], image_indices[i], guidance, steps, size,
sampler), independent of the batch it is in, so a test recomputes what each request must get back (`expected`).
Records every call; `delay_s` simulates pipeline time (spread over the steps) so that concurrent requests meet in
one batch. Like the real pipeline, it tokenizes the whole batch (`prepare_inputs` refuses text that is not UTF-8,
as the CLIP tokenizer does) and, like the generation core, polls `should_stop()` once per step and raises
`Cancelled` when it returns True. `FakePipelineWithoutStop` lacks `should_stop` (the pipelines before the core).
"""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np

from sdjax import samplers
from sdjax.infotext import sampler_id

SAMPLERS = samplers.available()


def expected(
    prompt: str,
    negative: str,
    seed: int,
    index: int,
    guidance: float,
    steps: int,
    height: int,
    width: int,
    sampler: str,
) -> np.ndarray:
    """The uint8 `(H, W, 3)` image the fake makes for these parameters."""
    digest = hashlib.sha256(
        repr((prompt, negative, int(seed), int(index), float(guidance), int(steps), sampler_id(sampler))).encode()
    ).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    base = rng.integers(0, 256, size=(1, 1, 3))
    noise = rng.integers(0, 32, size=(height, width, 3))
    return ((base + noise) % 256).astype(np.uint8)


try:
    from sdjax.core import Cancelled
except ImportError:  # the generation core is not there yet

    class Cancelled(Exception):
        """A run stopped by its `should_stop` callback."""


class FakePipeline:
    """Deterministic fake of the pipeline's high-level interface (see module docstring)."""

    default_steps = 4
    default_sampler = "euler_a"
    sampler_names = SAMPLERS

    def __init__(
        self,
        *,
        delay_s: float = 0.0,
        size: tuple[int, int] = (64, 64),
        multiple: int = 8,
        fail_prompt: str | None = None,
        report_latents: bool = False,
    ):
        self.default_size = size
        self.name = "fake"
        self.params = {}
        self.delay_s = delay_s
        self.multiple = multiple
        self.fail_prompt = fail_prompt
        self.report_latents = report_latents
        self.calls: list[dict] = []
        self.prompt_syntaxes: list[str | None] = []
        self.warmups: list[tuple] = []
        self._lock = threading.Lock()
        self._active = 0
        self.max_concurrent = 0

    def validate(
        self,
        *,
        prompts=None,
        negative_prompts=None,
        steps=None,
        height=None,
        width=None,
        guidance_scales=None,
        sampler=None,
        num_images=None,
    ) -> None:
        if prompts is not None and (not prompts or not all(isinstance(p, str) for p in prompts)):
            raise ValueError("prompt must be a non-empty str or list of str")
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ValueError(f"num_inference_steps={steps} must be at least 1")
        for name, v in (("height", height), ("width", width)):
            if v is not None and (v <= 0 or v % self.multiple):
                raise ValueError(f"{name}={v} must be a positive multiple of {self.multiple}")
        if guidance_scales is not None and not all(np.isfinite(g) for g in guidance_scales):
            raise ValueError("guidance_scale must be finite")
        if sampler is not None:
            samplers.get_sampler(sampler)  # the real name resolution (registry, A1111 "sampler schedule" pairs)

    def prepare_inputs(self, prompts) -> np.ndarray:
        """Token ids `(N, 77)`; like the CLIP tokenizer, refuses text that is not valid Unicode."""
        for p in prompts:
            try:
                p.encode("utf-8")
            except UnicodeEncodeError:
                raise TypeError(
                    "TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]"
                ) from None
        return np.zeros((len(prompts), 77), np.int32)

    def generate_arrays(
        self,
        prompts,
        negative_prompts,
        seeds,
        image_indices,
        guidance_scales,
        *,
        steps,
        height,
        width,
        sampler=None,
        pad_to=None,
        progress=None,
        should_stop=None,
        prompt_syntax=None,
    ) -> np.ndarray:
        self.prompt_syntaxes.append(prompt_syntax)
        return self._run(
            prompts, negative_prompts, seeds, image_indices, guidance_scales, steps, height, width, sampler, pad_to,
            progress, should_stop,
        )  # fmt: skip

    def _run(
        self, prompts, negative_prompts, seeds, image_indices, guidance_scales, steps, height, width, sampler, pad_to,
        progress, should_stop,
    ) -> np.ndarray:  # fmt: skip
        sampler = sampler or self.default_sampler
        self.validate(
            prompts=list(prompts),
            steps=steps,
            height=height,
            width=width,
            guidance_scales=list(guidance_scales),
            sampler=sampler,
        )
        record = dict(
            n=len(prompts),
            pad_to=pad_to,
            steps=steps,
            height=height,
            width=width,
            sampler=sampler,
            prompts=list(prompts),
            seeds=list(seeds),
            progress=progress is not None,
            should_stop=should_stop is not None,
            steps_run=0,
            stopped=False,
            started=time.monotonic(),
        )
        with self._lock:
            self._active += 1
            self.max_concurrent = max(self.max_concurrent, self._active)
            self.calls.append(record)
        try:
            self.prepare_inputs(list(prompts) + list(negative_prompts))
            if self.fail_prompt is not None and self.fail_prompt in prompts:
                raise RuntimeError("the fake pipeline was told to fail")
            if progress:
                progress("encode", 1, 1)
            for i in range(steps):
                if should_stop is not None and should_stop():
                    record["stopped"] = True
                    raise Cancelled("stopped by should_stop() before the last denoising step")
                if self.delay_s:
                    time.sleep(self.delay_s / steps)
                record["steps_run"] = i + 1
                if progress and self.report_latents:
                    progress(
                        "denoise",
                        i + 1,
                        steps,
                        latents=self.reported_latents(len(prompts), height, width, i + 1, steps),
                    )
                elif progress:
                    progress("denoise", i + 1, steps)
            if progress:
                progress("decode", 1, 1)
            return np.stack(
                [
                    expected(p, q, s, i, g, steps, height, width, sampler)
                    for p, q, s, i, g in zip(prompts, negative_prompts, seeds, image_indices, guidance_scales)
                ]
            )
        finally:
            record["ended"] = time.monotonic()
            with self._lock:
                self._active -= 1

    def decode_latents(self, latents, params=None) -> np.ndarray:
        """The fake's VAE: uint8 `(N, 8h, 8w, 3)` of the first three latent channels clipped to [0, 1], each latent
        pixel an 8x8 block (what `server.partial` decodes an interrupted batch's latents with)."""
        x = np.clip(np.asarray(latents, np.float32)[:, :3], 0, 1).repeat(8, axis=2).repeat(8, axis=3)
        return np.round(x.transpose(0, 2, 3, 1) * 255).astype(np.uint8)

    @staticmethod
    def reported_latents(n: int, height: int, width: int, step: int, steps: int) -> np.ndarray:
        """The latents the fake reports after step `step` (1-based) of `steps` (with `report_latents`)."""
        latents = np.full((n, 4, height // 8, width // 8), (step - 1) / steps, np.float32)
        latents[:, 0] = np.linspace(0, 1, width // 8)[None, None, :]
        return latents

    def warmup(self, batch_size, height, width, steps, sampler=None) -> None:
        self.warmups.append((batch_size, height, width, steps, sampler))

    def generate(
        self,
        prompt,
        negative_prompt=None,
        num_images=1,
        seed=0,
        steps=None,
        guidance_scale=None,
        height=None,
        width=None,
        sampler=None,
        progress=None,
    ):
        from PIL import Image

        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        all_prompts = [p for p in prompts for _ in range(num_images)]
        n = len(all_prompts)
        h, w = self.default_size
        arrays = self.generate_arrays(
            all_prompts,
            [negative_prompt or ""] * n,
            [seed] * n,
            list(range(n)),
            [7.5 if guidance_scale is None else guidance_scale] * n,
            steps=steps or self.default_steps,
            height=height or h,
            width=width or w,
            sampler=sampler,
            progress=progress,
        )
        return [Image.fromarray(a) for a in arrays]


class FakePipelineWithoutStop(FakePipeline):
    """The fake as the pipelines before the generation core: `generate_arrays` takes no `should_stop`."""

    def generate_arrays(
        self,
        prompts,
        negative_prompts,
        seeds,
        image_indices,
        guidance_scales,
        *,
        steps,
        height,
        width,
        sampler=None,
        pad_to=None,
        progress=None,
        prompt_syntax=None,
    ) -> np.ndarray:
        self.prompt_syntaxes.append(prompt_syntax)
        return self._run(
            prompts, negative_prompts, seeds, image_indices, guidance_scales, steps, height, width, sampler, pad_to,
            progress, None,
        )  # fmt: skip
