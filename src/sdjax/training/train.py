"""Latent-diffusion training (Rombach et al. 2022) of a small Stable Diffusion on the synthetic shape scenes.

Two stages, with the same model code that inference uses (`sdjax.models`):

1. **VAE** (`AutoencoderKL`): L1 + L2 reconstruction of the posterior's sample plus a small KL term; then the
   latent `scaling_factor` is set to 1 / std of the encoded training images, as SD did.
2. **Text encoder + UNet** (`CLIPTextModel` with CLIP's real tokenizer and vocabulary, `UNet2DConditionModel`),
   trained jointly on the DDPM objective (Ho et al. 2020) with v-prediction, DDPM's `linear` betas,
   Min-SNR-gamma loss weights (Hang et al. 2023) and classifier-free-guidance dropout (Ho & Salimans 2022:
   a fraction of captions replaced by the empty prompt). An exponential moving average of the weights is what
   gets exported.

Training runs a fixed number of steps (so a run is reproducible from its seed); the latents of a fixed set of
rendered scenes are computed once after stage 1, and each step draws fresh captions, timesteps and noise.
AdamW (optax) with linear warm-up and cosine decay, gradient clipping, float32, `jit` on whatever JAX has,
data-parallel over the devices (the batch split, the weights replicated). On CPU, `python -m sdjax.training`
asks XLA for 2 host devices: this model's small ops leave one device's executor mostly serial (one core busy at
a time), and two devices with half the diffusion batch each train 1.09x faster on 2 cores (`data_parallel`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sdjax.models.clip import CLIPTextConfig, CLIPTextModel
from sdjax.models.unet import UNet2DConditionConfig, UNet2DConditionModel
from sdjax.models.vae import AutoencoderKL, AutoencoderKLConfig
from sdjax.text.tokenizer import CLIPTokenizer
from sdjax.training import data

Log = Callable[[str], None]


# ---------------------------------------------------------------------------------------------- configuration
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Architecture (real diffusers / transformers config keys) and optimisation settings of one run."""

    text_encoder: dict
    unet: dict
    vae: dict
    scheduler: dict
    seed: int = 0
    # stage 1: VAE
    vae_steps: int = 3200
    vae_batch: int = 8
    vae_lr: float = 1e-3
    kl_weight: float = 1e-4
    # stage 2: text encoder + UNet
    dataset_size: int = 8192
    steps: int = 5600
    batch: int = 32
    lr: float = 1e-3
    warmup: int = 200
    weight_decay: float = 0.0
    ema_decay: float = 0.999
    min_snr_gamma: float = 5.0
    # Timestep sampling: this share of each batch draws t uniformly from [low_t_start, low_t_end), the rest
    # uniformly over all timesteps (`sample_timesteps`).
    low_t_share: float = 0.35
    low_t_start: int = 100
    low_t_end: int = 500
    cfg_dropout: float = 0.1
    partial_rate: float = 0.2
    grad_clip: float = 1.0

    def replace(self, **kwargs) -> TrainConfig:
        return dataclasses.replace(self, **kwargs)


# The "embedded" preset below is the recipe of the shipped model (src/sdjax/assets/embedded), about 45 min on 2
# CPU cores. Captions: 80% name every attribute, 20% leave out a random non-empty subset of them
# (`data.random_caption`). DDPM's linear betas with v-prediction, sampled by DPM-Solver++ (2M) in 20 steps;
# timesteps (`sample_timesteps`): 35% of each batch from [100, 500), the rest uniform. Why each choice was made,
# and the runs that led to it (with their held-out scores), are in docs/embedded-model.md.
SCHEDULER = {
    "_class_name": "DPMSolverMultistepScheduler",
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "prediction_type": "v_prediction",
    "algorithm_type": "dpmsolver++",
    "solver_order": 2,
    "solver_type": "midpoint",
    "lower_order_final": True,
    "timestep_spacing": "linspace",
    "steps_offset": 1,
    "use_karras_sigmas": False,
    "final_sigmas_type": "zero",
    "thresholding": False,
}

