"""The published OpenAPI schema (`GET /openapi.json`) with this server's limits in it, so that it states what the
server validates: the request models are static, but sizes, steps, counts, guidance and (pinned) samplers are
bounded by `Limits` at run time (`schemas.check_common`). Schema-driven clients and fuzzers
(tests/server/test_schemathesis.py) then generate requests the server takes.

Multipart form fields (/v1/images/edits, /variations) are published as what a form can carry: strings or absent
(never null), files as `format: binary`. Per body: the fields sdjax refuses unless they hold A1111's default
(`restore_faces`, `tiling`, ...) get an `enum` of that value, `hr_upscaler` the upscalers it has;
`width`/`height` get `minimum`/`maximum` (an `enum` of the served sides when sizes are pinned), `steps` `maximum`
(an `enum` when pinned), image counts (`n`, `batch_size`, `n_iter`) `maximum`, guidance `maximum`, and with
pinned samplers the sampler fields an `enum` of the names that resolve to them (`scheduler`: the schedules that
do); /controlnet/detect's image lists 1 to `max_images` items, one of the two lists. What the schema cannot say (a
size that is not a multiple of the model's, a sampler and a schedule that do not go together, the cost budget, an
image and a mask of different sizes) is still answered 422 naming the field.
"""

from __future__ import annotations

import copy
from typing import Any

from sdjax.infotext import sampler_display_name, sampler_id
from sdjax.server.a1111_info import label
from sdjax.server.schemas import UPSCALERS, A1111Txt2ImgRequest, Defaults, FieldError, Limits, a1111_sampler

_A1111 = ("A1111Txt2ImgRequest", "A1111Img2ImgRequest")
_OPENAI = ("OpenAIImageRequest", "Body_openai_edits_v1_images_edits_post")
_OPENAI_FORMS = ("Body_openai_edits_v1_images_edits_post", "Body_openai_variations_v1_images_variations_post")


def _value_schema(prop: dict) -> dict:
    """The non-null branch of an optional property (`anyOf: [{type: X}, {type: null}]`), else the property."""
    for branch in prop.get("anyOf", ()):
        if branch.get("type") not in (None, "null"):
            return branch
    return prop


def _constrain(components: dict, model: str, field: str, **keywords: Any) -> None:
    prop = components.get(model, {}).get("properties", {}).get(field)
    if prop is not None:
        _value_schema(prop).update(keywords)


def _a1111_names(limits: Limits, defaults: Defaults) -> tuple[list[str], list[str]]:
    """(sampler names, schedule names) that resolve to one of the pinned samplers in an A1111 request."""
    from sdjax.samplers import a1111, schedules

    candidates = [s.name for s in a1111.A1111_SAMPLERS if s.registry is not None]
    candidates += [name for name in limits.samplers if name not in candidates]
    schedule_names = ["Automatic", *(s.label for s in schedules.SCHEDULES if s.keys is not None)]
    names, labels = [], []
    for name in candidates:
        for schedule in schedule_names:
            try:
                resolved = a1111_sampler(
                    A1111Txt2ImgRequest(prompt="", sampler_name=name, scheduler=schedule), defaults
                )
            except FieldError:
                continue
            if sampler_id(resolved) in limits.samplers:
                names += [name] if name not in names else []
                labels += [schedule] if schedule not in labels else []
    return names, labels


def publish_limits(schema: dict, limits: Limits, defaults: Defaults) -> dict:
    """A copy of `schema` (FastAPI's OpenAPI dict) with `limits` in the request bodies."""
    schema = copy.deepcopy(schema)
    components = schema.get("components", {}).get("schemas", {})
    for model in _OPENAI_FORMS:  # multipart fields are strings or absent, never null; files are binary
        for prop in components.get(model, {}).get("properties", {}).values():
            branches = [b for b in prop.get("anyOf", ()) if b.get("type") != "null"]
            if len(branches) == 1:
                del prop["anyOf"]
                prop.update(branches[0])
            if prop.get("contentMediaType") == "application/octet-stream":
                prop["format"] = "binary"
    for field in ("controlnet_input_images", "controlnet_images"):
        _constrain(components, "DetectRequest", field, minItems=1, maxItems=limits.max_images)
    sides = {"minimum": limits.min_size, "maximum": limits.max_size}
    for model in _A1111:  # what `resolve_a1111` refuses unless it has A1111's default value
        for field in ("restore_faces", "tiling"):
            _constrain(components, model, field, enum=[False])
        _constrain(components, model, "subseed_strength", enum=[0])
        _constrain(components, model, "initial_noise_multiplier", enum=[1])
        _constrain(components, model, "script_name", enum=[""])
        _constrain(components, model, "hr_upscaler", enum=[label(name) for name in UPSCALERS])
    _constrain(components, "A1111Img2ImgRequest", "enable_hr", enum=[False])  # a txt2img option
    _constrain(components, "A1111Img2ImgRequest", "resize_mode", maximum=2)  # 3, latent upscale: not supported
    for model in (*_OPENAI, *_OPENAI_FORMS):
        _constrain(components, model, "size", pattern=r"^(auto|\d+x\d+)$")
    for model in _A1111:
        for field, index in (("width", 0), ("height", 1)):
            enum = sorted({size[index] for size in limits.sizes}) if limits.sizes is not None else None
            _constrain(components, model, field, **({"enum": enum} if enum else sides))
        for field in ("batch_size", "n_iter"):
            _constrain(components, model, field, maximum=limits.max_images)
        _constrain(components, model, "cfg_scale", maximum=limits.max_guidance)
    for model in (*_A1111, *_OPENAI):
        if limits.steps is not None:
            _constrain(components, model, "steps", enum=sorted(limits.steps))
        else:
            _constrain(components, model, "steps", maximum=limits.max_steps)
    for model in (*_OPENAI, *_OPENAI_FORMS):
        _constrain(components, model, "n", maximum=limits.max_images)
        _constrain(components, model, "guidance_scale", maximum=limits.max_guidance)
        if limits.sizes is not None:
            _constrain(components, model, "size", enum=[f"{w}x{h}" for w, h in limits.sizes] + ["auto"])
    if limits.samplers is not None:
        names, labels = _a1111_names(limits, defaults)
        for model in _A1111:
            for field in ("sampler_name", "sampler_index", "hr_sampler_name"):
                _constrain(components, model, field, enum=names)
            _constrain(components, model, "scheduler", enum=labels)
        served = sorted({*limits.samplers, *(sampler_display_name(s) for s in limits.samplers)})
        for model in (*_OPENAI, *_OPENAI_FORMS):
            _constrain(components, model, "sampler", enum=served)
    return schema
