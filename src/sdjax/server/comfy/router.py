"""ComfyUI's HTTP and websocket API on sdjax (`router(...)`, mounted by `server.app` at ComfyUI's root paths and
again under `/api`, as ComfyUI's own server does).

`POST /prompt` checks the workflow (`comfy.graph`), plans it (`comfy.nodes`) and queues its generations on the
server's batcher at once, so a prompt meets the same admission as every other request (429 with Retry-After when the
queue is full, the per-request limits of the server); it answers `{"prompt_id", "number", "node_errors": {}}` and
runs in the background. Its progress goes to the websocket clients (`GET /ws?clientId=`) in ComfyUI's messages:
`status` (on connect and when the queue changes), `execution_start`, `execution_cached`, `executing` (each node,
then `node: null` when done), `progress` `{value, max}` of the sampler, `executed` with the output images,
`execution_success`, `execution_error`, `execution_interrupted`; and, to the prompt's client while it samples, binary
latent preview frames (a big-endian event type 1 and image format 1, then a JPEG: `comfy.preview`) when its
`extra_data.preview_method` asks for them ("auto", "latent2rgb", "taesd"; ComfyUI's default is none, and clients such
as comfy-api-simplified take every binary frame for an output image), at most one per 0.2 s. A prompt has the
server's request timeout; prompts run concurrently, batched with the other APIs' requests (ComfyUI runs one at a
time; `front` is ignored).

Also: `GET /queue`, `POST /queue` (`delete`, `clear`), `POST /interrupt`, `GET|POST /history[/{id}]`,
`GET /view`, `POST /upload/image`, `POST /upload/mask`, `GET /object_info[/{node}]`, `GET /system_stats`,
`GET /embeddings`, `GET /models[/{folder}]`, `GET /prompt`, `POST /free`. Errors answer in ComfyUI's shape, never 500
for a bad request. Credentials: the HTTP routes are behind the server's guard; the websocket checks the same
`Authorization` header itself (the guard passes websockets through).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import platform
import sys
import uuid
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse, Response
from PIL import Image

from sdjax.server.batching import QueueFull, ShuttingDown
from sdjax.server.comfy import defs, loaders, nodes
from sdjax.server.comfy.graph import PromptError, error_item, parse
from sdjax.server.comfy.preview import wanted
from sdjax.server.comfy.runner import Hub, Run, Runner
from sdjax.server.comfy.store import TYPES, Files, History, clean_name
from sdjax.server.errors import APIError
from sdjax.server.guard import Auth

PATHS = (
    "/prompt",
    "/queue",
    "/interrupt",
    "/history",
    "/view",
    "/upload/image",
    "/upload/mask",
    "/object_info",
    "/system_stats",
    "/embeddings",
    "/models",
    "/free",
    "/ws",
)
UPLOAD_PATHS = ("/upload/image", "/upload/mask", "/api/upload/image", "/api/upload/mask")


# What the published schema says of names (a safe subset of what `store.clean_name` accepts).
_NAME = r"^[A-Za-z0-9_][A-Za-z0-9_. ()-]{0,100}$"
_SUBFOLDER = r"^([A-Za-z0-9_-]+(/[A-Za-z0-9_-]+)*)?$"
_UPLOAD_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["image"],
                    "properties": {
                        "image": {"type": "string", "format": "binary"},
                        "subfolder": {"type": "string", "pattern": _SUBFOLDER},
                        "type": {"type": "string", "enum": list(TYPES)},
                        "overwrite": {"type": "string", "enum": ["true", "false"]},
                    },
                }
            }
        },
    }
}


def _bad(message: str, status: int = 400, kind: str = "invalid_prompt", headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": error_item(kind, message), "node_errors": {}}, status_code=status, headers=headers)


def router(
    *,
    config: Any,
    batcher: Any,
    served: Callable[[], Any],
    wait_for_model: Callable[[], Awaitable[Any]],
    networks: Any = None,
    md: Any = None,
) -> APIRouter:
    """The ComfyUI routes over the server's batcher; `served()` is the model served now (`app.Served`)."""
    api = APIRouter(tags=["ComfyUI"])
    s = _shared(config=config, batcher=batcher, served=served, wait_for_model=wait_for_model, networks=networks, md=md)
    for add in (_prompt_routes, _queue_routes, _file_routes, _introspection_routes):
        add(api, s)
    api.state = {"runner": s.runner, "files": s.files}  # for tests
    return api


