"""`sdjax serve`: the OpenAI and AUTOMATIC1111 image APIs, /metrics and a web page (FastAPI + uvicorn, the `serve`
extra), over one pipeline loaded at start-up. The options are checked, the models directory resolved and the model
loaded before `server.serve` takes over with a `server.ServerConfig` made of them."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Annotated, NamedTuple

import typer
from rich.console import Console
from rich.markup import escape

from sdjax import infotext
from sdjax.cli.common import (
    CalibrationOpt,
    DType,
    DTypeOpt,
    QuantComputeOpt,
    Quantize,
    QuantizeOpt,
    _apply_quant_compute,
    _check_devices_env,
    _load_with_vae,
    _mega,
    _parse_list,
    _parse_size,
    _quant_options,
    _quantize_kw,
    _require_extra,
    load_pipeline,
)

ModelOpt = Annotated[
    str | None,
    typer.Option("--model", "-m", help="A diffusers folder or Hugging Face Hub id. Default: the embedded tiny model."),
]
HostOpt = Annotated[
    str, typer.Option(help="Address to listen on: 127.0.0.1 (this machine only) unless you name another.")
]
PortOpt = Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on.")]
MaxBatchOpt = Annotated[int, typer.Option(min=1, help="Most images in one compiled batch.")]
BatchSizesOpt = Annotated[
    str | None,
    typer.Option(
        help="Compiled batch sizes, comma-separated (a batch is padded to the next). Default: powers of two up "
        "to --max-batch. One size (e.g. 8) makes every image's bytes independent of the load."
    ),
]
BatchWindowMsOpt = Annotated[
    float, typer.Option(min=0.0, help="How long the oldest waiting request waits for others to share its batch.")
]
MaxQueueOpt = Annotated[int, typer.Option(min=1, help="Most images waiting; more get 429 Retry-After.")]
MaxQueueCostOpt = Annotated[
    float | None,
    typer.Option(
        min=0.0,
        help="Most work waiting, in millions of pixel-steps (width x height x steps x images); more get 429, "
        "a request larger than all of it 422. Default: no bound.",
    ),
]
MaxRequestCostOpt = Annotated[
    float | None,
    typer.Option(
        min=0.0,
        help="Most work one request may ask for, in millions of pixel-steps (512x512 x 50 steps x 4 images = "
        "52.4); more get 422. Default: no bound beyond --max-size, --max-steps and --max-images.",
    ),
]
RequestTimeoutOpt = Annotated[
    float,
    typer.Option(
        min=0.001,
        help="Seconds before a request is answered 504 and its work cancelled (compilation of a new shape counts).",
    ),
]
WarmSizeOpt = Annotated[
    list[str] | None,
    typer.Option(
        help="WIDTHxHEIGHT to compile at start-up, for each batch size (repeatable). Default: the model's size."
    ),
]
WarmStepsOpt = Annotated[
    list[int] | None,
    typer.Option(min=1, help="Steps to compile at start-up (repeatable). Default: --steps."),
]
WarmSamplerOpt = Annotated[
    list[str] | None,
    typer.Option(help="Samplers to compile at start-up (repeatable). Default: --sampler."),
]
StepsOpt = Annotated[
    int | None,
    typer.Option(min=1, help="Steps of requests that give none, compiled at start-up. Default: the pipeline's."),
]
SamplerOpt = Annotated[
    str | None,
    typer.Option(help="Sampler of requests that give none, compiled at start-up. Default: the model's scheduler."),
]
NoWarmOpt = Annotated[bool, typer.Option("--no-warm", help="Compile nothing at start-up.")]
PinOpt = Annotated[
    bool,
    typer.Option(
        "--pin",
        help="Serve only what start-up compiled: the --warm-size sizes x --warm-steps x --warm-sampler samplers "
        "(422 otherwise), so that no request stalls the server compiling.",
    ),
]
OnlyWarmSizesOpt = Annotated[
    bool,
    typer.Option(
        "--only-warm-sizes",
        help="Refuse (422) sizes other than the --warm-size ones (sizes only; --pin also pins steps and samplers).",
    ),
]
MaxSizeOpt = Annotated[int, typer.Option(min=8, help="Largest width or height a request may ask for.")]
MaxStepsOpt = Annotated[int, typer.Option(min=1, help="Most steps a request may ask for.")]
MaxImagesOpt = Annotated[int, typer.Option(min=1, help="Most images one request may ask for.")]
MaxBodyKbOpt = Annotated[int, typer.Option(min=1, help="Largest request body in KiB (413 above).")]
MaxProgramsOpt = Annotated[
    int, typer.Option(min=1, help="Compiled programs kept (least recently used out, their memory freed).")
]
MaxProgramMbOpt = Annotated[
    int | None, typer.Option(min=1, help="Bound on the programs' generated code in MiB (GPU/TPU report it).")
]
MaxImageBodyMbOpt = Annotated[
    int, typer.Option(min=1, help="Largest body in MiB of the endpoints that carry images (img2img, edits).")
]
BodyTimeoutOpt = Annotated[
    float, typer.Option(min=0.001, help="Seconds for a whole request body to arrive (then 400 or 408).")
]
HeaderTimeoutOpt = Annotated[
    float, typer.Option(min=0.001, help="Seconds for a connection's request head to arrive (then it is closed).")
]
ShutdownTimeoutOpt = Annotated[
    float,
    typer.Option(min=0.0, help="On SIGTERM, seconds to let running requests finish before cancelling them."),
]
StuckAfterOpt = Annotated[
    float,
    typer.Option(min=0.001, help="GET /health/ready answers 503 when the running batch shows no progress this long."),
]
MaxConnectionsOpt = Annotated[int, typer.Option(min=1, help="Most concurrent connections and requests; more get 503.")]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        envvar="SDJAX_API_KEY",
        help="Require this key as Authorization: Bearer <key> (OpenAI clients' api_key). Or set SDJAX_API_KEY.",
    ),
]
ApiAuthOpt = Annotated[
    str | None,
    typer.Option(
        envvar="SDJAX_API_AUTH",
        help="Require HTTP basic auth (AUTOMATIC1111's --api-auth): user:password, comma-separated for several. "
        "Or set SDJAX_API_AUTH.",
    ),
]
CorsOriginsOpt = Annotated[
    str | None,
    typer.Option(help="Origins allowed to call the API from a browser, comma-separated. Default: none."),
]
ModelsDirOpt = Annotated[
    str | None,
    typer.Option(
        help="AUTOMATIC1111 models folder (Stable-diffusion/, Lora/, embeddings/, VAE/, ControlNet/), or a folder "
        "of diffusers model folders: --model names, POST /sdapi/v1/options (sd_model_checkpoint) switches, "
        "GET /sdapi/v1/sd-models, loras, embeddings (loaded at start-up) and sd-vae list them."
    ),
]
AllowPickleOpt = Annotated[
    bool,
    typer.Option(
        help="Load the pickled (.pt/.bin) embeddings of --models-dir too, with sdjax's restricted unpickler "
        "(runs no code). Default: they are listed as skipped."
    ),
]
VaeOpt = Annotated[
    str | None,
    typer.Option(help="Serve with this VAE: file, diffusers folder, Hub id or name in --models-dir's VAE/."),
]
ControlnetDirOpt = Annotated[
    str | None,
    typer.Option(
        help="A folder of diffusers ControlNet folders that A1111 requests name in alwayson_scripts.controlnet "
        "(listed by GET /controlnet/model_list)."
    ),
]
FileTtlOpt = Annotated[
    float, typer.Option(min=1.0, help='Seconds an image of response_format="url" stays downloadable.')
]
NoDocsOpt = Annotated[
    bool, typer.Option("--no-docs", help="No /docs page (it is served from the local swagger-ui-bundle).")
]
NoProgressOpt = Annotated[
    bool,
    typer.Option(
        "--no-progress",
        help="No per-step progress from the pipeline (a host callback per step; "
        "/sdapi/v1/progress then shows only queued/running).",
    ),
]
LogLevelOpt = Annotated[str, typer.Option(help="debug, info, warning or error.")]


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """The options of one `sdjax serve` call, as typer parsed them."""

    model: str | None
    host: str
    port: int
    dtype: DType
    quantize: Quantize | None
    quant_compute: Quantize | None
    calibration: Path | None
    max_batch: int
    batch_sizes: str | None
    batch_window_ms: float
    max_queue: int
    max_queue_cost: float | None
    max_request_cost: float | None
    request_timeout: float
    warm_size: list[str] | None
    warm_steps: list[int] | None
    warm_sampler: list[str] | None
    steps: int | None
    sampler: str | None
    no_warm: bool
    pin: bool
    only_warm_sizes: bool
    max_size: int
    max_steps: int
    max_images: int
    max_body_kb: int
    max_programs: int
    max_program_mb: int | None
    max_image_body_mb: int
    body_timeout: float
    header_timeout: float
    shutdown_timeout: float
    stuck_after: float
    max_connections: int
    api_key: str | None
    api_auth: str | None
    cors_origins: str | None
    models_dir: str | None
    allow_pickle: bool
    vae: str | None
    controlnet_dir: str | None
    file_ttl: float
    no_docs: bool
    no_progress: bool
    log_level: str


def serve(
    model: ModelOpt = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    dtype: DTypeOpt = DType.float32,
    quantize: QuantizeOpt = None,
    quant_compute: QuantComputeOpt = None,
    calibration: CalibrationOpt = None,
    max_batch: MaxBatchOpt = 8,
    batch_sizes: BatchSizesOpt = None,
    batch_window_ms: BatchWindowMsOpt = 10.0,
    max_queue: MaxQueueOpt = 64,
    max_queue_cost: MaxQueueCostOpt = None,
    max_request_cost: MaxRequestCostOpt = None,
    request_timeout: RequestTimeoutOpt = 300.0,
    warm_size: WarmSizeOpt = None,
    warm_steps: WarmStepsOpt = None,
    warm_sampler: WarmSamplerOpt = None,
    steps: StepsOpt = None,
    sampler: SamplerOpt = None,
    no_warm: NoWarmOpt = False,
    pin: PinOpt = False,
    only_warm_sizes: OnlyWarmSizesOpt = False,
    max_size: MaxSizeOpt = 1024,
    max_steps: MaxStepsOpt = 150,
    max_images: MaxImagesOpt = 8,
    max_body_kb: MaxBodyKbOpt = 64,
    max_programs: MaxProgramsOpt = 16,
    max_program_mb: MaxProgramMbOpt = None,
    max_image_body_mb: MaxImageBodyMbOpt = 48,
    body_timeout: BodyTimeoutOpt = 10.0,
    header_timeout: HeaderTimeoutOpt = 10.0,
    shutdown_timeout: ShutdownTimeoutOpt = 30.0,
    stuck_after: StuckAfterOpt = 600.0,
    max_connections: MaxConnectionsOpt = 1024,
    api_key: ApiKeyOpt = None,
    api_auth: ApiAuthOpt = None,
    cors_origins: CorsOriginsOpt = None,
    models_dir: ModelsDirOpt = None,
    allow_pickle: AllowPickleOpt = False,
    vae: VaeOpt = None,
    controlnet_dir: ControlnetDirOpt = None,
    file_ttl: FileTtlOpt = 3600.0,
    no_docs: NoDocsOpt = False,
    no_progress: NoProgressOpt = False,
    log_level: LogLevelOpt = "info",
) -> None:
    """Serve the OpenAI and AUTOMATIC1111 image APIs, /metrics and a web page at / (FastAPI + uvicorn)."""
    _serve(ServeOptions(**locals()))


class _Models(NamedTuple):
    """The served model and VAE as the models directory resolves them."""

    model: str | None
    model_label: str | None
    vae_target: str | None
    vae_label: str
    checkpoint: str  # the served model's A1111 title when it comes from the models directory
    controlnet_dir: str | None


def _serve(o: ServeOptions) -> None:
    """Check the options, resolve the models directory, load the model, then serve until stopped."""
    _require_extra("serve", "fastapi", "uvicorn", "prometheus_client")
    from sdjax import server

    sizes, batch, users = _parse_options(o, server)
    _check_devices_env()
    calibration = _quant_options(o.quantize, o.quant_compute, o.calibration)
    models = _resolve_models(o)
    _log_to_stderr(o.log_level)
    err = Console(stderr=True)
    t0 = time.perf_counter()
    pipe = _load(o, models, err, calibration)
    for name, option in [(o.sampler, "--sampler"), *((s, "--warm-sampler") for s in o.warm_sampler or ())]:
        if name is not None:
            try:
                pipe.validate(sampler=name)
            except (ValueError, KeyError) as e:
                raise typer.BadParameter(str(e.args[0] if e.args else e), param_hint=option) from None
    warming = (
        ""
        if o.no_warm
        else (f"; compiling {len(sizes) or 1} size(s) first (GET /health/ready answers 503 until then, requests wait)")
    )
    err.print(
        f"Loaded in {time.perf_counter() - t0:.1f} s. Serving at http://{o.host}:{o.port}/{warming}", highlight=False
    )
    config = _server_config(o, server, models, pipe, sizes, batch, users)
    loader = _switch_loader(o, models.vae_target) if o.models_dir else None
    server.serve(pipe, config, host=o.host, port=o.port, log_level=o.log_level, loader=loader)


def _switch_loader(o: ServeOptions, vae_target: str | None):
    """The loader of a model switched in from --models-dir: at --dtype, with --vae, and with the `quantize=` policy
    the server derives from the start-up model's (`server.models_api.load_like`), so that it is quantized while
    it loads, as the start-up model was by `_load`."""

    def loader(path: str, quantize=None):
        q = {} if quantize is None else {"quantize": quantize}
        return (
            load_pipeline(path, o.dtype, **q) if vae_target is None else _load_with_vae(path, o.dtype, vae_target, **q)
        )

    return loader


def _parse_options(o: ServeOptions, server):
    """--warm-size, --batch-sizes and --api-auth parsed, and the folders checked (usage errors, exit 2)."""
    sizes = tuple(_parse_size(s, "--warm-size") for s in (o.warm_size or ()))
    try:
        batch = tuple(int(x) for x in o.batch_sizes.split(",")) if o.batch_sizes else ()
    except ValueError:
        raise typer.BadParameter(
            f"{o.batch_sizes!r} is not a comma-separated list of ints", param_hint="--batch-sizes"
        ) from None
    if any(b < 1 or b > o.max_batch for b in batch):
        raise typer.BadParameter(f"sizes must lie in 1..--max-batch ({o.max_batch})", param_hint="--batch-sizes")
    try:
        users = tuple(server.Auth.parse_user(u) for u in _parse_list(o.api_auth))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--api-auth") from None
    if o.models_dir is not None and not Path(o.models_dir).is_dir():
        raise typer.BadParameter(f"{o.models_dir} is not a folder", param_hint="--models-dir")
    if o.controlnet_dir is not None and not Path(o.controlnet_dir).is_dir():
        raise typer.BadParameter(f"{o.controlnet_dir} is not a folder", param_hint="--controlnet-dir")
    return sizes, batch, users


def _resolve_models(o: ServeOptions) -> _Models:
    """--model and --vae as paths (names looked up in --models-dir), and its ControlNet/ folder."""
    from sdjax.cli import models as cli_models

    md = cli_models.open_models_dir(Path(o.models_dir) if o.models_dir else None)
    model, model_label, _ = cli_models.resolve_model(md, o.model)
    vae_target, vae_label = cli_models.resolve_vae(md, o.vae)
    checkpoint = ""  # the served model's A1111 title when it comes from the models directory
    entry = next((e for e in md.list("checkpoint") if str(e.path) == model), None) if md is not None else None
    if entry is not None:
        checkpoint = entry.name if entry.is_folder else f"{entry.name} [{md.hashes.sha256(entry.path)[:10]}]"
    controlnet_dir = o.controlnet_dir
    if controlnet_dir is None and md is not None and md.folder("controlnet") is not None:
        controlnet_dir = str(md.folder("controlnet"))
    return _Models(model, model_label, vae_target, vae_label, checkpoint, controlnet_dir)


def _log_to_stderr(log_level: str) -> None:
    """sdjax's log records to stderr, with their time, at --log-level."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("sdjax")
    logger.addHandler(handler)
    logger.setLevel(log_level.upper())


