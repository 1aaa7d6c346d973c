"""What every request of every API passes on its own before it may join a batch: `FieldError` (422 naming the
field), the server's `Limits`, the `Defaults` of the model served, costs in pixel-steps, the checks of text and
tokenization, `check_common` (limits and the model's own checks), `check_settings` (A1111 options), and
`decode_image` (a base64 image within the limits).

Isolation: a request is validated and tokenized alone (`check_common`), so text the tokenizer or the PNG writer
cannot take (a lone surrogate such as "\\ud800", valid in JSON) fails that request with 422 naming the field,
never the batch it would have joined. Static checks (types, ranges, multiples of 8) are pydantic constraints;
checks that depend on the server's limits or the model (maximum size, pinned shapes, the cost budget, known
sampler, the model's size multiple) raise `FieldError` from `resolve_*`. Unknown fields are ignored, as both
upstream APIs' clients send fields for features they do not use.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import random
import re
import warnings
from typing import Annotated, Any

from pydantic import Field

from sdjax.infotext import sampler_display_name, sampler_id
from sdjax.metadata import SEED_MAX, GenerationRequest
from sdjax.server.errors import APIError

# A base64 image (PNG, JPEG or WebP; or a `data:image/...;base64,` URL), as the published schema describes it:
# OpenAPI's `byte` format with the media type, so that schema-driven clients and fuzzers (tests/server/
# test_schemathesis.py) know a field holds an image, not any string.
IMAGE_SCHEMA = {"format": "byte", "contentEncoding": "base64", "contentMediaType": "image/png"}
ImageB64 = Annotated[str, Field(json_schema_extra=IMAGE_SCHEMA)]


class FieldError(APIError):
    """An invalid request field: answered 422 naming `field`."""

    def __init__(self, field: str, message: str, code: str = "invalid_value"):
        super().__init__(422, f"{field}: {message}", field, code=code)
        self.field = field
        self.detail_message = message


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask for.

    `max_cost` bounds width x height x steps x images ("pixel-steps", what the denoising loop's time grows with);
    `sizes`, `steps` and `samplers` pin what is served (None: anything within the bounds), so that no request
    compiles a program that start-up did not.
    """

    max_images: int = 8
    max_steps: int = 150
    max_size: int = 1024
    min_size: int = 8
    max_guidance: float = 50.0
    max_cost: int | None = None
    sizes: tuple[tuple[int, int], ...] | None = None  # (width, height) allowed
    steps: tuple[int, ...] | None = None
    samplers: tuple[str, ...] | None = None  # registry names
    max_image_pixels: int = 4096 * 4096  # decoded input images (png-info; img2img later)
    max_image_bytes: int = 32 * 1024 * 1024


def request_cost(width: int, height: int, steps: int, images: int) -> int:
    """Pixel-steps: what the budgets (`Limits.max_cost`, the queue's) count."""
    return int(width) * int(height) * int(steps) * int(images)