def _shared(*, config, batcher, served, wait_for_model, networks, md) -> SimpleNamespace:
    """What the ComfyUI routes share: the files, history, websocket hub and runner over the server's batcher, the
    prompt counter, the auth check, and the served model's names and combo values."""

    from sdjax.server.controlnet import list_controlnets

    files = Files(max_files=config.max_files, max_bytes=config.max_file_bytes)
    history = History()
    hub = Hub()
    runner = Runner(config=config, batcher=batcher, files=files, history=history, hub=hub)
    runs = runner.runs  # queued or running, in arrival order
    numbers = itertools.count()
    auth = Auth(api_key=config.api_key, users=tuple(config.api_auth))
    queue_remaining, status = runner.queue_remaining, runner.status

    def model_names(now: Any) -> tuple[str, ...]:
        names = [now.checkpoint.split(" [")[0], now.model_name]
        if md is not None:
            try:
                entry = md.resolve("checkpoint", now.checkpoint.split(" [")[0])
                names += [entry.name, entry.short_name, entry.stem]
            except (ValueError, LookupError):
                pass
        return tuple(dict.fromkeys(n for n in names if n))

    def choices() -> dict[str, list[str]]:
        now = served()
        out = {
            "checkpoint": [model_names(now)[0]],
            "sampler": list(defs.SAMPLERS),
            "scheduler": list(defs.SCHEDULERS),
            "image": files.names("input"),
            "controlnet": sorted(list_controlnets(config.controlnet_dir)),
            "unet": list(model_names(now)),
            "weight_dtype": loaders.weight_dtypes(now.pipeline),
            "clip": loaders.clip_names(now.pipeline),
            **{f"clip_type:{n}": loaders.clip_types(now.pipeline, n) for n in ("CLIPLoader", "DualCLIPLoader")},
            "lora": [],
            "vae": [],
        }
        if md is not None:
            for kind in ("lora", "vae"):
                try:
                    out[kind] = [e.name for e in md.list(kind)] if md.folder(kind) is not None else []
                except Exception:  # an unreadable folder lists nothing
                    out[kind] = []
        out["vae"] += [n for n in loaders.served_vae_names(now.pipeline) if n not in out["vae"]]
        return out

    return SimpleNamespace(
        config=config,
        batcher=batcher,
        served=served,
        wait_for_model=wait_for_model,
        networks=networks,
        md=md,
        files=files,
        history=history,
        hub=hub,
        runner=runner,
        runs=runs,
        numbers=numbers,
        auth=auth,
        queue_remaining=queue_remaining,
        status=status,
        model_names=model_names,
        choices=choices,
    )


