"""Test helper: write the tiny diffusers pipelines of `tests/reference.py` as ORIGINAL-layout single files.

The diffusers -> original key mapping here is the test's own, written independently of `sdjax.loading.ldm_keys`:
it walks the original modules in their order (`input_blocks` 0, 1, 2, ... with a downsampler after each level but
the last; `output_blocks` with `layers_per_block + 1` layers per level and the upsampler in the last one), the way
`ldm.modules.diffusionmodules.openaimodel.UNetModel.__init__` builds them, and checks that every diffusers tensor was
written exactly once. That the files are right is checked against diffusers' own `from_single_file` in the tests.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}


class _Writer:
    """Moves tensors from a diffusers state dict into an original-layout dict, tracking what is left."""

    def __init__(self, sd: dict[str, torch.Tensor], prefix: str):
        self.sd, self.prefix, self.out, self.left = sd, prefix, {}, set(sd)

    def put(self, dst: str, src: str, fn=None) -> None:
        value = self.sd[src]
        self.out[self.prefix + dst] = (fn(value) if fn else value).contiguous()
        self.left.discard(src)

    def subtree(self, dst: str, src: str, rename: dict[str, str] | None = None, fn=None) -> bool:
        """Copy every `src.*` key to `dst.*` (first segment renamed by `rename`); whether any existed."""
        keys = [k for k in self.sd if k.startswith(src + ".")]
        for k in keys:
            rest = k[len(src) + 1 :]
            if rename:
                head, _, tail = rest.partition(".")
                rest = f"{rename.get(head, head)}.{tail}"
            self.put(f"{dst}.{rest}", k, fn)
        return bool(keys)

    def done(self) -> dict[str, torch.Tensor]:
        assert not self.left, f"diffusers tensors not written: {sorted(self.left)[:10]}"
        return self.out


def unet_to_original(sd: dict, config: dict, prefix: str = "model.diffusion_model.") -> dict:
    w = _Writer(sd, prefix)
    per, levels = config["layers_per_block"], len(config["block_out_channels"])
    for a, b in (("time_embed.0", "time_embedding.linear_1"), ("time_embed.2", "time_embedding.linear_2")):
        w.subtree(a, b)
    w.subtree("label_emb.0.0", "add_embedding.linear_1")
    w.subtree("label_emb.0.2", "add_embedding.linear_2")
    w.subtree("input_blocks.0.0", "conv_in")
    block = 1
    for level in range(levels):
        for j in range(per):
            w.subtree(f"input_blocks.{block}.0", f"down_blocks.{level}.resnets.{j}", _RESNET)
            w.subtree(f"input_blocks.{block}.1", f"down_blocks.{level}.attentions.{j}")
            block += 1
        if level < levels - 1:
            w.subtree(f"input_blocks.{block}.0.op", f"down_blocks.{level}.downsamplers.0.conv")
            block += 1
    w.subtree("middle_block.0", "mid_block.resnets.0", _RESNET)
    w.subtree("middle_block.1", "mid_block.attentions.0")
    w.subtree("middle_block.2", "mid_block.resnets.1", _RESNET)
    block = 0
    for level in range(levels):
        for j in range(per + 1):
            w.subtree(f"output_blocks.{block}.0", f"up_blocks.{level}.resnets.{j}", _RESNET)
            has_attention = w.subtree(f"output_blocks.{block}.1", f"up_blocks.{level}.attentions.{j}")
            if j == per and level < levels - 1:
                slot = 2 if has_attention else 1
                w.subtree(f"output_blocks.{block}.{slot}.conv", f"up_blocks.{level}.upsamplers.0.conv")
            block += 1
    w.subtree("out.0", "conv_norm_out")
    w.subtree("out.2", "conv_out")
    return w.done()


def vae_to_original(sd: dict, config: dict, prefix: str = "first_stage_model.") -> dict:
    w = _Writer(sd, prefix)
    per, levels = config["layers_per_block"], len(config["block_out_channels"])
    shortcut = {"conv_shortcut": "nin_shortcut"}
    for part in ("encoder", "decoder"):
        w.subtree(f"{part}.conv_in", f"{part}.conv_in")
        w.subtree(f"{part}.conv_out", f"{part}.conv_out")
        w.subtree(f"{part}.norm_out", f"{part}.conv_norm_out")
        w.subtree(f"{part}.mid.block_1", f"{part}.mid_block.resnets.0", shortcut)
        w.subtree(f"{part}.mid.block_2", f"{part}.mid_block.resnets.1", shortcut)
        attn = f"{part}.mid_block.attentions.0"
        w.subtree(f"{part}.mid.attn_1.norm", f"{attn}.group_norm")
        for new, old in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("proj_out", "to_out.0")):
            w.put(f"{part}.mid.attn_1.{new}.weight", f"{attn}.{old}.weight", lambda t: t[:, :, None, None])
            w.put(f"{part}.mid.attn_1.{new}.bias", f"{attn}.{old}.bias")
    for level in range(levels):
        for j in range(per):
            w.subtree(f"encoder.down.{level}.block.{j}", f"encoder.down_blocks.{level}.resnets.{j}", shortcut)
        if level < levels - 1:
            w.subtree(f"encoder.down.{level}.downsample.conv", f"encoder.down_blocks.{level}.downsamplers.0.conv")
    for i in range(levels):  # the decoder's up.{k} counts from the lowest resolution
        level = levels - 1 - i
        for j in range(per + 1):
            w.subtree(f"decoder.up.{level}.block.{j}", f"decoder.up_blocks.{i}.resnets.{j}", shortcut)
        if i < levels - 1:
            w.subtree(f"decoder.up.{level}.upsample.conv", f"decoder.up_blocks.{i}.upsamplers.0.conv")
    w.subtree("quant_conv", "quant_conv")
    w.subtree("post_quant_conv", "post_quant_conv")
    return w.done()


def _text_model_keys(sd: dict) -> dict:
    """transformers 5 saves CLIPTextModel without `text_model.`; the original files always have it."""
    return {(k if k.startswith(("text_model.", "text_projection")) else f"text_model.{k}"): v for k, v in sd.items()}


def clip_to_original(sd: dict, prefix: str) -> dict:
    out = {prefix + k: v.contiguous() for k, v in _text_model_keys(sd).items()}
    out[prefix + "text_model.embeddings.position_ids"] = torch.arange(77, dtype=torch.int64)[None]
    return out


def openclip_to_original(sd: dict, num_layers: int, prefix: str) -> dict:
    sd = _text_model_keys(sd)
    w = _Writer(sd, prefix)
    w.put("token_embedding.weight", "text_model.embeddings.token_embedding.weight")
    w.put("positional_embedding", "text_model.embeddings.position_embedding.weight")
    w.subtree("ln_final", "text_model.final_layer_norm")
    if "text_projection.weight" in sd:
        w.put("text_projection", "text_projection.weight", lambda t: t.T)
    for i in range(num_layers):
        src, dst = f"text_model.encoder.layers.{i}", f"transformer.resblocks.{i}"
        for p in ("weight", "bias"):
            fused = torch.cat([sd[f"{src}.self_attn.{x}_proj.{p}"] for x in "qkv"])
            w.out[f"{prefix}{dst}.attn.in_proj_{p}"] = fused.contiguous()
            w.left -= {f"{src}.self_attn.{x}_proj.{p}" for x in "qkv"}
        w.subtree(f"{dst}.attn.out_proj", f"{src}.self_attn.out_proj")
        w.subtree(f"{dst}.ln_1", f"{src}.layer_norm1")
        w.subtree(f"{dst}.ln_2", f"{src}.layer_norm2")
        w.subtree(f"{dst}.mlp.c_fc", f"{src}.mlp.fc1")
        w.subtree(f"{dst}.mlp.c_proj", f"{src}.mlp.fc2")
    out = w.done()
    out[prefix + "logit_scale"] = torch.tensor(4.6052)
    return out


def _sd(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def ldm_buffers() -> dict[str, torch.Tensor]:
    """The DDPM schedule buffers every LDM training checkpoint carries beside the models."""
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    alphas_cumprod = torch.cumprod(1 - betas, 0)
    return {"betas": betas.float(), "alphas_cumprod": alphas_cumprod.float(), "alphas_cumprod_prev": alphas_cumprod}


def pipeline_to_original(
    pipe,
    kind: str,
    *,
    ema: bool = False,
    ema_noise_seed: int = 7,
    sd2_extra_layer: bool = False,
    buffers: bool = True,
) -> dict[str, torch.Tensor]:
    """A whole tiny diffusers pipeline (`reference.sd_pipeline` / `sdxl_pipeline`) -> one original-layout state dict.

    `kind`: "sd1" (also SD 1 inpainting), "sd2", "sdxl" or "sdxl-refiner". `ema=True` writes the pipeline's UNet
    as the EMA copy (`model_ema.*`, LitEma's dot-less names) and a perturbed copy as the plain weights, so the two
    are told apart. `sd2_extra_layer` adds the 24th OpenCLIP block real SD 2 files carry (SD 2 uses the penultimate
    layer; diffusers drops it).
    """
    out: dict[str, torch.Tensor] = {}
    unet_sd = _sd(pipe.unet)
    unet = unet_to_original(unet_sd, dict(pipe.unet.config))
    if ema:
        g = torch.Generator().manual_seed(ema_noise_seed)
        for k, v in unet.items():
            out["model_ema." + k[len("model.") :].replace(".", "")] = v
            noise = 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else 0
            out[k] = (v + noise).contiguous()
        out["model_ema.decay"] = torch.tensor(0.9999)
        out["model_ema.num_updates"] = torch.tensor(1000, dtype=torch.int32)
    else:
        out.update(unet)
    out.update(vae_to_original(_sd(pipe.vae), dict(pipe.vae.config)))
    if kind == "sd1":
        out.update(clip_to_original(_sd(pipe.text_encoder), "cond_stage_model.transformer."))
    elif kind == "sd2":
        te = pipe.text_encoder
        n = te.config.num_hidden_layers
        sd = _sd(te)
        prefix = "cond_stage_model.model."
        out.update(openclip_to_original(sd, n, prefix))
        d = te.config.hidden_size
        g = torch.Generator().manual_seed(3)
        out[prefix + "text_projection"] = torch.randn(d, d, generator=g)  # real SD 2 files keep it; unused
        if sd2_extra_layer:
            src = {k: v for k, v in openclip_to_original(sd, n, prefix).items() if f"resblocks.{n - 1}." in k}
            for k, v in src.items():
                out[k.replace(f"resblocks.{n - 1}.", f"resblocks.{n}.")] = v + 0.5
    elif kind == "sdxl":
        out.update(clip_to_original(_sd(pipe.text_encoder), "conditioner.embedders.0.transformer."))
        te2 = pipe.text_encoder_2
        out.update(openclip_to_original(_sd(te2), te2.config.num_hidden_layers, "conditioner.embedders.1.model."))
    elif kind == "sdxl-refiner":  # OpenCLIP bigG alone, as embedder 0
        te2 = pipe.text_encoder_2
        out.update(openclip_to_original(_sd(te2), te2.config.num_hidden_layers, "conditioner.embedders.0.model."))
    else:
        raise ValueError(kind)
    if buffers:
        out.update(ldm_buffers())
    return out


def save_original(
    state: dict[str, torch.Tensor],
    path: Path,
    *,
    dtype: torch.dtype | None = None,
    pickle: bool = False,
    global_step: int | None = None,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write as safetensors (default) or as a Lightning-style `torch.save` pickle `{"state_dict": ..., ...}`.
    `dtype` casts the floating tensors (fp16/bf16 files, as civitai ships them)."""
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    if pickle:
        torch.save({"state_dict": state, "global_step": global_step or 0, "epoch": 1}, path)
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata)
    return path