_CLIP = dict(
    vocab_size=49408,
    hidden_size=64,
    intermediate_size=256,
    projection_dim=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    bos_token_id=49406,
    eos_token_id=49407,
    pad_token_id=1,
)
# 64x64 images -> 16x16x4 latents (two 2x downsamplings); SD-style VAE blocks, no mid-block attention.
_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(16, 32, 32),
    layers_per_block=1,
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    norm_num_groups=4,
    sample_size=64,
    scaling_factor=1.0,
    mid_block_add_attention=False,
    force_upcast=False,
)
# 16x16 latents, three resolutions (16, 8, 4) with cross-attention at each and in the 4x4 mid block: a convolution
# knows where it is only through the zero padding at the borders, which every 4x4 pixel is near (a third level
# costs about nothing here: 0.48 s per training step with it and without). Two attention heads (of 16 channels)
# at the 16x16 level, four at the others: at 256 tokens the score tensor is most of a training step's time on
# CPU, and two heads there make the step 1.3x faster than four (0.71 s against 0.92 s at batch 64).
_UNET = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(32, 64, 64),
    down_block_types=("CrossAttnDownBlock2D",) * 3,
    up_block_types=("CrossAttnUpBlock2D",) * 3,
    cross_attention_dim=64,
    attention_head_dim=(2, 4, 4),
    norm_num_groups=8,
)

PRESETS: dict[str, TrainConfig] = {
    # The shipped embedded model (see the README for its held-out scores).
    "embedded": TrainConfig(text_encoder=_CLIP, unet=_UNET, vae=_VAE, scheduler=SCHEDULER),
    # A seconds-long run for tests: the same block types at tiny widths, two UNet levels (not three: a third of the
    # parameters and their initialisers fewer to compile), a handful of steps.
    "tiny": TrainConfig(
        text_encoder={
            **_CLIP,
            "hidden_size": 16,
            "intermediate_size": 32,
            "projection_dim": 16,
            "num_hidden_layers": 1,
        },
        unet={
            **_UNET,
            "block_out_channels": (8, 16),
            "down_block_types": ("CrossAttnDownBlock2D",) * 2,
            "up_block_types": ("CrossAttnUpBlock2D",) * 2,
            "cross_attention_dim": 16,
            "attention_head_dim": 2,
            "norm_num_groups": 4,
        },
        vae={**_VAE, "block_out_channels": (4, 8, 8), "norm_num_groups": 2},
        scheduler=SCHEDULER,
        vae_steps=4,
        vae_batch=2,
        dataset_size=16,
        steps=4,
        batch=4,
        warmup=1,
    ),
}


def model_configs(cfg: TrainConfig) -> tuple[CLIPTextConfig, UNet2DConditionConfig, AutoencoderKLConfig]:
    return (
        CLIPTextConfig.from_dict(cfg.text_encoder, source="TrainConfig.text_encoder"),
        UNet2DConditionConfig(**cfg.unet),
        AutoencoderKLConfig(**cfg.vae),
    )


# ---------------------------------------------------------------------------------------------- helpers
def images_to_nchw(images_bhwc_uint8: np.ndarray) -> np.ndarray:
    """uint8 `(B, H, W, 3)` -> float32 NCHW in [-1, 1] (the VAE's input range)."""
    return (images_bhwc_uint8.astype(np.float32) / 127.5 - 1.0).transpose(0, 3, 1, 2)


def _optimizer(lr: float, steps: int, warmup: int, weight_decay: float, clip: float) -> optax.GradientTransformation:
    warmup = max(1, min(warmup, steps))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(schedule, b2=0.99, weight_decay=weight_decay))


def data_parallel(batch: int, min_per_device: int = 16) -> tuple[NamedSharding, NamedSharding]:
    """(replicated, batch-split) shardings over the most devices (of `default_devices()`) that divide `batch` and
    leave each at least `min_per_device` examples (measured on 2 CPU cores: the diffusion step, batch 32, 0.79 s
    split over 2 devices against 0.86 s on one; the VAE step, batch 8, 0.24 s split against 0.18 s)."""
    from sdjax.parallel.sharding import default_devices

    devices = default_devices()
    n = max(d for d in range(1, len(devices) + 1) if batch % d == 0 and (d == 1 or batch // d >= min_per_device))
    mesh = Mesh(np.asarray(devices[:n]), ("data",))
    return NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))


def _count(params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))