def _prompt_routes(api: APIRouter, s: SimpleNamespace) -> None:
    """The ComfyUI routes: prompts."""
    from sdjax.server.controlnet import list_controlnets

    (
        config,
        batcher,
        wait_for_model,
        networks,
        files,
        history,
        runner,
        runs,
        numbers,
        queue_remaining,
        status,
        model_names,
    ) = (
        s.config,
        s.batcher,
        s.wait_for_model,
        s.networks,
        s.files,
        s.history,
        s.runner,
        s.runs,
        s.numbers,
        s.queue_remaining,
        s.status,
        s.model_names,
    )

    # A workflow's validity is a graph check (comfy.graph), which OpenAPI cannot state: /prompt and /upload/mask
    # (which needs an uploaded original) are left out of the published schema, so schema fuzzers do not report them
    # as refusing what the schema allows; test_comfy_api fuzzes /prompt with mutated workflows instead.
    @api.post("/prompt", summary="Queue a workflow (ComfyUI API format)", include_in_schema=False)
    async def post_prompt(request: Request):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            return _bad(f"the body is not JSON: {type(e).__name__}: {e}")
        now = await wait_for_model()
        try:
            graph = parse(body)
            ctx = nodes.Context(
                pipeline=now.pipeline,
                limits=now.limits,
                model_names=model_names(now),
                model_name=now.model_name,
                read_input=files.read_input,
                networks=networks,
                controlnets=list_controlnets(config.controlnet_dir),
                default_vae=config.vae_name,
            )
            plan = await asyncio.to_thread(nodes.plan, graph, ctx)
        except PromptError as e:
            return JSONResponse(e.body(), status_code=400)
        prompt_id = str(body.get("prompt_id") or uuid.uuid4())
        if clean_name(prompt_id) is None or prompt_id in runs or history.get(prompt_id) is not None:
            return _bad(f"prompt_id {prompt_id!r} is in use or not a plain id")
        jobs = []
        try:
            for k, stage in enumerate(plan.stages):
                jobs.append(batcher.submit(stage.request.images(), f"comfy-{prompt_id}-{k}"))
        except (QueueFull, ShuttingDown, APIError) as e:
            for job in jobs:
                batcher.cancel(job, "interrupt")
            if isinstance(e, QueueFull):
                return _bad(str(e), 429, "queue_full", {"Retry-After": str(e.retry_after)})
            if isinstance(e, ShuttingDown):
                return _bad(str(e), 503, "shutting_down", {"Retry-After": "5"})
            return _bad(e.message, 400, e.code)
        run = Run(
            prompt_id, next(numbers), graph, plan, jobs, preview=now.pipeline if wanted(graph.extra_data) else None
        )
        runs[prompt_id] = run
        run.task = asyncio.create_task(runner.execute(run))
        await status()
        return {"prompt_id": prompt_id, "number": run.number, "node_errors": {}}

    @api.get("/prompt", summary="Queue size (ComfyUI API)")
    async def get_prompt():
        return {"exec_info": {"queue_remaining": queue_remaining()}}


def _queue_routes(api: APIRouter, s: SimpleNamespace) -> None:
    """The ComfyUI routes: queue, interrupt, history."""
    batcher, history, runs = s.batcher, s.history, s.runs

    @api.get("/queue", summary="Running and pending prompts (ComfyUI API)")
    async def get_queue():
        return {
            "queue_running": [r.entry() for r in runs.values() if r.started],
            "queue_pending": [r.entry() for r in runs.values() if not r.started],
        }

    @api.post("/queue", summary="Delete pending prompts or clear the queue (ComfyUI API)")
    async def post_queue(request: Request):
        body = await _json(request)
        if not isinstance(body, dict):
            return _bad("expected {'delete': [prompt ids]} or {'clear': true}")
        targets = [r for r in runs.values() if not r.started] if body.get("clear") else []
        ids = body.get("delete") or []
        if not isinstance(ids, list):
            return _bad("'delete' must be a list of prompt ids")
        targets += [runs[i] for i in ids if isinstance(i, str) and i in runs and not runs[i].started]
        for run in targets:
            for job in run.jobs:
                batcher.cancel(job, "interrupt")
            if run.task is not None:
                run.task.cancel()
        return {}

    @api.post("/interrupt", summary="Stop the running prompt (ComfyUI API)")
    async def interrupt(request: Request):
        body = await _json(request)
        wanted = body.get("prompt_id") if isinstance(body, dict) else None
        targets = [r for r in runs.values() if r.started and (wanted is None or r.prompt_id == wanted)]
        for run in targets:
            run.interrupted = True
            for job in run.jobs:
                if not job.future.done():
                    batcher.interrupt(job.task_id)
        return {}

    @api.get("/history", summary="Finished prompts (ComfyUI API)")
    async def get_history(max_items: int | None = None):
        return history.last(max_items)

    @api.get("/history/{prompt_id}", summary="One finished prompt (ComfyUI API)")
    async def get_history_item(prompt_id: str):
        entry = history.get(prompt_id)
        return {prompt_id: entry} if entry is not None else {}

    @api.post("/history", summary="Clear or delete history entries (ComfyUI API)")
    async def post_history(request: Request):
        body = await _json(request)
        if not isinstance(body, dict):
            return _bad("expected {'delete': [prompt ids]} or {'clear': true}")
        if body.get("clear"):
            history.clear()
        for prompt_id in body.get("delete") or []:
            if isinstance(prompt_id, str):
                history.delete(prompt_id)
        return {}


