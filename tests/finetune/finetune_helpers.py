"""Helpers of the LoRA step parity tests (imported by this unique name, as `tests/server`'s helpers are): the
same peft LoRA on diffusers' UNet, the same random batch and the same gradient comparison."""

import copy

import jax
import numpy as np

from sdjax.finetune import lora as lora_lib
from sdjax.models.convert import path_to_torch_key

TARGETS = ["to_k", "to_q", "to_v", "to_out.0"]


def kohya_conv_config(torch_unet, conv_rank: int, conv_alpha: float) -> dict:
    """peft `LoraConfig` arguments adding kohya's `conv_dim` layers to `TARGETS`, found on the PyTorch UNet by
    sd-scripts' rule: every Linear and Conv2d inside a ResnetBlock2D, Downsample2D or Upsample2D module, the convs
    wider than 1x1 at (`conv_rank`, `conv_alpha`) through `rank_pattern` / `alpha_pattern`, the rest at `r`."""
    import torch

    targets, ranks, alphas = list(TARGETS), {}, {}
    for name, module in torch_unet.named_modules():
        if type(module).__name__ not in ("ResnetBlock2D", "Downsample2D", "Upsample2D"):
            continue
        for child_name, child in module.named_modules():
            if isinstance(child, torch.nn.Linear | torch.nn.Conv2d):
                full = f"{name}.{child_name}"
                targets.append(full)
                if isinstance(child, torch.nn.Conv2d) and tuple(child.kernel_size) != (1, 1):
                    ranks[full], alphas[full] = conv_rank, conv_alpha
    return {"target_modules": targets, "rank_pattern": ranks, "alpha_pattern": alphas}


def peft_unet(torch_unet, rank: int, alpha: float, **config):
    """A frozen copy of `torch_unet` with a peft LoRA (gaussian A factors, nonzero B factors: the gradients of
    both factors are then meaningful) on the attention projections (or `config`'s `target_modules`, ...)."""
    import torch
    from peft import LoraConfig

    unet = copy.deepcopy(torch_unet)
    unet.requires_grad_(False)
    torch.manual_seed(0)  # peft's gaussian init of the A factors
    config = {"target_modules": TARGETS, **config}
    unet.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", **config))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return unet


def ddpm_forward(unet, scheduler_config, prediction_type: str, batch: dict, context):
    """diffusers' training forward: `batch`'s latents noised by DDPMScheduler, `unet`'s prediction with `context`
    -> (prediction, target, scheduler, timesteps)."""
    import torch
    from diffusers import DDPMScheduler

    sched = DDPMScheduler.from_config(scheduler_config, prediction_type=prediction_type)
    latents, noise = torch.from_numpy(batch["latents"]), torch.from_numpy(batch["noise"])
    t = torch.from_numpy(batch["timesteps"]).long()
    noisy = sched.add_noise(latents, noise, t)
    target = noise if prediction_type == "epsilon" else sched.get_velocity(latents, noise, t)
    pred = unet(noisy, t, context).sample
    return pred, target, sched, t


def peft_forward(torch_unet, scheduler_config, prediction_type: str, batch: dict, rank: int, alpha: float, **config):
    """`ddpm_forward` of `peft_unet` (`config`: more `LoraConfig` arguments) on `batch` -> (unet, prediction, target,
    scheduler, timesteps) (the loss and its backward pass are the caller's)."""
    import torch

    unet = peft_unet(torch_unet, rank, alpha, **config)
    context = torch.from_numpy(batch["context"])
    return (unet, *ddpm_forward(unet, scheduler_config, prediction_type, batch, context))


def min_snr_loss(pred, target, sched, t, prediction_type: str, gamma: float):
    """diffusers' Min-SNR-gamma weighted MSE (`train_text_to_image_lora.py`)."""
    import torch
    from diffusers.training_utils import compute_snr

    snr = compute_snr(sched, t)
    weights = torch.stack([snr, gamma * torch.ones_like(t)], dim=1).min(dim=1)[0]
    weights = weights / snr if prediction_type == "epsilon" else weights / (snr + 1)
    mse = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=[1, 2, 3])
    return (mse * weights).mean()


def parity_batch(seed: int, timesteps: list[int]) -> dict:
    """Random latents, noise and encoder hidden states of `len(timesteps)` examples (8x8 latents, 9 tokens)."""
    rng = np.random.default_rng(seed)
    n = len(timesteps)
    return {
        "latents": rng.standard_normal((n, 4, 8, 8)).astype(np.float32),
        "noise": rng.standard_normal((n, 4, 8, 8)).astype(np.float32),
        "timesteps": np.asarray(timesteps, np.int32),
        "context": rng.standard_normal((n, 9, 32)).astype(np.float32),
    }


def lora_from_peft(params, tensors: dict, rank: int, conv_rank: int | None = None) -> dict:
    """The sdjax UNet LoRA (LoCon with `conv_rank`) holding the peft LoRA `tensors`' weights (sdjax's own init has
    peft's shapes: the same ranks and layouts)."""
    lora = lora_lib.init_lora(jax.random.PRNGKey(0), params, {"unet": lora_lib.UNET_TARGETS}, rank, conv_rank)
    for name, init in lora["unet"].items():
        module = path_to_torch_key(tuple(name.split("/"))).removesuffix(".weight")
        down = tensors[f"{module}.lora_A.default.weight"].detach().numpy()
        up = tensors[f"{module}.lora_B.default.weight"].detach().numpy()
        assert (init["down"].shape, init["up"].shape) == (down.shape, up.shape), name
        lora["unet"][name] = {"down": down, "up": up}
    return lora


def worst_grad_error(grads: dict, tensors: dict, tol: float | None = 1e-4, zero: float | None = None) -> float:
    """The worst relative error of the sdjax LoRA gradients against peft's (each at most `tol` unless None). With
    `zero`, a peft gradient of L2 norm below it is one that is 0 in exact arithmetic (rounding noise: no relative
    error to take), and sdjax's must be below `zero` too."""
    worst = 0.0
    for name, g in grads.items():
        module = path_to_torch_key(tuple(name.split("/"))).removesuffix(".weight")
        for ours, theirs in (("down", "lora_A"), ("up", "lora_B")):
            ref = tensors[f"{module}.{theirs}.default.weight"].grad.numpy()
            if zero is not None and np.linalg.norm(ref) < zero:
                assert np.linalg.norm(np.asarray(g[ours])) < zero, f"{module}.{theirs}: gradient not 0"
                continue
            err = np.linalg.norm(np.asarray(g[ours]) - ref) / np.linalg.norm(ref)
            worst = max(worst, err)
            assert tol is None or err <= tol, f"{module}.{theirs}: gradient relative error {err:.2e}"
    return worst


def board_events(folder) -> list[tuple[str, object]]:
    """Every event of the TensorBoard event files in `folder`, in file order, as (file name, tensorboardX `Event`
    protobuf). The files are TFRecords: per record a little-endian u64 length, a u32 CRC of it, the data, a u32 CRC
    of the data."""
    import struct

    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            events.append((path.name, event_pb2.Event.FromString(data[at + 12 : at + 12 + length])))
            at += 16 + length
        assert at == len(data), path  # whole records only
    return events


def board_images(folder) -> list[dict]:
    """The image summaries of `board_events(folder)`: file, step, tag and the decoded image (a PIL image)."""
    import io

    from PIL import Image

    return [
        {"file": name, "step": e.step, "tag": v.tag, "image": Image.open(io.BytesIO(v.image.encoded_image_string))}
        for name, e in board_events(folder)
        for v in e.summary.value
        if v.HasField("image")
    ]
