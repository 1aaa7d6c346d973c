"""Tiny SD 3 / 3.5 ControlNets for tests (diffusers `SD3ControlNetModel`, torch), shared by the model, loading,
pipeline and server tests:

- `NETS`: an InstantX-like net (joint blocks) and an SD 3.5-large-like one (single blocks, no text, the
  transformer's patch embedding) that fit the tiny pipeline of tests/sd3_reference.py; `pipeline_net` builds one
  with the random weights the pipeline tests use;
- `tiny_transformer`: the config of a small `SD3Transformer2DModel` (4 latent channels, text 40 wide, pooled 24
  wide) for the model-level tests;
- `randomized`: random weights where diffusers starts at zero (`pos_embed_input`, `controlnet_blocks`: otherwise a
  net's samples are 0 and a comparison proves nothing), optionally non-trivial q/k RMSNorm scales and a random
  position table;
- `to_sai` / `write_sai_file`: a net saved as Stability AI's single file (`sd3.5_large_controlnet_*.safetensors`),
  the inverse of diffusers' `scripts/convert_sd3_controlnet_to_diffusers.py` (`SCRIPT_BLOCK` is that script's
  block mapping);
- `rel_err`: the largest absolute difference over the largest magnitude of the reference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import sd3_reference

_T = sd3_reference.TRANSFORMER
_NET = {k: _T[k] for k in ("sample_size", "patch_size", "in_channels", "attention_head_dim", "num_attention_heads")}
_NET.update(pooled_projection_dim=_T["pooled_projection_dim"], out_channels=16)
NETS = {
    "instantx": {
        **_NET,
        "num_layers": 2,
        "joint_attention_dim": _T["joint_attention_dim"],
        "caption_projection_dim": _T["caption_projection_dim"],
        "pos_embed_max_size": 12,
        "dual_attention_layers": (0,),
        "qk_norm": "rms_norm",
    },
    "sd35-large": {
        **_NET,
        "num_layers": 3,
        "joint_attention_dim": None,
        "caption_projection_dim": 48,
        "pos_embed_max_size": None,
        "pos_embed_type": None,
        "use_pos_embed": False,
        "force_zeros_for_pooled_projection": False,
    },
}
# the random weights of the pipeline tests' nets and transformers (`randomized`'s keywords)
PIPELINE_RANDOM = dict(scale=0.3, norms=0.1, table=0.5)

# diffusers' conversion script, block part: the file's name -> diffusers' name (`attn.qkv` is split in three row
# blocks, q, k, v)
SCRIPT_BLOCK = {
    "attn.proj": "attn.to_out.0",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
    "adaLN_modulation.1": "norm1.linear",
}


def tiny_transformer(*, num_layers: int, attention_head_dim: int, **extra) -> dict:
    """An `SD3Transformer2DModel` config with 2 heads of `attention_head_dim` (the caption projection that wide),
    patch 2, 4 latent channels, text 40 wide, pooled 24 wide and a `pos_embed_max_size` 12 table."""
    return dict(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=num_layers,
        attention_head_dim=attention_head_dim,
        num_attention_heads=2,
        joint_attention_dim=40,
        caption_projection_dim=2 * attention_head_dim,
        pooled_projection_dim=24,
        out_channels=4,
        pos_embed_max_size=12,
        **extra,
    )


def randomized(model, seed: int, *, scale: float = 0.2, norms: float = 0.0, table: float = 0.0):
    """`model` (a diffusers SD 3 ControlNet or transformer) in eval mode with, drawn from `seed`: the layers
    diffusers starts at zero set to `scale` x N(0, 1); with `norms`, the q/k RMSNorm scales 1 + `norms` x N(0, 1);
    with `table`, its position table `table` x N(0, 1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("pos_embed_input.", "controlnet_blocks.")):
                p.copy_(scale * torch.randn(p.shape, generator=g))
            elif norms and ("norm_q" in name or "norm_k" in name or "norm_added" in name):
                p.copy_(1 + norms * torch.randn(p.shape, generator=g))
        pos = getattr(model, "pos_embed", None)
        if table and pos is not None and getattr(pos, "pos_embed", None) is not None:
            pos.pos_embed.copy_(table * torch.randn(pos.pos_embed.shape, generator=g))
    return model.eval()


def pipeline_net(config: dict, seed: int):
    """A diffusers `SD3ControlNetModel(**config)` initialised from torch seed `seed`, with the pipeline tests'
    random weights (`PIPELINE_RANDOM`)."""
    import diffusers
    import torch

    torch.manual_seed(seed)
    return randomized(diffusers.SD3ControlNetModel(**config), seed, **PIPELINE_RANDOM)


def to_sai(sd: dict, control_type: int = 1) -> dict:
    """A diffusers `SD3ControlNetModel` state dict -> the released files' layout (the inverse of diffusers'
    conversion script), with Stability's `control_type` tag (1: canny)."""
    import torch

    out = {"control_type": torch.tensor([control_type], dtype=torch.int32)}
    blocks = sorted({int(k.split(".")[1]) for k in sd if k.startswith("transformer_blocks.")})
    for i in blocks:
        p = f"transformer_blocks.{i}."
        for leaf in ("weight", "bias"):
            out[f"{p}attn.qkv.{leaf}"] = torch.cat([sd[f"{p}attn.{n}.{leaf}"] for n in ("to_q", "to_k", "to_v")])
            for src, dst in SCRIPT_BLOCK.items():
                out[f"{p}{src}.{leaf}"] = sd[f"{p}{dst}.{leaf}"]
    for k, v in sd.items():
        if not k.startswith("transformer_blocks."):
            out[k] = v
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def write_sai_file(net, path: Path) -> Path:
    """`net` (a diffusers SD3ControlNetModel) saved as Stability's single file at `path`."""
    from safetensors.torch import save_file

    save_file(to_sai(net.state_dict()), str(path))
    return path


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
