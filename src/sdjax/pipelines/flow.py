"""What the flow-matching transformer families (Flux.1, SD 3 / 3.5) share as pipelines: T5 as a component, the
`max_sequence_length` setting, flow sampler names on a family's sigma grid, per-image second/third prompts, and the
assembly of a single-file load (the files' components over a diffusers folder's). A family subclasses
`FlowTransformerPipeline`, sets `sigma_grid` and `model_label`, and gives `_conditioning()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from sdjax import samplers
from sdjax.loading.components import ModelSpec, model_loader
from sdjax.pipelines.base import DiffusionPipeline
from sdjax.text.t5_tokenizer import check_max_sequence_length

T5_ENCODER = ModelSpec("sdjax.models.t5", "T5Config", "T5EncoderModel", "convert_t5_encoder", "t5")


def _load_t5_tokenizer(req):
    from sdjax.text.t5_tokenizer import T5Tokenizer

    return T5Tokenizer.from_folder(req.folder), None


# The T5 classes a flow family's model_index.json names: (library, class) -> loader.
T5_LOADERS = {
    ("transformers", "T5EncoderModel"): model_loader(T5_ENCODER),
    ("transformers", "T5TokenizerFast"): _load_t5_tokenizer,
    ("transformers", "T5Tokenizer"): _load_t5_tokenizer,
}


class FlowTransformerPipeline(DiffusionPipeline):
    """The part of `FluxPipeline` and `StableDiffusion3Pipeline` that is the same (see the module docstring)."""

    sigma_grid = "scheduler"  # the family's FlowMatch sigma grid: "flux" (linspace(1, 1/n, n)) or "scheduler"
    model_label = "a flow model"  # how errors name the family's models ("a Flux model")

    def __init__(self, *, denoiser, vae, scheduler, dtype, name: str, params: dict | None):
        super().__init__(
            denoiser=denoiser,
            vae=vae,
            scheduler=on_flow_grid(scheduler, self.sigma_grid),
            dtype=dtype,
            name=name,
            params=params,
        )
        # img2img's first step as the flow img2img pipelines' get_timesteps: int(steps - steps * strength)
        self.generator.strength_rule = "float"

    def _conditioning(self):
        raise NotImplementedError

    def _replace_models(self, **models) -> None:
        """Swap the generator's conditioning or denoiser: the programs' shapes or contents change, so compiled
        programs are dropped."""
        gen = self.generator
        gen.models = dataclasses.replace(gen.models, **models)
        gen.cache.clear()
        gen._pmapped.clear()

    @property
    def max_sequence_length(self) -> int:
        """T5 tokens per prompt. Setting it changes the programs' input shapes: compiled programs are dropped."""
        return self._max_sequence_length

    @max_sequence_length.setter
    def max_sequence_length(self, n: int) -> None:
        n = check_max_sequence_length(n, self.model_label)
        if n != self._max_sequence_length:
            self._max_sequence_length = n
            self._replace_models(conditioning=self._conditioning())

    @property
    def sampler_names(self) -> list[str]:
        return samplers.available(flow=True)

    def _sampler(self, name) -> Any:
        """A flow sampler on the family's sigma grid: a registry name of `samplers.FLOW_SAMPLERS`, an A1111/Forge name
        ("Euler", "Euler a", "DPM++ 2M SDE", optionally with a schedule: "Euler Karras"), a k-diffusion-form name or
        sampler object, or None (the model's own)."""
        return on_flow_grid(flow_sampler_named(self, name, self.model_label, super()._sampler), self.sigma_grid)

    @classmethod
    def _with_file_components(cls, path, config, loaded: dict, policy, kwargs: dict, *, dtype, **extra):
        """`(pipeline, params)`: `config`'s diffusers folder with `loaded` ({component: (module, params)}, read
        from single files) in place of its own, the rest quantized by `policy` as the folder loads it, then the
        whole pipeline by `policy` (what is already quantized is kept)."""
        from sdjax.quant import quantize_pipeline
        from sdjax.quant.loading import policy_without

        for name in loaded:
            if name in kwargs:
                raise ValueError(f"{name} is given both by a file argument and as {name}=")
        overrides = {name: module for name, (module, _) in loaded.items()}
        folder_policy = policy_without(policy, loaded)  # what the folder still loads is quantized there
        pipe, params = cls.from_pretrained(config, dtype=dtype, quantize=folder_policy, **extra, **overrides, **kwargs)
        params = {**params, **{name: p for name, (_, p) in loaded.items()}}
        pipe.params = params
        pipe.name = str(path)
        return quantize_pipeline(pipe, params, policy)


def on_flow_grid(sampler: Any, grid: str) -> Any:
    """`sampler` on a family's FlowMatch sigma grid ("flux" or "scheduler"): a FlowMatch sampler's `sigma_grid`, or
    a k-diffusion-form sampler's "flow" schedule on either FlowMatch grid (DPM-Solver's "solver" grid, and every
    other schedule, stay as they are)."""
    if hasattr(sampler, "sigma_grid") and sampler.sigma_grid != grid:
        return dataclasses.replace(sampler, sigma_grid=grid)
    if isinstance(sampler, samplers.KDiffusionSampler):
        schedule = sampler.schedule
        if schedule.name == "flow" and schedule.grid in ("scheduler", "flux") and schedule.grid != grid:
            return dataclasses.replace(sampler, schedule=dataclasses.replace(schedule, grid=grid))
    return sampler


def flow_sampler_named(pipe: Any, name: Any, model: str, resolve) -> Any:
    """A flow family's sampler for `name`: an A1111/Forge name through `samplers.a1111.from_a1111_flow` on the
    pipeline's scheduler (refused as a ValueError naming the sampler and `model`), anything else (a flow registry
    name, a diffusers class name, a "kdiffusion:..." name, a sampler object, None) through `resolve`."""
    if (
        isinstance(name, str)
        and name not in samplers.FLOW_SAMPLERS
        and not name.endswith("Scheduler")
        and not name.strip().lower().startswith("kdiffusion:")
    ):
        try:
            return samplers.a1111.from_a1111_flow(name, "Automatic", pipe.scheduler)
        except (samplers.a1111.UnsupportedSamplerError, ValueError) as e:
            raise ValueError(
                f"sampler={name!r}: not a flow-matching sampler for {model} ({e}); use one of "
                f"{samplers.available(flow=True)} or an A1111 name such as 'Euler'"
            ) from None
    return resolve(name)


def per_image(texts: str | Sequence[str], prompts: int, num_images: int, name: str) -> list[str]:
    """`texts` (one, or one per prompt) repeated for each of a prompt's `num_images` images."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    if len(texts) == 1:
        texts = texts * prompts
    if len(texts) != prompts:
        raise ValueError(f"{name}: got {len(texts)} texts for {prompts} prompts; pass one, or one per prompt")
    return [t for t in texts for _ in range(num_images)]
