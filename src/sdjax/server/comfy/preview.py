"""ComfyUI's latent previews on the websocket: binary frames sent while a prompt samples.

A frame is what ComfyUI's `PromptServer.send_image` writes (server.py, `BinaryEventTypes.PREVIEW_IMAGE`): a 4-byte
big-endian event type 1, a 4-byte big-endian image format (1 JPEG, 2 PNG), then the encoded image. ComfyUI's
"latent2rgb" previewer maps the sampler's latents to RGB by the model's linear latent->RGB factors (and biases) and
scales `[-1, 1]` to `[0, 255]`; sdjax does the same with the pipeline's `latent_rgb_factors` (`latent_preview`, the
map of the A1111 progress endpoint's current image), on the latents the batcher reports after each step (the
sampler's current sample x_t, where ComfyUI previews the model's x0 prediction: noisier early on, alike at the end).

Previews are per prompt, as ComfyUI's `extra_data.preview_method` sets them: "auto", "latent2rgb" and "taesd" (sdjax
has no TAESD decoders; ComfyUI falls back to latent2rgb without one) send them, "none" and "default" (ComfyUI: the
server's `--preview-method`, "none" unless set) do not. Off by default because clients such as
comfy-api-simplified take every binary frame for an output image, as they do against a ComfyUI without previews.
"""

from __future__ import annotations

import io
import struct
from typing import Any

import numpy as np
from PIL import Image, ImageOps

PREVIEW_IMAGE = 1  # ComfyUI's BinaryEventTypes.PREVIEW_IMAGE
JPEG = 1  # the image format field: 1 JPEG, 2 PNG
METHODS = ("default", "none", "auto", "latent2rgb", "taesd")
SENDING = ("auto", "latent2rgb", "taesd")
MAX_SIZE = 512  # ComfyUI's --preview-size default: the preview fits in MAX_SIZE x MAX_SIZE
MIN_INTERVAL_S = 0.2  # at most one frame per prompt in this time (ComfyUI sends one per step)


def check_method(extra_data: dict[str, Any]) -> str | None:
    """Why `extra_data["preview_method"]` is not one of ComfyUI's values, or None."""
    method = extra_data.get("preview_method", "default")
    if method not in METHODS:
        return f"'extra_data.preview_method' {method!r} must be one of {list(METHODS)}"
    return None


def wanted(extra_data: dict[str, Any]) -> bool:
    return extra_data.get("preview_method", "default") in SENDING


def frame(latents_chw: np.ndarray, pipeline: Any) -> bytes:
    """One image's latents `(C, h, w)` -> a PREVIEW_IMAGE frame holding its latent->RGB preview as a JPEG."""
    from sdjax.server.routes.a1111 import latent_preview

    image = Image.fromarray(latent_preview(latents_chw, pipeline))
    if max(image.size) > MAX_SIZE:
        image = ImageOps.contain(image, (MAX_SIZE, MAX_SIZE), Image.BILINEAR)
    buf = io.BytesIO()
    buf.write(struct.pack(">II", PREVIEW_IMAGE, JPEG))
    image.save(buf, format="JPEG", quality=95)
    return buf.getvalue()
