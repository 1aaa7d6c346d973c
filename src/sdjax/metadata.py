"""Generation parameters as typed values, as AUTOMATIC1111 "infotext", and as the PNG `parameters` chunk.

The CLI and the server are adapters over one call: a `GenerationRequest` (what a user asked for, defaults
resolved) expands to one `ImageParameters` per image, and `generate_images` runs a list of those that share a
compiled shape through `pipeline.generate_arrays`. Every image of the CLI and the server has its own seed (image
`i` of a request uses `seed + i`, with fold-in index 0, AUTOMATIC1111's convention), so the `Seed:` written in a
file reproduces that image alone, whatever the batch it was made in.

The infotext format itself (writing, reading, the PNG chunk) is `sdjax.infotext`, and the task planner with
diffusers' and A1111's meanings is `sdjax.planning` / `sdjax.policy`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from sdjax import planning
from sdjax.infotext import (
    Quoted,
    conditioning_fields,
    conditioning_from_fields,
    format_parameters,
    number,
    parse_parameters,
    sampler_display_name,
    sampler_id,
)
from sdjax.policy import A1111

SEED_MAX = 2**32 - 1  # seeds are unsigned 32-bit, as in AUTOMATIC1111; seed + i wraps around


class Progress(Protocol):
    def __call__(self, stage: str, step: int, total: int) -> None: ...


# A1111's names of the hires-fix upscalers sdjax implements (`sdjax.pipelines.recipes.UPSCALERS`).
UPSCALER_NAMES = {"latent": "Latent", "latent-nearest": "Latent (nearest)", "lanczos": "Lanczos", "nearest": "Nearest"}


# the family conditioning options that belong to the negative prompt (a NegativeSwitch replaces them)
NEGATIVE_OPTIONS = ("negative_prompt_2", "negative_prompt_3", "zero_negative")
SWITCH_SUFFIX = " after switch"  # the infotext keys of a NegativeSwitch's options: "Zero negative after switch"


@dataclasses.dataclass(frozen=True)
class NegativeSwitch:
    """The negative conditioning from model call `step` on (ComfyUI's ConditioningSetTimestepRange pair that hands
    the negative over at a step, e.g. SD 3's example: the negative prompt first, zero conditioning after): the
    steps before `step` use the image's negative prompt and options, the rest `negative_prompt` with
    `conditioning` (the family's negative options, `NEGATIVE_OPTIONS`). `generate_images` runs it as two
    generations: model calls [0, step) returning latents, then [step, n) from them without new noise, which is the
    one-stage run with the negative swapped for a sampler whose step reads only the latent and its sigma (euler)."""

    step: int
    negative_prompt: str = ""
    conditioning: tuple[tuple[str, Any], ...] = ()

    def fields(self) -> dict[str, Any]:
        return {
            "Negative switch at step": self.step,
            "Negative prompt" + SWITCH_SUFFIX: Quoted(self.negative_prompt),
            **conditioning_fields(self.conditioning, SWITCH_SUFFIX),
        }


def switch_fraction(sampler: Any, steps: int, step: int) -> float:
    """The `denoising_end` that stops a `steps`-step run of `sampler` after model call `step` - 1 exactly
    (`core.tasks.base.window` keeps the calls whose timestep is at least the rounded cutoff); ValueError where no
    whole-number cutoff lies between the two timesteps, or the sampler makes more than one call per step."""
    from sdjax.core.tasks.base import sampler_timesteps, window

    if int(sampler.order) != 1 or not 0 < step < steps:
        raise ValueError(f"a negative switch needs a one-call-per-step sampler and 0 < step < {steps}; got {step}")
    t = np.asarray(sampler_timesteps(sampler, steps), np.float64)
    cutoff = min(int(np.floor(t[step - 1])), sampler.num_train_timesteps - 1)  # a flow grid starts at t = 1000
    end = 1.0 - cutoff / sampler.num_train_timesteps
    if not t[step] < cutoff or window(sampler, steps, denoising_end=end) != (0, step):
        raise ValueError(f"no denoising_end stops this {steps}-step schedule after step {step} (timesteps "
                         f"{t[step - 1]:.3f}, {t[step]:.3f})")  # fmt: skip
    return end


@dataclasses.dataclass(frozen=True)
class ImageParameters:
    """Everything that fixes one image: its noise is drawn from `fold_in(PRNGKey(seed), image_index)`.

    `sampler` is a registry name (`sdjax.samplers.available()`) where one exists; infotext shows the
    AUTOMATIC1111 name ("Euler a"), and parsing maps it back.

    Image-to-image and inpainting (`init_image`, `mask_image`: PIL images, not part of equality) follow
    AUTOMATIC1111's step rule, as the infotext they write does: with `steps` and `denoising_strength` s, the
    sampler runs `int(min(s, 0.999) * steps) + 1` steps at the end of a `steps`-step schedule (diffusers, and
    sdjax's Python API, run `int(s * steps)`). Inpainting pastes the original back outside the mask (A1111's
    overlay). `hires` (text-to-image only) adds A1111's second pass; `refiner`/`refiner_switch` hand the last part
    of the schedule to an SDXL refiner (diffusers' `denoising_end`/`denoising_start`).
    """

    prompt: str
    negative_prompt: str
    steps: int
    sampler: str
    guidance_scale: float
    seed: int
    width: int
    height: int
    model: str = ""
    image_index: int = 0
    denoising_strength: float | None = None
    mask_blur: float = 0.0
    inpaint_full_res_padding: int | None = None  # A1111 "Inpaint area: Only masked" with this padding
    inpainting_fill: str = "original"  # A1111's masked content: fill, original, latent noise, latent nothing
    invert_mask: bool = False
    resize_mode: str = "resize"
    hires: Any = None  # sdjax.pipelines.recipes.Hires
    refiner: str = ""
    refiner_switch: float | None = None
    prompt_syntax: str = "plain"  # "a1111": emphasis, BREAK, long prompts (sdjax.text.prompt_syntax)
    control: tuple[ControlUnit, ...] = ()  # ControlNets (sdjax.pipelines.controlnet)
    clip_skip: int = 1  # A1111's "Clip skip" (a per-image input of the program: not part of the shape key)
    distilled_guidance: float | None = None  # Forge's "Distilled CFG Scale" (Flux dev's embedded guidance; per image)
    loras: tuple[
        tuple[str, float | tuple[float, float]], ...
    ] = ()  # the <lora:name:w> tags of the prompt, applied to the params
    vae: str = ""  # the VAE's name when it is not the model's own (infotext "VAE")
    model_hash: str = ""  # the checkpoint's short hash (infotext "Model hash")
    lora_hashes: str = ""  # A1111's "Lora hashes": "name: hash, ..." of the prompt's LoRAs
    ti_hashes: str = ""  # A1111's "TI hashes": "name: hash, ..." of the embeddings the prompts use
    # options of the family's conditioning (`Conditioning.host_inputs`) with this image's value, e.g. Flux's
    # `prompt_2` (its T5 text) or `zero_negative` (zero negative embeddings); their names are part of the shape key
    conditioning: tuple[tuple[str, Any], ...] = ()
    negative_switch: NegativeSwitch | None = None  # another negative from a step on (text-to-image, one-step samplers)
    init_image: Any = dataclasses.field(default=None, compare=False, repr=False)
    mask_image: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def task(self) -> str:
        return planning.task_name(self.init_image, self.mask_image)

    @property
    def shape_key(self) -> tuple:
        """What fixes the compiled executables (and the host work): images with equal keys can share a batch."""
        return (
            self.steps,
            self.height,
            self.width,
            self.sampler,
            self.guidance_scale > 1,
            self.task,
            self.denoising_strength,
            self.mask_blur,
            self.inpaint_full_res_padding,
            self.inpainting_fill,
            self.invert_mask,
            self.resize_mode,
            self.hires,
            self.refiner,
            self.refiner_switch,
            self.prompt_syntax,
            self.control,
            self.loras,
            self.vae,
            tuple(name for name, _ in self.conditioning),
            self.negative_switch
            and (self.negative_switch.step, tuple(n for n, _ in self.negative_switch.conditioning)),
        )

    def extra_fields(self) -> dict[str, Any]:
        """The infotext fields beyond the text-to-image ones, in A1111's names."""
        out: dict[str, Any] = {}
        if self.denoising_strength is not None:
            out["Denoising strength"] = number(self.denoising_strength)
        if self.task == "inpaint":
            out["Mask blur"] = number(self.mask_blur) if self.mask_blur else None
            if self.inpaint_full_res_padding is not None:
                out["Inpaint area"] = "Only masked"
                out["Masked area padding"] = self.inpaint_full_res_padding
        if self.hires is not None:
            h = self.hires
            out["Denoising strength"] = number(h.strength)
            out["Hires upscale"] = None if h.resize else number(h.scale).removesuffix(".0")
            out["Hires resize"] = f"{h.resize[0]}x{h.resize[1]}" if h.resize else None
            out["Hires steps"] = h.steps or None
            out["Hires upscaler"] = UPSCALER_NAMES[h.upscaler]
            out["Hires sampler"] = sampler_display_name(h.sampler) if h.sampler else None
        if self.clip_skip > 1:
            out["Clip skip"] = self.clip_skip
        if self.distilled_guidance is not None:
            out["Distilled CFG Scale"] = number(self.distilled_guidance)
        if self.lora_hashes:
            out["Lora hashes"] = self.lora_hashes
        if self.ti_hashes:
            out["TI hashes"] = self.ti_hashes
        for i, unit in enumerate(self.control):
            out[f"ControlNet {i}"] = unit.infotext()
        if self.refiner:
            out["Refiner"] = self.refiner
            out["Refiner switch at"] = number(self.refiner_switch) if self.refiner_switch is not None else None
        out.update(conditioning_fields(self.conditioning))  # Prompt 2, ..., Zero negative
        if self.negative_switch is not None:
            out.update(self.negative_switch.fields())
        return out

    def infotext(self) -> str:
        return format_parameters(self, self.extra_fields())


_NET_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")  # a net given as one weights file


@dataclasses.dataclass(frozen=True)
class ControlUnit:
    """One ControlNet of a request: the net (folder, Hub id or name), the preprocessor that made `image` (the
    control map, a uint8 HWC array; not part of equality), its weight and guidance window, as sd-webui-controlnet
    writes them in the infotext ("ControlNet 0: ...")."""

    model: str
    module: str = "none"
    weight: float = 1.0
    guidance_start: float = 0.0
    guidance_end: float = 1.0
    image: Any = dataclasses.field(default=None, compare=False, repr=False)

    def infotext(self) -> str:
        return (
            f"Module: {self.module}, Model: {self.model_name}, Weight: {number(self.weight)}, "
            f"Guidance Start: {number(self.guidance_start)}, Guidance End: {number(self.guidance_end)}"
        )

    @property
    def model_name(self) -> str:
        """The net's name as a server lists it (and sd-webui-controlnet writes it): a folder's name, a weights
        file's stem (`sd35_canny.safetensors` -> `sd35_canny`), so a pasted infotext names a served net."""
        path = Path(self.model)
        return (path.stem if path.suffix.lower() in _NET_FILE_SUFFIXES else path.name) or self.model


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A request with every default resolved; `images()` expands it to one `ImageParameters` per image (all with
    the same init image, mask and settings)."""

    prompt: str
    negative_prompt: str = ""
    num_images: int = 1
    seed: int = 0
    steps: int = 50
    guidance_scale: float = 7.5
    width: int = 512
    height: int = 512
    sampler: str = ""
    model: str = ""
    denoising_strength: float | None = None
    mask_blur: float = 0.0
    inpaint_full_res_padding: int | None = None
    inpainting_fill: str = "original"
    invert_mask: bool = False
    resize_mode: str = "resize"
    hires: Any = None
    refiner: str = ""
    refiner_switch: float | None = None
    prompt_syntax: str = "plain"
    control: tuple[ControlUnit, ...] = ()
    clip_skip: int = 1
    distilled_guidance: float | None = None
    loras: tuple[tuple[str, float | tuple[float, float]], ...] = ()
    vae: str = ""
    model_hash: str = ""
    lora_hashes: str = ""
    ti_hashes: str = ""
    conditioning: tuple[tuple[str, Any], ...] = ()
    negative_switch: NegativeSwitch | None = None
    init_image: Any = dataclasses.field(default=None, compare=False, repr=False)
    mask_image: Any = dataclasses.field(default=None, compare=False, repr=False)

    def images(self) -> list[ImageParameters]:
        return [
            ImageParameters(
                prompt=self.prompt,
                negative_prompt=self.negative_prompt,
                steps=self.steps,
                sampler=sampler_id(self.sampler),
                guidance_scale=float(self.guidance_scale),
                seed=(self.seed + i) % (SEED_MAX + 1),
                width=self.width,
                height=self.height,
                model=self.model,
                denoising_strength=self.denoising_strength,
                mask_blur=self.mask_blur,
                inpaint_full_res_padding=self.inpaint_full_res_padding,
                inpainting_fill=self.inpainting_fill,
                invert_mask=self.invert_mask,
                resize_mode=self.resize_mode,
                hires=self.hires,
                refiner=self.refiner,
                refiner_switch=self.refiner_switch,
                prompt_syntax=self.prompt_syntax,
                control=self.control,
                clip_skip=self.clip_skip,
                distilled_guidance=self.distilled_guidance,
                loras=self.loras,
                vae=self.vae,
                model_hash=self.model_hash,
                lora_hashes=self.lora_hashes,
                ti_hashes=self.ti_hashes,
                conditioning=self.conditioning,
                negative_switch=self.negative_switch,
                init_image=self.init_image,
                mask_image=self.mask_image,
            )
            for i in range(self.num_images)
        ]


def generate_images(
    pipeline: Any,
    images: Sequence[ImageParameters],
    *,
    pad_to: int | None = None,
    progress: Progress | None = None,
    refiner: Any = None,
    **kwargs: Any,
) -> np.ndarray:
    """Run images sharing one `shape_key` -> uint8 `(N, H, W, 3)` (for inpainting with "Only masked": the
    original's size). `kwargs` (e.g. `should_stop`) go to every `generate_arrays` call; `refiner` is the loaded
    refiner pipeline when the images name one."""
    keys = {im.shape_key for im in images}
    if len(keys) != 1:
        raise ValueError(
            f"generate_images: images must share steps, size, sampler and task settings to share a "
            f"batch; got {len(keys)} different ones"
        )
    p = images[0]
    prompts, negatives = [im.prompt for im in images], [im.negative_prompt for im in images]
    if p.loras:  # the tags stay in the infotext; the caller applied the LoRAs to the params
        prompts, negatives = strip_lora_tags(prompts, p.loras), strip_lora_tags(negatives, p.loras)
    args = (
        prompts,
        negatives,
        [im.seed for im in images],
        [im.image_index for im in images],
        [im.guidance_scale for im in images],
    )
    common = dict(
        steps=p.steps, height=p.height, width=p.width, sampler=p.sampler, pad_to=pad_to, progress=progress, **kwargs
    )
    if p.prompt_syntax != "plain":
        common["prompt_syntax"] = p.prompt_syntax
    skips = [im.clip_skip for im in images]
    if any(s != 1 for s in skips):  # a per-image input: one batch may mix values
        common["clip_skip"] = skips[0] if len(set(skips)) == 1 else skips
    distilled = [im.distilled_guidance for im in images]
    if any(d is not None for d in distilled):  # Flux dev's embedded guidance, per image
        default = getattr(pipeline, "distilled_guidance_scale", None)
        common["guidance"] = [default if d is None else d for d in distilled]
    for name, _ in p.conditioning:  # the family's options, one value per image (the shape key fixes the names)
        common[name] = [dict(im.conditioning)[name] for im in images]
    if p.negative_switch is not None:
        return _switched(pipeline, images, args, common)
    if p.control and (p.hires is not None or p.refiner_switch is not None):
        raise ValueError("ControlNet runs with txt2img, img2img and inpainting; not with the hires fix or a refiner")
    if p.hires is not None:
        from sdjax.pipelines.recipes import hires_arrays

        return hires_arrays(pipeline, *args, hires=p.hires, **common)
    if p.refiner_switch is not None:
        if refiner is None:
            raise ValueError(f"the images name the refiner {p.refiner!r} but no refiner pipeline was given")
        from sdjax.pipelines.recipes import refine_arrays

        return refine_arrays(pipeline, refiner, *args, switch=p.refiner_switch, **common)
    if p.init_image is not None:  # text-to-image keeps the generator's default task
        inputs = planning.TaskInputs(
            image=[im.init_image for im in images],
            mask_image=None if p.mask_image is None else [im.mask_image for im in images],
            strength=p.denoising_strength,
            resize_mode=p.resize_mode,
            mask_blur=p.mask_blur,
            padding_mask_crop=p.inpaint_full_res_padding,
            fill=p.inpainting_fill,
            invert_mask=p.invert_mask,
        )
        common["task"] = planning.plan_task(
            pipeline, inputs, height=p.height, width=p.width, count=len(images), steps=p.steps, policy=A1111
        )
    if p.control:
        from sdjax.pipelines.controlnet import control_request

        units = p.control
        per_image = [[unit.image for unit in im.control] for im in images]  # batch-mates may have their own maps
        common["control"] = control_request(
            pipeline,
            control_image=per_image if len(units) > 1 else [maps[0] for maps in per_image],
            controlnet=[u.model for u in units] if len(units) > 1 else units[0].model,
            params=None,
            count=len(images),
            height=p.height,
            width=p.width,
            task=p.task,
            controlnet_conditioning_scale=[u.weight for u in units],
            control_guidance_start=[u.guidance_start for u in units],
            control_guidance_end=[u.guidance_end for u in units],
        )
    return pipeline.generate_arrays(*args, **common)


def _switched(pipeline: Any, images: Sequence[ImageParameters], args: tuple, common: dict) -> np.ndarray:
    """Text-to-image with a `NegativeSwitch`: model calls [0, k) with the images' negatives, returning latents
    that keep their noise, then [k, n) from them with the switch's negatives and no noise added."""
    p = images[0]
    if p.init_image is not None or p.control or p.hires is not None or p.refiner_switch is not None:
        raise ValueError("a negative switch runs with text-to-image alone (no image, ControlNet, hires fix or refiner)")
    k = p.negative_switch.step
    end = switch_fraction(pipeline._sampler(p.sampler), p.steps, k)
    plan = dict(height=p.height, width=p.width, count=len(images), steps=p.steps, policy=A1111)
    task = planning.plan_task(pipeline, planning.TaskInputs(denoising_end=end), **plan)
    latents = pipeline.generate_arrays(*args, **dict(common, task=task, output="latents"))
    negatives = [im.negative_switch.negative_prompt for im in images]
    if p.loras:
        negatives = strip_lora_tags(negatives, p.loras)
    second = {name: value for name, value in common.items() if name not in NEGATIVE_OPTIONS}
    for name, _ in p.negative_switch.conditioning:
        second[name] = [dict(im.negative_switch.conditioning)[name] for im in images]
    # (denoising_start only turns the added noise off: start_step puts the start at call k)
    inputs = planning.TaskInputs(image=latents, denoising_start=1.0, start_step=k)
    second["task"] = planning.plan_task(pipeline, inputs, **plan)
    return pipeline.generate_arrays(args[0], negatives, *args[2:], **second)


def strip_lora_tags(texts: list[str], loras: tuple[tuple[str, float | tuple[float, float]], ...]) -> list[str]:
    """The texts without their `<lora:...>` tags, each of which must name one of `loras` (those applied)."""
    from sdjax.text import prompt_syntax

    names = {name for name, _ in loras}
    out = []
    for text in texts:
        stripped, tags = prompt_syntax.extract_networks(text)
        stray = [t for t in tags if t.kind != "lora" or t.name not in names]
        if stray:
            raise ValueError(f"prompt tag <{stray[0].kind}:{stray[0].name}:...> is not among the applied LoRAs {names}")
        out.append(stripped)
    return out


# ---------------------------------------------------------------------------------------------- reading a request back
def parameters_from_text(text: str) -> ImageParameters:
    """Infotext -> `ImageParameters`; raises ValueError naming a missing or malformed field."""
    raw = parse_parameters(text)
    missing = [k for k in ("Steps", "Sampler", "CFG scale", "Seed", "Size") if k not in raw]
    if missing:
        raise ValueError(f"infotext lacks the field(s) {missing}; got keys {sorted(raw)}")
    sampler = raw["Sampler"]
    schedule = raw.get("Schedule type", "")
    if schedule and schedule.lower() != "automatic" and not sampler.endswith(schedule):
        sampler = f"{sampler} {schedule}"
    try:
        hires = None
        if "Hires upscaler" in raw:
            from sdjax.pipelines.recipes import Hires

            upscaler = {v: k for k, v in UPSCALER_NAMES.items()}.get(raw["Hires upscaler"])
            if upscaler is None:
                raise ValueError(f"Hires upscaler {raw['Hires upscaler']!r} is not one sdjax implements")
            resize = tuple(int(x) for x in raw["Hires resize"].split("x")) if "Hires resize" in raw else None
            hires = Hires(
                scale=float(raw.get("Hires upscale", 2)),
                resize=resize,
                upscaler=upscaler,
                steps=int(raw.get("Hires steps", 0)),
                strength=float(raw.get("Denoising strength", A1111.hires_strength)),
                sampler=sampler_id(raw["Hires sampler"]) if "Hires sampler" in raw else None,
            )
        return ImageParameters(
            prompt=raw["Prompt"],
            negative_prompt=raw["Negative prompt"],
            steps=int(raw["Steps"]),
            sampler=sampler_id(sampler),
            guidance_scale=float(raw["CFG scale"]),
            seed=int(raw["Seed"]),
            width=int(raw["Size-1"]),
            height=int(raw["Size-2"]),
            model=raw.get("Model", ""),
            image_index=int(raw.get("Image index", 0)),
            denoising_strength=(
                float(raw["Denoising strength"]) if "Denoising strength" in raw and hires is None else None
            ),
            mask_blur=float(raw.get("Mask blur", 0)),
            inpaint_full_res_padding=(
                int(raw.get("Masked area padding", 32)) if raw.get("Inpaint area") == "Only masked" else None
            ),
            hires=hires,
            refiner=raw.get("Refiner", ""),
            refiner_switch=float(raw["Refiner switch at"]) if "Refiner switch at" in raw else None,
            clip_skip=int(raw.get("Clip skip", 1)),
            distilled_guidance=float(raw["Distilled CFG Scale"]) if "Distilled CFG Scale" in raw else None,
            vae=raw.get("VAE", ""),
            model_hash=raw.get("Model hash", ""),
            lora_hashes=raw.get("Lora hashes", ""),
            ti_hashes=raw.get("TI hashes", ""),
            conditioning=conditioning_from_fields(raw),
            negative_switch=_switch_from_fields(raw),
        )
    except (KeyError, ValueError) as e:
        raise ValueError(f"infotext has a malformed field: {e}; fields: {raw}") from None


def _switch_from_fields(raw: dict[str, str]) -> NegativeSwitch | None:
    if "Negative switch at step" not in raw:
        return None
    return NegativeSwitch(
        int(raw["Negative switch at step"]),
        raw.get("Negative prompt" + SWITCH_SUFFIX, ""),
        conditioning_from_fields(raw, SWITCH_SUFFIX),
    )
