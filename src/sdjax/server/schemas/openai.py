"""The OpenAI images API's bodies and their translation to a `GenerationRequest`: `POST /v1/images/generations`
(`prompt`, `n`, `size` ("WIDTHxHEIGHT"), `response_format` (`b64_json`, the default here, or `url`: an expiring
`/v1/files/...` link), `stream` + `partial_images` (server-sent events: `server.openai_stream`),
`model`/`quality`/`style`/`user` accepted and ignored; sdjax extensions `negative_prompt`, `steps`,
`guidance_scale`, `seed`, `sampler`), and the multipart forms of `/v1/images/edits` and `/v1/images/variations`.
"""

from __future__ import annotations

import base64
import dataclasses
import re
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sdjax.metadata import SEED_MAX, GenerationRequest
from sdjax.server.schemas.common import Defaults, FieldError, Limits, check_request, decode_image, random_seed

_SIZE_RE = re.compile(r"^(\d+)x(\d+)$")


class OpenAIImageRequest(BaseModel):
    """`POST /v1/images/generations` (OpenAI images API) with sdjax extensions."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1, description="What to draw")
    n: int = Field(1, ge=1, description="Number of images")
    size: str | None = Field(
        None, description='"WIDTHxHEIGHT", each a multiple of 8; "auto" or none: the model\'s size'
    )
    response_format: Literal["b64_json", "url"] = Field(
        "b64_json",
        description='"b64_json": images base64-encoded in the response; "url": links to GET /v1/files/{id}, '
        "valid for a limited time",
    )
    model: str | None = Field(None, description="Accepted for compatibility; the server serves one model")
    negative_prompt: str = Field("", description="sdjax: what not to draw")
    steps: int | None = Field(None, ge=1, description="sdjax: sampling steps")
    guidance_scale: float | None = Field(None, ge=0, allow_inf_nan=False, description="sdjax: CFG scale")
    seed: int | None = Field(None, ge=-1, le=SEED_MAX, description="sdjax: seed of the first image; -1/none: random")
    sampler: str | None = Field(None, description="sdjax: sampler name (GET /sdapi/v1/samplers)")
    stream: bool | None = Field(False, description="Answer with server-sent events (partial images, then each image)")
    partial_images: int | None = Field(
        None, ge=0, le=3, description="With stream: partial images sent while denoising (none: 0)"
    )

    @field_validator("size")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is None or v.strip() == "auto":  # "auto" (newer OpenAI models): the model's size
            return None
        m = _SIZE_RE.match(v.strip())
        if not m:
            raise ValueError(f'size must be "WIDTHxHEIGHT" such as "512x512", got {v!r}')
        w, h = int(m.group(1)), int(m.group(2))
        if w % 8 or h % 8 or not w or not h:
            raise ValueError(f"size {v!r}: width and height must each be a positive multiple of 8")
        return f"{w}x{h}"


class OpenAIImage(BaseModel):
    b64_json: str | None = None
    url: str | None = None


VARIATION_STRENGTH = 0.7  # /v1/images/variations: image-to-image of the image with an empty prompt at this strength


class OpenAIEditForm(BaseModel):
    """The fields of `POST /v1/images/edits` and `/v1/images/variations` (multipart forms) besides the files."""

    prompt: str
    n: int = 1
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    negative_prompt: str = ""
    steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    sampler: str | None = None
    strength: float = 1.0

    @field_validator("size")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        return OpenAIImageRequest._size(v)


class OpenAIImageResponse(BaseModel):
    created: int
    data: list[OpenAIImage]


def resolve_openai(
    body: OpenAIImageRequest, pipeline: Any, limits: Limits, defaults: Defaults, model_name: str
) -> GenerationRequest:
    if body.stream and body.response_format == "url":
        raise FieldError("response_format", 'streamed images are base64: use "b64_json" with stream')
    if body.size is None:
        width, height = defaults.width, defaults.height
    else:
        width, height = (int(x) for x in body.size.split("x"))
    request = GenerationRequest(
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        num_images=body.n,
        seed=random_seed() if body.seed in (None, -1) else body.seed,
        steps=body.steps or defaults.steps,
        guidance_scale=defaults.guidance_scale if body.guidance_scale is None else body.guidance_scale,
        width=width,
        height=height,
        sampler=body.sampler or defaults.sampler,
        model=model_name,
    )
    fields = dict(
        num_images="n",
        steps="steps",
        guidance_scale="guidance_scale",
        width="size",
        height="size",
        size="size",
        sampler="sampler",
        prompt="prompt",
        negative_prompt="negative_prompt",
    )
    check_request(request, pipeline, limits, fields)
    return request


def _decode_bytes(data: bytes, field: str, limits: Limits):
    return decode_image(base64.b64encode(data).decode("ascii"), field=field, limits=limits)


def edit_mask(image, mask):
    """OpenAI's convention -> sdjax's: pixels whose alpha is 0 (in `mask`, else in `image`) are repainted (white)."""
    from PIL import Image

    source, field = (mask, "mask") if mask is not None else (image, "image")
    if "A" not in source.getbands():
        raise FieldError(
            field,
            "has no alpha channel: transparent pixels mark what to edit; send an RGBA PNG"
            + ("" if mask is not None else " or a mask"),
        )
    alpha = np.asarray(source.getchannel("A"))
    if not (alpha == 0).any():
        raise FieldError(field, "has no fully transparent pixel: there is nothing to edit")
    return Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8))


def resolve_openai_edit(
    form: OpenAIEditForm,
    image_bytes: bytes,
    mask_bytes: bytes | None,
    pipeline: Any,
    limits: Limits,
    defaults: Defaults,
    model_name: str,
    *,
    variation: bool = False,
) -> GenerationRequest:
    """`/v1/images/edits` (inpainting where the mask is transparent) and `/v1/images/variations` (image-to-image
    with an empty prompt at `VARIATION_STRENGTH`). The output has `size` (default: the model's size); the image
    and mask are resized to it."""
    image = _decode_bytes(image_bytes, "image", limits)
    mask = _decode_bytes(mask_bytes, "mask", limits) if mask_bytes is not None else None
    if mask is not None and mask.size != image.size:
        raise FieldError(
            "mask", f"the mask is {mask.size[0]}x{mask.size[1]} but the image is {image.size[0]}x{image.size[1]}"
        )
    body = OpenAIImageRequest(
        prompt=form.prompt or " ",
        n=form.n,
        size=form.size,
        response_format=form.response_format,
        negative_prompt=form.negative_prompt,
        steps=form.steps,
        guidance_scale=form.guidance_scale,
        seed=form.seed,
        sampler=form.sampler,
    )
    base = resolve_openai(body, pipeline, limits, defaults, model_name)
    extra: dict[str, Any] = dict(prompt=form.prompt, init_image=image.convert("RGB"), denoising_strength=form.strength)
    if not variation:
        extra.update(mask_image=edit_mask(image, mask), mask_blur=0.0, inpainting_fill="original")
    return dataclasses.replace(base, **extra)
