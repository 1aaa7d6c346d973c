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
- Several hosts (`finetune.distributed`): micro-batches are built by rows (`run.RowBatches`), so each process opens
  only the images of its own devices' rows (a row's template is still chosen by its row in the whole batch).
- FSDP (`fsdp=True`, `finetune.sharding`): supported as for a LoRA, and for the same reason: what is big is frozen
  (the UNet and the text encoders, token table included, split over the devices), while the trained rows and their
  optimiser state are a few vectors and stay whole on every device.
- Outputs: `out` in A1111 / kohya form (`emb_params` `(n, D)`; SDXL `clip_l`, `clip_g`) and, in the run directory,
  diffusers' `learned_embeds.safetensors` `{token: (n, D)}` (SDXL: `learned_embeds_2.safetensors` for the second
  encoder, as `textual_inversion_sdxl.py` writes). The run directory is `train_lora`'s (`config.json`,
  `loss.jsonl`, `loss.png`, orbax `checkpoints/`, resuming).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from sdjax.finetune import data as data_lib
from sdjax.finetune import distributed
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
_RESUME_KEYS = (
    "model",
    "token",
    "init_word",
    "vectors",
    "batch_size",
    "accumulation",
    "seed",
    "lr",
    "optimizer",
    *run_lib.EMA_SETTINGS,
)


