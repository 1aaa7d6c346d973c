"""One router per API over one `ServerState` (`server.state`): OpenAI's images API (`openai`), AUTOMATIC1111's
web UI API (`a1111`), sd-webui-controlnet's (`controlnet`), and health, metrics and the web page (`health`).
ComfyUI's (`server.comfy`) and the A1111 information endpoints (`server.a1111_info`) are routers of their own."""