def training_alphas_cumprod(scheduler: dict) -> np.ndarray:
    """alpha-bar_t of the training schedule (diffusers' `scaled_linear` / `linear` betas), float64 math."""
    n, b0, b1 = scheduler["num_train_timesteps"], scheduler["beta_start"], scheduler["beta_end"]
    if scheduler["beta_schedule"] == "scaled_linear":
        betas = np.linspace(b0**0.5, b1**0.5, n, dtype=np.float64) ** 2
    elif scheduler["beta_schedule"] == "linear":
        betas = np.linspace(b0, b1, n, dtype=np.float64)
    else:
        raise ValueError(f"beta_schedule {scheduler['beta_schedule']!r}: training supports scaled_linear and linear")
    return np.cumprod(1.0 - betas).astype(np.float32)


# ---------------------------------------------------------------------------------------------- stage 1: VAE
def train_vae(cfg: TrainConfig, vae_config: AutoencoderKLConfig, log: Log = print) -> tuple[dict, list[float]]:
    """Train the autoencoder; returns (params, per-step losses)."""
    vae = AutoencoderKL(vae_config)
    key = jax.random.key(cfg.seed)
    size = data.IMAGE_SIZE
    params = jax.jit(vae.init)(key, jnp.zeros((1, 3, size, size)))["params"]
    log(f"vae: {_count(params) / 1e6:.3f}M params, {cfg.vae_steps} steps x {cfg.vae_batch} images")
    opt = _optimizer(cfg.vae_lr, cfg.vae_steps, cfg.warmup, 0.0, cfg.grad_clip)
    replicated, split = data_parallel(cfg.vae_batch)
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(opt.init(params), replicated)

    def loss_fn(p, x_nchw, k):
        posterior = vae.apply({"params": p}, x_nchw, method=AutoencoderKL.encode)
        recon = vae.apply({"params": p}, posterior.sample(k), method=AutoencoderKL.decode).astype(jnp.float32)
        err = recon - x_nchw
        rec = jnp.mean(jnp.abs(err)) + jnp.mean(jnp.square(err))
        kl = 0.5 * jnp.mean(jnp.square(posterior.mean) + posterior.var - 1.0 - posterior.logvar)
        return rec + cfg.kl_weight * kl, (rec, kl)

    @jax.jit
    def step(p, s, x_nchw, k):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, x_nchw, k)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss, aux

    losses = []
    stream = data.batches(cfg.seed + 1, cfg.vae_batch, partial_rate=0.0)
    t0 = time.time()
    for i in range(cfg.vae_steps):
        images, _ = next(stream)
        params, opt_state, loss, (rec, kl) = step(
            params, opt_state, jax.device_put(images_to_nchw(images), split), jax.random.fold_in(key, i)
        )
        losses.append(float(loss))
        if i % 100 == 0 or i == cfg.vae_steps - 1:
            log(
                f"vae step {i:5d}  loss {float(loss):.4f}  rec {float(rec):.4f}  kl {float(kl):.2f}  "
                f"{time.time() - t0:.0f}s"
            )
    return params, losses


def encode_dataset(
    vae: AutoencoderKL, params: dict, images: np.ndarray, batch: int = 64
) -> tuple[np.ndarray, np.ndarray]:
    """Posterior mean and std NCHW of every image (float32)."""
    encode = jax.jit(lambda p, x: vae.apply({"params": p}, x, method=AutoencoderKL.encode))
    means, stds = [], []
    for i in range(0, len(images), batch):
        chunk = images[i : i + batch]
        pad = batch - len(chunk)
        x = images_to_nchw(np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)]) if pad else chunk)
        post = encode(params, x)
        means.append(np.asarray(post.mean)[: len(chunk)])
        stds.append(np.asarray(post.std)[: len(chunk)])
    return np.concatenate(means), np.concatenate(stds)


# ---------------------------------------------------------------------------------------------- stage 2: diffusion
def caption_vocabulary_ids(tokenizer: CLIPTokenizer) -> np.ndarray:
    """Token ids of every caption phrasing the training data can produce, plus BOS and EOS (the pad token)."""
    captions = []
    for i, colour in enumerate(data.COLOURS):
        background = data.COLOURS[(i + 1) % len(data.COLOURS)]
        for shape in data.SHAPES:
            for size in data.SIZES:
                for position in data.POSITIONS:
                    scene = data.Scene(shape, colour, background, size, position)
                    captions += [data.caption(scene, v) for v in range(15)]
                    captions += [data.partial_caption(scene, d, v) for d in data.PARTIAL_DROPS for v in range(6)]
    ids = np.unique(tokenizer(captions))
    return ids.astype(np.int32)


