"""Model families as plug-ins: one folder each, one row in `FAMILIES`.

A family folder holds what makes the family itself: its conditioning (prompts -> the denoiser's conditioning,
with its tokenizers), its denoiser adapter (`core.protocols.Denoiser`: the network behind one call, latent
packing, timestep scaling), its pipeline class (the user API: `from_pretrained -> (pipeline, params)`,
`generate`), and the loaders of model classes only it uses. The generation core (`sdjax.core`) speaks to the
`Conditioning` and `Denoiser` protocols only.

`FAMILIES` is the one table the rest of sdjax reads to pick a family: by the `_class_name` of a diffusers
`model_index.json` (`family_of_pipeline_class`), and for a family's defaults. Pipeline classes are imported
lazily, when a model of that family is loaded.

Adding a family: a folder `families/NAME/` with `conditioning.py`, `denoiser.py`, `pipeline.py`, and a row here
(docs/DEVELOPING.md, "Adding a model family").
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What a user gets without asking: output size, steps, guidance scale (the one `generate` takes)."""

    size: tuple[int, int]
    steps: int
    guidance_scale: float


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family (see the module docstring)."""

    name: str
    title: str  # for people: "Stable Diffusion XL", "Flux.1"
    pipeline: str  # "module:Class" of its pipeline class (imported when used)
    model_index_classes: tuple[str, ...]  # diffusers `_class_name`s of its pipeline folders
    defaults: Defaults
    denoiser_component: str  # the params key of the denoiser's weights
    lora_prefixes: tuple[str, ...] = ()  # key prefixes of LoRA files made for this family
    # "module:function" `(path) -> bool`: whether a checkpoint file is this family's own single file, which its
    # pipeline class's `from_single_file(path, config=FOLDER, **parts)` loads (the SD 1.x/2.x/XL original layout
    # is told apart by `loading.single_file` instead)
    single_file: str = ""
    single_file_parts: tuple[str, ...] = ()  # from_single_file's arguments naming separate component files

    def pipeline_class(self) -> type:
        return _imported(self.pipeline)

    def claims_file(self, path: str) -> bool:
        """Whether `path` is a single file of this family (`single_file`)."""
        return bool(self.single_file) and bool(_imported(self.single_file)(path))


def _imported(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


FAMILIES: dict[str, Family] = {
    "sd": Family(
        name="sd",
        title="Stable Diffusion 1.x / 2.x",
        pipeline="sdjax.pipelines.stable_diffusion:StableDiffusionPipeline",
        model_index_classes=(
            "StableDiffusionPipeline",
            "StableDiffusionImg2ImgPipeline",
            "StableDiffusionInpaintPipeline",
        ),
        defaults=Defaults(size=(512, 512), steps=50, guidance_scale=7.5),
        denoiser_component="unet",
        lora_prefixes=("lora_unet_", "lora_te_", "unet.", "text_encoder."),
    ),
    "sdxl": Family(
        name="sdxl",
        title="Stable Diffusion XL",
        pipeline="sdjax.pipelines.stable_diffusion_xl:StableDiffusionXLPipeline",
        model_index_classes=(
            "StableDiffusionXLPipeline",
            "StableDiffusionXLImg2ImgPipeline",
            "StableDiffusionXLInpaintPipeline",
        ),
        defaults=Defaults(size=(1024, 1024), steps=50, guidance_scale=5.0),
        denoiser_component="unet",
        lora_prefixes=("lora_unet_", "lora_te1_", "lora_te2_", "unet.", "text_encoder.", "text_encoder_2."),
    ),
    "flux": Family(
        name="flux",
        title="Flux.1",
        pipeline="sdjax.families.flux.pipeline:FluxPipeline",
        model_index_classes=("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline"),
        defaults=Defaults(size=(1024, 1024), steps=28, guidance_scale=3.5),
        denoiser_component="transformer",
        lora_prefixes=("lora_unet_double_blocks_", "lora_unet_single_blocks_", "transformer."),
        single_file="sdjax.families.flux.weights:is_flux_file",
        single_file_parts=("t5", "clip_l"),
    ),
    "sd3": Family(
        name="sd3",
        title="Stable Diffusion 3 / 3.5",
        pipeline="sdjax.families.sd3.pipeline:StableDiffusion3Pipeline",
        model_index_classes=(
            "StableDiffusion3Pipeline",
            "StableDiffusion3Img2ImgPipeline",
            "StableDiffusion3InpaintPipeline",
        ),
        defaults=Defaults(size=(1024, 1024), steps=28, guidance_scale=7.0),
        denoiser_component="transformer",
        lora_prefixes=(
            "lora_unet_joint_blocks_",
            "diffusion_model.joint_blocks.",
            "transformer.",
            "lora_transformer_",
            "lora_te1_",
            "lora_te2_",
            "text_encoder.",
            "text_encoder_2.",
        ),
        single_file="sdjax.families.sd3.weights:is_sd3_file",
        single_file_parts=("clip_l", "clip_g", "t5"),
    ),
}


def family_of_pipeline_class(class_name: str) -> Family:
    """The family whose pipeline folders carry this `model_index.json` `_class_name` (a `Flax` prefix is
    ignored); a ValueError naming the known classes otherwise."""
    name = class_name[4:] if class_name.startswith("Flax") else class_name
    for family in FAMILIES.values():
        if name in family.model_index_classes:
            return family
    known = sorted(c for f in FAMILIES.values() for c in f.model_index_classes)
    raise ValueError(f"pipeline class {class_name!r} belongs to no model family sdjax has (known: {known})")


def family_of_file(path: str) -> Family | None:
    """The family whose own single-file layout `path` has (Flux.1, SD 3), or None (an SD 1.x/2.x/XL checkpoint,
    or no checkpoint: the single-file loader tells which)."""
    for family in FAMILIES.values():
        if family.claims_file(path):
            return family
    return None


def pipeline_classes() -> dict[str, Any]:
    """`_class_name` -> pipeline class, for every family (imports them all)."""
    return {c: f.pipeline_class() for f in FAMILIES.values() for c in f.model_index_classes}
