"""The images of an interrupted batch: AUTOMATIC1111's `/sdapi/v1/interrupt` ends a request with the partly
denoised image, not with nothing.

The generation core stops a run between two model calls (`sdjax.core.Cancelled`) and hands back no latents; the
batcher's progress callback, though, receives the batch's latents after every model call (the previews of
`/sdapi/v1/progress`). `decode_latents` runs those last latents through the VAE, one image at a time (one small
program per image size, compiled on the first interrupt of that size).

What the image is: the decode of the sampler's current sample x_t after the last model call, not A1111's, which
decodes the model's last prediction of the clean image (x0, `sampler.last_latent`). The two agree near the end of
sampling; early on x_t still holds the noise of its sigma (and for samplers that keep x_t unscaled, such as Euler,
values far outside the VAE's range), so the partial image is noisier than A1111's. Getting A1111's exactly needs the
core to report the x0 prediction (see `decode_latents`). The image is the raw decode: inpainting's paste-back and the
"only masked" crop are not applied (an "only masked" image is dropped, as its size is the crop's).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

_LOCK = threading.Lock()
_DECODERS: OrderedDict = OrderedDict()  # (vae, dtype, tiling) -> jitted decode; bounded
_MAX_DECODERS = 4


def decode_latents(pipeline: Any, latents: Any, params: dict | None = None) -> np.ndarray:
    """UNet latents `(N, C, h, w)` -> uint8 images `(N, H, W, 3)` through `pipeline`'s VAE (`params["vae"]`, default
    the pipeline's), with its VAE tiling. A pipeline with its own `decode_latents(latents, params=)` is asked first
    (the fake of the tests). For the core to give A1111's image instead, `loop.denoise` would pass the sampler's x0
    prediction of the last model call to the host callback (or `Cancelled` would carry it)."""
    own = getattr(pipeline, "decode_latents", None)
    if own is not None:
        return np.asarray(own(latents, params=params))
    import jax

    from sdjax.pipelines.images import to_uint8

    vae_params = (params if params is not None else pipeline.params)["vae"]
    tiling = getattr(getattr(pipeline, "generator", None), "vae_tiling", None)
    decode = _decoder(pipeline.vae, pipeline.dtype, tiling)
    x = np.asarray(latents, np.float32)
    return np.concatenate([to_uint8(jax.device_get(decode(vae_params, x[i : i + 1]))) for i in range(len(x))])


def _decoder(vae: Any, dtype: Any, tiling: Any):
    import jax

    from sdjax.core import autoencoder

    key = (id(vae), str(dtype), tiling)
    with _LOCK:
        if key in _DECODERS:
            _DECODERS.move_to_end(key)
            return _DECODERS[key][1]
        fn = jax.jit(lambda p, z: autoencoder.decode(vae, p, z, dtype, tiling))
        _DECODERS[key] = (vae, fn)  # the module kept alive: its id stays unique while the entry lives
        while len(_DECODERS) > _MAX_DECODERS:
            _DECODERS.popitem(last=False)
        return fn


def output_size(image: Any) -> tuple[int, int] | None:
    """(height, width) of the finished image of `image` (an `ImageParameters`): the hires target with the hires
    fix; None for "only masked" inpainting, whose finished image is the original's (the decode is the crop's)."""
    if getattr(image, "inpaint_full_res_padding", None) is not None and getattr(image, "mask_image", None) is not None:
        return None
    hires = getattr(image, "hires", None)
    if hires is not None:
        return tuple(hires.target(image.height, image.width))
    return image.height, image.width
