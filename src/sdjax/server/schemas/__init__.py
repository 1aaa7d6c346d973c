"""Request and response bodies of the HTTP APIs, their translation to a `GenerationRequest`, and the checks every
request passes on its own before it may join a batch, one module per API:

- `common`: `FieldError`, `Limits`, `Defaults`, costs, the isolation checks (`check_common`: a request is validated
  and tokenized alone, so text the tokenizer cannot take fails that request with 422 naming the field, never the
  batch it would have joined), `check_settings` and `decode_image`;
- `openai`: OpenAI images API bodies (`/v1/images/generations`, `/edits`, `/variations`) and `resolve_openai*`;
- `a1111`: AUTOMATIC1111 web UI API bodies (`/sdapi/v1/txt2img`, `/img2img`, `/png-info`), the hires fix, and
  `resolve_a1111*`.

Every name is importable from here (`from sdjax.server.schemas import FieldError, resolve_a1111`).
"""

from sdjax.server.schemas import a1111, common, openai
from sdjax.server.schemas.a1111 import (
    FILLS,
    RESIZE_MODES,
    UPSCALERS,
    A1111Img2ImgRequest,
    A1111PngInfoRequest,
    A1111PngInfoResponse,
    A1111Txt2ImgRequest,
    A1111Txt2ImgResponse,
    a1111_sampler,
    a1111_schedulers,
    check_mask,
    resolve_a1111,
    resolve_a1111_img2img,
    samplers_available,
)
from sdjax.server.schemas.common import (
    IMAGE_FORMATS,
    IMAGE_SCHEMA,
    Defaults,
    FieldError,
    ImageB64,
    Limits,
    check_common,
    check_request,
    check_settings,
    check_text,
    check_tokenizable,
    decode_image,
    image_cost,
    random_seed,
    request_cost,
)
from sdjax.server.schemas.openai import (
    VARIATION_STRENGTH,
    OpenAIEditForm,
    OpenAIImage,
    OpenAIImageRequest,
    OpenAIImageResponse,
    edit_mask,
    resolve_openai,
    resolve_openai_edit,
)

# The private helpers that were importable from here before the split (comfy.nodes uses the first two).
_a1111_syntax, _check_hires, _check_prompt_tags = a1111._a1111_syntax, a1111._check_hires, a1111._check_prompt_tags
_distilled, _hires = a1111._distilled, a1111._hires
_check, _random_seed, _same_setting = common.check_request, common.random_seed, common._same_setting
_SIZE_RE, _decode_bytes = openai._SIZE_RE, openai._decode_bytes

__all__ = [
    "FILLS",
    "IMAGE_FORMATS",
    "IMAGE_SCHEMA",
    "RESIZE_MODES",
    "UPSCALERS",
    "VARIATION_STRENGTH",
    "A1111Img2ImgRequest",
    "A1111PngInfoRequest",
    "A1111PngInfoResponse",
    "A1111Txt2ImgRequest",
    "A1111Txt2ImgResponse",
    "Defaults",
    "FieldError",
    "ImageB64",
    "Limits",
    "OpenAIEditForm",
    "OpenAIImage",
    "OpenAIImageRequest",
    "OpenAIImageResponse",
    "a1111_sampler",
    "a1111_schedulers",
    "check_common",
    "check_mask",
    "check_request",
    "check_settings",
    "check_text",
    "check_tokenizable",
    "decode_image",
    "edit_mask",
    "image_cost",
    "random_seed",
    "request_cost",
    "resolve_a1111",
    "resolve_a1111_img2img",
    "resolve_openai",
    "resolve_openai_edit",
    "samplers_available",
]
