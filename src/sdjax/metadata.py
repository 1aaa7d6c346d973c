"""Generation parameters as typed values, as AUTOMATIC1111 "infotext", and as the PNG `parameters` chunk.

The CLI and the server are adapters over one call: a `GenerationRequest` (what a user asked for, defaults
resolved) expands to one `ImageParameters` per image, and `generate_images` runs a list of those that share a
compiled shape through `pipeline.generate_arrays`. Every image of the CLI and the server has its own seed (image
`i` of a request uses `seed + i`, with fold-in index 0, AUTOMATIC1111's convention), so the `Seed:` written in a
file reproduces that image alone, whatever the batch it was made in.

The text format is the one the AUTOMATIC1111 web UI writes and reads (`modules/infotext_utils.py`,
`create_infotext` / `parse_generation_parameters`), also read by ComfyUI, InvokeAI and image hosts::

    a photo of an astronaut
    Negative prompt: blurry
    Steps: 20, Sampler: Euler a, CFG scale: 7.5, Seed: 0, Size: 512x512, Model: stable-diffusion-v1-5

The last line is `key: value` pairs separated by ", "; a value holding ",", ":" or a line break is JSON-quoted.
`Size` is width x height.

Escaping (`format_parameters`): AUTOMATIC1111 writes prompts as they are, so a multi-line prompt takes several
lines, and its reader moves every line that starts with "Negative prompt:" into the negative prompt. sdjax keeps
the multi-line layout (as A1111 does) but lets no prompt text change the structure: every line break (`\r\n`,
`\r`, and the separators `str.splitlines` knows, such as U+2028) is written as `\n`, and a prompt line starting
with "Negative prompt:" is written with that marker in lower case. The CLIP tokenizer collapses whitespace and
lower-cases, so the tokens (and the image) of what is read back are those of the prompt asked for. Quoted values
also escape U+0085, U+2028 and U+2029 (JSON leaves them raw).
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from PIL import Image, PngImagePlugin

from sdjax.policy import A1111

PARAMETERS_KEY = "parameters"  # the PNG text chunk keyword AUTOMATIC1111 writes and reads
SEED_MAX = 2**32 - 1  # seeds are unsigned 32-bit, as in AUTOMATIC1111; seed + i wraps around
EMBEDDED_MODEL_NAME = "sdjax/embedded"

# From AUTOMATIC1111's infotext_utils.py: a key starts with a word character; a value is a JSON string or runs
# to the next comma.
_PARAM_RE = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
_SIZE_RE = re.compile(r"^(\d+)x(\d+)$")


class Progress(Protocol):
    def __call__(self, stage: str, step: int, total: int) -> None: ...


# A1111's names of the hires-fix upscalers sdjax implements (`sdjax.pipelines.recipes.UPSCALERS`).
UPSCALER_NAMES = {"latent": "Latent", "latent-nearest": "Latent (nearest)", "lanczos": "Lanczos", "nearest": "Nearest"}


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
    init_image: Any = dataclasses.field(default=None, compare=False, repr=False)
    mask_image: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def task(self) -> str:
        if self.init_image is None:
            return "txt2img"
        return "img2img" if self.mask_image is None else "inpaint"

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
        )

    def extra_fields(self) -> dict[str, Any]:
        """The infotext fields beyond the text-to-image ones, in A1111's names."""
        out: dict[str, Any] = {}
        if self.denoising_strength is not None:
            out["Denoising strength"] = _number(self.denoising_strength)
        if self.task == "inpaint":
            out["Mask blur"] = _number(self.mask_blur) if self.mask_blur else None
            if self.inpaint_full_res_padding is not None:
                out["Inpaint area"] = "Only masked"
                out["Masked area padding"] = self.inpaint_full_res_padding
        if self.hires is not None:
            h = self.hires
            out["Denoising strength"] = _number(h.strength)
            out["Hires upscale"] = None if h.resize else _number(h.scale).removesuffix(".0")
            out["Hires resize"] = f"{h.resize[0]}x{h.resize[1]}" if h.resize else None
            out["Hires steps"] = h.steps or None
            out["Hires upscaler"] = UPSCALER_NAMES[h.upscaler]
            out["Hires sampler"] = sampler_display_name(h.sampler) if h.sampler else None
        if self.clip_skip > 1:
            out["Clip skip"] = self.clip_skip
        if self.distilled_guidance is not None:
            out["Distilled CFG Scale"] = _number(self.distilled_guidance)
        if self.lora_hashes:
            out["Lora hashes"] = self.lora_hashes
        if self.ti_hashes:
            out["TI hashes"] = self.ti_hashes
        for i, unit in enumerate(self.control):
            out[f"ControlNet {i}"] = unit.infotext()
        if self.refiner:
            out["Refiner"] = self.refiner
            out["Refiner switch at"] = _number(self.refiner_switch) if self.refiner_switch is not None else None
        return out

    def infotext(self) -> str:
        return format_parameters(self, self.extra_fields())


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
            f"Module: {self.module}, Model: {Path(self.model).name or self.model}, Weight: {_number(self.weight)}, "
            f"Guidance Start: {_number(self.guidance_start)}, Guidance End: {_number(self.guidance_end)}"
        )


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
                init_image=self.init_image,
                mask_image=self.mask_image,
            )
            for i in range(self.num_images)
        ]


