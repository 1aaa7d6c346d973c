"""The AUTOMATIC1111 web UI API's bodies and their translation to a `GenerationRequest`: `POST /sdapi/v1/txt2img`,
`/sdapi/v1/img2img`: `prompt`, `negative_prompt`, `steps`, `cfg_scale`, `width`, `height`, `seed` (-1: random),
`batch_size`, `n_iter`, `sampler_name` (+ `scheduler`, e.g. "Karras"), `force_task_id`, `override_settings`
(honoured where the value is what sdjax does, else 422 naming the setting), the hires fix (`enable_hr`, `hr_scale`,
`hr_upscaler`, `hr_second_pass_steps`, `hr_resize_x/_y`, `denoising_strength`, `hr_sampler_name`), and for img2img
`init_images`, `mask`, `denoising_strength`, `mask_blur`, `inpainting_fill`, `inpaint_full_res(_padding)`,
`inpainting_mask_invert`, `resize_mode`. Other fields of that API are accepted and ignored, except those that would
change the image in ways sdjax does not implement (`restore_faces`, `tiling`, `subseed_strength`,
`initial_noise_multiplier`, a `script_name`), which are refused. `POST /sdapi/v1/png-info` too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sdjax import infotext
from sdjax.infotext import sampler_display_name, sampler_id
from sdjax.metadata import SEED_MAX, GenerationRequest
from sdjax.policy import A1111
from sdjax.server.errors import APIError
from sdjax.server.schemas.common import (
    Defaults,
    FieldError,
    ImageB64,
    Limits,
    check_request,
    check_text,
    decode_image,
    image_cost,
    random_seed,
)


class A1111Txt2ImgRequest(BaseModel):
    """`POST /sdapi/v1/txt2img` (AUTOMATIC1111 `StableDiffusionTxt2ImgProcessingAPI`), the fields sdjax uses."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(description="What to draw (may be empty)")
    negative_prompt: str = ""
    steps: int | None = Field(None, ge=1)
    cfg_scale: float | None = Field(None, ge=0, allow_inf_nan=False)
    distilled_cfg_scale: float | None = Field(
        None, ge=0, allow_inf_nan=False, description="Forge: Flux dev's distilled guidance (default: the model's)"
    )
    width: int | None = Field(None, ge=8, multiple_of=8)
    height: int | None = Field(None, ge=8, multiple_of=8)
    seed: int = Field(-1, ge=-1, le=SEED_MAX, description="-1: random; image i uses seed + i")
    batch_size: int = Field(1, ge=1)
    n_iter: int = Field(1, ge=1)
    sampler_name: str | None = None
    sampler_index: str | None = Field(None, description="Older name of sampler_name")
    scheduler: str | None = Field(None, description='Noise schedule, e.g. "Karras"; "Automatic": the sampler\'s')
    force_task_id: str | None = Field(None, max_length=128, description="Id for GET /sdapi/v1/progress?id_task=")
    send_images: bool = True
    save_images: bool = False
    enable_hr: bool = False
    restore_faces: bool | None = None
    tiling: bool | None = None
    subseed_strength: float = 0.0
    override_settings: dict[str, Any] | None = Field(
        None, description="Settings for this request: honoured where the value is what sdjax does, else 422"
    )
    override_settings_restore_afterwards: bool = True
    # hires fix (txt2img only)
    hr_scale: float = Field(2.0, gt=0, allow_inf_nan=False, description="Hires fix: upscale factor of the second pass")
    hr_upscaler: str | None = Field(None, description='Hires fix: "Latent", "Latent (nearest)", "Lanczos", "Nearest"')
    hr_second_pass_steps: int = Field(0, ge=0, description="Hires fix: second-pass steps (0: the first pass's)")
    hr_resize_x: int = Field(0, ge=0, description="Hires fix: target width (0: by hr_scale)")
    hr_resize_y: int = Field(0, ge=0, description="Hires fix: target height (0: by hr_scale)")
    hr_sampler_name: str | None = Field(None, description="Hires fix: second-pass sampler (None: the first's)")
    denoising_strength: float | None = Field(
        None, ge=0, le=1, description="img2img: how much to change the image; txt2img: the hires pass's strength"
    )
    initial_noise_multiplier: float | None = Field(None, description="Only 1 (A1111's default) is supported")
    alwayson_scripts: dict[str, Any] | None = Field(
        None, description='Scripts: {"controlnet": {"args": [units]}} (sd-webui-controlnet\'s API); others 422'
    )
    script_name: str | None = Field(None, description="A selectable script: sdjax has none; anything but null or "
                                    '"" is refused (GET /sdapi/v1/scripts)')  # fmt: skip
    script_args: list[Any] = Field(default_factory=list, description="The selectable script's arguments")


