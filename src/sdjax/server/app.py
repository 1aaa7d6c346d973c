"""The HTTP server: FastAPI routes over one pipeline and a `Batcher`; `serve()` runs it under uvicorn.

Endpoints:
- `GET /` the web page; `GET /health/live` (the process answers), `GET /health/ready` and `GET /health` (200 when
  serving; 503 while compiling at start-up, switching models, draining, or when the running batch has shown no
  progress for `stuck_after_s`); `GET /metrics` Prometheus text; `GET /v1/config` what the page needs;
  `GET /docs` the API explorer from the locally installed `swagger-ui-bundle` (absent: /docs answers 404 and
  the start-up log says so; `/openapi.json` is always there);
- OpenAI: `POST /v1/images/generations` (`response_format` `b64_json` or `url`; `stream`: server-sent events,
  `server.openai_stream`), `GET /v1/files/{id}` (the images behind those urls, for `file_ttl_s`), `GET /v1/models`;
- AUTOMATIC1111: `POST /sdapi/v1/txt2img`, `POST /sdapi/v1/interrupt`, `POST /sdapi/v1/skip`,
  `GET /sdapi/v1/progress` (with a latent preview as `current_image` when the pipeline reports latents; null
  otherwise), `GET /sdapi/v1/samplers`, `GET /sdapi/v1/schedulers`, `GET /sdapi/v1/sd-models`, `/loras`,
  `/embeddings`, `/sd-vae`, `POST /sdapi/v1/refresh-checkpoints`, `/refresh-loras`, `/refresh-vae` (the models
  directory: `server.models_api`), `GET|POST /sdapi/v1/options` (POST switches `sd_model_checkpoint` when the
  server has a models directory, and sets the default `CLIP_stop_at_last_layers` and `sd_vae`; any setting it
  cannot honour answers 422), `POST /sdapi/v1/png-info`, and `GET /sdapi/v1/cmd-flags`, `/upscalers`,
  `/latent-upscale-modes`, `/scripts`, `/memory`, `/prompt-styles` (`server.a1111_info`). `<lora:...>` prompt
  tags and `override_settings.sd_vae` are applied per batch as params (`server.networks`).

Errors have one shape per API (`sdjax.server.errors`): invalid input 422 naming the field, a body too large 413,
truncated 400, too slow 408, bad credentials 401, queue full 429 with `Retry-After`, no result within the request
timeout 504 (and the work is cancelled), pipeline failure or bug 500 naming only a request id, draining 503.
Every response carries `X-Request-ID`. A request never takes the server down. On SIGTERM the server stops
accepting connections and drains for at most `shutdown_timeout_s`, then cancels what is left (503) and exits.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import importlib.resources
import io
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from sdjax.metadata import (
    SEED_MAX,
    GenerationRequest,
    ImageParameters,
    parse_parameters,
    png_bytes,
    sampler_display_name,
    sampler_id,
    strip_lora_tags,
    ti_hashes,
)
from sdjax.samplers import a1111
from sdjax.server import a1111_info, comfy, models_api, openai_stream, published
from sdjax.server import controlnet as controlnet_api
from sdjax.server.batching import Batcher, Outcome, QueueFull, ShuttingDown
from sdjax.server.errors import APIError, error_body, internal_error
from sdjax.server.files import FileStore
from sdjax.server.guard import Auth, Guard, call_when_exiting, protocol_class, request_id_of
from sdjax.server.metrics import Metrics
from sdjax.server.networks import Networks
from sdjax.server.schemas import (
    VARIATION_STRENGTH,
    A1111Img2ImgRequest,
    A1111PngInfoRequest,
    A1111PngInfoResponse,
    A1111Txt2ImgRequest,
    A1111Txt2ImgResponse,
    Defaults,
    FieldError,
    Limits,
    OpenAIEditForm,
    OpenAIImageRequest,
    OpenAIImageResponse,
    a1111_schedulers,
    check_settings,
    decode_image,
    resolve_a1111,
    resolve_a1111_img2img,
    resolve_openai,
    resolve_openai_edit,
)

log = logging.getLogger("sdjax.server")

# Endpoints whose bodies carry images: they may be up to `ServerConfig.max_image_body_bytes` (txt2img: the
# control images of its ControlNet units).
IMAGE_ENDPOINTS = (
    "/sdapi/v1/txt2img",
    "/sdapi/v1/img2img",
    "/sdapi/v1/png-info",
    "/v1/images/edits",
    "/v1/images/variations",
    "/controlnet/detect",
    *comfy.UPLOAD_PATHS,
)

ENDPOINTS = (
    "/",
    "/health",
    "/health/live",
    "/health/ready",
    "/metrics",
    "/docs",
    "/openapi.json",
    "/v1/config",
    "/v1/models",
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/images/variations",
    "/sdapi/v1/txt2img",
    "/sdapi/v1/img2img",
    "/sdapi/v1/interrupt",
    "/sdapi/v1/skip",
    "/sdapi/v1/samplers",
    "/sdapi/v1/schedulers",
    "/sdapi/v1/progress",
    "/sdapi/v1/sd-models",
    "/sdapi/v1/loras",
    "/sdapi/v1/embeddings",
    "/sdapi/v1/sd-vae",
    "/sdapi/v1/refresh-checkpoints",
    "/sdapi/v1/refresh-loras",
    "/sdapi/v1/refresh-vae",
    "/sdapi/v1/options",
    "/sdapi/v1/png-info",
    "/controlnet/model_list",
    "/controlnet/module_list",
    "/controlnet/detect",
    "/controlnet/version",
    *a1111_info.PATHS,
    *comfy.PATHS,
)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Batching, limits, time bounds, security and start-up compilation of one server."""

    model_name: str = ""
    max_batch: int = 8
    batch_sizes: tuple[int, ...] = ()  # compiled batch sizes; default: powers of two up to max_batch
    batch_window_s: float = 0.01
    max_queue_images: int = 64
    max_queue_cost: int | None = None  # pixel-steps queued at most (width x height x steps x images); None: no bound
    request_timeout_s: float = 300.0  # no result by then: 504, and the request's work is cancelled
    max_body_bytes: int = 64 * 1024
    max_image_body_bytes: int = 48 * 1024 * 1024  # bodies of IMAGE_ENDPOINTS (base64 or multipart images)
    body_timeout_s: float = 10.0  # the whole request body must arrive within this
    header_timeout_s: float = 10.0  # a connection's request head must arrive within this
    shutdown_timeout_s: float = 30.0  # SIGTERM: drain for at most this, then cancel
    stuck_after_s: float = 600.0  # readiness fails when the running batch shows no progress for this long
    max_connections: int = 1024  # more concurrent connections/requests get 503 from uvicorn
    warm_sizes: tuple[tuple[int, int], ...] = ()  # (width, height) compiled at start-up; () = the model's size
    warm_steps: tuple[int, ...] = ()  # steps compiled at start-up; () = the default steps
    warm_samplers: tuple[str, ...] = ()  # samplers compiled at start-up; () = the default sampler
    warm: bool = True
    pin: bool = False  # serve only the warm sizes x steps x samplers (422 otherwise): no request compiles
    max_programs: int | None = None  # compiled programs kept (least recently used out, memory freed); None: 16
    max_program_bytes: int | None = None  # ... and their generated code in bytes (GPU/TPU report it; CPU does not)
    limits: Limits = Limits()
    progress: bool = True  # per-step progress from the pipeline (for /sdapi/v1/progress)
    default_steps: int | None = None  # for requests without steps, and compiled at start-up; None: the pipeline's
    default_sampler: str | None = None  # likewise for the sampler
    api_key: str | None = None  # required as `Authorization: Bearer <key>`
    api_auth: tuple[tuple[str, str], ...] = ()  # (user, password) pairs accepted as HTTP basic auth
    cors_origins: tuple[str, ...] = ()
    models_dir: str | None = None  # A1111 models directory (or a folder of diffusers models): see models_api
    allow_pickle_embeddings: bool = False  # load its .pt/.bin embeddings (restricted unpickler) instead of skipping
    checkpoint: str = ""  # the served model's name in the models directory (sd_model_checkpoint); "": model_name
    vae_name: str = ""  # the VAE the server was started with (sd_vae); "": the model's own ("Automatic")
    controlnet_dir: str | None = None  # ControlNet folders A1111 requests may name (alwayson_scripts.controlnet)
    file_ttl_s: float = 3600.0  # response_format="url" images live this long
    max_files: int = 256
    max_file_bytes: int = 256 * 1024 * 1024
    docs: bool = True  # /docs from the local swagger-ui-bundle (when installed)


