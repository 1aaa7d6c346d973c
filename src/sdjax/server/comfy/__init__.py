"""ComfyUI's HTTP + websocket API served by sdjax (docs/comfyui.md): `defs` describes the nodes, `graph` checks a
workflow, `nodes` (with `inputs`, `loaders`, `custom` and `values`) plans it into sdjax generations, `runner` runs
the plan on the server's batcher and tells the websocket clients (with latent previews: `preview`), `router` serves
the endpoints, `store` keeps files and history."""

from sdjax.server.comfy.router import PATHS, UPLOAD_PATHS, router

__all__ = ["PATHS", "UPLOAD_PATHS", "router"]
