"""OpenAI's image streaming: `stream: true` on `POST /v1/images/generations` answers with server-sent events, as the
`openai` client's `images.generate(stream=True)` reads them.

Events (`event:` line and JSON `data:`, each with the request's `size`, `quality` "auto", `background` "opaque",
`output_format` "png" and `created_at`):
- `image_generation.partial_image` (`b64_json`, `partial_image_index` 0..partial_images-1): up to `partial_images`
  (0-3) images while the request's first running image is denoised, at evenly spaced fractions of its steps
  (1/(k+1), 2/(k+1), ...): the VAE decode of its latents at that step (`server.partial`; the pipeline must report
  latents, and a fast generation may finish before them all, as OpenAI's API allows);
- `image_generation.completed` (`b64_json`, the PNG with its infotext), one per image in order;
- on a failure after the events started (the generation failed, the request timed out), one `error` event whose
  data is `{"error": {message, type, param, code}}`, which the client raises as `openai.APIError`.

Validation, queue limits and budgets answer as without streaming (422, 429, ...), before the first event. Streamed
images are base64: `response_format: "url"` with `stream` is refused (422). A client that disconnects cancels its
work as without streaming.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from sdjax.server import partial
from sdjax.server.batching import Batcher, Job, ShuttingDown
from sdjax.server.errors import APIError, error_body

log = logging.getLogger("sdjax.server")

PATH = "/v1/images/generations"
POLL_S = 0.05  # how often the running batch's progress is looked at for the next partial image


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _fields(width: int, height: int) -> dict[str, Any]:
    return {
        "created_at": int(time.time()),
        "size": f"{width}x{height}",
        "quality": "auto",
        "background": "opaque",
        "output_format": "png",
    }


def _png(array: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(array, np.uint8)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


async def events(
    *,
    batcher: Batcher,
    job: Job,
    pipeline: Any,
    partial_images: int,
    width: int,
    height: int,
    timeout_s: float,
    finish: Callable[[Any], Any],
    request_id: str,
) -> AsyncIterator[bytes]:
    """The events of `job` (submitted already). `finish(outcome)` -> the completed images' PNG bytes."""
    fields = _fields(width, height)
    deadline = time.monotonic() + timeout_s
    sent = 0
    try:
        while not job.future.done():
            if time.monotonic() > deadline:
                batcher.cancel(job, "timeout")
                error = APIError(504, f"no result within the request timeout of {timeout_s:g} s; its work was "
                                 "cancelled", None, "timeout", "server_error")  # fmt: skip
                yield sse("error", error_body(PATH, error))
                return
            await asyncio.wait({job.future}, timeout=POLL_S)
            if sent < partial_images and not job.future.done():
                latents = _due(batcher, job, (sent + 1) / (partial_images + 1))
                if latents is not None:
                    try:
                        image = await asyncio.to_thread(partial.decode_latents, pipeline, latents[None])
                    except Exception:  # no partial image; the completed ones still come
                        log.exception("decoding a partial image failed (request id %s)", request_id)
                        partial_images = sent
                        continue
                    event = "image_generation.partial_image"
                    yield sse(event, {"type": event, "b64_json": _png(image[0]), "partial_image_index": sent, **fields})
                    sent += 1
        if job.future.cancelled():  # cancelled by the server (its work was dropped): nothing to send
            return
        try:
            outcome = job.future.result()
        except ShuttingDown as e:
            yield sse("error", error_body(PATH, APIError(503, str(e), None, "shutting_down", "server_error")))
            return
        except Exception as e:
            log.error("generation failed (request id %s): %s: %s", request_id, type(e).__name__, e)
            error = APIError(500, f"generation failed; it was logged under request id {request_id} (X-Request-ID)",
                             None, "generation_failed", "server_error")  # fmt: skip
            yield sse("error", error_body(PATH, error))
            return
        event = "image_generation.completed"
        for png in await finish(outcome):
            b64 = base64.b64encode(png).decode("ascii")
            yield sse(event, {"type": event, "b64_json": b64, **fields})
    finally:
        if not job.future.done():  # the client went away (or the server stops): nobody waits for the images
            batcher.cancel(job, "disconnect")


def _due(batcher: Batcher, job: Job, fraction: float) -> np.ndarray | None:
    """The latents `(C, h, w)` of `job`'s first image in the running batch once its denoising has reached
    `fraction` of its steps; else None."""
    status = batcher.current
    if status is None or job.task_id not in status.owners or status.latents is None:
        return None
    if status.stage != "denoise" or not status.total or status.step / status.total < fraction:
        return None
    latents = np.asarray(status.latents)
    index = status.owners.index(job.task_id)
    return latents[index] if index < len(latents) else None
