"""HTTP server over a pipeline: OpenAI and AUTOMATIC1111 APIs, dynamic batching, metrics and a web page.

Needs the `serve` extra (`pip install 'sdjax[serve]'`). `sdjax serve` on the command line runs `serve()`.
"""

from sdjax.server.app import ServerConfig, build_asgi, create_app, make_server, serve, uvicorn_config
from sdjax.server.guard import Auth
from sdjax.server.schemas import Limits

__all__ = ["Auth", "Limits", "ServerConfig", "build_asgi", "create_app", "make_server", "serve", "uvicorn_config"]
