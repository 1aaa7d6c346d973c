"""Stable Diffusion XL (base, refiner, inpainting): two CLIP text encoders and micro-conditioning, the UNet
denoiser of `families.sd`."""

from sdjax.families.sdxl.conditioning import SDXLConditioning

__all__ = ["SDXLConditioning"]