def a1111_start_step(steps: int, strength: float) -> int:
    """AUTOMATIC1111's first img2img step: `t_enc = int(min(strength, 0.999) * steps)` steps run after it, plus one
    (`sigmas[steps - t_enc - 1:]` in its k-diffusion sampler)."""
    t_enc = int(min(strength, 0.999) * steps)
    return steps - t_enc - 1


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
    task = None
    if p.init_image is not None:
        from sdjax.core.tasks import img2img, inpaint

        strength = A1111.strength if p.denoising_strength is None else p.denoising_strength
        start = a1111_start_step(p.steps, strength)
        inits = [im.init_image for im in images]
        if p.mask_image is None:
            task = img2img.request(
                inits, width=p.width, height=p.height, strength=strength, resize_mode=p.resize_mode, start_step=start
            )
        else:
            task = inpaint.request(
                inits,
                [im.mask_image for im in images],
                width=p.width,
                height=p.height,
                strength=strength,
                resize_mode=p.resize_mode,
                mask_blur=p.mask_blur,
                padding_mask_crop=p.inpaint_full_res_padding,
                paste_back=True,
                start_step=start,
                fill=p.inpainting_fill,
                invert_mask=p.invert_mask,
            )
    if task is not None:
        common["task"] = task
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


def lora_hashes(named_files: Sequence[tuple[str, str | Path]], hashes: Any = None) -> str:
    """A1111's `Lora hashes` value, "name: hash12, ...", for (name as written in the prompt, file) pairs; `hashes`:
    a `models_dir.HashCache` (default: a new one)."""
    from sdjax.models_dir import HashCache

    cache = hashes or HashCache()
    clean = str.maketrans("", "", ":,")  # A1111 takes these out of the names
    return ", ".join(f"{name.translate(clean)}: {cache.network_hash(path)[:12]}" for name, path in named_files)


