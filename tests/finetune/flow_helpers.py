"""Helpers of the flow-matching LoRA tests (Flux.1, SD 3): the tiny diffusers pipelines saved as folders, a short
`train_lora` run on them, a peft LoRA on diffusers' transformer, and the loss of diffusers'
`train_dreambooth_lora_flux.py` / `train_dreambooth_lora_sd3.py` written out as the scripts compute it (their lines,
on given latents, noise, `u` and text states instead of their random draws and encoders)."""

from __future__ import annotations

import copy

import numpy as np

from sdjax.finetune import flow_models


def save_flux(tmp_path_factory, kind: str, tokenizer_dir):
    """A tiny diffusers FluxPipeline ("dev" / "schnell") saved as a folder -> (torch pipeline, folder)."""
    import flux_reference

    torch_pipe = flux_reference.flux_pipeline(kind, seed=0, tokenizer_dir=tokenizer_dir)
    folder = tmp_path_factory.mktemp(f"flux-{kind}")
    torch_pipe.save_pretrained(folder, safe_serialization=True)
    return torch_pipe, folder


def save_sd3(tmp_path_factory, tokenizer_dir):
    import sd3_reference

    torch_pipe = sd3_reference.sd3_pipeline(seed=0, tokenizer_dir=tokenizer_dir)
    folder = tmp_path_factory.mktemp("sd3")
    torch_pipe.save_pretrained(folder, safe_serialization=True)
    return torch_pipe, folder


def dev_and_sd3_pipelines(tmp_path_factory, max_sequence_length: int) -> dict:
    """family -> (torch pipeline, folder, sdjax pipeline, params) for a tiny Flux dev and SD 3 saved as folders."""
    import t5_reference

    from sdjax.pipelines import load_pipeline

    tok = t5_reference.write_t5_tokenizer(tmp_path_factory.mktemp("t5-tokenizer"))
    out = {}
    for family, (torch_pipe, folder) in (
        ("flux", save_flux(tmp_path_factory, "dev", tok)),
        ("sd3", save_sd3(tmp_path_factory, tok)),
    ):
        pipe, params = load_pipeline(str(folder))
        pipe.max_sequence_length = max_sequence_length
        out[family] = (torch_pipe, folder, pipe, params)
    return out


def tiny_lora_run(data, out, folder, *, size: int, **options):
    """`finetune.train_lora` of the saved tiny pipeline `folder` on the images in `data`: batches of two at `size`
    pixels without bucketing, the LoRA written to `out` (`options`: steps, rank, alpha, lr, ... as `train_lora`
    takes them)."""
    from sdjax.finetune import train_lora

    return train_lora(data, out, model=str(folder), batch_size=2, resolution=size, bucketing=False, **options)