def init_text_params(text_config: CLIPTextConfig, key, used_ids: np.ndarray) -> dict:
    """CLIP text encoder params; token embeddings of words the captions never use start (and stay) zero, so an
    unknown word carries no signal and the exported embedding table compresses to almost nothing."""
    model = CLIPTextModel(text_config)
    params = jax.jit(model.init)(key, jnp.zeros((1, text_config.max_position_embeddings), jnp.int32))["params"]
    emb = params["text_model"]["embeddings"]["token_embedding"]["embedding"]
    rows = 0.02 * jax.random.normal(jax.random.fold_in(key, 1), (len(used_ids), emb.shape[1]))
    emb = jnp.zeros_like(emb).at[used_ids].set(rows)
    params["text_model"]["embeddings"]["token_embedding"]["embedding"] = emb
    params["text_model"]["embeddings"]["position_embedding"]["embedding"] *= 0.01 / jnp.maximum(
        jnp.std(params["text_model"]["embeddings"]["position_embedding"]["embedding"]), 1e-8
    )
    return params


def min_snr_v_weight(snr, gamma: float):
    """Per-sample weight of the squared v error: `(min(snr, gamma) + 1) / (snr + 1)`.

    An error in v is an error in x0 scaled by `sqrt(snr + 1)`, so an unweighted v loss weights x0 by `snr + 1`;
    this clips that x0 weight at `gamma + 1` (Min-SNR-gamma, Hang et al. 2023), which stops the nearly
    noise-free timesteps from dominating. The paper's v weight, `min(snr, gamma) / (snr + 1)`, also tends to 0
    at high noise (0.005 at t=999 with SD's betas), where a sampler decides the layout; here the weight is 1
    there, as in plain v-prediction. (This alone did not make the model follow the position words: the noise
    schedule did, see `SCHEDULER`.)"""
    return (jnp.minimum(snr, gamma) + 1.0) / (snr + 1.0)


def sample_timesteps(
    key, batch: int, num_t: int, low_share: float = 0.0, low_end: int = 0, low_start: int = 0
) -> jax.Array:
    """`(batch,)` int timesteps: each is uniform over `[low_start, low_end)` with probability `low_share`, else
    uniform over `[0, num_t)`.

    Uniform t (DDPM) spends half of the batch above t=500, where with the linear betas sqrt(snr) < 0.3 and only
    the layout (position, colour, background) is still to decide; the outline of a shape (a circle's edge
    against a square's corner, 1-2 latent pixels) is drawn below that. Drawing more t there moves training
    effort to those timesteps without changing what the model should predict at any t (the loss at each t has
    the same minimiser), as the timestep densities of EDM (Karras et al. 2022) and SD3 (Esser et al. 2024) do."""
    k_mix, k_low, k_all = jax.random.split(key, 3)
    t_all = jax.random.randint(k_all, (batch,), 0, num_t)
    if low_share <= 0.0:
        return t_all
    end = min(low_end, num_t)
    if not 0 <= low_start < end:
        raise ValueError(f"sample_timesteps: low_start={low_start}, low_end={low_end} with {num_t} timesteps")
    t_low = jax.random.randint(k_low, (batch,), low_start, end)
    return jnp.where(jax.random.uniform(k_mix, (batch,)) < low_share, t_low, t_all)


