"""The AUTOMATIC1111 web UI API: `POST /sdapi/v1/txt2img`, `/sdapi/v1/img2img`, `/sdapi/v1/interrupt`,
`/sdapi/v1/skip`, `GET /sdapi/v1/progress` (with a latent preview as `current_image` when the pipeline reports
latents; null otherwise), `POST /sdapi/v1/png-info`, `GET /sdapi/v1/samplers`, `/schedulers`, `/sd-models`,
`/loras`, `/embeddings`, `/sd-vae`, `POST /sdapi/v1/refresh-checkpoints`, `/refresh-loras`, `/refresh-vae` (the
models directory: `server.models_api`), and `GET|POST /sdapi/v1/options` (POST switches `sd_model_checkpoint` when
the server has a models directory, and sets the default `CLIP_stop_at_last_layers` and `sd_vae`; any setting it
cannot honour answers 422). `<lora:...>` prompt tags and `override_settings.sd_vae` are applied per batch as params
(`server.networks`); ControlNet units (`alwayson_scripts.controlnet`) by `server.controlnet`."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from sdjax.infotext import parse_parameters, sampler_display_name, ti_hashes
from sdjax.metadata import GenerationRequest, strip_lora_tags
from sdjax.samplers import a1111
from sdjax.server import controlnet as controlnet_api
from sdjax.server import models_api
from sdjax.server.batching import Batcher, Outcome
from sdjax.server.schemas import (
    A1111Img2ImgRequest,
    A1111PngInfoRequest,
    A1111PngInfoResponse,
    A1111Txt2ImgRequest,
    A1111Txt2ImgResponse,
    FieldError,
    a1111_schedulers,
    check_settings,
    decode_image,
    resolve_a1111,
    resolve_a1111_img2img,
)
from sdjax.server.state import Served, ServerState, b64, version


def router(state: ServerState) -> APIRouter:
    """The AUTOMATIC1111 routes over `state`."""
    api = APIRouter()
    _generation_routes(api, state)
    _option_routes(api, state)
    _model_routes(api, state)
    return api


def _generation_routes(api: APIRouter, state: ServerState) -> None:
    """txt2img, img2img, interrupt, skip, progress, png-info."""
    config, batcher = state.config, state.batcher

    async def generate(request: Request, body: A1111Txt2ImgRequest, now: Served, gen: GenerationRequest) -> dict:
        gen = await asyncio.to_thread(
            controlnet_api.apply, gen, body.alwayson_scripts, config.controlnet_dir, now.limits, now.pipeline
        )
        outcome, pngs = await state.run(request, gen, body.force_task_id)
        info = processed_info(gen, outcome, body)
        parameters = body.model_dump()
        if isinstance(body, A1111Img2ImgRequest) and not body.include_init_images:  # as A1111: not echoed back
            parameters.update(init_images=None, mask=None)
        return {
            "images": [b64(p) for p in pngs] if body.send_images else [],
            "parameters": parameters,
            "info": json.dumps(info),
        }

    @api.post("/sdapi/v1/txt2img", response_model=A1111Txt2ImgResponse,
              summary="Text to image (AUTOMATIC1111 web UI API)")  # fmt: skip
    async def a1111_txt2img(request: Request, body: A1111Txt2ImgRequest) -> dict:
        now = await state.wait_for_model()
        changes, plain = await asyncio.to_thread(request_settings, state, body, now)
        gen = dataclasses.replace(
            resolve_a1111(plain, now.pipeline, now.limits, now.defaults, now.model_name), **changes
        )
        return await generate(request, body, now, gen)

    @api.post("/sdapi/v1/img2img", response_model=A1111Txt2ImgResponse,
              summary="Image to image and inpainting (AUTOMATIC1111 web UI API)")  # fmt: skip
    async def a1111_img2img(request: Request, body: A1111Img2ImgRequest) -> dict:
        now = await state.wait_for_model()
        changes, plain = await asyncio.to_thread(request_settings, state, body, now)
        gen = await asyncio.to_thread(
            resolve_a1111_img2img, plain, now.pipeline, now.limits, now.defaults, now.model_name
        )
        return await generate(request, body, now, dataclasses.replace(gen, **changes))

    @api.post("/sdapi/v1/interrupt", summary="Stop the running requests; they answer with the images made so far")
    async def interrupt(id_task: str | None = None):
        return {"interrupted": batcher.interrupt(id_task)}

    @api.post("/sdapi/v1/skip", summary="Drop the running batch's images; its requests go on with the rest")
    async def skip():
        return {"skipped": batcher.skip()}

    @api.get("/sdapi/v1/progress", summary="Progress of the running batch or of one task (AUTOMATIC1111 API)")
    async def progress(id_task: str | None = None, skip_current_image: bool = False):
        return progress_of(batcher, state.served().pipeline, id_task, skip_current_image)

    @api.post("/sdapi/v1/png-info", response_model=A1111PngInfoResponse, summary="Parameters of a PNG (AUTOMATIC1111)")
    async def png_info(body: A1111PngInfoRequest):
        image = await asyncio.to_thread(decode_image, body.image, field="image", limits=state.served().limits)
        texts = {k: v for k, v in image.info.items() if isinstance(k, str) and isinstance(v, str)}
        text = texts.pop("parameters", "")
        return {"info": text, "items": texts, "parameters": parse_parameters(text) if text else {}}


def _option_routes(api: APIRouter, state: ServerState) -> None:
    """GET and POST /sdapi/v1/options."""
    config = state.config

    @api.get("/sdapi/v1/options", summary="Current options (AUTOMATIC1111 API)")
    async def get_options():
        return state.settings()

    @api.post("/sdapi/v1/options", summary="Set options: sd_model_checkpoint switches the model (with a models dir)")
    async def set_options(request: Request, body: dict[str, Any]):
        switchable = (
            frozenset({"sd_model_checkpoint"}) if state.loader is not None and config.models_dir else frozenset()
        )
        model, rest = await asyncio.to_thread(state.model_settings, body, state.served(), "")
        try:
            changes = check_settings(rest, state.settings(), field="", switchable=switchable)
        except FieldError as e:
            if e.field == "sd_model_checkpoint" and not switchable:
                raise FieldError(
                    "sd_model_checkpoint",
                    f"this server serves only {state.served().model_name!r}; start it with a models directory "
                    "(--models-dir) to switch models",
                    code="unsupported",
                ) from None
            raise
        if "sd_model_checkpoint" in changes:
            await state.switch_model(request, changes["sd_model_checkpoint"])
        if "CLIP_stop_at_last_layers" in body:
            state.clip_skip = models_api.clip_skip_setting(
                body["CLIP_stop_at_last_layers"], state.served().pipeline, "CLIP_stop_at_last_layers"
            )  # checked against the model now served
        if "sd_vae" in body and "sd_model_checkpoint" not in changes:
            state.vae = "" if model["vae"] == config.vae_name else model["vae"]
        return None


def _model_routes(api: APIRouter, state: ServerState) -> None:
    """Samplers, schedulers, the models directory's checkpoints, LoRAs, embeddings and VAEs, and its rescans."""
    md = state.md

    @api.get("/sdapi/v1/samplers", summary="Samplers (AUTOMATIC1111 API)")
    async def samplers():
        return a1111.a1111_samplers()

    @api.get("/sdapi/v1/schedulers", summary="Noise schedules (AUTOMATIC1111 API)")
    async def schedulers():
        return a1111_schedulers()

    @api.get("/sdapi/v1/sd-models", summary="Models (AUTOMATIC1111 API): the models directory, or the served one")
    async def sd_models():
        return await asyncio.to_thread(models_api.sd_models, md, state.served().checkpoint)

    @api.get("/sdapi/v1/loras", summary="LoRAs of the models directory's Lora/ (AUTOMATIC1111 API)")
    async def list_loras():
        return await asyncio.to_thread(models_api.loras, md)

    @api.get("/sdapi/v1/embeddings", summary="Embeddings loaded from the models directory (AUTOMATIC1111 API)")
    async def list_embeddings():
        return state.served().embeddings or {"loaded": {}, "skipped": {}}

    @api.get("/sdapi/v1/sd-vae", summary="VAEs of the models directory's VAE/ (AUTOMATIC1111 API)")
    async def list_vaes():
        return await asyncio.to_thread(models_api.sd_vae, md)

    def refresher(kind: str):
        async def refresh():
            if md is not None:
                md.refresh(kind)
            return None

        return refresh

    for kind, path in (("checkpoint", "checkpoints"), ("lora", "loras"), ("vae", "vae")):
        api.add_api_route(
            f"/sdapi/v1/refresh-{path}",
            refresher(kind),
            methods=["POST"],
            summary=f"Rescan the models directory's {kind} folder (AUTOMATIC1111 API)",
        )


