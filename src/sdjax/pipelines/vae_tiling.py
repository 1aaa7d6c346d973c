"""VAE tiling and slicing on a pipeline: `enable_vae_tiling()` / `disable_vae_tiling()` and `enable_vae_slicing()` /
`disable_vae_slicing()`, as diffusers' pipelines have them.

With tiling on, every program the pipeline compiles afterwards (text-to-image decode, image-to-image and inpainting
encode) runs the VAE tile by tile (`models.vae_tiling`: diffusers' `AutoencoderKL` tiling, with its overlap and
blending), so a large image's decode needs one tile's activations instead of the whole image's. The setting is part
of the compile key (`ProgramSpec.vae_tiling`): switching it compiles (or reuses) a different program and never
changes one already compiled. Images that fit one tile are unchanged, as in diffusers.

With slicing on, the VAE runs over the batch one image per device at a time (`models.vae_slicing`): the memory of
one image's VAE activations per device instead of the whole batch's, and the same images (no cross-image
operation). It combines with tiling (each slice is decoded tile by tile). Also part of the compile key.
"""

from __future__ import annotations

from sdjax.models.vae_tiling import DEFAULT_OVERLAP, VaeTiling


class VaeTilingMixin:
    """The VAE tiling and slicing methods of `DiffusionPipeline` (see the module docstring)."""

    def enable_vae_tiling(self, tile_size: int | None = None, overlap_factor: float = DEFAULT_OVERLAP) -> None:
        """Encode and decode through the VAE in overlapping tiles (diffusers' `enable_vae_tiling`). `tile_size`: the
        tile edge in pixels (default: the VAE config's `sample_size`, as diffusers: 512 for SD 1.5, 1024 for SDXL);
        `overlap_factor`: diffusers' `tile_overlap_factor`."""
        self.generator.vae_tiling = VaeTiling.for_config(self.vae.config, tile_size, overlap_factor)

    def disable_vae_tiling(self) -> None:
        """Run the VAE on whole images again (the default)."""
        self.generator.vae_tiling = None

    @property
    def vae_tiling(self) -> VaeTiling | None:
        """The tiling settings in use, or None."""
        return self.generator.vae_tiling

    def enable_vae_slicing(self) -> None:
        """Encode and decode one image per device at a time (diffusers' `enable_vae_slicing`): same images, the VAE
        memory of one image per device instead of the batch's."""
        self.generator.vae_slicing = True

    def disable_vae_slicing(self) -> None:
        """Run the VAE on the whole batch at once again (the default)."""
        self.generator.vae_slicing = False