def diffusion_loss_fn(
    text_encoder: CLIPTextModel,
    unet: UNet2DConditionModel,
    alphas_cumprod: jax.Array,
    min_snr_gamma: float,
    prediction_type: str = "epsilon",
    low_t_share: float = 0.0,
    low_t_end: int = 0,
    low_t_start: int = 0,
):
    """`loss(params, latents, ids, key)`: MSE to the noise (`epsilon`) or to `v = sqrt(ab) * noise -
    sqrt(1 - ab) * x0` (`v_prediction`, Salimans & Ho 2022), each weighted by Min-SNR-gamma (for v:
    `min_snr_v_weight`); timesteps from `sample_timesteps`."""
    if prediction_type not in ("epsilon", "v_prediction"):
        raise ValueError(f"prediction_type={prediction_type!r}: training supports epsilon and v_prediction")
    num_t = alphas_cumprod.shape[0]

    def loss(params, latents, ids, key):
        k_t, k_n = jax.random.split(key)
        b = latents.shape[0]
        t = sample_timesteps(k_t, b, num_t, low_t_share, low_t_end, low_t_start)
        noise = jax.random.normal(k_n, latents.shape)
        ab = alphas_cumprod[t][:, None, None, None]
        noisy = jnp.sqrt(ab) * latents + jnp.sqrt(1.0 - ab) * noise
        context = text_encoder.apply({"params": params["text_encoder"]}, ids).last_hidden_state
        pred = unet.apply({"params": params["unet"]}, noisy, t.astype(jnp.float32), context)
        snr = alphas_cumprod[t] / (1.0 - alphas_cumprod[t])
        if prediction_type == "v_prediction":
            target = jnp.sqrt(ab) * noise - jnp.sqrt(1.0 - ab) * latents
            weight = min_snr_v_weight(snr, min_snr_gamma)
        else:
            target = noise
            weight = jnp.minimum(snr, min_snr_gamma) / snr
        return jnp.mean(weight * jnp.mean(jnp.square(pred.astype(jnp.float32) - target), axis=(1, 2, 3)))

    return loss


def train_diffusion(
    cfg: TrainConfig,
    text_config: CLIPTextConfig,
    unet_config: UNet2DConditionConfig,
    latent_mean: np.ndarray,
    latent_std: np.ndarray,
    scenes: list[data.Scene],
    log: Log = print,
    checkpoint: Callable[[int, dict], None] | None = None,
    checkpoint_every: int = 0,
) -> tuple[dict, list[float]]:
    """Train text encoder + UNet jointly on scaled latents; returns (EMA params, per-step losses).

    `checkpoint(step, ema_params)` is called every `checkpoint_every` steps (0: never)."""
    tokenizer = CLIPTokenizer.default()
    # Attention in query blocks of 64 (`sdjax.ops.attention`, the same function): at batch 32 the 16x16 level's
    # whole score tensor (32 x heads x 256 x 256 floats) falls out of cache on CPU; 1.2x faster steps.
    text_encoder = CLIPTextModel(text_config)
    unet = UNet2DConditionModel(unet_config, attention="chunked", attention_chunk_size=64)
    key = jax.random.key(cfg.seed + 2)
    lat_shape = latent_mean.shape[1:]
    params = {
        "text_encoder": init_text_params(text_config, jax.random.fold_in(key, 0), caption_vocabulary_ids(tokenizer)),
        "unet": jax.jit(unet.init)(
            jax.random.fold_in(key, 1),
            jnp.zeros((1,) + lat_shape),
            jnp.zeros((1,)),
            jnp.zeros((1, text_config.max_position_embeddings, text_config.hidden_size)),
        )["params"],
    }
    log(
        f"diffusion: text encoder {_count(params['text_encoder']) / 1e6:.2f}M params, unet "
        f"{_count(params['unet']) / 1e6:.2f}M params; {cfg.steps} steps x {cfg.batch}, {len(scenes)} scenes"
    )
    opt = _optimizer(cfg.lr, cfg.steps, cfg.warmup, cfg.weight_decay, cfg.grad_clip)
    replicated, split = data_parallel(cfg.batch)
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(opt.init(params), replicated)
    ema = params
    alphas_cumprod = jnp.asarray(training_alphas_cumprod(cfg.scheduler))
    loss_fn = diffusion_loss_fn(
        text_encoder,
        unet,
        alphas_cumprod,
        cfg.min_snr_gamma,
        cfg.scheduler.get("prediction_type", "epsilon"),
        cfg.low_t_share,
        cfg.low_t_end,
        cfg.low_t_start,
    )

    @jax.jit
    def step(p, s, e, mean, std, ids, k, i):
        k_z, k_l = jax.random.split(k)
        latents = mean + std * jax.random.normal(k_z, mean.shape)
        loss, grads = jax.value_and_grad(loss_fn)(p, latents, ids, k_l)
        updates, s = opt.update(grads, s, p)
        p = optax.apply_updates(p, updates)
        decay = jnp.minimum(cfg.ema_decay, (1.0 + i) / (10.0 + i))
        e = jax.tree_util.tree_map(lambda a, b: decay * a + (1.0 - decay) * b, e, p)
        return p, s, e, loss

    rng = np.random.default_rng(cfg.seed + 3)
    empty = tokenizer([""])[0]
    losses: list[float] = []
    pending: list[jax.Array] = []
    t0 = time.time()
    for i in range(cfg.steps):
        idx = rng.integers(len(scenes), size=cfg.batch)
        captions = [data.random_caption(rng, scenes[j], cfg.partial_rate) for j in idx]
        ids = tokenizer(captions)
        ids[rng.uniform(size=cfg.batch) < cfg.cfg_dropout] = empty
        batch = jax.device_put((latent_mean[idx], latent_std[idx], ids), split)
        params, opt_state, ema, loss = step(
            params, opt_state, ema, *batch, jax.random.fold_in(key, 1000 + i), jnp.float32(i)
        )
        pending.append(loss)  # read back at the log lines, so the host prepares the next batches meanwhile
        if i % 100 == 0 or i == cfg.steps - 1:
            losses += [float(x) for x in pending]
            pending.clear()
            recent = float(np.mean(losses[-100:]))
            log(f"diffusion step {i:5d}  loss {recent:.4f}  {time.time() - t0:.0f}s")
        if checkpoint is not None and checkpoint_every and (i + 1) % checkpoint_every == 0 and i + 1 < cfg.steps:
            checkpoint(i + 1, ema)
    return ema, losses