class A1111Img2ImgRequest(A1111Txt2ImgRequest):
    """`POST /sdapi/v1/img2img` (AUTOMATIC1111 `StableDiffusionImg2ImgProcessingAPI`), the fields sdjax uses."""

    init_images: list[ImageB64] = Field(min_length=1, description="Base64 images (the first is used for every image)")
    mask: ImageB64 | None = Field(None, description="Base64 mask: white is repainted (inpainting)")
    mask_blur: int | None = Field(None, ge=0, le=1024, description="Mask blur in pixels (sets x and y)")
    mask_blur_x: int = Field(4, ge=0, le=1024)
    mask_blur_y: int = Field(4, ge=0, le=1024)
    inpainting_fill: int = Field(0, ge=0, le=3, description="0 fill, 1 original, 2 latent noise, 3 latent nothing")
    inpaint_full_res: bool = Field(True, description="Repaint only the masked region at full resolution")
    inpaint_full_res_padding: int = Field(0, ge=0)
    inpainting_mask_invert: int = Field(0, ge=0, le=1)
    resize_mode: int = Field(0, ge=0, le=3, description="0 just resize, 1 crop and resize, 2 resize and fill")
    image_cfg_scale: float | None = Field(None, description="instruct-pix2pix only: accepted, has no effect")
    include_init_images: bool = False


class A1111Txt2ImgResponse(BaseModel):
    images: list[str]
    parameters: dict[str, Any]
    info: str


class A1111PngInfoRequest(BaseModel):
    """`POST /sdapi/v1/png-info`."""

    image: ImageB64 = Field(description="A base64 PNG (or a data: URL)")


class A1111PngInfoResponse(BaseModel):
    info: str
    items: dict[str, Any]
    parameters: dict[str, Any]


def a1111_schedulers() -> list[dict[str, Any]]:
    """`GET /sdapi/v1/schedulers` items (AUTOMATIC1111's `SchedulerItem`: name, label, aliases, default_rho,
    need_inner_model) for the schedules sdjax can run."""
    from sdjax.samplers import a1111

    return a1111.a1111_schedulers()


def a1111_sampler(body: A1111Txt2ImgRequest, defaults: Defaults) -> str:
    """The sampler for `sampler_name` + `scheduler` with A1111's meaning ("Automatic": the sampler's own schedule,
    Karras for "DPM++ 2M"), as the one string `sdjax.samplers.a1111.canonical` writes. A registry name that is
    no A1111 sampler (the server's default, e.g. "pndm") is served as it is with "Automatic"."""
    name = body.sampler_name or body.sampler_index
    scheduler = (body.scheduler or "").strip() or "Automatic"
    if not name and scheduler.lower() == "automatic":  # the server's default sampler, as the other APIs run it
        return sampler_id(defaults.sampler)
    try:
        return infotext.a1111_sampler(name or defaults.sampler, scheduler, registry_fallback=True)
    except infotext.SamplerChoiceError as e:
        raise FieldError("scheduler" if e.field == "schedule" else "sampler_name", str(e)) from None


def samplers_available() -> list[str]:
    from sdjax import samplers

    return samplers.available()


def _a1111_syntax(pipeline: Any, *texts: str) -> str:
    """ "a1111" (emphasis, BREAK, long prompts, as A1111 reads them) where that changes the reading of a text, else
    "plain", so that such requests share batches with the other APIs' requests (the numbers are the same)."""
    from sdjax.text import prompt_syntax

    tokenizer = getattr(pipeline, "tokenizer", None) or getattr(pipeline, "tokenizer_2", None)
    if not hasattr(tokenizer, "encode"):
        tokenizer = None
    return "a1111" if any(prompt_syntax.changes_reading(t, tokenizer) for t in texts) else "plain"


def _check_prompt_tags(text: str, field: str) -> None:
    from sdjax.text import prompt_syntax

    try:
        _, tags = prompt_syntax.extract_networks(text)
    except ValueError as e:
        raise FieldError(field, str(e)) from None
    if tags:
        tag = tags[0]
        raise FieldError(field, f"<{tag.kind}:{tag.name}:...>: extra networks in prompts are not served here")


def _distilled(pipeline: Any, value: float | None) -> float | None:
    """Forge's `distilled_cfg_scale`: the model's default on a model with distilled guidance (Flux dev, written
    to the infotext as Forge does), refused by name on one without."""
    default = getattr(pipeline, "distilled_guidance_scale", None)
    transformer = getattr(pipeline, "transformer", None)
    has = default is not None and bool(getattr(getattr(transformer, "config", None), "guidance_embeds", False))
    if value is not None and not has:
        raise FieldError("distilled_cfg_scale", "this model has no distilled guidance (Flux dev has); use cfg_scale")
    return (float(default) if value is None else float(value)) if has else None


