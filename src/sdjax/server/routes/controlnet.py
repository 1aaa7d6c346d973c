"""The sd-webui-controlnet extension's API (`server.controlnet`): `GET /controlnet/model_list` (the
`--controlnet-dir` folders), `/controlnet/module_list`, `/controlnet/version`, and `POST /controlnet/detect`."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from sdjax.server import controlnet as controlnet_api
from sdjax.server.state import ServerState


def router(state: ServerState) -> APIRouter:
    """The ControlNet routes over `state`."""
    api = APIRouter()
    config = state.config

    @api.get("/controlnet/model_list", summary="ControlNets (sd-webui-controlnet API): the --controlnet-dir folders")
    async def controlnet_models():
        return {"model_list": list(controlnet_api.list_controlnets(config.controlnet_dir))}

    @api.get("/controlnet/module_list", summary="Control-map preprocessors (sd-webui-controlnet API)")
    async def controlnet_modules():
        return {"module_list": controlnet_api.module_list()}

    @api.get("/controlnet/version", summary="The sd-webui-controlnet API version these endpoints follow")
    async def controlnet_version():
        return {"version": controlnet_api.API_VERSION}

    @api.post("/controlnet/detect", summary="Run a control-map preprocessor on images (sd-webui-controlnet API)")
    async def controlnet_detect(body: controlnet_api.DetectRequest):
        return await asyncio.to_thread(controlnet_api.detect, body, state.served().limits)

    return api
