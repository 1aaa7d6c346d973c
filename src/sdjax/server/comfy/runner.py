"""Running planned ComfyUI prompts on the server's batcher and telling the websocket clients (`comfy.router` serves
the routes): a `Run` is one queued prompt, `Hub` the clients by client id, `Runner` follows each run's batcher jobs
and sends ComfyUI's messages (see the router's docstring) and, where the prompt asks, its latent previews as binary
frames (`comfy.preview`), saves the outputs and writes the history."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import time
from typing import Any

import numpy as np
from fastapi import WebSocket
from PIL import Image, PngImagePlugin

from sdjax.server.comfy import preview
from sdjax.server.comfy.store import Files, History
from sdjax.server.comfy.values import Output, Plan

log = logging.getLogger("sdjax.server")


@dataclasses.dataclass(eq=False)
class Run:
    prompt_id: str
    number: int
    graph: Any
    plan: Plan
    jobs: list[Any]
    started: bool = False
    interrupted: bool = False
    task: asyncio.Task | None = None
    preview: Any = None  # the pipeline whose latents the previews map to RGB; None: no previews (`comfy.preview`)

    def entry(self) -> list:
        return [self.number, self.prompt_id, self.graph.raw, self.graph.extra_data, self.graph.outputs]


class Hub:
    """The websocket clients by client id; a send that does not finish within 5 s drops that client."""

    def __init__(self):
        self.clients: dict[str, set[WebSocket]] = {}

    async def send(self, kind: str, data: dict, client_id: str | None = None) -> None:
        targets = list(self.clients.get(client_id, ())) if client_id else [w for s in self.clients.values() for w in s]
        for ws in targets:
            try:
                await asyncio.wait_for(ws.send_text(json.dumps({"type": kind, "data": data})), 5.0)
            except Exception:  # a slow or gone client: stop sending to it
                self._drop(ws)

    async def send_bytes(self, data: bytes, client_id: str | None) -> None:
        """A binary frame to the clients of `client_id` only (a prompt without one sends none)."""
        for ws in list(self.clients.get(client_id, ())) if client_id else []:
            try:
                await asyncio.wait_for(ws.send_bytes(data), 5.0)
            except Exception:
                self._drop(ws)

    def _drop(self, ws: WebSocket) -> None:
        for group in self.clients.values():
            group.discard(ws)


class Runner:
    """The runs queued or running (`runs`, in arrival order) and their execution."""

    def __init__(self, *, config: Any, batcher: Any, files: Files, history: History, hub: Hub):
        self.config, self.batcher, self.files, self.history, self.hub = config, batcher, files, history, hub
        self.runs: dict[str, Run] = {}

    def queue_remaining(self) -> int:
        return len(self.runs)

    async def status(self, client_id: str | None = None) -> None:
        data = {"status": {"exec_info": {"queue_remaining": self.queue_remaining()}}}
        await self.hub.send("status", data, client_id)

    async def execute(self, run: Run) -> None:
        cid, pid = run.graph.client_id, run.prompt_id
        outcomes: list[Any] = []
        node = ""
        try:
            samplers = {s.node_id for s in run.plan.stages}
            outputs = {o.node_id for o in run.plan.outputs}
            deadline = time.monotonic() + self.config.request_timeout_s
            for k, (stage, job) in enumerate(zip(run.plan.stages, run.jobs, strict=True)):
                await self._wait_running(run, job, deadline)
                if k == 0:
                    for nid in run.plan.order:
                        if nid not in samplers and nid not in outputs:
                            node = nid
                            await self.hub.send("executing", {"node": nid, "display_node": nid, "prompt_id": pid}, cid)
                node = stage.node_id
                await self.hub.send("executing", {"node": node, "display_node": node, "prompt_id": pid}, cid)
                outcome = await self._follow(run, job, node, deadline)
                if outcome.stopped == "interrupt" or run.interrupted:
                    raise _Interrupted
                outcomes.append(outcome)
            if not run.started:  # nothing to sample (a loaded image saved): the other nodes still "execute"
                await self._start(run)
                for nid in run.plan.order:
                    if nid not in outputs:
                        await self.hub.send("executing", {"node": nid, "display_node": nid, "prompt_id": pid}, cid)
            saved: dict[str, Any] = {}
            for out in run.plan.outputs:
                node = out.node_id
                await self.hub.send("executing", {"node": node, "display_node": node, "prompt_id": pid}, cid)
                images = self._store(run, out, await asyncio.to_thread(self._encode, run, out, outcomes))
                saved[node] = {"images": images}
                await self.hub.send(
                    "executed",
                    {"node": node, "display_node": node, "output": {"images": images}, "prompt_id": pid},
                    cid,
                )
            self._finish(run, "success", saved, [])
            # the images generated (once per sampling stage an output shows, however many outputs show it), in the
            # counter the other APIs' requests add to (`sdjax_images_generated_total`)
            shown = {out.pixels.stage for out in run.plan.outputs if out.pixels.arrays is None}
            self.batcher.metrics.images.inc(sum(len(outcomes[k].images) for k in shown))
            await self.hub.send("execution_success", {"prompt_id": pid, "timestamp": _ms()}, cid)
            await self.hub.send("executing", {"node": None, "display_node": None, "prompt_id": pid}, cid)
        except _Interrupted:
            data = {
                "prompt_id": pid,
                "node_id": node,
                "node_type": _class(run, node),
                "executed": [],
                "timestamp": _ms(),
            }
            self._finish(run, "error", {}, [["execution_interrupted", data]])
            await self.hub.send("execution_interrupted", data, cid)
        except asyncio.CancelledError:  # deleted from the queue, or the server stops
            self._finish(run, "error", {}, [["execution_interrupted", {"prompt_id": pid}]])
            raise
        except Exception as e:  # the pipeline failed, the prompt timed out, or the server is shutting down
            log.error("ComfyUI prompt %s failed: %s: %s", pid, type(e).__name__, e)
            data = {
                "prompt_id": pid,
                "node_id": node,
                "node_type": _class(run, node),
                "executed": [],
                "exception_message": str(e) or type(e).__name__,
                "exception_type": type(e).__name__,
                "traceback": [],
                "current_inputs": {},
                "current_outputs": {},
                "timestamp": _ms(),
            }
            self._finish(run, "error", {}, [["execution_error", data]])
            await self.hub.send("execution_error", data, cid)
        finally:
            for job in run.jobs:
                if not job.future.done():
                    self.batcher.cancel(job, "interrupt")
            self.runs.pop(pid, None)
            with _suppress():
                await self.status()

    async def _start(self, run: Run) -> None:
        run.started = True
        cid, pid = run.graph.client_id, run.prompt_id
        await self.hub.send("execution_start", {"prompt_id": pid, "timestamp": _ms()}, cid)
        await self.hub.send("execution_cached", {"nodes": [], "prompt_id": pid, "timestamp": _ms()}, cid)

    async def _wait_running(self, run: Run, job: Any, deadline: float) -> None:
        while not run.started:
            current = self.batcher.current
            if job.future.done() or (current is not None and job.task_id in current.task_ids):
                await self._start(run)
                return
            await _wait(job.future, 0.05, deadline, self.batcher, job)

    async def _follow(self, run: Run, job: Any, node: str, deadline: float) -> Any:
        last, shown = None, 0.0
        while not job.future.done():
            await _wait(job.future, 0.1, deadline, self.batcher, job)
            current = self.batcher.current
            if current is not None and job.task_id in current.task_ids and current.stage == "denoise":
                value = (current.step, current.total)
                if value != last and current.total:
                    last = value
                    await self.hub.send(
                        "progress",
                        {"value": current.step, "max": current.total, "prompt_id": run.prompt_id, "node": node},
                        run.graph.client_id,
                    )
                    if run.preview is not None and time.monotonic() - shown >= preview.MIN_INTERVAL_S:
                        shown = time.monotonic() if await self._preview(run, job, current) else shown
        outcome = job.future.result()
        total = last[1] if last else job.images[0].steps
        if outcome.stopped is None and last != (total, total):  # a fast run between polls still reports its end
            data = {"value": total, "max": total, "prompt_id": run.prompt_id, "node": node}
            await self.hub.send("progress", data, run.graph.client_id)
        return outcome

    async def _preview(self, run: Run, job: Any, current: Any) -> bool:
        """The latent preview of the job's first image in the running batch, as a binary frame to the prompt's
        client; False when the batch reports no latents (or they cannot be previewed: the prompt runs on)."""
        latents, owners = current.latents, current.owners
        if latents is None or job.task_id not in owners or run.graph.client_id is None:
            return False
        index = owners.index(job.task_id)
        if index >= len(latents):
            return False
        try:
            data = await asyncio.to_thread(preview.frame, np.asarray(latents[index], np.float32), run.preview)
        except Exception as e:  # a preview is never worth failing the prompt for
            log.warning("ComfyUI preview of prompt %s failed: %s: %s", run.prompt_id, type(e).__name__, e)
            run.preview = None
            return False
        await self.hub.send_bytes(data, run.graph.client_id)
        return True

    def _encode(self, run: Run, out: Output, outcomes: list[Any]) -> list[bytes]:
        """The PNGs of an output (on a worker thread: the image operations and the encoding)."""
        pixels = out.pixels
        if pixels.arrays is not None:
            arrays, infos = pixels.arrays, [None] * len(pixels.arrays)
        else:
            outcome = outcomes[pixels.stage]
            arrays, infos = outcome.arrays, [im.infotext() for im in outcome.images]
            for op in pixels.ops:
                arrays = op(arrays)
        prompt_text = json.dumps(run.graph.raw)
        return [_png(array, info, prompt_text) for array, info in zip(arrays, infos, strict=True)]

    def _store(self, run: Run, out: Output, pngs: list[bytes]) -> list[dict]:
        """Keep an output's PNGs under ComfyUI's names (on the event loop, which owns the store)."""
        images = []
        for png in pngs:
            prefix = out.prefix if out.kind == "output" else f"ComfyUI_temp_{run.number}"
            sub, name = self.files.next_name(out.kind, prefix)
            self.files.put(out.kind, sub, name, png)
            images.append({"filename": name, "subfolder": sub, "type": out.kind})
        return images

    def _finish(self, run: Run, status_str: str, outputs: dict, messages: list) -> None:
        self.history.put(
            run.prompt_id,
            {
                "prompt": run.entry(),
                "outputs": outputs,
                "status": {"status_str": status_str, "completed": status_str == "success", "messages": messages},
                "meta": {
                    nid: {"node_id": nid, "display_node": nid, "parent_node": None, "real_node_id": nid}
                    for nid in outputs
                },
            },
        )


class _Interrupted(Exception):
    pass


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], Exception)


async def _wait(future: asyncio.Future, step_s: float, deadline: float, batcher: Any, job: Any) -> None:
    await asyncio.wait({future}, timeout=step_s)
    if not future.done() and time.monotonic() > deadline:
        batcher.cancel(job, "timeout")
        raise TimeoutError("no result within the server's request timeout; the prompt's work was cancelled")


def _class(run: Run, node: str) -> str | None:
    n = run.graph.nodes.get(node)
    return n.class_type if n is not None else None


def _ms() -> int:
    return int(time.time() * 1000)


def _png(array: np.ndarray, infotext: str | None, prompt: str) -> bytes:
    """PNG bytes with sdjax's infotext (`parameters`) and, as ComfyUI's SaveImage writes, the `prompt`."""
    info = PngImagePlugin.PngInfo()
    if infotext:
        info.add_text("parameters", infotext)
    info.add_text("prompt", prompt)
    buf = io.BytesIO()
    Image.fromarray(np.asarray(array, np.uint8)).save(buf, format="PNG", pnginfo=info)
    return buf.getvalue()