def resolve_a1111(
    body: A1111Txt2ImgRequest, pipeline: Any, limits: Limits, defaults: Defaults, model_name: str
) -> GenerationRequest:
    for field, value, default in (
        ("restore_faces", body.restore_faces, None),
        ("tiling", body.tiling, None),
        ("subseed_strength", body.subseed_strength, 0.0),
    ):
        if value and value != default:
            raise FieldError(field, f"{field}={value!r} is not supported by sdjax; leave it out")
    if body.initial_noise_multiplier not in (None, 1, 1.0):
        raise FieldError("initial_noise_multiplier", "only 1 is supported")
    if body.script_name is not None and body.script_name.strip():
        raise FieldError(
            "script_name",
            f"{body.script_name!r}: sdjax runs no selectable scripts (GET /sdapi/v1/scripts); leave it out "
            "(ControlNet is an always-on script: alwayson_scripts)",
            code="unsupported",
        )
    check_text("prompt", body.prompt)  # before the tokenizer reads them (a lone surrogate is valid JSON)
    check_text("negative_prompt", body.negative_prompt or "")
    request = GenerationRequest(
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        num_images=body.batch_size * body.n_iter,
        seed=random_seed() if body.seed == -1 else body.seed,
        steps=body.steps or defaults.steps,
        guidance_scale=defaults.guidance_scale if body.cfg_scale is None else body.cfg_scale,
        width=body.width or defaults.width,
        height=body.height or defaults.height,
        sampler=a1111_sampler(body, defaults),
        model=model_name,
        hires=_hires(body) if body.enable_hr and not isinstance(body, A1111Img2ImgRequest) else None,
        prompt_syntax=_a1111_syntax(pipeline, body.prompt, body.negative_prompt or ""),
        distilled_guidance=_distilled(pipeline, body.distilled_cfg_scale),
    )
    _check_prompt_tags(body.prompt, "prompt")
    _check_prompt_tags(body.negative_prompt or "", "negative_prompt")
    fields = dict(
        num_images="batch_size",
        steps="steps",
        guidance_scale="cfg_scale",
        width="width",
        height="height",
        size="width",
        sampler="sampler_name",
        prompt="prompt",
        negative_prompt="negative_prompt",
    )
    check_request(request, pipeline, limits, fields)
    if request.hires is not None:
        _check_hires(request, pipeline, limits)
    return request


def _check_hires(r: GenerationRequest, pipeline: Any, limits: Limits) -> None:
    try:
        th, tw = r.hires.target(r.height, r.width)
    except (OverflowError, ValueError):  # a finite hr_scale whose product is not (1e308 x 64)
        raise FieldError("hr_scale", f"{r.hires.scale!r} gives no image size") from None
    for name, v in (("hr_resize_x", tw), ("hr_resize_y", th)):
        if not limits.min_size <= v <= limits.max_size:
            raise FieldError(name, f"the hires target {tw}x{th} is outside {limits.min_size}..{limits.max_size}")
    try:
        pipeline.validate(height=th, width=tw)
    except (ValueError, KeyError) as e:
        raise FieldError("hr_scale", f"the hires target {tw}x{th}: {e.args[0] if e.args else e}") from None
    # pinned sizes and samplers bind the second pass too (else it would compile what start-up did not)
    if limits.sizes is not None and (tw, th) not in limits.sizes:
        served = ", ".join(f"{w}x{h}" for w, h in limits.sizes)
        raise FieldError("hr_scale", f"the hires target {tw}x{th} is not served here; choose one of {served}",
                         code="not_pinned")  # fmt: skip
    if r.hires.sampler and limits.samplers is not None and sampler_id(r.hires.sampler) not in limits.samplers:
        served = ", ".join(sampler_display_name(s) for s in limits.samplers)
        raise FieldError("hr_sampler_name", f"{r.hires.sampler!r} is not served here (compiled ahead: {served})",
                         code="not_pinned")  # fmt: skip
    cost = image_cost(r.images()[0]) * r.num_images
    if limits.max_cost is not None and cost > limits.max_cost:
        raise APIError(
            422,
            f"the request (both hires passes) costs {cost} pixel-steps, over the per-request budget "
            f"of {limits.max_cost} (max_request_cost)",
            None,
            code="over_budget",
        )


UPSCALERS = {
    "latent": "latent",
    "latent (nearest)": "latent-nearest",
    "latent (nearest-exact)": "latent-nearest",
    "lanczos": "lanczos",
    "nearest": "nearest",
}  # A1111 names -> sdjax's (`recipes.UPSCALERS`)
FILLS = {0: "fill", 1: "original", 2: "latent noise", 3: "latent nothing"}  # A1111's `inpainting_fill`
RESIZE_MODES = {0: "resize", 1: "crop", 2: "fill"}  # A1111's `resize_mode` (3, latent upscale: not supported)


