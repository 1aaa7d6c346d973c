"""`train_textual_inversion`: a textual-inversion embedding (Gal et al. 2022) of an SD 1.x / 2.x / XL model, from a
data folder to an A1111 `.safetensors` file and diffusers' `learned_embeds.safetensors`.

- A new token (`token`, e.g. `<star>`) of `vectors` rows per text encoder is added the way
  `pipe.load_textual_inversion` adds a file (tokens `token, token_1, ...`, the prompt's `token` expanded to all of
  them), its rows initialised from the embedding of `init_word`'s tokens (cycled over the rows, as A1111; one token:
  every row is its embedding, as diffusers' `textual_inversion.py`). The initial embedding is the run directory's
  `init.safetensors`.
- Only those rows are trained: they are a float32 pytree `{component: (n, D)}` written over the last rows of the
  frozen token-embedding table inside the jitted loss, so the gradient is exactly the table gradient's new rows
  (diffusers trains the whole table and restores the old rows after every update: the same values). The UNet, the
  VAE and the text encoder(s) stay frozen; the noise, timesteps, objective and Min-SNR weighting are `step`'s.
- Prompts: a caption that names the token is used as it is; a caption without it gets the token in front
  (`"<star>, caption"`); an image without a caption gets one of diffusers' object templates (`"a photo of a
  <star>"`, ...), chosen from `(seed, step, index)` so a resumed run reads what the unbroken one read.
- Outputs: `out` in A1111 / kohya form (`emb_params` `(n, D)`; SDXL `clip_l`, `clip_g`) and, in the run directory,
  diffusers' `learned_embeds.safetensors` `{token: (n, D)}` (SDXL: `learned_embeds_2.safetensors` for the second
  encoder, as `textual_inversion_sdxl.py` writes). The run directory is `train_lora`'s (`config.json`,
  `loss.jsonl`, `loss.png`, orbax `checkpoints/`, resuming).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sdjax.finetune import data as data_lib
from sdjax.finetune import run as run_lib

# diffusers' examples/textual_inversion `imagenet_templates_small` (object templates)
OBJECT_TEMPLATES = (
    "a photo of a {}",
    "a rendering of a {}",
    "a cropped photo of the {}",
    "the photo of a {}",
    "a photo of a clean {}",
    "a photo of a dirty {}",
    "a dark photo of the {}",
    "a photo of my {}",
    "a photo of the cool {}",
    "a close-up photo of a {}",
    "a bright photo of the {}",
    "a cropped photo of a {}",
    "a photo of the {}",
    "a good photo of the {}",
    "a photo of one {}",
    "a close-up photo of the {}",
    "a rendition of the {}",
    "a photo of the clean {}",
    "a rendition of a {}",
    "a photo of a nice {}",
    "a good photo of a {}",
    "a photo of the nice {}",
    "a photo of the small {}",
    "a photo of the weird {}",
    "a photo of the large {}",
    "a photo of a cool {}",
    "a photo of a small {}",
)
# text-encoder component -> its tokenizer attribute on the pipeline, and its key in A1111's SDXL files
TOKENIZERS = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}
A1111_SDXL_KEYS = {"text_encoder": "clip_l", "text_encoder_2": "clip_g"}
DIFFUSERS_FILES = {"text_encoder": "learned_embeds.safetensors", "text_encoder_2": "learned_embeds_2.safetensors"}
_RESUME_KEYS = ("model", "token", "init_word", "vectors", "batch_size", "accumulation", "seed", "lr")


@dataclasses.dataclass(frozen=True)
class TextualInversionConfig:
    """Every setting of a textual-inversion run (written to the run directory's config.json)."""

    data: str
    out: str
    token: str
    init_word: str
    vectors: int = 1  # rows of the embedding (tokens token, token_1, ...)
    model: str | None = None  # diffusers folder, single file, Hub id; None: the embedded model
    steps: int = 300
    lr: float = 5e-3  # A1111's default; diffusers' example: 5e-4 x batch x accumulation
    lr_schedule: str = "constant"
    warmup: int = 0
    weight_decay: float = 1e-2
    max_grad_norm: float | None = None  # diffusers' textual_inversion.py does not clip
    batch_size: int = 1
    accumulation: int = 1
    resolution: int | None = None
    bucketing: bool = True
    bucket_step: int = 64
    random_crop: bool = False
    flip: bool = False
    shuffle_tags: bool = False
    keep_tokens: int = 0
    on_bad_image: str = "skip"
    prediction_type: str | None = None
    min_snr_gamma: float | None = None
    noise_offset: float = 0.0
    input_perturbation: float = 0.0
    mixed_precision: str = "no"
    gradient_checkpointing: bool = False
    clip_skip: int = 1
    seed: int = 0
    devices: int | None = None
    run_dir: str | None = None
    save_every: int = 0
    resume: bool = True

    def check(self) -> None:
        """Bad settings fail here, naming the setting, before anything is loaded or compiled."""
        if not isinstance(self.token, str) or not self.token.strip() or len(self.token.split()) != 1:
            raise ValueError(f"token={self.token!r} must be one word without spaces (e.g. '<star>')")
        if not isinstance(self.init_word, str) or not self.init_word.strip():
            raise ValueError(f"init_word={self.init_word!r} must be a word the tokenizer knows (e.g. 'star')")
        for name in ("vectors", "steps", "batch_size", "accumulation"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.lr <= 0 or not math.isfinite(self.lr):
            raise ValueError(f"lr={self.lr} must be a positive number")
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision={self.mixed_precision!r} must be 'no' or 'bf16'")
        if self.resolution is not None and (self.resolution < 8 or self.resolution % 8):
            raise ValueError(f"resolution={self.resolution} must be a positive multiple of 8")
        if not str(self.out).endswith(".safetensors"):
            raise ValueError(f"out={self.out}: the embedding is written as a .safetensors file")
        if self.save_every < 0 or self.warmup < 0:
            raise ValueError("save_every and warmup must be 0 or more")
        self.data_config(self.resolution or 512).check()
        if not Path(self.data).expanduser().is_dir():
            raise data_lib.DataError(f"data folder {self.data} does not exist or is not a folder")

    def data_config(self, resolution: int) -> data_lib.DataConfig:
        return data_lib.DataConfig(
            resolution=resolution,
            bucketing=self.bucketing,
            bucket_step=self.bucket_step,
            random_crop=self.random_crop,
            flip=self.flip,
            shuffle_tags=self.shuffle_tags,
            keep_tokens=self.keep_tokens,
            on_bad_image=self.on_bad_image,
        )

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path(str(self.out).removesuffix(".safetensors") + "-run")


# ------------------------------------------------------------------------------------------------ the token
def _table(text_params) -> Any:
    from sdjax.loading.textual_inversion import TOKEN_EMBEDDING

    node = text_params
    for k in TOKEN_EMBEDDING:
        node = node[k]
    return node


def init_vectors(tokenizer, table, init_word: str, vectors: int) -> np.ndarray:
    """`(vectors, D)` float32: the embeddings of `init_word`'s tokens, cycled over the rows."""
    ids = tokenizer.encode(init_word)
    if not ids:
        raise ValueError(f"init_word={init_word!r} has no tokens")
    table = np.asarray(table, np.float32)
    return np.stack([table[ids[i % len(ids)]] for i in range(vectors)])


def add_token(pipe, token: str, init_word: str, vectors: int, path: Path) -> tuple[dict[str, int], dict]:
    """Add `token` (its rows from `init_word`) to `pipe` through `load_textual_inversion`, writing the initial
    embedding to `path` (A1111 form); returns, per text-encoder component, the table size before the new rows
    and the initial rows (float32)."""
    components = [c for c in pipe.generator.models.conditioning.components if c in TOKENIZERS]
    rows, base = {}, {}
    for c in components:
        table = _table(pipe.params[c])
        rows[c] = init_vectors(getattr(pipe, TOKENIZERS[c]), table, init_word, vectors)
        base[c] = int(table.shape[0])
    write_a1111(path, rows, {"sdjax_token": token, "sdjax_init_word": init_word})
    pipe.load_textual_inversion(path, token=token)
    return base, rows


def with_rows(text_params: dict, rows) -> dict:
    """A text encoder's params with the last `len(rows)` rows of its token-embedding table replaced by `rows`."""
    import jax.numpy as jnp

    from sdjax.loading.textual_inversion import TOKEN_EMBEDDING

    table = _table(text_params)
    grown = jnp.concatenate([table[: table.shape[0] - rows.shape[0]], rows.astype(table.dtype)])
    return _replace(text_params, TOKEN_EMBEDDING, grown)


def _replace(tree, path: Sequence[str], value) -> dict:
    out = dict(tree)
    out[path[0]] = value if len(path) == 1 else _replace(tree[path[0]], path[1:], value)
    return out


def prompts(captions: Sequence[str], token: str, seed: int, step: int) -> list[str]:
    """The training prompts of a micro-batch's captions (see the module docstring)."""
    out = []
    for i, caption in enumerate(captions):
        if token in caption:
            out.append(caption)
        elif caption.strip():
            out.append(f"{token}, {caption}")
        else:
            rng = np.random.default_rng([seed, step, i, 7])
            out.append(OBJECT_TEMPLATES[int(rng.integers(len(OBJECT_TEMPLATES)))].format(token))
    return out


# ------------------------------------------------------------------------------------------------ the step
def embedding_loss(rows, frozen, models, objective, alphas_cumprod, batch: dict):
    """The diffusion loss with the token rows `rows` `{component: (n, D)}` in the frozen text encoders, on given
    `latents`, `noise`, `timesteps` (and `perturbation`), `ids`, `clip_skip`, `time_ids`."""
    from sdjax.finetune import step as step_lib

    conditioning = models.conditioning
    text = {c: with_rows(frozen[c], rows[c]) if c in rows else frozen[c] for c in conditioning.components}
    inputs = {k: batch[k] for k in ("ids", "clip_skip", "time_ids")}
    context, kwargs = conditioning.encode(text, inputs, cfg=False)
    unet_batch = {**batch, "context": context, "unet_kwargs": kwargs}
    return step_lib.unet_loss(None, frozen["unet"], models, objective, alphas_cumprod, unet_batch)


def make_train_step(models, objective, alphas_cumprod, optimizer) -> Callable:
    """`step(state, frozen, batch, key) -> (state, loss)` (jitted; `state = {"rows", "opt_state", "step"}`); the
    latents, noise and timesteps as `step.make_loss` draws them from `fold_in(key, state["step"])`."""
    import jax
    import jax.numpy as jnp
    import optax

    from sdjax.core import autoencoder
    from sdjax.finetune import step as step_lib

    ac = jnp.asarray(alphas_cumprod, jnp.float32)
    factor = 2 ** (len(models.vae.config.block_out_channels) - 1)

    def loss_fn(rows, frozen, batch, key):
        k_vae, k_draw, _ = jax.random.split(key, 3)
        b, _, h, w = batch["pixels"].shape
        eps = jax.random.normal(k_vae, (b, models.vae.config.latent_channels, h // factor, w // factor))
        latents = jax.lax.stop_gradient(
            autoencoder.encode(models.vae, frozen["vae"], batch["pixels"], eps, models.dtype)
        )
        draws = step_lib.draw(k_draw, latents.shape, objective)
        return embedding_loss(rows, frozen, models, objective, ac, {**batch, "latents": latents, **draws})

    def step(state, frozen, batch, key):
        k = jax.random.fold_in(key, state["step"])
        loss, grads = jax.value_and_grad(loss_fn)(state["rows"], frozen, batch, k)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["rows"])
        rows = optax.apply_updates(state["rows"], updates)
        return {"rows": rows, "opt_state": opt_state, "step": state["step"] + 1}, loss

    return jax.jit(step, donate_argnums=(0,))


# ------------------------------------------------------------------------------------------------ files
def write_a1111(path: str | Path, rows: dict, metadata: dict[str, str]) -> None:
    """A1111 / kohya: `emb_params` (one text encoder) or `clip_l` + `clip_g` (SDXL)."""
    from sdjax.finetune.lora import save_safetensors

    host = {c: np.ascontiguousarray(np.asarray(v, np.float32)) for c, v in rows.items()}
    tensors = (
        {A1111_SDXL_KEYS[c]: v for c, v in host.items()} if len(host) > 1 else {"emb_params": host[next(iter(host))]}
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(path, tensors, metadata)


def write_diffusers(run_dir: Path, token: str, rows: dict) -> list[Path]:
    """diffusers' `learned_embeds.safetensors` `{token: (n, D)}` (SDXL: and `learned_embeds_2.safetensors`)."""
    from sdjax.finetune.lora import save_safetensors

    paths = []
    for c, v in rows.items():
        path = run_dir / DIFFUSERS_FILES[c]
        save_safetensors(path, {token: np.ascontiguousarray(np.asarray(v, np.float32))}, {"format": "pt"})
        paths.append(path)
    return paths


def _check_resume(run_dir: Path, cfg: TextualInversionConfig) -> None:
    saved = run_dir / "config.json"
    if not saved.is_file():
        return
    old, new = json.loads(saved.read_text()), dataclasses.asdict(cfg)
    diff = [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in _RESUME_KEYS if old.get(k) != new[k]]
    if diff:
        raise ValueError(
            f"{run_dir}: its checkpoints come from a run with other settings ({'; '.join(diff)}); use another "
            "run_dir or resume=False"
        )


# ------------------------------------------------------------------------------------------------ the run
def train_textual_inversion(
    data: str | Path,
    out: str | Path,
    *,
    on_step: run_lib.OnStep | None = None,
    log: Callable[[str], None] = lambda s: None,
    stop_after: int | None = None,
    **options: Any,
) -> run_lib.TrainResult:
    """Train the embedding of a new token on the images of `data`; write it to `out` (A1111) and the run
    directory's `learned_embeds.safetensors` (diffusers). `options` are `TextualInversionConfig`'s fields (`token`
    and `init_word` required)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from sdjax.finetune import step as step_lib
    from sdjax.parallel.sharding import batch_sharding

    cfg = TextualInversionConfig(data=str(data), out=str(out), **options)
    cfg.check()
    run_dir = cfg.run_path
    if cfg.resume:
        _check_resume(run_dir, cfg)
    dataset = data_lib.scan(cfg.data, cfg.data_config(cfg.resolution or 512))
    pipe, _, dtype = run_lib._load(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    _, rows = add_token(pipe, cfg.token, cfg.init_word, cfg.vectors, run_dir / "init.safetensors")
    params = pipe.params
    conditioning = pipe.generator.models.conditioning
    resolution = cfg.resolution or pipe.default_size[0]
    dataset = data_lib.with_buckets(dataset, cfg.data_config(resolution))
    log(f"{len(dataset.items)} images ({dataset.examples_per_epoch} examples per epoch), buckets {dataset.buckets}")
    mesh = run_lib._mesh(cfg, log)
    prediction_type = cfg.prediction_type or pipe.scheduler.prediction_type
    objective = step_lib.Objective(
        prediction_type=prediction_type,
        num_train_timesteps=int(pipe.scheduler.num_train_timesteps),
        min_snr_gamma=cfg.min_snr_gamma,
        noise_offset=cfg.noise_offset,
        input_perturbation=cfg.input_perturbation,
    )
    models = step_lib.Models(conditioning, pipe.unet, pipe.vae, dtype, remat=cfg.gradient_checkpointing)
    frozen = {c: params[c] for c in ("unet", "vae", *conditioning.components)}
    schedule = step_lib.lr_schedule(cfg.lr, cfg.steps, cfg.warmup, cfg.lr_schedule)
    optimizer = step_lib.make_optimizer(
        schedule, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, accumulation=cfg.accumulation
    )
    rows = jax.tree_util.tree_map(jax.numpy.asarray, rows)
    state = {"rows": rows, "opt_state": optimizer.init(rows), "step": jax.numpy.zeros((), jax.numpy.int32)}
    manager = run_lib._checkpoints(run_dir)
    start = 0
    if cfg.resume:
        state, micro = run_lib._restore(manager, state)
        start = micro // cfg.accumulation
        if start:
            log(f"resuming {run_dir} at update {start}")
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    loss_log = run_dir / "loss.jsonl"
    run_lib._log_lines(loss_log, start)

    replicated = NamedSharding(mesh, PartitionSpec())
    state = jax.device_put(state, replicated)
    frozen = jax.device_put(frozen, replicated)
    train_step = make_train_step(models, objective, pipe.scheduler.alphas_cumprod, optimizer)
    sampler = data_lib.Sampler(dataset, cfg.data_config(resolution), cfg.batch_size, cfg.seed)
    key = jax.random.PRNGKey(cfg.seed)
    losses: list[float] = []
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    for update in range(start, end):
        t0 = time.perf_counter()
        micro_losses = []
        for micro in range(update * cfg.accumulation, (update + 1) * cfg.accumulation):
            loaded = sampler.load(micro)
            loaded["captions"] = prompts(loaded["captions"], cfg.token, cfg.seed, micro)
            host = run_lib._inputs(conditioning, loaded, cfg.clip_skip)
            state, loss = train_step(state, frozen, jax.device_put(host, batch_sharding(mesh)), key)
            micro_losses.append(loss)
        loss = float(np.mean([float(v) for v in micro_losses]))
        seconds = time.perf_counter() - t0
        losses.append(loss)
        row = {"step": update, "loss": loss, "lr": float(schedule(update)), "seconds": round(seconds, 4)}
        with loss_log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at update {update}; lower lr ({cfg.lr}) or check the data")
        done = update + 1
        if (cfg.save_every and done % cfg.save_every == 0) or done == end:
            manager.save(done * cfg.accumulation, args=run_lib._save_args(state), force=True)
        if on_step is not None:
            on_step(done, cfg.steps, loss, seconds)
    manager.wait_until_finished()
    manager.close()
    if end == cfg.steps:
        trained = {c: np.asarray(v, np.float32) for c, v in state["rows"].items()}
        meta = {
            "sdjax_token": cfg.token,
            "sdjax_init_word": cfg.init_word,
            "sdjax_steps": str(cfg.steps),
            "sdjax_model": str(cfg.model or "embedded"),
        }
        write_a1111(cfg.out, trained, meta)
        write_diffusers(run_dir, cfg.token, trained)
        if loss_log.is_file():
            run_lib.plot_losses(loss_log, run_dir / "loss.png")
    return run_lib.TrainResult(Path(cfg.out), run_dir, losses, start, end, dataset.skipped)
