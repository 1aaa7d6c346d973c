"""Request and response bodies of the two HTTP APIs, and their translation to a `GenerationRequest`.

- OpenAI images API (`POST /v1/images/generations`): `prompt`, `n`, `size` ("WIDTHxHEIGHT"), `response_format`
  (only `b64_json`; it is also the default here), `model`/`quality`/`style`/`user` accepted and ignored; sdjax
  extensions `negative_prompt`, `steps`, `guidance_scale`, `seed`, `sampler`.
- AUTOMATIC1111 web UI API (`POST /sdapi/v1/txt2img`): `prompt`, `negative_prompt`, `steps`, `cfg_scale`,
  `width`, `height`, `seed` (-1: random), `batch_size`, `n_iter`, `sampler_name` (+ `scheduler`, e.g. "Karras"),
  `force_task_id`; other fields of that API are accepted and ignored, except those that would change the image in
  ways sdjax does not implement (`enable_hr`, `restore_faces`, `tiling`, `subseed_strength`), which are refused.

Static checks (types, ranges, multiples of 8) are pydantic constraints; checks that depend on the server's limits
or the model (maximum size, known sampler, the model's size multiple) raise `FieldError` from `resolve_*`.
Unknown fields are ignored, as both upstream APIs' clients send fields for features they do not use.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sdjax.metadata import SEED_MAX, GenerationRequest, sampler_id

_SIZE_RE = re.compile(r"^(\d+)x(\d+)$")


class FieldError(ValueError):
    """An invalid request field: answered 422 naming `field`."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_images: int = 8
    max_steps: int = 150
    max_size: int = 1024
    min_size: int = 8
    max_guidance: float = 50.0
    sizes: tuple[tuple[int, int], ...] | None = None  # (width, height) allowed; None: any within the bounds


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
        )


# ---------------------------------------------------------------------------------------------- OpenAI
class OpenAIImageRequest(BaseModel):
    """`POST /v1/images/generations` (OpenAI images API) with sdjax extensions."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1, description="What to draw")
    n: int = Field(1, ge=1, description="Number of images")
    size: str | None = Field(
        None, description='"WIDTHxHEIGHT", each a multiple of 8; "auto" or none: the model\'s size'
    )
    response_format: Literal["b64_json"] = Field(
        "b64_json", description='Only "b64_json": images come back base64-encoded in the response'
    )
    model: str | None = Field(None, description="Accepted for compatibility; the server serves one model")
    negative_prompt: str = Field("", description="sdjax: what not to draw")
    steps: int | None = Field(None, ge=1, description="sdjax: sampling steps")
    guidance_scale: float | None = Field(None, ge=0, allow_inf_nan=False, description="sdjax: CFG scale")
    seed: int | None = Field(None, ge=-1, le=SEED_MAX, description="sdjax: seed of the first image; -1/none: random")
    sampler: str | None = Field(None, description="sdjax: sampler name (GET /sdapi/v1/samplers)")

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
    b64_json: str


class OpenAIImageResponse(BaseModel):
    created: int
    data: list[OpenAIImage]


# ---------------------------------------------------------------------------------------------- AUTOMATIC1111
class A1111Txt2ImgRequest(BaseModel):
    """`POST /sdapi/v1/txt2img` (AUTOMATIC1111 `StableDiffusionTxt2ImgProcessingAPI`), the fields sdjax uses."""

    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(description="What to draw (may be empty)")
    negative_prompt: str = ""
    steps: int | None = Field(None, ge=1)
    cfg_scale: float | None = Field(None, ge=0, allow_inf_nan=False)
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


class A1111Txt2ImgResponse(BaseModel):
    images: list[str]
    parameters: dict[str, Any]
    info: str


# ---------------------------------------------------------------------------------------------- resolution
def _random_seed() -> int:
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
            fields["size"], f"{width}x{height} is not served here (each size is compiled ahead); choose one of {served}"
        )
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


def resolve_openai(
    body: OpenAIImageRequest, pipeline: Any, limits: Limits, defaults: Defaults, model_name: str
) -> GenerationRequest:
    if body.size is None:
        width, height = defaults.width, defaults.height
    else:
        width, height = (int(x) for x in body.size.split("x"))
    request = GenerationRequest(
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        num_images=body.n,
        seed=_random_seed() if body.seed in (None, -1) else body.seed,
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
    )
    _check(request, pipeline, limits, fields)
    return request


def a1111_sampler(body: A1111Txt2ImgRequest, defaults: Defaults) -> str:
    name = body.sampler_name or body.sampler_index or defaults.sampler
    if body.scheduler and body.scheduler.lower() not in ("automatic", "auto", ""):
        name = f"{name} {body.scheduler}"
    return name


def resolve_a1111(
    body: A1111Txt2ImgRequest, pipeline: Any, limits: Limits, defaults: Defaults, model_name: str
) -> GenerationRequest:
    for field, value, default in (
        ("enable_hr", body.enable_hr, False),
        ("restore_faces", body.restore_faces, None),
        ("tiling", body.tiling, None),
        ("subseed_strength", body.subseed_strength, 0.0),
    ):
        if value and value != default:
            raise FieldError(field, f"{field}={value!r} is not supported by sdjax; leave it out")
    request = GenerationRequest(
        prompt=body.prompt,
        negative_prompt=body.negative_prompt,
        num_images=body.batch_size * body.n_iter,
        seed=_random_seed() if body.seed == -1 else body.seed,
        steps=body.steps or defaults.steps,
        guidance_scale=defaults.guidance_scale if body.cfg_scale is None else body.cfg_scale,
        width=body.width or defaults.width,
        height=body.height or defaults.height,
        sampler=a1111_sampler(body, defaults),
        model=model_name,
    )
    fields = dict(
        num_images="batch_size",
        steps="steps",
        guidance_scale="cfg_scale",
        width="width",
        height="height",
        size="width",
        sampler="sampler_name",
        prompt="prompt",
    )
    _check(request, pipeline, limits, fields)
    return request


def _check(r: GenerationRequest, pipeline: Any, limits: Limits, fields: dict[str, str]) -> None:
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