def _hires(body: A1111Txt2ImgRequest):
    from sdjax.pipelines.recipes import Hires

    upscaler = UPSCALERS.get((body.hr_upscaler or "Latent").strip().lower())
    if upscaler is None:
        raise FieldError(
            "hr_upscaler",
            f"unknown upscaler {body.hr_upscaler!r}; sdjax has: Latent, Latent (nearest), Lanczos, Nearest",
        )
    resize = None
    if body.hr_resize_x or body.hr_resize_y:
        width, height = body.width or 0, body.height or 0
        rx, ry = body.hr_resize_x, body.hr_resize_y
        if not (rx and ry):  # A1111: the missing side keeps the aspect ratio
            if not (width and height):
                raise FieldError("hr_resize_x", "give both hr_resize_x and hr_resize_y, or width and height")
            rx, ry = (rx, rx * height // width) if rx else (ry * width // height, ry)
        resize = (rx - rx % 8, ry - ry % 8)
    strength = A1111.hires_strength if body.denoising_strength is None else body.denoising_strength
    if strength <= 0:
        raise FieldError("denoising_strength", "the hires pass needs a strength above 0")
    try:
        return Hires(
            scale=body.hr_scale,
            resize=resize,
            upscaler=upscaler,
            steps=body.hr_second_pass_steps,
            strength=strength,
            sampler=sampler_id(body.hr_sampler_name) if body.hr_sampler_name else None,
        )
    except ValueError as e:
        raise FieldError("hr_scale", str(e)) from None


def check_mask(
    mask, *, blur: float, invert: bool, width: int, height: int, resize_mode: str, field: str = "mask"
) -> None:
    """The mask as the model will see it (inverted, blurred, resized, binarized at 0.5) must repaint something,
    checked here so that an empty mask fails its request (422), not the batch it would join."""
    from PIL import ImageOps

    from sdjax.core import images as image_lib

    m = ImageOps.invert(mask.convert("L")) if invert else mask.convert("L")
    m = image_lib.resize(image_lib.blur_mask(m, blur), width, height, resize_mode)
    if not image_lib.mask_array(m).any():
        raise FieldError(
            field,
            "the mask repaints nothing (no pixel >= 0.5 after the mask blur): paint more, or use a smaller mask_blur",
        )


def resolve_a1111_img2img(
    body: A1111Img2ImgRequest, pipeline: Any, limits: Limits, defaults: Defaults, model_name: str
) -> GenerationRequest:
    """`/sdapi/v1/img2img`: the init image (and mask) decoded with the pixel limit, A1111's fields mapped to the
    image-to-image / inpainting settings of `GenerationRequest` (A1111's step rule, see `sdjax.metadata`)."""
    if body.resize_mode == 3:
        raise FieldError("resize_mode", "3 (just resize, latent upscale) is not supported; use 0, 1 or 2")
    if body.enable_hr:
        raise FieldError("enable_hr", "the hires fix is a txt2img option")
    image = decode_image(body.init_images[0], field="init_images[0]", limits=limits).convert("RGB")
    mask = decode_image(body.mask, field="mask", limits=limits) if body.mask else None
    if mask is not None and mask.size != image.size:
        raise FieldError(
            "mask", f"the mask is {mask.size[0]}x{mask.size[1]} but init_images[0] is {image.size[0]}x{image.size[1]}"
        )
    base = resolve_a1111(body, pipeline, limits, defaults, model_name)
    strength = A1111.strength if body.denoising_strength is None else body.denoising_strength
    extra: dict[str, Any] = dict(
        init_image=image, denoising_strength=strength, resize_mode=RESIZE_MODES[body.resize_mode]
    )
    if mask is not None:
        blur = float(body.mask_blur if body.mask_blur is not None else max(body.mask_blur_x, body.mask_blur_y))
        check_mask(
            mask,
            blur=blur,
            invert=bool(body.inpainting_mask_invert),
            width=base.width,
            height=base.height,
            resize_mode=RESIZE_MODES[body.resize_mode],
        )
        extra.update(
            mask_image=mask,
            mask_blur=float(body.mask_blur if body.mask_blur is not None else max(body.mask_blur_x, body.mask_blur_y)),
            inpaint_full_res_padding=body.inpaint_full_res_padding if body.inpaint_full_res else None,
            inpainting_fill=FILLS[body.inpainting_fill],
            invert_mask=bool(body.inpainting_mask_invert),
        )
    return dataclasses.replace(base, **extra)
