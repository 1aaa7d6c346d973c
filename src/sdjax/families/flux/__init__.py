"""Flux.1 (dev, schnell and fine-tunes): CLIP-L pooled + T5 conditioning, the Flux transformer on packed latents,
flow matching (see `families.flux.pipeline`)."""