def request_settings(
    state: ServerState, body: A1111Txt2ImgRequest, now: Served
) -> tuple[dict[str, Any], A1111Txt2ImgRequest]:
    """`override_settings` and `<lora:...>` tags of an A1111 request (files loaded here: run in a thread) ->
    (the changes to its GenerationRequest, the body to resolve: its prompts without the tags). 422 for the rest."""
    md, networks = state.md, state.networks
    changes, rest = state.model_settings(body.override_settings or {}, now, "override_settings")
    if rest:
        # per-request model switching is not done: a request's checkpoint must be the served one
        check_settings(rest, state.settings(), field="override_settings")
    texts = {"prompt": body.prompt, "negative_prompt": body.negative_prompt or ""}
    loaded = (now.embeddings or {}).get("loaded", {})
    if loaded and md is not None:  # A1111's "TI hashes" of the embeddings these prompts use
        files = [(name, md.resolve("embedding", name).path) for name in loaded]
        changes["ti_hashes"] = ti_hashes(list(texts.values()), files, md.hashes)
    loras = networks.prompt_loras(now.pipeline, texts)
    if not loras:
        return changes, body
    stripped = dict(zip(texts, strip_lora_tags(list(texts.values()), loras), strict=True))
    changes.update(loras=loras, lora_hashes=networks.lora_hashes(loras), **texts)  # the tags stay in the prompt
    return changes, body.model_copy(update=stripped)