def _file_routes(api: APIRouter, s: SimpleNamespace) -> None:
    """The ComfyUI routes: files."""
    served, files = s.served, s.files

    @api.get("/view", summary="An output, temp or uploaded image (ComfyUI API)")
    async def view(
        filename: Annotated[str, Query(json_schema_extra={"pattern": _NAME})] = "",
        subfolder: Annotated[str, Query(json_schema_extra={"pattern": _SUBFOLDER})] = "",
        type: Annotated[str, Query(json_schema_extra={"enum": list(TYPES)})] = "output",
    ):
        if not filename:  # as ComfyUI: nothing asked, nothing found
            return _bad("no filename given", 404, "not_found")
        name, sub = clean_name(filename), clean_name(subfolder, subfolder=True)
        if name is None or sub is None or type not in TYPES:
            return _bad("filename, subfolder or type is not a plain name inside the store", kind="invalid_name")
        data = files.get(type, sub, name)
        if data is None:
            return _bad(f"no {type} file {filename!r}", 404, "not_found")
        media = "image/png" if data[:8] == b"\x89PNG\r\n\x1a\n" else "application/octet-stream"
        return Response(data, media_type=media, headers={"Content-Disposition": f'filename="{name}"'})

    async def upload(request: Request, mask: bool) -> JSONResponse | dict:
        try:
            form = await request.form(max_files=2, max_fields=8)
        except Exception as e:  # not multipart, or malformed
            return _bad(f"expected a multipart form with an 'image' file: {e}", kind="invalid_upload")
        image = form.get("image")
        if image is None or not hasattr(image, "read"):
            return _bad("the form has no 'image' file", kind="invalid_upload")
        kind = str(form.get("type") or "input")
        name, sub = clean_name(image.filename or ""), clean_name(str(form.get("subfolder") or ""), subfolder=True)
        if name is None or sub is None or kind not in TYPES:
            return _bad(
                f"{image.filename!r} / {form.get('subfolder')!r}: not a plain file name and subfolder "
                "(no '..', separators or control characters)",
                kind="invalid_name",
            )
        data = await image.read()
        try:
            data = await asyncio.to_thread(_checked_image, data, served().limits, mask and _original(form))
        except ValueError as e:
            return _bad(str(e), kind="invalid_image")
        overwrite = str(form.get("overwrite") or "").lower() in ("true", "1")
        if not overwrite and files.exists(kind, sub, name):
            stem, dot, ext = name.rpartition(".")
            stem, ext = (stem, f".{ext}") if dot else (name, "")
            name = next(
                f"{stem} ({i}){ext}" for i in itertools.count(1) if not files.exists(kind, sub, f"{stem} ({i}){ext}")
            )
        files.put(kind, sub, name, data)
        return {"name": name, "subfolder": sub, "type": kind}

    def _original(form) -> bytes | None:
        try:
            ref = json.loads(str(form.get("original_ref") or "{}"))
            return files.get(
                str(ref.get("type") or "input"),
                clean_name(str(ref.get("subfolder") or ""), subfolder=True) or "",
                clean_name(str(ref.get("filename") or "")) or "",
            )
        except (ValueError, AttributeError):
            return None

    @api.post("/upload/image", summary="Upload an image for LoadImage (ComfyUI API)", openapi_extra=_UPLOAD_SCHEMA)
    async def upload_image(request: Request):
        return await upload(request, mask=False)

    @api.post(
        "/upload/mask", summary="Upload a mask: its alpha onto original_ref (ComfyUI API)", include_in_schema=False
    )
    async def upload_mask(request: Request):
        return await upload(request, mask=True)