@dataclasses.dataclass(frozen=True)
class Served:
    """The model being served and what follows from it (replaced as a whole by a model switch)."""

    pipeline: Any
    model_name: str
    defaults: Defaults
    limits: Limits
    warm_shapes: tuple[tuple[int, int, int, str], ...]
    warm_sizes: tuple[tuple[int, int], ...]
    checkpoint: str = ""  # its name in the models directory (what sd_model_checkpoint shows)
    embeddings: Any = None  # GET /sdapi/v1/embeddings: what loading the directory's embeddings into it gave


def served_for(
    pipeline: Any, model_name: str, config: ServerConfig, *, checkpoint: str = "", embeddings: Any = None
) -> Served:
    """Defaults, warm shapes and (with `config.pin`) the pinned limits for `pipeline`."""
    defaults = Defaults.of(pipeline, steps=config.default_steps, sampler=config.default_sampler)
    sizes = config.warm_sizes or ((defaults.width, defaults.height),)
    steps = config.warm_steps or (defaults.steps,)
    # Warm samplers are named as the native API names them ("Euler a" is diffusers' Euler a on the model's grid);
    # A1111 requests resolve "Automatic", so warm their pair explicitly ("DPM++ 2M Karras", "Euler a Uniform").
    samplers = tuple(dict.fromkeys(sampler_id(s) for s in (config.warm_samplers or (defaults.sampler,))))
    shapes = tuple((st, h, w, s) for (w, h) in sizes for st in steps for s in samplers) if config.warm else ()
    limits = config.limits
    if config.pin:
        limits = dataclasses.replace(limits, sizes=tuple(sizes), steps=tuple(steps), samplers=samplers)
    cache = getattr(getattr(pipeline, "generator", None), "cache", None)
    if cache is not None:  # the core's bounded cache of compiled programs
        if config.max_programs is not None:
            cache.max_entries = config.max_programs
        if config.max_program_bytes is not None:
            cache.max_bytes = config.max_program_bytes
    return Served(pipeline, model_name, defaults, limits, shapes, tuple(sizes), checkpoint or model_name, embeddings)