def processed_info(request: GenerationRequest, outcome: Outcome, body: A1111Txt2ImgRequest) -> dict:
    """The `info` object of AUTOMATIC1111's `Processed.js()`, with the keys clients read, for the images made (an
    interrupted or skipped request has fewer than it asked for; `stopped` says why)."""
    images = outcome.images
    n = len(images)
    return {
        "prompt": request.prompt,
        "all_prompts": [im.prompt for im in images],
        "negative_prompt": request.negative_prompt,
        "all_negative_prompts": [im.negative_prompt for im in images],
        "seed": images[0].seed if images else request.seed,
        "all_seeds": [im.seed for im in images],
        "subseed": -1,
        "all_subseeds": [-1] * n,
        "subseed_strength": 0,
        "width": request.width,
        "height": request.height,
        "sampler_name": a1111.describe(sampler_display_name(request.sampler))[0],
        "scheduler": a1111.describe(sampler_display_name(request.sampler))[1] or "Automatic",
        "cfg_scale": request.guidance_scale,
        "steps": request.steps,
        "batch_size": body.batch_size,
        "restore_faces": False,
        "face_restoration_model": None,
        "sd_model_name": request.model,
        "sd_model_hash": None,
        "sd_vae_name": request.vae or None,
        "sd_vae_hash": None,
        "seed_resize_from_w": -1,
        "seed_resize_from_h": -1,
        "denoising_strength": None,
        "extra_generation_params": {},
        "index_of_first_image": 0,
        "infotexts": [im.infotext() for im in images],
        "styles": [],
        "job_timestamp": time.strftime("%Y%m%d%H%M%S"),
        "clip_skip": request.clip_skip,
        "is_using_inpainting_conditioning": False,
        "version": f"sdjax {version()}",
        "stopped": outcome.stopped,
    }