# ---------------------------------------------------------------------------------------------- the whole run
@dataclasses.dataclass
class TrainResult:
    text_config: CLIPTextConfig
    unet_config: UNet2DConditionConfig
    vae_config: AutoencoderKLConfig
    params: dict[str, Any]
    vae_losses: list[float]
    losses: list[float]
    seconds: float


def train(
    cfg: TrainConfig,
    log: Log = print,
    *,
    vae: tuple[AutoencoderKLConfig, dict] | None = None,
    checkpoint: Callable[[int, TrainResult], None] | None = None,
    checkpoint_every: int = 0,
) -> TrainResult:
    """Both stages; returns the configs (the VAE's with its measured `scaling_factor`) and the params.

    `vae=(config, params)` skips stage 1 and uses that autoencoder (its `scaling_factor` is measured again).
    `checkpoint(step, result)` receives the EMA weights every `checkpoint_every` diffusion steps."""
    t0 = time.time()
    text_config, unet_config, vae_config = model_configs(cfg)
    if vae is None:
        vae_params, vae_losses = train_vae(cfg, vae_config, log)
    else:
        (vae_config, vae_params), vae_losses = vae, []
        log(f"vae: reusing a trained autoencoder ({_count(vae_params) / 1e6:.3f}M params)")

    rng = np.random.default_rng(cfg.seed + 4)
    scenes = [data.random_scene(rng) for _ in range(cfg.dataset_size)]
    images = np.stack([data.render(s) for s in scenes])
    mean, std = encode_dataset(AutoencoderKL(vae_config), vae_params, images)
    scaling = float(f"{1.0 / float(np.std(mean)):.4g}")
    vae_config = dataclasses.replace(vae_config, scaling_factor=scaling)
    log(
        f"latents: mean {mean.mean():.3f}, std {mean.std():.3f} -> scaling_factor {scaling}; "
        f"posterior std {std.mean():.4f}"
    )

    def result(ema, losses) -> TrainResult:
        params = {"text_encoder": ema["text_encoder"], "unet": ema["unet"], "vae": vae_params}
        params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
        return TrainResult(text_config, unet_config, vae_config, params, vae_losses, losses, time.time() - t0)

    on_checkpoint = None if checkpoint is None else (lambda step, ema: checkpoint(step, result(ema, [])))
    ema, losses = train_diffusion(
        cfg, text_config, unet_config, mean * scaling, std * scaling, scenes, log, on_checkpoint, checkpoint_every
    )
    out = result(ema, losses)
    log(f"trained in {out.seconds / 60:.1f} min")
    return out


def save(result: TrainResult, cfg: TrainConfig, out) -> None:
    from sdjax.training.export import export_pipeline

    export_pipeline(
        out,
        text_config=result.text_config,
        unet_config=result.unet_config,
        vae_config=result.vae_config,
        scheduler_config=cfg.scheduler,
        params=result.params,
    )