# ---------------------------------------------------------------------------------------------- app
def create_app(
    pipeline: Any, config: ServerConfig = ServerConfig(), *, loader: Callable[[str], Any] | None = None
) -> FastAPI:
    """A FastAPI app serving `pipeline`; `loader(path) -> pipeline` lets POST /sdapi/v1/options switch to another
    model of `config.models_dir`. The batcher starts and stops with the app's lifespan."""
    metrics = Metrics(config.max_batch)
    if getattr(getattr(pipeline, "generator", None), "cache", None) is not None:
        metrics.watch_cache(pipeline.generator.cache)
    md = models_api.open_models_dir(config.models_dir)
    checkpoint = config.checkpoint or config.model_name
    embeddings = models_api.load_embeddings(
        pipeline, md, allow_pickle=config.allow_pickle_embeddings
    )  # before start-up compiles: vocab grows
    box = {"served": served_for(pipeline, config.model_name, config, checkpoint=checkpoint, embeddings=embeddings)}
    networks = Networks(md, served_vae=config.vae_name)  # <lora:...> tags and sd_vae per request, as params
    batcher = Batcher(
        pipeline,
        metrics=metrics,
        max_batch=config.max_batch,
        batch_sizes=config.batch_sizes,
        window_s=config.batch_window_s,
        max_queue_images=config.max_queue_images,
        max_queue_cost=config.max_queue_cost,
        warm_shapes=box["served"].warm_shapes,
        warm_guidance=box["served"].defaults.guidance_scale,
        warm_no_guidance=config.pin,
        progress=config.progress,
        params_for=networks.params_for,
    )
    files = FileStore(ttl_s=config.file_ttl_s, max_files=config.max_files, max_bytes=config.max_file_bytes)
    # clip_skip, vae: the defaults POST /sdapi/v1/options set (CLIP_stop_at_last_layers, sd_vae; "": the served VAE)
    state: dict[str, Any] = {"switching": False, "clip_skip": 1, "vae": ""}
    gate = asyncio.Event()  # cleared while a model switch is under way: new requests wait
    gate.set()
    switch_lock = asyncio.Lock()
    page = _page()
    docs_assets = _swagger_assets() if config.docs else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if config.docs and docs_assets is None:
            log.info("/docs is off: the swagger-ui-bundle package is not installed (GET /openapi.json still works)")
        await batcher.start()
        try:
            yield
        finally:
            await batcher.stop(timeout_s=config.shutdown_timeout_s)

    app = FastAPI(
        title="sdjax",
        version=_version(),
        lifespan=lifespan,
        description="Stable Diffusion in JAX: OpenAI- and AUTOMATIC1111-compatible image generation",
        docs_url=None,
        redoc_url=None,
    )
    raw_openapi = app.openapi  # FastAPI's schema (generated once), with this server's limits (`server.published`)
    app.openapi = lambda: published.publish_limits(raw_openapi(), served().limits, served().defaults)
    app.state.batcher = batcher
    app.state.metrics = metrics
    app.state.config = config
    app.state.files = files
    app.state.box = box

    def served() -> Served:
        return box["served"]

    # ------------------------------------------------------------------ errors: one shape per API
    def answer(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error_body(request.url.path, error), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        field = _field_of(first.get("loc", ()))
        msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        if first.get("type") == "json_invalid":
            message, field = f"malformed JSON body: {first.get('ctx', {}).get('error', msg)}", "body"
        elif field is None:
            message, field = f"body: {msg}; send a JSON object", "body"
        else:
            message = f"{field}: {msg}"
        log.info(
            "422 %s (request id %s)", jsonable_encoder(errors, exclude={"input", "url"}), request_id_of(request.scope)
        )
        return answer(request, APIError(422, message, field, code=str(first.get("type", "invalid"))))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        messages = {
            400: "the request body could not be parsed (send UTF-8 JSON)",
            404: f"no such endpoint: {request.method} {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
        }
        message = messages.get(exc.status_code, str(exc.detail))
        code = {400: "malformed_body", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        param = "body" if exc.status_code == 400 else None
        return answer(request, APIError(exc.status_code, message, param, code=code, headers=dict(exc.headers or {})))

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        if exc.code == "over_budget":
            metrics.rejected.labels("over_budget").inc()
        return answer(request, exc)

    @app.exception_handler(QueueFull)
    async def on_queue_full(request: Request, exc: QueueFull):
        metrics.rejected.labels("queue_full").inc()
        return answer(
            request,
            APIError(429, str(exc), None, "queue_full", "rate_limit_error", {"Retry-After": str(exc.retry_after)}),
        )

    @app.exception_handler(ShuttingDown)
    async def on_shutting_down(request: Request, exc: ShuttingDown):
        return answer(request, APIError(503, str(exc), None, "shutting_down", "server_error", {"Retry-After": "5"}))

    @app.exception_handler(Exception)
    async def on_error(request: Request, exc: Exception):
        request_id = request_id_of(request.scope)
        log.error("request failed (request id %s)", request_id, exc_info=exc)
        return answer(request, internal_error(request_id))

    # ------------------------------------------------------------------ generation
    async def wait_for_model() -> Served:
        if not gate.is_set():
            try:
                await asyncio.wait_for(gate.wait(), config.request_timeout_s)
            except TimeoutError:
                raise APIError(503, "the server is switching models", None, "switching", "server_error") from None
        return served()

    async def run(request: Request, gen: GenerationRequest, task_id: str | None = None) -> tuple[Outcome, list[bytes]]:
        job = batcher.submit(gen.images(), task_id)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            done, _ = await asyncio.wait(
                {job.future, gone}, timeout=config.request_timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:  # uvicorn gave up on this request (shutdown): stop its work
            batcher.cancel(job, "shutdown")
            raise
        finally:
            gone.cancel()
        if job.future not in done:
            if gone in done:
                batcher.cancel(job, "disconnect")
                raise _ClientGone
            batcher.cancel(job, "timeout")
            metrics.rejected.labels("timeout").inc()
            raise APIError(
                504,
                f"no result within the request timeout of {config.request_timeout_s:g} s; its work was cancelled",
                None,
                "timeout",
                "server_error",
            )
        try:
            outcome = job.future.result()
        except ShuttingDown:
            raise
        except Exception as e:  # the pipeline raised for this batch; logged by the batcher
            request_id = request_id_of(request.scope)
            log.error("generation failed (request id %s): %s: %s", request_id, type(e).__name__, e)
            raise APIError(
                500,
                f"generation failed; it was logged under request id {request_id} (X-Request-ID)",
                None,
                "generation_failed",
                "server_error",
            ) from None
        metrics.images.inc(len(outcome.images))
        pngs = await asyncio.to_thread(_encode, outcome.arrays, outcome.images)
        return outcome, pngs

    @app.exception_handler(_ClientGone)
    async def on_client_gone(request: Request, exc: _ClientGone):
        return Response(status_code=499)  # nobody reads it; counted in the metrics

    @app.post("/v1/images/generations", response_model=OpenAIImageResponse, response_model_exclude_none=True,
              summary="Create images (OpenAI images API); with stream, server-sent events",
              responses={200: {"content": {"text/event-stream": {}}}})  # fmt: skip
    async def openai_generations(request: Request, body: OpenAIImageRequest) -> Any:
        now = await wait_for_model()
        gen = resolve_openai(body, now.pipeline, now.limits, now.defaults, now.model_name)
        if body.stream:
            return stream_images(request, gen, now, body.partial_images or 0)
        _, pngs = await run(request, gen)
        if body.response_format == "url":
            base = str(request.base_url).rstrip("/")
            data = [{"url": f"{base}/v1/files/{files.put(p)}"} for p in pngs]
        else:
            data = [{"b64_json": _b64(p)} for p in pngs]
        return {"created": int(time.time()), "data": data}

    def stream_images(request: Request, gen: GenerationRequest, now: Served, partial_images: int) -> Response:
        """OpenAI's server-sent image events (`server.openai_stream`); queue limits answer before the first event."""
        job = batcher.submit(gen.images())

        async def finish(outcome: Outcome) -> list[bytes]:
            metrics.images.inc(len(outcome.images))
            return await asyncio.to_thread(_encode, outcome.arrays, outcome.images)

        events = openai_stream.events(
            batcher=batcher, job=job, pipeline=now.pipeline, partial_images=partial_images, width=gen.width,
            height=gen.height, timeout_s=config.request_timeout_s, finish=finish,
            request_id=request_id_of(request.scope),
        )  # fmt: skip
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/files/{file_id}", summary="An image from response_format=url (expires)", response_class=Response)
    async def get_file(file_id: str):
        data = files.get(file_id.removesuffix(".png"))
        if data is None:
            message = f"file_id: no such file {file_id!r} (files expire after {config.file_ttl_s:g} s)"
            raise APIError(404, message, "file_id", code="not_found")
        return Response(data, media_type="image/png", headers={"Cache-Control": "private, max-age=60"})

    def settings() -> dict[str, Any]:
        return {
            "sd_model_checkpoint": served().checkpoint,
            "samples_format": "png",
            "CLIP_stop_at_last_layers": state["clip_skip"],
            "eta_noise_seed_delta": 0,
            "sd_vae": state["vae"] or config.vae_name or "Automatic",
        }

    def same_checkpoint(value: Any) -> bool:
        """Whether an sd_model_checkpoint value names the served model (any of its names in the directory)."""
        now = served()
        if isinstance(value, str) and value.strip().lower() in (now.checkpoint.lower(), now.model_name.lower()):
            return True
        if md is None or not isinstance(value, str):
            return False
        try:
            return md.resolve("checkpoint", value).name == md.resolve("checkpoint", now.checkpoint).name
        except (ValueError, LookupError):
            return False

    def model_settings(overrides: dict[str, Any], now: Served, field: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model settings of `overrides` checked and taken out -> (GenerationRequest changes, the rest)."""
        rest = dict(overrides)
        changes: dict[str, Any] = {"clip_skip": state["clip_skip"], "vae": state["vae"] or config.vae_name}
        prefix = f"{field}." if field else ""
        if "CLIP_stop_at_last_layers" in rest:
            value = rest.pop("CLIP_stop_at_last_layers")
            changes["clip_skip"] = models_api.clip_skip_setting(
                value, now.pipeline, f"{prefix}CLIP_stop_at_last_layers"
            )
        if "sd_vae" in rest:
            value = rest.pop("sd_vae")
            if not isinstance(value, str):
                raise FieldError(f"{prefix}sd_vae", f"{value!r} is not a VAE name")
            if value.strip().lower() in models_api.OWN_VAE or (config.vae_name and value.strip() == config.vae_name):
                changes["vae"] = config.vae_name  # the served params' own VAE
            else:
                changes["vae"] = networks.vae(now.pipeline, value, f"{prefix}sd_vae")
        if "sd_model_checkpoint" in rest and same_checkpoint(rest["sd_model_checkpoint"]):
            rest.pop("sd_model_checkpoint")
        return changes, rest

    def request_settings(body: A1111Txt2ImgRequest, now: Served) -> tuple[dict[str, Any], A1111Txt2ImgRequest]:
        """`override_settings` and `<lora:...>` tags of an A1111 request (files loaded here: run in a thread) ->
        (the changes to its GenerationRequest, the body to resolve: its prompts without the tags). 422 for the rest."""
        changes, rest = model_settings(body.override_settings or {}, now, "override_settings")
        if rest:
            # per-request model switching is not done: a request's checkpoint must be the served one
            check_settings(rest, settings(), field="override_settings")
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

    @app.post("/sdapi/v1/txt2img", response_model=A1111Txt2ImgResponse,
              summary="Text to image (AUTOMATIC1111 web UI API)")  # fmt: skip
    async def a1111_txt2img(request: Request, body: A1111Txt2ImgRequest) -> dict:
        now = await wait_for_model()
        changes, plain = await asyncio.to_thread(request_settings, body, now)
        gen = dataclasses.replace(
            resolve_a1111(plain, now.pipeline, now.limits, now.defaults, now.model_name), **changes
        )
        gen = await asyncio.to_thread(
            controlnet_api.apply, gen, body.alwayson_scripts, config.controlnet_dir, now.limits, now.pipeline
        )
        outcome, pngs = await run(request, gen, body.force_task_id)
        info = _a1111_info(gen, outcome, body)
        return {
            "images": [_b64(p) for p in pngs] if body.send_images else [],
            "parameters": body.model_dump(),
            "info": json.dumps(info),
        }

    @app.post("/sdapi/v1/img2img", response_model=A1111Txt2ImgResponse,
              summary="Image to image and inpainting (AUTOMATIC1111 web UI API)")  # fmt: skip
    async def a1111_img2img(request: Request, body: A1111Img2ImgRequest) -> dict:
        now = await wait_for_model()
        changes, plain = await asyncio.to_thread(request_settings, body, now)
        gen = await asyncio.to_thread(
            resolve_a1111_img2img, plain, now.pipeline, now.limits, now.defaults, now.model_name
        )
        gen = dataclasses.replace(gen, **changes)
        gen = await asyncio.to_thread(
            controlnet_api.apply, gen, body.alwayson_scripts, config.controlnet_dir, now.limits, now.pipeline
        )
        outcome, pngs = await run(request, gen, body.force_task_id)
        info = _a1111_info(gen, outcome, body)
        parameters = body.model_dump()
        if not body.include_init_images:  # as A1111: the request's images are not echoed back
            parameters.update(init_images=None, mask=None)
        return {
            "images": [_b64(p) for p in pngs] if body.send_images else [],
            "parameters": parameters,
            "info": json.dumps(info),
        }

    async def openai_images(request: Request, gen: GenerationRequest, response_format: str) -> dict:
        _, pngs = await run(request, gen)
        if response_format == "url":
            base = str(request.base_url).rstrip("/")
            data = [{"url": f"{base}/v1/files/{files.put(p)}"} for p in pngs]
        else:
            data = [{"b64_json": _b64(p)} for p in pngs]
        return {"created": int(time.time()), "data": data}

    @app.post("/v1/images/edits", response_model=OpenAIImageResponse, response_model_exclude_none=True,
              summary="Edit an image where the mask is transparent (OpenAI images API)")  # fmt: skip
    async def openai_edits(
        request: Request,
        image: Annotated[UploadFile, File(description="The image to edit (PNG/JPEG/WebP)")],
        prompt: Annotated[str, Form(min_length=1)],
        mask: Annotated[
            UploadFile | None, File(description="Transparent pixels are repainted (default: the image's)")
        ] = None,
        n: Annotated[int, Form(ge=1)] = 1,
        size: Annotated[str | None, Form()] = None,
        response_format: Annotated[Literal["b64_json", "url"], Form()] = "b64_json",
        negative_prompt: Annotated[str, Form()] = "",
        steps: Annotated[int | None, Form(ge=1)] = None,
        guidance_scale: Annotated[float | None, Form(ge=0)] = None,
        seed: Annotated[int | None, Form(ge=-1, le=SEED_MAX)] = None,
        sampler: Annotated[str | None, Form()] = None,
        strength: Annotated[float, Form(ge=0, le=1)] = 1.0,
    ) -> dict:
        now = await wait_for_model()
        form = _edit_form(
            prompt=prompt,
            n=n,
            size=size,
            response_format=response_format,
            negative_prompt=negative_prompt,
            steps=steps,
            guidance_scale=guidance_scale,
            seed=seed,
            sampler=sampler,
            strength=strength,
        )
        image_bytes = await image.read()
        mask_bytes = await mask.read() if mask is not None else None
        gen = await asyncio.to_thread(
            resolve_openai_edit, form, image_bytes, mask_bytes, now.pipeline, now.limits, now.defaults, now.model_name
        )
        return await openai_images(request, gen, form.response_format)

    @app.post("/v1/images/variations", response_model=OpenAIImageResponse, response_model_exclude_none=True,
              summary="Variations of an image (OpenAI images API): image-to-image with an empty prompt")  # fmt: skip
    async def openai_variations(
        request: Request,
        image: Annotated[UploadFile, File(description="The image to vary (PNG/JPEG/WebP)")],
        n: Annotated[int, Form(ge=1)] = 1,
        size: Annotated[str | None, Form()] = None,
        response_format: Annotated[Literal["b64_json", "url"], Form()] = "b64_json",
        seed: Annotated[int | None, Form(ge=-1, le=SEED_MAX)] = None,
        strength: Annotated[float, Form(ge=0, le=1)] = VARIATION_STRENGTH,
    ) -> dict:
        now = await wait_for_model()
        form = _edit_form(prompt="", n=n, size=size, response_format=response_format, seed=seed, strength=strength)
        gen = await asyncio.to_thread(
            resolve_openai_edit,
            form,
            await image.read(),
            None,
            now.pipeline,
            now.limits,
            now.defaults,
            now.model_name,
            variation=True,
        )
        return await openai_images(request, gen, form.response_format)

    @app.post("/sdapi/v1/interrupt", summary="Stop the running requests; they answer with the images made so far")
    async def interrupt(id_task: str | None = None):
        return {"interrupted": batcher.interrupt(id_task)}

    @app.post("/sdapi/v1/skip", summary="Drop the running batch's images; its requests go on with the rest")
    async def skip():
        return {"skipped": batcher.skip()}

    @app.get("/sdapi/v1/options", summary="Current options (AUTOMATIC1111 API)")
    async def get_options():
        return settings()

    @app.post("/sdapi/v1/options", summary="Set options: sd_model_checkpoint switches the model (with a models dir)")
    async def set_options(request: Request, body: dict[str, Any]):
        switchable = frozenset({"sd_model_checkpoint"}) if loader is not None and config.models_dir else frozenset()
        model, rest = await asyncio.to_thread(model_settings, body, served(), "")
        try:
            changes = check_settings(rest, settings(), field="", switchable=switchable)
        except FieldError as e:
            if e.field == "sd_model_checkpoint" and not switchable:
                raise FieldError(
                    "sd_model_checkpoint",
                    f"this server serves only {served().model_name!r}; start it with a models directory "
                    "(--models-dir) to switch models",
                    code="unsupported",
                ) from None
            raise
        if "sd_model_checkpoint" in changes:
            await switch_model(request, changes["sd_model_checkpoint"])
        if "CLIP_stop_at_last_layers" in body:
            state["clip_skip"] = models_api.clip_skip_setting(
                body["CLIP_stop_at_last_layers"], served().pipeline, "CLIP_stop_at_last_layers"
            )  # checked against the model now served
        if "sd_vae" in body and "sd_model_checkpoint" not in changes:
            state["vae"] = "" if model["vae"] == config.vae_name else model["vae"]
        return None

    async def switch_model(request: Request, value: Any) -> None:
        if md is None or not isinstance(value, str):
            raise FieldError("sd_model_checkpoint", f"{value!r} is not a model name")
        try:
            entry = md.resolve("checkpoint", value)
        except (ValueError, LookupError) as e:
            raise FieldError("sd_model_checkpoint", str(e.args[0] if e.args else e)) from None
        name = entry.name if entry.is_folder else entry.short_name

        def load() -> tuple[Any, Any, str]:
            pipe = loader(str(entry.path))
            title = entry.name if entry.is_folder else f"{entry.name} [{md.hashes.sha256(entry.path)[:10]}]"
            return pipe, models_api.load_embeddings(pipe, md, allow_pickle=config.allow_pickle_embeddings), title

        async with switch_lock:
            if same_checkpoint(entry.name):
                return
            gate.clear()
            state["switching"] = True
            try:
                await batcher.idle()
                log.info("switching model to %s", name)
                try:
                    pipe, embeddings, title = await batcher.run_on_worker(load)
                except Exception as e:
                    request_id = request_id_of(request.scope)
                    log.error("could not load %s (request id %s)", name, request_id, exc_info=e)
                    raise APIError(
                        500,
                        f"could not load the model {name!r}; the error was logged under request id {request_id}",
                        "sd_model_checkpoint",
                        "model_load_failed",
                        "server_error",
                    ) from None
                new = served_for(pipe, name, config, checkpoint=title, embeddings=embeddings)
                if getattr(getattr(pipe, "generator", None), "cache", None) is not None:
                    metrics.watch_cache(pipe.generator.cache)
                batcher.set_pipeline(pipe)
                networks.clear()
                state["vae"] = ""  # a VAE is checked against the model it was chosen for
                box["served"] = new
                if config.warm:
                    await batcher.warm(new.warm_shapes)
            finally:
                state["switching"] = False
                gate.set()

    @app.post("/sdapi/v1/png-info", response_model=A1111PngInfoResponse, summary="Parameters of a PNG (AUTOMATIC1111)")
    async def png_info(body: A1111PngInfoRequest):
        image = await asyncio.to_thread(decode_image, body.image, field="image", limits=served().limits)
        texts = {k: v for k, v in image.info.items() if isinstance(k, str) and isinstance(v, str)}
        text = texts.pop("parameters", "")
        return {"info": text, "items": texts, "parameters": parse_parameters(text) if text else {}}

    # ------------------------------------------------------------------ the rest
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index():
        return HTMLResponse(page)

    def readiness() -> tuple[bool, str]:
        if batcher.draining or batcher.stopping:
            return False, "draining"
        if state["switching"]:
            return False, "switching model"
        if served().pipeline is None:
            return False, "model not loaded"
        if not batcher.ready:
            return False, "warming"
        stuck = batcher.stuck_for()
        if stuck > config.stuck_after_s:
            return False, f"stuck: the running batch has shown no progress for {stuck:.0f} s"
        return True, "ok"

    async def ready_response():
        ok, status = readiness()
        body = {
            "status": status,
            "model": served().model_name,
            "queue_depth": batcher.queued_images,
            "busy": batcher.current is not None,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    app.add_api_route("/health/ready", ready_response, methods=["GET"], summary="Readiness: 200 when serving")
    app.add_api_route("/health", ready_response, methods=["GET"], summary="Readiness (same as /health/ready)")

    @app.get("/health/live", summary="Liveness: the process answers")
    async def live():
        return {"status": "alive"}

    @app.get("/metrics", summary="Prometheus metrics", include_in_schema=False)
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/config", summary="Defaults, limits and samplers (used by the web page)")
    async def server_config():
        now = served()
        return {
            "model": now.model_name,
            "samplers": list(now.pipeline.sampler_names),
            "sampler_labels": {name: sampler_display_name(name) for name in now.pipeline.sampler_names},
            "default_sampler": sampler_id(now.defaults.sampler),
            "default_steps": now.defaults.steps,
            "default_guidance_scale": now.defaults.guidance_scale,
            "default_width": now.defaults.width,
            "default_height": now.defaults.height,
            "limits": dataclasses.asdict(now.limits),
            "max_batch": config.max_batch,
            "batch_sizes": list(batcher.batch_sizes),
            "warm_sizes": [list(s) for s in now.warm_sizes] if config.warm else [],
            "pinned": config.pin,
        }

    @app.get("/v1/models", summary="The served model (OpenAI models API)")
    async def models():
        return {"object": "list", "data": [{"id": served().model_name, "object": "model", "owned_by": "sdjax"}]}

    app.include_router(a1111_info.router(config, lambda: served().pipeline))  # cmd-flags, upscalers, memory, ...
    comfy_api = comfy.router(config=config, batcher=batcher, served=served, wait_for_model=wait_for_model,
                             networks=networks, md=md)  # fmt: skip
    app.include_router(comfy_api)  # ComfyUI's paths at the root, and under /api as ComfyUI serves them too
    app.include_router(comfy_api, prefix="/api", include_in_schema=False)

    @app.get("/sdapi/v1/samplers", summary="Samplers (AUTOMATIC1111 API)")
    async def samplers():
        return a1111.a1111_samplers()

    @app.get("/controlnet/model_list", summary="ControlNets (sd-webui-controlnet API): the --controlnet-dir folders")
    async def controlnet_models():
        return {"model_list": list(controlnet_api.list_controlnets(config.controlnet_dir))}

    @app.get("/controlnet/module_list", summary="Control-map preprocessors (sd-webui-controlnet API)")
    async def controlnet_modules():
        return {"module_list": controlnet_api.module_list()}

    @app.get("/controlnet/version", summary="The sd-webui-controlnet API version these endpoints follow")
    async def controlnet_version():
        return {"version": controlnet_api.API_VERSION}

    @app.post("/controlnet/detect", summary="Run a control-map preprocessor on images (sd-webui-controlnet API)")
    async def controlnet_detect(body: controlnet_api.DetectRequest):
        return await asyncio.to_thread(controlnet_api.detect, body, served().limits)

    @app.get("/sdapi/v1/schedulers", summary="Noise schedules (AUTOMATIC1111 API)")
    async def schedulers():
        return a1111_schedulers()

    @app.get("/sdapi/v1/sd-models", summary="Models (AUTOMATIC1111 API): the models directory, or the served one")
    async def sd_models():
        return await asyncio.to_thread(models_api.sd_models, md, served().checkpoint)

    @app.get("/sdapi/v1/loras", summary="LoRAs of the models directory's Lora/ (AUTOMATIC1111 API)")
    async def list_loras():
        return await asyncio.to_thread(models_api.loras, md)

    @app.get("/sdapi/v1/embeddings", summary="Embeddings loaded from the models directory (AUTOMATIC1111 API)")
    async def list_embeddings():
        return served().embeddings or {"loaded": {}, "skipped": {}}

    @app.get("/sdapi/v1/sd-vae", summary="VAEs of the models directory's VAE/ (AUTOMATIC1111 API)")
    async def list_vaes():
        return await asyncio.to_thread(models_api.sd_vae, md)

    def refresher(kind: str):
        async def refresh():
            if md is not None:
                md.refresh(kind)
            return None

        return refresh

    for kind, path in (("checkpoint", "checkpoints"), ("lora", "loras"), ("vae", "vae")):
        app.add_api_route(
            f"/sdapi/v1/refresh-{path}",
            refresher(kind),
            methods=["POST"],
            summary=f"Rescan the models directory's {kind} folder (AUTOMATIC1111 API)",
        )

    @app.get("/sdapi/v1/progress", summary="Progress of the running batch or of one task (AUTOMATIC1111 API)")
    async def progress(id_task: str | None = None, skip_current_image: bool = False):
        return _progress(batcher, served().pipeline, id_task, skip_current_image)

    if docs_assets is not None:
        from fastapi.openapi.docs import get_swagger_ui_html
        from fastapi.staticfiles import StaticFiles

        app.mount("/docs/assets", StaticFiles(directory=docs_assets), name="docs-assets")

        @app.get("/docs", include_in_schema=False)
        async def docs():
            return get_swagger_ui_html(
                openapi_url="/openapi.json",
                title="sdjax API",
                swagger_js_url="/docs/assets/swagger-ui-bundle.js",
                swagger_css_url="/docs/assets/swagger-ui.css",
                swagger_favicon_url="/docs/assets/favicon-32x32.png",
            )

    return app


class _ClientGone(Exception):
    """The client disconnected while its request waited."""


async def _disconnected(receive) -> None:
    """Returns when the client disconnects (the body was read already: what is left to receive is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _edit_form(**fields: Any) -> OpenAIEditForm:
    """The form fields of /v1/images/edits and /variations, checked as a JSON body is: an invalid one ("size=null")
    is a 422 naming it, not an error inside the endpoint."""
    try:
        return OpenAIEditForm(**fields)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


def _field_of(loc) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _encode(arrays: np.ndarray, images: list[ImageParameters]) -> list[bytes]:
    return [png_bytes(a, im.infotext()) for a, im in zip(arrays, images)]


def _version() -> str:
    try:
        import sdjax

        return getattr(sdjax, "__version__", "0")
    except ImportError:
        return "0"


def _page() -> str:
    return importlib.resources.files("sdjax.server").joinpath("static/index.html").read_text("utf-8")


def _swagger_assets() -> str | None:
    """The folder of swagger-ui's JS and CSS from the `swagger-ui-bundle` package, if installed."""
    try:
        import swagger_ui_bundle
    except ImportError:
        return None
    folder = Path(swagger_ui_bundle.swagger_ui_path)
    return str(folder) if (folder / "swagger-ui-bundle.js").is_file() else None


def _a1111_info(request: GenerationRequest, outcome: Outcome, body: A1111Txt2ImgRequest) -> dict:
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
        "version": f"sdjax {_version()}",
        "stopped": outcome.stopped,
    }


def latent_preview(latents: Any, pipeline: Any) -> np.ndarray:
    """A cheap RGB preview `(h, w, 3)` uint8 of one image's latents `(C, h, w)`: the pipeline's linear latent->RGB
    map (`pipeline.latent_rgb_factors`, shape `(C, 3)`) where it has one, else its first three channels, each
    stretched to 0..255. No VAE decode: a glimpse of the layout, not the image."""
    x = np.asarray(latents, np.float32)
    factors = getattr(pipeline, "latent_rgb_factors", None)
    if factors is not None:
        rgb = np.einsum("chw,ck->hwk", x, np.asarray(factors, np.float32))
        return np.clip((rgb + 1.0) * 127.5, 0, 255).astype(np.uint8)
    rgb = np.moveaxis(x[:3] if x.shape[0] >= 3 else np.repeat(x[:1], 3, axis=0), 0, -1)
    lo, hi = rgb.min(axis=(0, 1)), rgb.max(axis=(0, 1))
    return np.clip((rgb - lo) / np.maximum(hi - lo, 1e-6) * 255, 0, 255).astype(np.uint8)


def _progress(batcher: Batcher, pipeline: Any, id_task: str | None, skip_current_image: bool) -> dict:
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
    return _b64(buf.getvalue())


# ---------------------------------------------------------------------------------------------- running
def build_asgi(pipeline: Any, config: ServerConfig = ServerConfig(), *, loader: Callable[[str], Any] | None = None):
    """The app inside the guard layer (and CORS when `config.cors_origins` is set): what uvicorn serves."""
    app = create_app(pipeline, config, loader=loader)
    auth = Auth(api_key=config.api_key, users=tuple(config.api_auth))
    outer: Any = Guard(
        app,
        metrics=app.state.metrics,
        endpoints=ENDPOINTS,
        max_body_bytes=config.max_body_bytes,
        image_body_bytes=(IMAGE_ENDPOINTS, config.max_image_body_bytes),
        body_timeout_s=config.body_timeout_s,
        auth=auth,
    )
    if config.cors_origins:
        from starlette.middleware.cors import CORSMiddleware

        outer = CORSMiddleware(
            outer,
            allow_origins=list(config.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
            expose_headers=["X-Request-ID", "Retry-After"],
            allow_credentials=False,
        )
    outer.state = app.state  # for tests and callers
    outer.fastapi = app
    return outer


def uvicorn_config(asgi, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"):
    """The uvicorn configuration `serve()` uses (also for tests): guarded protocol, connection bound, timeouts."""
    import uvicorn

    return uvicorn.Config(
        asgi,
        host=host,
        port=port,
        log_level=log_level,
        http=protocol_class(config.header_timeout_s),
        limit_concurrency=config.max_connections,
        timeout_keep_alive=5,
        timeout_graceful_shutdown=int(math.ceil(config.shutdown_timeout_s)) + 5,  # the batcher cancels first
        access_log=False,
    )


def make_server(asgi, config: ServerConfig, **kwargs):
    """A `uvicorn.Server` whose SIGINT/SIGTERM starts the batcher's bounded drain."""
    import uvicorn

    batcher = asgi.state.batcher
    server_cls = call_when_exiting(uvicorn.Server, lambda: batcher.begin_drain(config.shutdown_timeout_s))
    return server_cls(uvicorn_config(asgi, config, **kwargs))


def serve(
    pipeline: Any,
    config: ServerConfig = ServerConfig(),
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    loader: Callable[[str], Any] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM; then drain for at most `config.shutdown_timeout_s`, cancel the rest, exit."""
    make_server(build_asgi(pipeline, config, loader=loader), config, host=host, port=port, log_level=log_level).run()