def latent_preview(latents: Any, pipeline: Any) -> np.ndarray:
    """A cheap RGB preview `(h, w, 3)` uint8 of one image's latents `(C, h, w)`: the pipeline's linear latent->RGB
    map (`pipeline.latent_rgb_factors`, shape `(C, 3)`, plus `latent_rgb_factors_bias` `(3,)` where it has one) from
    [-1, 1] to 0..255 where it has one, else its first three channels, each stretched to 0..255. No VAE decode: a
    glimpse of the layout, not the image."""
    x = np.asarray(latents, np.float32)
    factors = getattr(pipeline, "latent_rgb_factors", None)
    if factors is not None:
        rgb = np.einsum("chw,ck->hwk", x, np.asarray(factors, np.float32))
        bias = getattr(pipeline, "latent_rgb_factors_bias", None)
        if bias is not None:
            rgb = rgb + np.asarray(bias, np.float32)
        return np.clip((rgb + 1.0) * 127.5, 0, 255).astype(np.uint8)
    rgb = np.moveaxis(x[:3] if x.shape[0] >= 3 else np.repeat(x[:1], 3, axis=0), 0, -1)
    lo, hi = rgb.min(axis=(0, 1)), rgb.max(axis=(0, 1))
    return np.clip((rgb - lo) / np.maximum(hi - lo, 1e-6) * 255, 0, 255).astype(np.uint8)


def progress_of(batcher: Batcher, pipeline: Any, id_task: str | None, skip_current_image: bool) -> dict:
    """AUTOMATIC1111's `ProgressResponse` (`progress`, `eta_relative`, `state`, `current_image`, `textinfo`),
    plus `stage`, `queue_position` (images ahead of the task) and `queue_depth`."""
    current = batcher.current
    where, ahead = (
        ("running", 0)
        if id_task is None and current is not None
        else (batcher.position(id_task) if id_task is not None else ("idle", 0))
    )
    fraction, eta, stage, step, total = 0.0, 0.0, where, 0, 0
    image = None
    if where == "running" and current is not None:
        stage, step, total = current.stage, current.step, current.total
        fraction = step / total if total else 0.0
        if stage == "decode":
            fraction = 1.0
        elapsed = time.monotonic() - current.started
        eta = elapsed / fraction - elapsed if fraction > 0 else 0.0
        if not skip_current_image and current.latents is not None:
            image = _preview_png(current, pipeline, id_task)
    text = {
        "queued": f"queued: {ahead} images ahead",
        "running": f"{stage} {step}/{total}",
        "idle": "idle",
        "unknown": "no such task (finished or never queued)",
    }.get(where, where)
    return {
        "progress": round(fraction, 4),
        "eta_relative": round(eta, 3),
        "state": {
            "skipped": bool(current.skip) if current else False,
            "interrupted": False,
            "job": id_task or "",
            "job_count": 1 if current else 0,
            "job_timestamp": "",
            "job_no": 0,
            "sampling_step": step,
            "sampling_steps": total,
        },
        "current_image": image,
        "textinfo": text,
        "stage": stage,
        "queue_position": ahead,
        "queue_depth": batcher.queued_images,
    }


def _preview_png(current, pipeline: Any, id_task: str | None) -> str | None:
    owners = current.owners
    index = owners.index(id_task) if id_task in owners else 0
    latents = current.latents
    if latents is None or index >= len(latents):
        return None
    buf = io.BytesIO()
    from PIL import Image

    Image.fromarray(latent_preview(latents[index], pipeline)).save(buf, format="PNG")
    return b64(buf.getvalue())