def _load(o: ServeOptions, models: _Models, err: Console, calibration=None):
    """The served pipeline (--quantize, --quant-compute with `calibration`); one that does not load is a message
    (exit 1), not a traceback."""
    model, vae_target = models.model, models.vae_target
    with err.status(f"Loading {model or 'the embedded model'}"):
        try:
            q = _quantize_kw(o.quantize)
            pipe = (
                load_pipeline(model, o.dtype, **q)
                if vae_target is None
                else _load_with_vae(model, o.dtype, vae_target, **q)
            )
            return _apply_quant_compute(pipe, o.quant_compute, calibration)
        except Exception as e:
            err.print(
                f"[red]error:[/red] could not load {model or 'the embedded model'}: {escape(str(e))}",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1) from None


def _server_config(o: ServeOptions, server, models: _Models, pipe, sizes, batch, users):
    """The `server.ServerConfig` of the options."""
    allowed = None
    if o.only_warm_sizes:
        h, w = pipe.default_size
        allowed = sizes or ((w, h),)
    return server.ServerConfig(
        model_name=models.model_label or infotext.model_label(models.model),
        checkpoint=models.checkpoint,
        vae_name=models.vae_label,
        max_batch=o.max_batch,
        batch_sizes=batch,
        batch_window_s=o.batch_window_ms / 1000,
        max_queue_images=o.max_queue,
        max_queue_cost=_mega(o.max_queue_cost),
        request_timeout_s=o.request_timeout,
        max_body_bytes=o.max_body_kb * 1024,
        max_image_body_bytes=o.max_image_body_mb * 1024 * 1024,
        max_programs=o.max_programs,
        max_program_bytes=None if o.max_program_mb is None else o.max_program_mb * 1024 * 1024,
        body_timeout_s=o.body_timeout,
        header_timeout_s=o.header_timeout,
        shutdown_timeout_s=o.shutdown_timeout,
        stuck_after_s=o.stuck_after,
        max_connections=o.max_connections,
        warm_sizes=sizes,
        warm_steps=tuple(o.warm_steps or ()),
        warm_samplers=tuple(o.warm_sampler or ()),
        warm=not o.no_warm,
        pin=o.pin,
        progress=not o.no_progress,
        default_steps=o.steps,
        default_sampler=o.sampler,
        limits=server.Limits(
            max_images=o.max_images,
            max_steps=o.max_steps,
            max_size=o.max_size,
            sizes=allowed,
            max_cost=_mega(o.max_request_cost),
        ),
        api_key=o.api_key or None,
        api_auth=users,
        cors_origins=_parse_list(o.cors_origins),
        models_dir=o.models_dir,
        allow_pickle_embeddings=o.allow_pickle,
        controlnet_dir=models.controlnet_dir,
        file_ttl_s=o.file_ttl,
        docs=not o.no_docs,
    )