def peft_transformer(torch_transformer, targets, rank: int, alpha: float, seed: int = 0):
    """A frozen float32 copy of `torch_transformer` with the scripts' peft LoRA (`init_lora_weights="gaussian"`)
    on `targets`, and nonzero B factors (so both factors' gradients are meaningful)."""
    import torch
    from peft import LoraConfig

    model = copy.deepcopy(torch_transformer).float()
    model.requires_grad_(False)
    torch.manual_seed(seed)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(targets)))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def script_loss(family: str, transformer, scheduler_config, batch: dict, *, weighting_scheme: str, guidance=3.5,
                precondition_outputs: bool = False, prior_loss_weight: float | None = None):  # fmt: skip
    """The scripts' loss on `batch` (`latents`, `noise`, `u`, `text`, `pooled`: numpy, or torch tensors, e.g. the
    outputs of text encoders with LoRA) -> torch scalar; with `prior_loss_weight` the batch is [instance; class]
    and the loss the scripts' `--with_prior_preservation` sum."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    noise_scheduler_copy = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    model_input, noise, u, prompt_embeds, pooled_prompt_embeds = (
        v if isinstance(v, torch.Tensor) else torch.from_numpy(v)
        for v in (batch[k] for k in ("latents", "noise", "u", "text", "pooled"))
    )

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        sigmas = noise_scheduler_copy.sigmas.to(dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
    timesteps = noise_scheduler_copy.timesteps[indices]
    sigmas = get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    if family == "flux":
        b, c, h, w = model_input.shape
        latent_image_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)
        packed = FluxPipeline._pack_latents(noisy_model_input, b, c, h, w)
        g = torch.tensor([guidance]).expand(b) if transformer.config.guidance_embeds else None
        text_ids = torch.zeros(prompt_embeds.shape[1], 3)
        model_pred = transformer(
            hidden_states=packed,
            timestep=timesteps / 1000,
            guidance=g,
            pooled_projections=pooled_prompt_embeds,
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=latent_image_ids,
            return_dict=False,
        )[0]
        vae_scale_factor = 8  # any factor: _unpack_latents divides the pixel size by it again
        model_pred = FluxPipeline._unpack_latents(model_pred, h * vae_scale_factor, w * vae_scale_factor, 8)
    else:
        model_pred = transformer(
            hidden_states=noisy_model_input,
            timestep=timesteps,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled_prompt_embeds,
            return_dict=False,
        )[0]
    if precondition_outputs:
        model_pred = model_pred * (-sigmas) + noisy_model_input
    weighting = compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = model_input if precondition_outputs else noise - model_input
    if prior_loss_weight is not None:  # the scripts' lines
        model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
        target, target_prior = torch.chunk(target, 2, dim=0)
        weighting, weighting_prior = torch.chunk(weighting, 2, dim=0)
        prior_loss = torch.mean(
            (weighting_prior.float() * (model_pred_prior.float() - target_prior.float()) ** 2).reshape(
                target_prior.shape[0], -1
            ),
            1,
        )
        prior_loss = prior_loss.mean()
    loss = torch.mean(
        (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1),
        1,
    )
    loss = loss.mean()
    if prior_loss_weight is not None:
        loss = loss + prior_loss_weight * prior_loss
    return loss


def peft_text_encoder(torch_text_encoder, rank: int, alpha: float, seed: int = 0):
    """A frozen float32 copy of a transformers CLIP text encoder with the scripts' `text_lora_config` (peft LoRA on
    `q_proj`, `k_proj`, `v_proj`, `out_proj`, gaussian init) and nonzero B factors."""
    import torch
    from peft import LoraConfig

    model = copy.deepcopy(torch_text_encoder).float()
    model.requires_grad_(False)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=list(flow_models.TEXT_TARGETS)
    )
    model.add_adapter(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def text_lora_from_peft(params_te, peft_model, rank: int, component: str) -> tuple[dict, dict]:
    """The sdjax LoRA of one CLIP encoder holding `peft_model`'s LoRA weights, and `{module: (A, B) parameters}`."""
    import jax

    lora = flow_models.init_lora(jax.random.PRNGKey(0), params_te, flow_models.TEXT_TARGETS, rank, component=component)
    named = dict(peft_model.named_parameters())
    torch_params = {}
    for name in lora[component]:
        module = flow_models.diffusers_module(tuple(name.split("/")))
        torch_module = module if f"{module}.lora_A.default.weight" in named else module.removeprefix("text_model.")
        a, b = named[f"{torch_module}.lora_A.default.weight"], named[f"{torch_module}.lora_B.default.weight"]
        lora[component][name] = {"down": a.detach().numpy().copy(), "up": b.detach().numpy().copy()}
        torch_params[module] = (a, b)
    assert 2 * len(torch_params) == sum("lora_" in n for n in named), "every peft LoRA layer has its sdjax twin"
    return lora, torch_params


def lora_from_peft(params_t, peft_model, targets, rank: int) -> tuple[dict, dict]:
    """The sdjax LoRA holding `peft_model`'s LoRA weights, and `{module: (lora_A, lora_B) parameters}`."""
    import jax

    lora = flow_models.init_lora(jax.random.PRNGKey(0), params_t, targets, rank)
    named = dict(peft_model.named_parameters())
    torch_params = {}
    for name in lora["transformer"]:
        module = flow_models.diffusers_module(tuple(name.split("/")))
        a, b = named[f"{module}.lora_A.default.weight"], named[f"{module}.lora_B.default.weight"]
        lora["transformer"][name] = {"down": a.detach().numpy().copy(), "up": b.detach().numpy().copy()}
        torch_params[module] = (a, b)
    assert 2 * len(torch_params) == sum("lora_" in n for n in named), "every peft LoRA layer has its sdjax twin"
    return lora, torch_params


def worst_grad_error(grads: dict, torch_params: dict, tol: float = 1e-4) -> float:
    """The worst relative (L2) error of the sdjax LoRA gradients against peft's; each at most `tol` (where peft's
    gradient is exactly zero, sdjax's must be zero to 1e-7)."""
    worst = 0.0
    for name, g in grads.items():
        module = flow_models.diffusers_module(tuple(name.split("/")))
        for ours, theirs in zip(("down", "up"), torch_params[module]):
            ref, got = theirs.grad.numpy(), np.asarray(g[ours])
            if not np.any(ref):  # a layer whose output is unused (SD 3's context pre-only block: add_q_proj)
                assert np.abs(got).max() <= 1e-7, f"{module} {ours}: gradient {np.abs(got).max():.1e}, peft's is 0"
                continue
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            worst = max(worst, err)
            assert err <= tol, f"{module} {ours}: gradient relative error {err:.2e}"
    return worst
