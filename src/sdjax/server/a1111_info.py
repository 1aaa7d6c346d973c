"""AUTOMATIC1111's informational GET endpoints that clients call at start-up, in A1111's response shapes, listing
only what sdjax has:

- `GET /sdapi/v1/cmd-flags`: the A1111 command-line flags that have a meaning here (`api`, `nowebui`, `api_auth`
  redacted to "***" when set, `cors_allow_origins`, `no_half` / `no_half_vae` from the served dtype); directories
  are not disclosed (as in `server.models_api`).
- `GET /sdapi/v1/upscalers`: the pixel upscalers `hr_upscaler` takes (Lanczos, Nearest; no model files);
  `GET /sdapi/v1/latent-upscale-modes`: the latent ones (Latent, Latent (nearest), Latent (nearest-exact)).
- `GET /sdapi/v1/scripts`: `{"txt2img": [...], "img2img": [...]}`, A1111's lower-case script titles: "controlnet"
  (an always-on script of `alwayson_scripts`) when the server serves ControlNets, nothing else; selectable scripts
  (`script_name`) there are none, and a request naming one is refused (`schemas.resolve_a1111`).
- `GET /sdapi/v1/memory`: `ram` (A1111's definitions: `used` the process's resident memory, `total` the machine's,
  `free` their difference) and `cuda` (the first accelerator's memory as JAX reports it: `system` free/used/total
  against its limit, `allocated` current/peak; `{"error": "unavailable"}` where the platform reports none, e.g. CPU).
- `GET /sdapi/v1/prompt-styles`: `[]` (sdjax has no saved styles).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from sdjax.server.schemas import UPSCALERS


class UpscalerItem(BaseModel):
    name: str
    model_name: str | None = None
    model_path: str | None = None
    model_url: str | None = None
    scale: float | None = None


class LatentUpscalerModeItem(BaseModel):
    name: str


class ScriptsList(BaseModel):
    txt2img: list[str]
    img2img: list[str]


class PromptStyleItem(BaseModel):
    name: str
    prompt: str | None = None
    negative_prompt: str | None = None


class MemoryResponse(BaseModel):
    ram: dict[str, Any]
    cuda: dict[str, Any]


class FlagsModel(BaseModel):
    """The A1111 flags (`FlagsModel`) with a meaning in sdjax."""

    api: bool = True
    nowebui: bool = False
    api_auth: str | None = None
    cors_allow_origins: str | None = None
    no_half: bool = True
    no_half_vae: bool = True


def label(name: str) -> str:
    return name[:1].upper() + name[1:]  # "latent (nearest)" -> "Latent (nearest)"


def upscalers() -> list[dict[str, Any]]:
    return [UpscalerItem(name=label(n)).model_dump() for n in UPSCALERS if not n.startswith("latent")]


def latent_upscale_modes() -> list[dict[str, str]]:
    return [{"name": label(n)} for n in UPSCALERS if n.startswith("latent")]


def scripts(controlnet: bool) -> dict[str, list[str]]:
    names = ["controlnet"] if controlnet else []
    return {"txt2img": list(names), "img2img": list(names)}


def cmd_flags(config: Any, pipeline: Any) -> dict[str, Any]:
    import jax.numpy as jnp

    full = getattr(pipeline, "dtype", jnp.float32) == jnp.float32
    return FlagsModel(
        api_auth="***" if config.api_auth else None,
        cors_allow_origins=",".join(config.cors_origins) or None,
        no_half=full,
        no_half_vae=full,
    ).model_dump()


def ram() -> dict[str, Any]:
    """A1111's `ram`: `used` this process's resident memory, `total` the machine's, `free` = total - used."""
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, IndexError) as e:
        return {"error": f"unavailable ({type(e).__name__})"}
    return {"free": total - used, "used": used, "total": total}


def accelerator() -> dict[str, Any]:
    """A1111's `cuda` for the first local JAX device: what its `memory_stats()` reports."""
    import jax

    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_in_use" not in stats:
        return {"error": "unavailable"}
    used = int(stats["bytes_in_use"])
    out: dict[str, Any] = {"device": str(getattr(device, "device_kind", device.platform))}
    limit = stats.get("bytes_limit")
    if limit is not None:
        out["system"] = {"free": int(limit) - used, "used": used, "total": int(limit)}
    out["allocated"] = {"current": used, "peak": int(stats.get("peak_bytes_in_use", used))}
    return out


def router(config: Any, pipeline: Callable[[], Any]) -> APIRouter:
    """The endpoints above; `pipeline()` is the served pipeline now."""
    api = APIRouter()

    @api.get("/sdapi/v1/cmd-flags", response_model=FlagsModel, summary="Command-line flags (AUTOMATIC1111 API)")
    async def get_cmd_flags():
        return cmd_flags(config, pipeline())

    @api.get("/sdapi/v1/upscalers", response_model=list[UpscalerItem], summary="Upscalers (AUTOMATIC1111 API)")
    async def get_upscalers():
        return upscalers()

    @api.get("/sdapi/v1/latent-upscale-modes", response_model=list[LatentUpscalerModeItem],
             summary="Latent upscale modes of the hires fix (AUTOMATIC1111 API)")  # fmt: skip
    async def get_latent_upscale_modes():
        return latent_upscale_modes()

    @api.get("/sdapi/v1/scripts", response_model=ScriptsList, summary="Scripts (AUTOMATIC1111 API)")
    async def get_scripts():
        return scripts(bool(config.controlnet_dir))

    @api.get("/sdapi/v1/memory", response_model=MemoryResponse, summary="Memory use (AUTOMATIC1111 API)")
    async def get_memory():
        return {"ram": ram(), "cuda": accelerator()}

    @api.get("/sdapi/v1/prompt-styles", response_model=list[PromptStyleItem],
             summary="Saved prompt styles (AUTOMATIC1111 API): none")  # fmt: skip
    async def get_prompt_styles():
        return []

    return api


PATHS = (
    "/sdapi/v1/cmd-flags",
    "/sdapi/v1/upscalers",
    "/sdapi/v1/latent-upscale-modes",
    "/sdapi/v1/scripts",
    "/sdapi/v1/memory",
    "/sdapi/v1/prompt-styles",
)