def _introspection_routes(api: APIRouter, s: SimpleNamespace) -> None:
    """The ComfyUI routes: introspection."""
    served, hub, auth, queue_remaining, choices = (
        s.served,
        s.hub,
        s.auth,
        s.queue_remaining,
        s.choices,
    )

    @api.get("/object_info", summary="The nodes sdjax runs, with their inputs (ComfyUI API)")
    async def object_info():
        now = choices()
        return {name: defs.object_info(d, now) for name, d in defs.NODES.items()}

    @api.get("/object_info/{node_class}", summary="One node's definition (ComfyUI API)")
    async def object_info_one(node_class: str):
        d = defs.NODES.get(node_class)
        return {node_class: defs.object_info(d, choices())} if d is not None else {}

    @api.get("/embeddings", summary="Embedding names (ComfyUI API)")
    async def embeddings():
        return sorted((served().embeddings or {}).get("loaded", {}))

    folders = {"checkpoints": "checkpoint", "diffusion_models": "unet", "text_encoders": "clip", "loras": "lora",
               "vae": "vae", "controlnet": "controlnet"}  # fmt: skip

    @api.get("/models", summary="Model folders (ComfyUI API)")
    async def model_types():
        return [*folders, "embeddings"]

    @api.get("/models/{folder}", summary="Models of a folder (ComfyUI API)")
    async def models_of(folder: str):
        now = choices()
        key = folders.get(folder)
        if folder == "embeddings":
            return await embeddings()
        return now[key] if key else _bad(f"no model folder {folder!r}", 404, "not_found")

    @api.get("/system_stats", summary="System and device (ComfyUI API)")
    async def system_stats():
        return await asyncio.to_thread(_system_stats)

    @api.post("/free", summary="Accepted; sdjax keeps its one model loaded (ComfyUI API)")
    async def free():
        return {}

    @api.websocket("/ws")
    async def ws(websocket: WebSocket, clientId: str | None = None):
        if auth.enabled and not auth.allows(websocket.headers.get("authorization")):
            await websocket.close(code=1008, reason="missing or incorrect credentials")
            return
        await websocket.accept()
        sid = clientId if clientId and clean_name(clientId) else uuid.uuid4().hex
        hub.clients.setdefault(sid, set()).add(websocket)
        try:
            data = {"status": {"exec_info": {"queue_remaining": queue_remaining()}}, "sid": sid}
            await websocket.send_text(json.dumps({"type": "status", "data": data}))
            while True:  # clients send feature flags; nothing is read from them
                await websocket.receive_text()
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            group = hub.clients.get(sid, set())
            group.discard(websocket)
            if not group:
                hub.clients.pop(sid, None)


async def _json(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def _checked_image(data: bytes, limits: Any, original: bytes | None | bool) -> bytes:
    """The upload if it is an image within the pixel limit; for a mask, the original image with the mask's alpha."""
    try:
        im = Image.open(io.BytesIO(data))
        if im.width * im.height > limits.max_image_pixels:
            raise ValueError(f"{im.width}x{im.height} pixels exceed {limits.max_image_pixels}")
        im.load()
    except Exception as e:  # any decoding failure
        raise ValueError(f"the upload is not a readable image: {e}") from None
    if original is False:
        return data
    if not original:
        raise ValueError("original_ref: no such uploaded image to put the mask on")
    base = Image.open(io.BytesIO(original)).convert("RGBA")
    alpha = (im.convert("RGBA") if "A" in im.getbands() else im.convert("L").convert("RGBA")).getchannel("A")
    base.putalpha(alpha.resize(base.size))
    buf = io.BytesIO()
    base.save(buf, format="PNG")
    return buf.getvalue()


def _system_stats() -> dict:
    import jax

    devices = []
    for i, d in enumerate(jax.devices()):
        stats = {}
        try:
            stats = d.memory_stats() or {}
        except Exception:  # CPU devices report none
            stats = {}
        total = int(stats.get("bytes_limit", 0))
        free = max(0, total - int(stats.get("bytes_in_use", 0)))
        devices.append(
            {
                "name": str(d.device_kind),
                "type": d.platform,
                "index": i,
                "vram_total": total,
                "vram_free": free,
                "torch_vram_total": 0,
                "torch_vram_free": 0,
            }
        )
    import sdjax

    return {
        "system": {
            "os": platform.system().lower(),
            "python_version": sys.version,
            "embedded_python": False,
            "comfyui_version": f"sdjax {getattr(sdjax, '__version__', '0')}",
            "pytorch_version": "",
            "argv": [],
            "ram_total": 0,
            "ram_free": 0,
        },
        "devices": devices,
    }
