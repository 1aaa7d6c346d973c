"""Cached latents (`cache_latents=True`, `--cache-latents`): every training image is encoded once by the frozen VAE
before the first update, and the step trains from the cache, without the VAE (kohya sd-scripts' `--cache_latents`,
diffusers' `train_text_to_image_sdxl.py` `compute_vae_encodings`).

- What is cached: the VAE posterior *sample* `mean + std * eps`, scaled into the denoiser's latent space
  (`core.autoencoder.encode`), drawn once per cached view for the whole run, as both kohya
  (`vae.encode(...).latent_dist.sample()` in `cache_batch_latents`) and diffusers' SDXL example
  (`latent_dist.sample()`) cache it. The uncached step draws a new `eps` at every step; with the cache an image
  always trains from the same draw. `eps` of view `v` comes from `fold_in(fold_in(PRNGKey(seed), SALT), v)`, so
  every call of a run (a resumed one too) builds the same cache.
- Views: each image at its bucket with the center crop and, with `flip`, also mirrored (kohya keeps
  `latents_flipped` beside the latents). Random crops are refused with a cache (kohya refuses them too): a crop
  drawn per step cannot be encoded ahead. A micro-batch takes each example's view from the sampler's draws
  (`data.Sampler.plan`, the draws of `Sampler.load`), so its flips, captions and SDXL time ids are those of the
  uncached run.
- Cost: one VAE pass per view before training (one compiled encoder per bucket shape, one image at a time); the
  cache is float32 host memory, `C x h/8 x w/8` per view (SD 1.x 512 px: 64 KiB; SDXL 1024 px: 256 KiB; twice
  that with `flip`). It is rebuilt by every call (not stored in the run directory).
- Several processes (`finetune.distributed`): each process builds the whole cache (any view can fall in its rows at
  some step, and the views are not exchanged between hosts), then takes only its own rows of each micro-batch from
  it (`LatentCache.batch(..., rows)`).

Cached text-encoder outputs (`cache_text_encoder_outputs=True`, `--cache-text-encoder-outputs`; kohya's
`--cache_text_encoder_outputs`) of SD 1.x / 2.x / XL LoRA runs: `TextEncoderCache`, the form of the flow trainer's
`flow_models.TextStates` for the UNet families.

- Each distinct caption string (after caption dropout and tag shuffling, so shuffled tags make many entries) is
  encoded the first time a micro-batch holds it, one caption per call of one compiled encoder, at the run's
  `clip_skip`, and kept on the host in the compute dtype: the context `(77, D)` and, for SDXL, the pooled
  `text_embeds` the UNet's added embedding takes (the time ids stay per view, from the data).
- The step then gets `context` (and `text_embeds`) instead of token ids, and the text encoders leave its frozen
  params: they are neither placed on the devices nor in the compiled step (`step.batch_text`).
- Several processes: each encodes the captions of its own rows only (the rows `RowBatches` gives it).
- Not with a text-encoder LoRA (the encoders then change at every step): refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from sdjax.finetune import data as data_lib
from sdjax.finetune.flow_models import TextStates

SALT = 0x1A7E  # separates the cache's posterior noise from the step's draws


def check(cfg: data_lib.DataConfig) -> None:
    """Refuse data settings a cache cannot serve (before anything is loaded)."""
    if cfg.random_crop:
        raise ValueError(
            "cache_latents (--cache-latents) with random_crop (--random-crop): a crop drawn at every step cannot be "
            "encoded ahead; use center crops (the default) or no cache"
        )


@dataclasses.dataclass(frozen=True)
class LatentCache:
    """`(item index, flipped) -> latents (C, h, w)` float32 and the view's SDXL time ids `(6,)`."""

    latents: dict[tuple[int, bool], np.ndarray]
    time_ids: dict[tuple[int, bool], np.ndarray]

    def batch(self, sampler: data_lib.Sampler, step: int, rows: Sequence[int] | None = None) -> dict:
        """Micro-batch `step` from the cache: `latents (B, C, h, w)`, `time_ids (B, 6)`, `captions` (list); only
        the rows `rows` of it when given (`Sampler.load`)."""
        plan = sampler.plan(step, rows)
        views = [(i, flipped) for i, (_, _, flipped), _ in plan]
        return {
            "latents": np.stack([self.latents[v] for v in views]),
            "time_ids": np.stack([self.time_ids[v] for v in views]),
            "captions": [caption for _, _, caption in plan],
        }


def views(dataset: data_lib.Dataset, cfg: data_lib.DataConfig) -> list[tuple[int, bool]]:
    """The cached views: every item, and its mirror image with `flip`."""
    flips = (False, True) if cfg.flip else (False,)
    return [(i, f) for i in range(len(dataset.items)) for f in flips]


def build(
    dataset: data_lib.Dataset,
    cfg: data_lib.DataConfig,
    models,
    vae_params,
    seed: int,
    log: Callable[[str], None] = lambda s: None,
) -> LatentCache:
    """Encode every view of `dataset` once (`models.vae` with `vae_params`, `models.dtype`; see the module
    docstring)."""
    import jax

    from sdjax.finetune import step as step_lib

    check(cfg)
    encode = jax.jit(lambda p, pixels, key: step_lib.encode_latents(models, p, pixels, key))
    base = jax.random.fold_in(jax.random.PRNGKey(seed), SALT)
    latents, time_ids = {}, {}
    todo = views(dataset, cfg)
    for n, (i, flipped) in enumerate(todo):
        item = dataset.items[i]
        top, left, _ = data_lib.example_choices(item, dataclasses.replace(cfg, flip=False), np.random.default_rng(0))
        try:
            pixels, ids = data_lib.crop_example(item, top, left, flipped)
        except Exception as e:  # the file changed since the scan
            raise data_lib.DataError(f"{item.path}: unreadable while caching latents ({type(e).__name__}: {e})") from e
        z = encode(vae_params, pixels[None], jax.random.fold_in(base, n))
        latents[(i, flipped)] = np.asarray(z[0], np.float32)
        time_ids[(i, flipped)] = ids
    log(f"cached the latents of {len(todo)} view(s) of {len(dataset.items)} image(s)")
    return LatentCache(latents, time_ids)


class TextEncoderCache(TextStates):
    """SD 1.x / 2.x / XL text-encoder outputs per caption (see the module docstring): `{"context": (77, D)}`, with
    SDXL's `"text_embeds": (P,)` too, from the conditioning's `encode` of the caption's ids at `clip_skip`."""

    def __init__(self, conditioning, params, dtype, clip_skip: int):
        self.clip_skip = int(clip_skip)
        super().__init__(conditioning, params, dtype)

    @staticmethod
    def _states(encoded):
        context, unet_kwargs = encoded  # SDXL: text_embeds beside time_ids (the time ids are the batch's own)
        pooled = {"text_embeds": unet_kwargs["text_embeds"]} if "text_embeds" in unet_kwargs else {}
        return {"context": context, **pooled}

    def _inputs(self, caption: str) -> dict[str, np.ndarray]:
        return {  # as `run._inputs` gives the step, for one caption (the time ids only pass through `encode`)
            "ids": np.asarray(self.conditioning.tokenize([caption]), np.int32),
            "clip_skip": np.full((1,), self.clip_skip, np.int32),
            "time_ids": np.zeros((1, 6), np.float32),
        }
