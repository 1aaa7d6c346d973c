"""Stable Diffusion 1.x / 2.x: one CLIP text encoder, a UNet, a VAE (see `sdjax.families` for the registry)."""

from sdjax.families.sd.conditioning import SDConditioning
from sdjax.families.sd.denoiser import UNetDenoiser

__all__ = ["SDConditioning", "UNetDenoiser"]
