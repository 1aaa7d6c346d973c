"""sdjax: Stable Diffusion in JAX/Flax."""