def numpy_state(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() if v.is_floating_point() else v.numpy() for k, v in state.items()}


def controlnet_to_original(sd: dict, config: dict, prefix: str = "") -> dict:
    """A diffusers ControlNet state dict in the original `cldm` layout: the UNet's encoder half under the UNet's
    names, the conditioning embedding as `input_hint_block` (SiLUs at the odd indices), `zero_convs.i.0` and
    `middle_block_out.0`."""
    unet = {k: v for k, v in sd.items() if not k.startswith("controlnet_")}
    out = unet_to_original(unet, config, prefix)
    w = _Writer({k: v for k, v in sd.items() if k.startswith("controlnet_")}, prefix)
    w.subtree("input_hint_block.0", "controlnet_cond_embedding.conv_in")
    n = 2 * (len(config["conditioning_embedding_out_channels"]) - 1)
    for i in range(n):
        w.subtree(f"input_hint_block.{2 * (i + 1)}", f"controlnet_cond_embedding.blocks.{i}")
    w.subtree(f"input_hint_block.{2 * (n + 1)}", "controlnet_cond_embedding.conv_out")
    i = 0
    while w.subtree(f"zero_convs.{i}.0", f"controlnet_down_blocks.{i}"):
        i += 1
    w.subtree("middle_block_out.0", "controlnet_mid_block")
    return {**out, **w.done()}
