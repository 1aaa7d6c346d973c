"""One server's state, shared by its routers: the configuration, the model served now (`Served`, replaced as a whole
by a model switch), the batcher, the file store, the metrics, the A1111 options, and the coroutines every
generating endpoint uses (`ServerState.run`, `wait_for_model`) or the options endpoint (`switch_model`).

`create_app` (`server.app`) builds one `ServerState` per app and hands it to each router (`server.routes`).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import Request

from sdjax.infotext import png_bytes, sampler_id
from sdjax.metadata import GenerationRequest, ImageParameters
from sdjax.server import models_api
from sdjax.server.batching import Batcher, Outcome, ShuttingDown
from sdjax.server.errors import APIError, ClientGone
from sdjax.server.files import FileStore
from sdjax.server.guard import request_id_of
from sdjax.server.metrics import Metrics
from sdjax.server.networks import Networks
from sdjax.server.schemas import Defaults, FieldError, Limits

log = logging.getLogger("sdjax.server")


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


class ServerState:
    """What the routers of one app share. `box["served"]` is the model served now (`served()`; a model switch
    replaces it whole); `clip_skip` and `vae` are the defaults POST /sdapi/v1/options set (CLIP_stop_at_last_layers,
    sd_vae; "": the served VAE); `gate` is cleared while a model switch is under way (new requests wait)."""

    def __init__(self, pipeline: Any, config: ServerConfig, *, loader: Callable[[str], Any] | None = None):
        self.config = config
        # loader(path) -> pipeline: POST /sdapi/v1/options switches models with it; one that also takes quantize=
        # loads a switched-in model quantized (`models_api.load_like`)
        self.loader = loader
        # the start-up model's quantization (--quantize / --quant-compute / --calibration): switched models get it too
        self.quantization = getattr(pipeline, "quantization", None)
        self.denoiser_component = getattr(getattr(pipeline, "denoiser", None), "component", None)
        self.metrics = Metrics(config.max_batch)
        if getattr(getattr(pipeline, "generator", None), "cache", None) is not None:
            self.metrics.watch_cache(pipeline.generator.cache)
        self.md = models_api.open_models_dir(config.models_dir)
        embeddings = models_api.load_embeddings(
            pipeline, self.md, allow_pickle=config.allow_pickle_embeddings
        )  # before start-up compiles: vocab grows
        checkpoint = config.checkpoint or config.model_name
        served = served_for(pipeline, config.model_name, config, checkpoint=checkpoint, embeddings=embeddings)
        self.box: dict[str, Served] = {"served": served}
        self.networks = Networks(self.md, served_vae=config.vae_name)  # <lora:...> tags and sd_vae, as params
        self.batcher = Batcher(
            pipeline,
            metrics=self.metrics,
            max_batch=config.max_batch,
            batch_sizes=config.batch_sizes,
            window_s=config.batch_window_s,
            max_queue_images=config.max_queue_images,
            max_queue_cost=config.max_queue_cost,
            warm_shapes=served.warm_shapes,
            warm_guidance=served.defaults.guidance_scale,
            warm_no_guidance=config.pin,
            progress=config.progress,
            params_for=self.networks.params_for,
        )
        self.files = FileStore(ttl_s=config.file_ttl_s, max_files=config.max_files, max_bytes=config.max_file_bytes)
        self.switching = False
        self.clip_skip = 1
        self.vae = ""
        self.gate = asyncio.Event()
        self.gate.set()
        self.switch_lock = asyncio.Lock()

    def served(self) -> Served:
        return self.box["served"]

    # ------------------------------------------------------------------ generation
    async def wait_for_model(self) -> Served:
        """The model served now, once any model switch under way is done (503 after the request timeout)."""
        if not self.gate.is_set():
            try:
                await asyncio.wait_for(self.gate.wait(), self.config.request_timeout_s)
            except TimeoutError:
                raise APIError(503, "the server is switching models", None, "switching", "server_error") from None
        return self.served()

    async def run(
        self, request: Request, gen: GenerationRequest, task_id: str | None = None
    ) -> tuple[Outcome, list[bytes]]:
        """Queue `gen`'s images and wait for them -> (the outcome, its PNGs). The work is cancelled when the client
        disconnects (`ClientGone`), at the request timeout (504) or at shutdown."""
        batcher, timeout_s = self.batcher, self.config.request_timeout_s
        job = batcher.submit(gen.images(), task_id)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            done, _ = await asyncio.wait({job.future, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # uvicorn gave up on this request (shutdown): stop its work
            batcher.cancel(job, "shutdown")
            raise
        finally:
            gone.cancel()
        if job.future not in done:
            if gone in done:
                batcher.cancel(job, "disconnect")
                raise ClientGone
            batcher.cancel(job, "timeout")
            self.metrics.rejected.labels("timeout").inc()
            raise APIError(
                504,
                f"no result within the request timeout of {timeout_s:g} s; its work was cancelled",
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
        return outcome, await self.finish(outcome)

    async def finish(self, outcome: Outcome) -> list[bytes]:
        """Count `outcome`'s images and encode them as PNGs carrying their parameters (in a thread)."""
        self.metrics.images.inc(len(outcome.images))
        return await asyncio.to_thread(encode_pngs, outcome.arrays, outcome.images)

    def readiness(self) -> tuple[bool, str]:
        """(serving?, why not): draining, switching models, not loaded, still compiling, or stuck."""
        batcher = self.batcher
        if batcher.draining or batcher.stopping:
            return False, "draining"
        if self.switching:
            return False, "switching model"
        if self.served().pipeline is None:
            return False, "model not loaded"
        if not batcher.ready:
            return False, "warming"
        stuck = batcher.stuck_for()
        if stuck > self.config.stuck_after_s:
            return False, f"stuck: the running batch has shown no progress for {stuck:.0f} s"
        return True, "ok"

    # ------------------------------------------------------------------ A1111 options and model switching
    def settings(self) -> dict[str, Any]:
        """AUTOMATIC1111's options as this server has them (GET /sdapi/v1/options)."""
        return {
            "sd_model_checkpoint": self.served().checkpoint,
            "samples_format": "png",
            "CLIP_stop_at_last_layers": self.clip_skip,
            "eta_noise_seed_delta": 0,
            "sd_vae": self.vae or self.config.vae_name or "Automatic",
        }

    def same_checkpoint(self, value: Any) -> bool:
        """Whether an sd_model_checkpoint value names the served model (any of its names in the directory)."""
        now, md = self.served(), self.md
        if isinstance(value, str) and value.strip().lower() in (now.checkpoint.lower(), now.model_name.lower()):
            return True
        if md is None or not isinstance(value, str):
            return False
        try:
            return md.resolve("checkpoint", value).name == md.resolve("checkpoint", now.checkpoint).name
        except (ValueError, LookupError):
            return False

    def model_settings(
        self, overrides: dict[str, Any], now: Served, field: str
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model settings of `overrides` checked and taken out -> (GenerationRequest changes, the rest)."""
        config = self.config
        rest = dict(overrides)
        changes: dict[str, Any] = {"clip_skip": self.clip_skip, "vae": self.vae or config.vae_name}
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
                changes["vae"] = self.networks.vae(now.pipeline, value, f"{prefix}sd_vae")
        if "sd_model_checkpoint" in rest and self.same_checkpoint(rest["sd_model_checkpoint"]):
            rest.pop("sd_model_checkpoint")
        return changes, rest

    async def switch_model(self, request: Request, value: Any) -> None:
        """Serve the models directory's checkpoint `value`: new requests wait, the running ones finish, the model
        loads on the batcher's worker (quantized as the start-up model was: `models_api.load_like`) and compiles
        start-up's shapes; a load failure is a 500 and keeps the old."""
        md, config = self.md, self.config
        if md is None or not isinstance(value, str):
            raise FieldError("sd_model_checkpoint", f"{value!r} is not a model name")
        try:
            entry = md.resolve("checkpoint", value)
        except (ValueError, LookupError) as e:
            raise FieldError("sd_model_checkpoint", str(e.args[0] if e.args else e)) from None
        name = entry.name if entry.is_folder else entry.short_name

        def load() -> tuple[Any, Any, str]:
            pipe = models_api.load_like(self.loader, str(entry.path), self.quantization, self.denoiser_component, name)
            title = entry.name if entry.is_folder else f"{entry.name} [{md.hashes.sha256(entry.path)[:10]}]"
            return pipe, models_api.load_embeddings(pipe, md, allow_pickle=config.allow_pickle_embeddings), title

        async with self.switch_lock:
            if self.same_checkpoint(entry.name):
                return
            self.gate.clear()
            self.switching = True
            try:
                await self.batcher.idle()
                log.info("switching model to %s", name)
                try:
                    pipe, embeddings, title = await self.batcher.run_on_worker(load)
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
                await self._serve(served_for(pipe, name, config, checkpoint=title, embeddings=embeddings))
            finally:
                self.switching = False
                self.gate.set()

    async def _serve(self, new: Served) -> None:
        pipe = new.pipeline
        if getattr(getattr(pipe, "generator", None), "cache", None) is not None:
            self.metrics.watch_cache(pipe.generator.cache)
        self.batcher.set_pipeline(pipe)
        self.networks.clear()
        self.vae = ""  # a VAE is checked against the model it was chosen for
        self.box["served"] = new
        if self.config.warm:
            await self.batcher.warm(new.warm_shapes)


async def _disconnected(receive) -> None:
    """Returns when the client disconnects (the body was read already: what is left to receive is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def encode_pngs(arrays: np.ndarray, images: list[ImageParameters]) -> list[bytes]:
    """PNGs of `arrays`, each carrying its image's parameters (A1111's infotext)."""
    return [png_bytes(a, im.infotext()) for a, im in zip(arrays, images)]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def version() -> str:
    try:
        import sdjax

        return getattr(sdjax, "__version__", "0")
    except ImportError:
        return "0"
