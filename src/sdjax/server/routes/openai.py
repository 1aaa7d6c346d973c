"""The OpenAI images API: `POST /v1/images/generations` (`response_format` `b64_json` or `url`; `stream`:
server-sent events, `server.openai_stream`), `/v1/images/edits`, `/v1/images/variations`, `GET /v1/files/{id}`
(the images behind those urls, for `file_ttl_s`) and `GET /v1/models`."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from sdjax.metadata import SEED_MAX, GenerationRequest
from sdjax.server import openai_stream
from sdjax.server.errors import APIError
from sdjax.server.guard import request_id_of
from sdjax.server.schemas import (
    VARIATION_STRENGTH,
    OpenAIEditForm,
    OpenAIImageRequest,
    OpenAIImageResponse,
    resolve_openai,
    resolve_openai_edit,
)
from sdjax.server.state import Served, ServerState, b64


def router(state: ServerState) -> APIRouter:
    """The OpenAI routes over `state`."""
    api = APIRouter()
    config, files = state.config, state.files

    async def openai_images(request: Request, gen: GenerationRequest, response_format: str) -> dict:
        _, pngs = await state.run(request, gen)
        if response_format == "url":
            base = str(request.base_url).rstrip("/")
            data = [{"url": f"{base}/v1/files/{files.put(p)}"} for p in pngs]
        else:
            data = [{"b64_json": b64(p)} for p in pngs]
        return {"created": int(time.time()), "data": data}

    @api.post("/v1/images/generations", response_model=OpenAIImageResponse, response_model_exclude_none=True,
              summary="Create images (OpenAI images API); with stream, server-sent events",
              responses={200: {"content": {"text/event-stream": {}}}})  # fmt: skip
    async def openai_generations(request: Request, body: OpenAIImageRequest) -> Any:
        now = await state.wait_for_model()
        gen = resolve_openai(body, now.pipeline, now.limits, now.defaults, now.model_name)
        if body.stream:
            return stream_images(state, request, gen, now, body.partial_images or 0)
        return await openai_images(request, gen, body.response_format)

    @api.get("/v1/files/{file_id}", summary="An image from response_format=url (expires)", response_class=Response)
    async def get_file(file_id: str):
        data = files.get(file_id.removesuffix(".png"))
        if data is None:
            message = f"file_id: no such file {file_id!r} (files expire after {config.file_ttl_s:g} s)"
            raise APIError(404, message, "file_id", code="not_found")
        return Response(data, media_type="image/png", headers={"Cache-Control": "private, max-age=60"})

    @api.post("/v1/images/edits", response_model=OpenAIImageResponse, response_model_exclude_none=True,
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
        now = await state.wait_for_model()
        form = edit_form(
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

    @api.post("/v1/images/variations", response_model=OpenAIImageResponse, response_model_exclude_none=True,
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
        now = await state.wait_for_model()
        form = edit_form(prompt="", n=n, size=size, response_format=response_format, seed=seed, strength=strength)
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

    @api.get("/v1/models", summary="The served model (OpenAI models API)")
    async def models():
        return {"object": "list", "data": [{"id": state.served().model_name, "object": "model", "owned_by": "sdjax"}]}

    return api


def stream_images(
    state: ServerState, request: Request, gen: GenerationRequest, now: Served, partial_images: int
) -> Response:
    """OpenAI's server-sent image events (`server.openai_stream`); queue limits answer before the first event."""
    batcher = state.batcher
    job = batcher.submit(gen.images())
    events = openai_stream.events(
        batcher=batcher, job=job, pipeline=now.pipeline, partial_images=partial_images, width=gen.width,
        height=gen.height, timeout_s=state.config.request_timeout_s, finish=state.finish,
        request_id=request_id_of(request.scope),
    )  # fmt: skip
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def edit_form(**fields: Any) -> OpenAIEditForm:
    """The form fields of /v1/images/edits and /variations, checked as a JSON body is: an invalid one ("size=null")
    is a 422 naming it, not an error inside the endpoint."""
    try:
        return OpenAIEditForm(**fields)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None