@dataclasses.dataclass(frozen=True)
class TextualInversionConfig(run_lib.TrainConfig):
    """Every setting of a textual-inversion run (written to the run directory's config.json)."""

    token: str = dataclasses.field(kw_only=True)
    init_word: str = dataclasses.field(kw_only=True)
    vectors: int = 1  # rows of the embedding (tokens token, token_1, ...)
    lr: float = 5e-3  # A1111's default; diffusers' example: 5e-4 x batch x accumulation
    max_grad_norm: float | None = None  # diffusers' textual_inversion.py does not clip

    written: ClassVar[str] = "the embedding"

    def check(self) -> None:
        """Bad settings fail here, naming the setting, before anything is loaded or compiled."""
        if not isinstance(self.token, str) or not self.token.strip() or len(self.token.split()) != 1:
            raise ValueError(f"token={self.token!r} must be one word without spaces (e.g. '<star>')")
        if not isinstance(self.init_word, str) or not self.init_word.strip():
            raise ValueError(f"init_word={self.init_word!r} must be a word the tokenizer knows (e.g. 'star')")
        for name in ("vectors", "steps", "batch_size", "accumulation"):
            if int(getattr(self, name)) != getattr(self, name) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        super().check()


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
    and the initial rows (float32). With several processes (`finetune.distributed`) only the first writes `path`
    (the run directory is shared: another's rewrite could cut the file under a process reading it); the others
    load their own copy from a temporary folder."""
    components = [c for c in pipe.generator.models.conditioning.components if c in TOKENIZERS]
    rows, base = {}, {}
    for c in components:
        table = _table(pipe.params[c])
        rows[c] = init_vectors(getattr(pipe, TOKENIZERS[c]), table, init_word, vectors)
        base[c] = int(table.shape[0])
    with contextlib.ExitStack() as stack:
        if not distributed.is_primary():
            path = Path(stack.enter_context(tempfile.TemporaryDirectory())) / Path(path).name
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


def rows_params(params: dict, rows: dict) -> dict:
    """`params` with the token rows `rows` `{component: (n, D)}` in their text encoders' tables (a new dict)."""
    import jax

    host = jax.device_get(rows)  # the run's values live on its mesh; the pipeline's params may not
    return {**params, **{c: with_rows(params[c], v) for c, v in host.items()}}


def _replace(tree, path: Sequence[str], value) -> dict:
    out = dict(tree)
    out[path[0]] = value if len(path) == 1 else _replace(tree[path[0]], path[1:], value)
    return out


def prompts(captions: Sequence[str], token: str, seed: int, step: int, rows: Sequence[int] | None = None) -> list[str]:
    """The training prompts of a micro-batch's captions (see the module docstring); `rows`: the captions' rows in
    the whole micro-batch (None: all of them, in order), which choose the templates."""
    out = []
    for i, caption in zip(range(len(captions)) if rows is None else rows, captions, strict=True):
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

    from sdjax.finetune import step as step_lib

    ac = jnp.asarray(alphas_cumprod, jnp.float32)

    def loss_fn(rows, frozen, batch, key):
        k_vae, k_draw, _ = jax.random.split(key, 3)
        latents = step_lib.encode_latents(models, frozen["vae"], batch["pixels"], k_vae)
        draws = step_lib.draw(k_draw, latents.shape, objective)
        return embedding_loss(rows, frozen, models, objective, ac, {**batch, "latents": latents, **draws})

    return step_lib.jit_step(loss_fn, optimizer, "rows")


def row_batches(cfg: TextualInversionConfig, sampler: data_lib.Sampler, conditioning) -> run_lib.RowBatches:
    """The run's micro-batches, built by rows (`run.RowBatches`: a process of a multi-host run opens only the rows
    its devices hold); a row's prompt template is chosen by its row in the whole micro-batch, as on one host."""

    def load(micro: int, rows: Sequence[int] | None) -> dict:
        loaded = sampler.load(micro, rows)
        loaded["captions"] = prompts(loaded["captions"], cfg.token, cfg.seed, micro, rows)
        return run_lib._inputs(conditioning, loaded, cfg.clip_skip)

    return run_lib.RowBatches(load, sampler.batch_size)


# ------------------------------------------------------------------------------------------------ files
def write_a1111(path: str | Path, rows: dict, metadata: dict[str, str], dtype=np.float32) -> None:
    """A1111 / kohya: `emb_params` (one text encoder) or `clip_l` + `clip_g` (SDXL), as `dtype`."""
    from sdjax.finetune.lora import save_safetensors

    host = {c: np.ascontiguousarray(np.asarray(v, np.float32)) for c, v in rows.items()}
    tensors = (
        {A1111_SDXL_KEYS[c]: v for c, v in host.items()} if len(host) > 1 else {"emb_params": host[next(iter(host))]}
    )
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(path, tensors, metadata, dtype)


def write_diffusers(run_dir: Path, token: str, rows: dict, dtype=np.float32) -> list[Path]:
    """diffusers' `learned_embeds.safetensors` `{token: (n, D)}` (SDXL: and `learned_embeds_2.safetensors`), as
    `dtype`."""
    from sdjax.finetune.lora import save_safetensors

    paths = []
    for c, v in rows.items():
        path = run_dir / DIFFUSERS_FILES[c]
        save_safetensors(path, {token: np.ascontiguousarray(np.asarray(v, np.float32))}, {"format": "pt"}, dtype)
        paths.append(path)
    return paths


def write_files(cfg: TextualInversionConfig, rows: dict) -> None:
    """The trained `rows` as `cfg.out` (A1111) and the run directory's diffusers files."""
    trained = {c: np.asarray(v, np.float32) for c, v in rows.items()}
    meta = {
        "sdjax_token": cfg.token,
        "sdjax_init_word": cfg.init_word,
        "sdjax_steps": str(cfg.steps),
        "sdjax_model": str(cfg.model or "embedded"),
    }
    dtype = run_lib.save_dtype(cfg.save_precision)
    write_a1111(cfg.out, trained, meta, dtype)
    write_diffusers(cfg.run_path, cfg.token, trained, dtype)


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

    from sdjax.finetune import step as step_lib
    from sdjax.finetune import validation as validation_lib

    cfg = TextualInversionConfig(data=str(data), out=str(out), **options)
    session = run_lib.Session.begin(cfg, on_step=on_step, log=log, stop_after=stop_after, resume_keys=_RESUME_KEYS)
    run_dir = cfg.run_path
    pipe, _, dtype = run_lib._load(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    _, rows = add_token(pipe, cfg.token, cfg.init_word, cfg.vectors, run_dir / "init.safetensors")
    params = pipe.params
    conditioning = pipe.generator.models.conditioning
    resolution = cfg.resolution or pipe.default_size[0]
    dataset = session.prepare(resolution)
    objective = run_lib._objective(cfg, pipe)
    models = step_lib.Models(conditioning, pipe.unet, pipe.vae, dtype, remat=cfg.gradient_checkpointing)
    frozen = {c: params[c] for c in ("unet", "vae", *conditioning.components)}
    schedule, optimizer = run_lib._optimizer(cfg)
    state = step_lib.init_state(rows, optimizer, "rows")
    train_step = make_train_step(models, objective, pipe.scheduler.alphas_cumprod, optimizer)
    sampler = data_lib.Sampler(dataset, cfg.data_config(resolution), cfg.batch_size, cfg.seed)
    batches = row_batches(cfg, sampler, conditioning)
    finish = lambda state: write_files(cfg, state["rows"])
    validate = validation_lib.make_validator(
        cfg, pipe, lambda rows: rows_params(params, rows), (resolution, resolution), log
    )
    return session.loop(state, frozen, train_step, batches, schedule, finish, validate=validate, trained="rows")