def image_cost(im: Any) -> int:
    """Pixel-steps of one `ImageParameters`, both passes of a hires fix counted."""
    cost = request_cost(im.width, im.height, im.steps, 1)
    if getattr(im, "hires", None) is not None:
        th, tw = im.hires.target(im.height, im.width)
        total, start = im.hires.window(im.steps)
        cost += request_cost(tw, th, total - start, 1)
    return cost


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What a request that leaves a field out gets (and what start-up compiles)."""

    steps: int
    sampler: str
    width: int
    height: int
    guidance_scale: float = 7.5

    @classmethod
    def of(cls, pipeline: Any, *, steps: int | None = None, sampler: str | None = None) -> Defaults:
        height, width = pipeline.default_size
        return cls(
            steps=steps or pipeline.default_steps,
            sampler=sampler_id(sampler or pipeline.default_sampler),
            width=int(width),
            height=int(height),
            # the faces' CFG scale (A1111/Forge meaning): a family with its own says so (Flux: 1, CFG off, its
            # distilled guidance apart; SD 3: 7); the UNet families keep the server's 7.5
            guidance_scale=float(getattr(pipeline, "cfg_scale_default", 7.5)),
        )


# ---------------------------------------------------------------------------------------------- isolation
def check_text(field: str, text: str) -> None:
    """Text must be encodable as UTF-8 (a lone surrogate is valid JSON but not text: the tokenizer and the PNG
    writer refuse it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FieldError(
            field, f"holds {text[e.start : e.end]!r} at position {e.start}, which is not text (a lone surrogate)"
        ) from None


def check_tokenizable(pipeline: Any, field: str, text: str) -> None:
    """Tokenize `text` alone (`pipeline.prepare_inputs`, where the pipeline has it), so that text the tokenizer
    refuses fails this request, not the batch it would join."""
    check_text(field, text)
    prepare = getattr(pipeline, "prepare_inputs", None)
    if prepare is None:
        return
    try:
        prepare([text])
    except Exception as e:  # any tokenizer failure is this field's problem
        raise FieldError(field, f"the tokenizer refused it: {type(e).__name__}: {e}") from None


def random_seed() -> int:
    return random.SystemRandom().randrange(SEED_MAX + 1)


def check_common(
    pipeline: Any,
    limits: Limits,
    *,
    fields: dict[str, str],
    num_images: int,
    steps: int,
    width: int,
    height: int,
    guidance_scale: float,
    sampler: str,
    prompt: str,
    negative_prompt: str,
) -> None:
    """Limits of this server and the model's own checks; `fields` maps sdjax names to the API's field names."""
    if num_images > limits.max_images:
        raise FieldError(fields["num_images"], f"at most {limits.max_images} images per request, got {num_images}")
    if steps > limits.max_steps:
        raise FieldError(fields["steps"], f"at most {limits.max_steps} steps, got {steps}")
    if guidance_scale > limits.max_guidance:
        raise FieldError(fields["guidance_scale"], f"at most {limits.max_guidance}, got {guidance_scale}")
    for name, v in (("width", width), ("height", height)):
        if not limits.min_size <= v <= limits.max_size:
            raise FieldError(fields[name], f"{name} {v} is outside {limits.min_size}..{limits.max_size}")
    if limits.sizes is not None and (width, height) not in limits.sizes:
        served = ", ".join(f"{w}x{h}" for w, h in limits.sizes)
        raise FieldError(
            fields["size"],
            f"{width}x{height} is not served here (each size is compiled ahead); choose one of {served}",
            code="not_pinned",
        )
    if limits.steps is not None and steps not in limits.steps:
        served = ", ".join(str(s) for s in limits.steps)
        raise FieldError(
            fields["steps"], f"{steps} steps are not served here (compiled ahead: {served})", code="not_pinned"
        )
    if limits.samplers is not None and sampler_id(sampler) not in limits.samplers:
        served = ", ".join(sampler_display_name(s) for s in limits.samplers)
        raise FieldError(
            fields["sampler"], f"{sampler!r} is not served here (compiled ahead: {served})", code="not_pinned"
        )
    cost = request_cost(width, height, steps, num_images)
    if limits.max_cost is not None and cost > limits.max_cost:
        raise APIError(
            422,
            f"the request costs {width}x{height} pixels x {steps} steps x {num_images} images = {cost} pixel-steps, "
            f"over the per-request budget of {limits.max_cost} (max_request_cost); ask for fewer images or steps, "
            "or a smaller size",
            None,
            code="over_budget",
        )
    check_text(fields.get("prompt", "prompt"), prompt)
    check_text(fields.get("negative_prompt", "negative_prompt"), negative_prompt)
    checks = (
        ("prompt", dict(prompts=[prompt], negative_prompts=[negative_prompt])),
        ("steps", dict(steps=steps)),
        ("size", dict(height=height, width=width)),
        ("guidance_scale", dict(guidance_scales=[guidance_scale])),
        ("sampler", dict(sampler=sampler)),
    )
    for name, kwargs in checks:
        try:
            pipeline.validate(**kwargs)
        except (ValueError, KeyError, TypeError) as e:
            message = e.args[0] if e.args else str(e)
            raise FieldError(fields.get(name, name), str(message)) from None
    check_tokenizable(pipeline, fields.get("prompt", "prompt"), prompt)
    check_tokenizable(pipeline, fields.get("negative_prompt", "negative_prompt"), negative_prompt)


def check_request(r: GenerationRequest, pipeline: Any, limits: Limits, fields: dict[str, str]) -> None:
    check_common(
        pipeline,
        limits,
        fields=fields,
        num_images=r.num_images,
        steps=r.steps,
        width=r.width,
        height=r.height,
        guidance_scale=r.guidance_scale,
        sampler=r.sampler,
        prompt=r.prompt,
        negative_prompt=r.negative_prompt,
    )


# ---------------------------------------------------------------------------------------------- settings
def check_settings(
    settings: dict[str, Any], current: dict[str, Any], *, field: str, switchable: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Settings (AUTOMATIC1111 options) a request asks for, against what the server does (`current`).

    A setting whose value equals the current one is honoured as is; a key in `switchable` may change (the caller
    does it); anything else is refused with 422 naming `field.key`. Returns the settings that change.
    """
    changes = {}
    for key, value in settings.items():
        name = f"{field}.{key}" if field else key
        if key not in current:
            raise FieldError(name, f"the setting {key!r} is not supported by sdjax (supported: {sorted(current)})")
        if _same_setting(value, current[key]):
            continue
        if key in switchable:
            changes[key] = value
            continue
        raise FieldError(
            name, f"{value!r} cannot be honoured here; sdjax serves {current[key]!r} for {key!r}", code="unsupported"
        )
    return changes


def _same_setting(value: Any, current: Any) -> bool:
    if isinstance(current, str) and isinstance(value, str):
        return value.strip().lower() == current.strip().lower()
    if isinstance(current, (int, float)) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value) == float(current)
    return value == current


# ---------------------------------------------------------------------------------------------- images in
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


def decode_image(data: str, *, field: str, limits: Limits = Limits(), load: bool = True):
    """A base64 image (or a `data:image/...;base64,` URL) -> PIL image, refusing with `FieldError` (422 naming
    `field`) anything that is not base64, not PNG/JPEG/WebP, larger than `limits.max_image_bytes`, or over
    `limits.max_image_pixels` pixels. The pixel count is read from the header, before any pixel is decoded."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, str) or not data.strip():
        raise FieldError(field, "expected a base64-encoded image")
    text = data.strip()
    if text.startswith("data:"):
        header, sep, text = text.partition(",")
        if not sep or not header.endswith(";base64"):
            raise FieldError(field, "a data URL must be data:image/...;base64,<data>")
    text = re.sub(r"\s+", "", text)
    if len(text) > (limits.max_image_bytes + 2) // 3 * 4:
        raise FieldError(field, f"the image is over {limits.max_image_bytes} bytes", code="image_too_large")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise FieldError(field, "is not valid base64") from None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise FieldError(
            field, f"the image has over {limits.max_image_pixels} pixels", code="image_too_large"
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise FieldError(field, f"is not a {', '.join(IMAGE_FORMATS)} image") from None
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise FieldError(
            field,
            f"{width}x{height} = {width * height} pixels exceeds the limit of {limits.max_image_pixels}",
            code="image_too_large",
        )
    if load:
        try:
            image.load()
        except (OSError, SyntaxError, ValueError) as e:
            raise FieldError(field, f"the image is truncated or corrupt ({e})") from None
    return image
