"""Stable Diffusion 3 / 3.5: `conditioning.py` (CLIP-L + CLIP-G + T5), `denoiser.py` (the MMDiT transformer and
skip-layer guidance), `pipeline.py` (`StableDiffusion3Pipeline`)."""