def ti_hashes(texts: Sequence[str], named_files: Sequence[tuple[str, str | Path]], hashes: Any = None) -> str:
    """A1111's `TI hashes` value, "name: hash12, ...", for the embeddings (trigger word, file) that `texts` use: a
    trigger word counts where it stands as a word of its own. The hash is the file's SHA-256, as A1111's."""
    from sdjax.models_dir import HashCache

    cache = hashes or HashCache()
    clean = str.maketrans("", "", ":,")
    used = [
        (name, path)
        for name, path in named_files
        if any(re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", t or "") for t in texts)
    ]
    return ", ".join(f"{name.translate(clean)}: {cache.sha256(path)[:12]}" for name, path in used)


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


# ---------------------------------------------------------------------------------------------- sampler names
def _fold(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


def sampler_id(name: str) -> str:
    """The sampler registry name for any spelling the registry knows ("Euler a", "DPM++ 2M Karras",
    "euler-a" -> "euler_a", "dpmpp_2m_karras"); other names (diffusers class names, samplers sdjax lacks) unchanged.
    Requests that name one sampler differently still share batches."""
    from sdjax import samplers

    if name in samplers.SAMPLERS:
        return name
    if name in samplers.ALIASES:
        return samplers.ALIASES[name]
    key = _fold(name)
    for registry in samplers.SAMPLERS:
        if _fold(registry) == key:
            return registry
    for alias, registry in samplers.ALIASES.items():
        if _fold(alias) == key:
            return registry
    from sdjax.samplers import a1111

    label, schedule = a1111.describe(name)  # "euler a uniform" -> "Euler a Uniform"
    return f"{label} {schedule}" if schedule is not None else name


def sampler_display_name(name: str) -> str:
    """AUTOMATIC1111's name of a sampler ("euler_a" -> "Euler a"), as written in infotext; else the name."""
    from sdjax import samplers

    registry = sampler_id(name)
    for a1111, target in samplers.A1111_NAMES.items():
        if target == registry:
            return a1111
    for alias, target in samplers.ALIASES.items():  # samplers AUTOMATIC1111 lacks: an upper-case spelling
        if target == registry and alias.isupper():
            return alias
    return registry


def model_label(model: str | None) -> str:
    """The `Model:` value: a Hub id as given, a local folder by its name (like AUTOMATIC1111's checkpoint name,
    and so that the same model gives the same file bytes on any machine), the embedded model by its name."""
    from sdjax.pipelines.auto import ALIASES, EMBEDDED_MODEL

    if not model or model in ALIASES or Path(model).resolve() == Path(EMBEDDED_MODEL).resolve():
        return EMBEDDED_MODEL_NAME
    path = Path(model)
    return path.resolve().name if path.exists() else model


# ---------------------------------------------------------------------------------------------- text format
# Every line boundary of `str.splitlines`, \r\n first so that it counts as one.
_LINE_BREAK_RE = re.compile("\r\n|[\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029]")
_NEGATIVE_MARK = "Negative prompt:"


def _prompt_lines(text: str) -> str:
    """A prompt for the infotext: line breaks as "\n", no line that reads as the negative-prompt marker."""
    lines = []
    for line in _LINE_BREAK_RE.split(text):
        body = line.lstrip()
        if body.startswith(_NEGATIVE_MARK):
            line = line[: len(line) - len(body)] + _NEGATIVE_MARK.lower() + body[len(_NEGATIVE_MARK) :]
        lines.append(line)
    return "\n".join(lines)


def _quote(value: str) -> str:
    if "," not in value and ":" not in value and not value.startswith('"') and not _LINE_BREAK_RE.search(value):
        return value
    quoted = json.dumps(value, ensure_ascii=False)
    return quoted.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _number(x: float) -> str:
    return str(float(x))


def _sampler_fields(sampler: str) -> dict[str, Any]:
    """A1111 >= 1.9 writes the sampler and its schedule apart: "Sampler: DPM++ 2M, Schedule type: Karras"."""
    from sdjax.samplers import a1111

    label, schedule = a1111.describe(sampler_display_name(sampler))
    return {"Sampler": label, "Schedule type": schedule}


def format_parameters(p: ImageParameters, extra: dict[str, Any] | None = None) -> str:
    """AUTOMATIC1111 infotext for one image. `extra` adds `key: value` pairs after the standard ones."""
    fields: dict[str, Any] = {
        "Steps": p.steps,
        **_sampler_fields(p.sampler),
        "CFG scale": _number(p.guidance_scale),
        "Seed": p.seed,
        "Size": f"{p.width}x{p.height}",
        "Model hash": p.model_hash or None,
        "Model": p.model or None,
        "VAE": p.vae or None,
        "Image index": p.image_index or None,  # sdjax: the fold_in index; 0 (omitted) for CLI and server images
        **(extra or {}),
    }
    params = ", ".join(f"{k}: {_quote(str(v))}" for k, v in fields.items() if v is not None and v != "")
    negative = f"\nNegative prompt: {_prompt_lines(p.negative_prompt)}" if p.negative_prompt else ""
    return f"{_prompt_lines(p.prompt)}{negative}\n{params}".strip()


def parse_parameters(text: str) -> dict[str, str]:
    """Infotext -> `{"Prompt": ..., "Negative prompt": ..., "Steps": "20", "Size-1": "512", "Size-2": "512", ...}`.

    Mirrors AUTOMATIC1111's `parse_generation_parameters`: lines are stripped, the negative prompt starts at a
    line beginning with `Negative prompt:`, the last line holds the parameters if it has at least three pairs.
    A `WxH` value `v` of key `K` is also split into `K-1` (width) and `K-2` (height). Values stay strings.
    A `Schedule type` (AUTOMATIC1111 1.9+, e.g. "Karras") stays a key of its own; `parameters_from_text` joins it
    to the sampler.
    """
    *lines, last = text.strip().split("\n")
    if len(_PARAM_RE.findall(last)) < 3:
        lines.append(last)
        last = ""
    prompt: list[str] = []
    negative: list[str] = []
    in_negative = False
    for line in lines:
        line = line.strip()
        if line.startswith("Negative prompt:"):
            in_negative = True
            line = line[len("Negative prompt:") :].strip()
        (negative if in_negative else prompt).append(line)
    out = {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative)}
    for key, value in _PARAM_RE.findall(last):
        value = _unquote(value.strip())
        out[key] = value
        m = _SIZE_RE.match(value)
        if m:
            out[f"{key}-1"], out[f"{key}-2"] = m.group(1), m.group(2)
    return out


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
                strength=float(raw.get("Denoising strength", 0.7)),
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
        )
    except (KeyError, ValueError) as e:
        raise ValueError(f"infotext has a malformed field: {e}; fields: {raw}") from None


# ---------------------------------------------------------------------------------------------- PNG files
def png_bytes(image: np.ndarray | Image.Image, parameters: str | None = None) -> bytes:
    """Encode an image as PNG with the `parameters` text chunk. Deterministic: same pixels and text, same bytes
    (PIL writes no time chunk; text that is not Latin-1 goes in an iTXt chunk as UTF-8)."""
    if not isinstance(image, Image.Image):
        image = Image.fromarray(np.ascontiguousarray(image))
    info = PngImagePlugin.PngInfo()
    if parameters is not None:
        info.add_text(PARAMETERS_KEY, parameters)
    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()


def read_parameters(source: str | Path | bytes) -> str | None:
    """The `parameters` text of a PNG file (path or bytes), or None if it has none."""
    data = io.BytesIO(source) if isinstance(source, bytes) else source
    with Image.open(data) as im:
        im.load()
        return im.info.get(PARAMETERS_KEY) or getattr(im, "text", {}).get(PARAMETERS_KEY)
