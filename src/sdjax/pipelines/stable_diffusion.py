"""Stable Diffusion 1.x / 2.x text-to-image, with the API of Diffusers' `FlaxStableDiffusionPipeline`.

Two ways in:
- the guide's API: `prepare_inputs`, `__call__(prompt_ids, params, prng_seed, ..., jit=True)` over
  `replicate`d params and `shard`ed ids, and `_generate`, the per-device function users `pmap` themselves;
- `generate(prompt, ...) -> list[PIL.Image]` for everyone else: tokenizes, spreads the batch over all devices with
  `jit` + a `Mesh` (padding when the count does not divide) and decodes.

Generation is one jitted function: encode text -> `lax.fori_loop` over the sampler -> VAE decode. Image `i` of a
call draws its noise from `fold_in(key, i)`, so an image does not change with batch size or device count.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from sdjax import samplers as sampler_lib
from sdjax.parallel import sharding as sharding_lib
from sdjax.pipelines import common
from sdjax.pipelines.common import PipelineOutput, Progress
from sdjax.pipelines.images import make_image_grid, numpy_to_pil, to_uint8


class StableDiffusionPipeline:
    """Text-to-image with a CLIP text encoder, a UNet, a VAE and a sampler (diffusers `StableDiffusionPipeline`)."""

    model_index_class = "StableDiffusionPipeline"
    pipeline_config_keys: tuple[str, ...] = ()  # model_index.json settings passed to __init__

    def __init__(
        self,
        *,
        tokenizer,
        text_encoder,
        unet,
        vae,
        scheduler,
        safety_checker=None,
        feature_extractor=None,
        dtype=jnp.float32,
        name: str = "",
        params: dict | None = None,
    ):
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.unet = unet
        self.vae = vae
        self.scheduler = scheduler
        self.safety_checker = safety_checker
        self.feature_extractor = feature_extractor
        self.dtype = dtype
        self.name = name
        self.params = params
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self._progress: Progress | None = None
        self._placed: tuple | None = None
        self.devices: list | None = None  # devices the high-level path spreads a batch over (default: all)
        self.mesh: Mesh | None = None  # or a (data, model) mesh from sdjax.parallel.make_mesh
        self._p_generate = jax.pmap(
            self._generate, in_axes=(0, 0, 0, None, None, None, 0, 0, 0), static_broadcasted_argnums=(3, 4, 5)
        )
        self._jit_generate = jax.jit(self._generate, static_argnums=(3, 4, 5))
        self._jit_sample = jax.jit(
            self._sample,
            static_argnames=(
                "num_inference_steps",
                "height",
                "width",
                "sampler",
                "progress",
                "guidance_rescale",
                "return_latents",
            ),
        )

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str,
        *,
        revision: str | None = None,
        variant: str | None = None,
        dtype=jnp.float32,
        from_pt: bool = False,
        split_head_dim: bool = False,
        use_memory_efficient_attention: bool = False,
        attention: str | None = None,
        local_files_only: bool = False,
        **components,
    ):
        """Load a diffusers folder or Hub repo id -> `(pipeline, params)`.

        `dtype` is the dtype of the stored params and of the computation (the scheduler state stays float32).
        A keyword named like a component (`scheduler=`, `safety_checker=None`, ...) replaces or disables it;
        `scheduler` may also be a sampler name such as `"euler_a"` or `"DPM++ 2M Karras"`. `"sdjax/embedded"` names
        the small model shipped with the package. `from_pt` is accepted
        for compatibility and has no effect: PyTorch-format weights are always converted.
        """
        from sdjax.loading.components import load_pipeline_components
        from sdjax.pipelines.auto import resolve_alias

        del from_pt
        pretrained_model_name_or_path = resolve_alias(pretrained_model_name_or_path)
        scheduler = components.pop("scheduler", None)
        loaded, params, model_index = load_pipeline_components(
            pretrained_model_name_or_path,
            expected_class=cls.model_index_class,
            revision=revision,
            variant=variant,
            dtype=dtype,
            local_files_only=local_files_only,
            overrides=components,
        )
        runtime = {"split_head_dim": split_head_dim}
        if attention or use_memory_efficient_attention:
            runtime["attention"] = attention or "chunked"
        for name in ("unet", "text_encoder", "text_encoder_2", "vae"):
            module = loaded.get(name)
            if module is not None:
                fields = {k: v for k, v in runtime.items() if hasattr(module, k)}
                loaded[name] = module.clone(**fields) if fields else module
        if scheduler is not None:
            loaded["scheduler"] = sampler_lib.get_sampler(scheduler, base_config=loaded["scheduler"])
            params["scheduler"] = loaded["scheduler"].create_state()
        settings = {k: model_index[k] for k in cls.pipeline_config_keys if k in model_index}
        pipe = cls(**loaded, **settings, dtype=dtype, name=str(pretrained_model_name_or_path), params=params)
        return pipe, params

    # ------------------------------------------------------------------ the guide's API
    def prepare_inputs(self, prompt: str | Sequence[str]) -> np.ndarray:
        """Tokenize to CLIP ids: int32 `(N, 77)`, padded and truncated (with a warning)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif not isinstance(prompt, (list, tuple)) or not all(isinstance(p, str) for p in prompt):
            raise TypeError(f"prompt must be a str or a list of str, got {type(prompt).__name__}")
        return self.tokenizer(list(prompt))

    @property
    def default_size(self) -> tuple[int, int]:
        s = self.unet.config.sample_size
        h, w = (s, s) if isinstance(s, int) else s
        return h * self.vae_scale_factor, w * self.vae_scale_factor

    def numpy_to_pil(self, images):
        return numpy_to_pil(images)

    make_image_grid = staticmethod(make_image_grid)

    def _size_multiple(self) -> int:
        return self.vae_scale_factor * 2 ** (len(self.unet.config.block_out_channels) - 1)

    def _generate(
        self,
        prompt_ids,
        params,
        prng_seed,
        num_inference_steps: int = 50,
        height: int | None = None,
        width: int | None = None,
        guidance_scale=7.5,
        latents=None,
        neg_prompt_ids=None,
    ):
        """Per-device generation: ids `(B, 77)`, one key -> images `(B, H, W, 3)` in [0, 1].

        Image `j` uses `fold_in(prng_seed, j)`. Steps, height and width fix shapes and must be static.
        """
        num_inference_steps = common.check_static("num_inference_steps", num_inference_steps)
        dh, dw = self.default_size
        height = dh if height is None else common.check_static("height", height)
        width = dw if width is None else common.check_static("width", width)
        keys = common.image_keys(common.as_key_array(prng_seed), prompt_ids.shape[0])
        return self._sample(
            params,
            prompt_ids,
            neg_prompt_ids,
            keys,
            guidance_scale,
            latents,
            num_inference_steps=num_inference_steps,
            height=height,
            width=width,
            sampler=self.scheduler,
        )

    def __call__(
        self,
        prompt_ids,
        params,
        prng_seed,
        num_inference_steps: int = 50,
        height: int | None = None,
        width: int | None = None,
        guidance_scale=7.5,
        latents=None,
        neg_prompt_ids=None,
        return_dict: bool = True,
        jit: bool = False,
    ):
        """The old Flax pipeline call. With `jit=True` inputs are per device (`replicate(params)`,
        `shard(prompt_ids)` -> `(ndev, bs, 77)`, one key per device) and images come back `(ndev, bs, H, W, 3)`;
        with `jit=False`, `(N, 77)` -> `(N, H, W, 3)`. Called inside a user's `pmap`, it traces `_generate`."""
        height = self.default_size[0] if height is None else height
        width = self.default_size[1] if width is None else width
        if common.is_traced(prompt_ids, prng_seed, params):
            images = self._generate(
                prompt_ids,
                params,
                prng_seed,
                num_inference_steps,
                height,
                width,
                guidance_scale,
                latents,
                neg_prompt_ids,
            )
            return PipelineOutput(images) if return_dict else (images,)
        self._validate_call(
            prompt_ids,
            params,
            prng_seed,
            num_inference_steps,
            height,
            width,
            guidance_scale,
            latents,
            neg_prompt_ids,
            jit,
        )
        if jit:
            ndev, bs = prompt_ids.shape[:2]
            g = common.per_device_guidance(guidance_scale, ndev, bs)
            images = self._p_generate(
                prompt_ids, params, prng_seed, num_inference_steps, height, width, g, latents, neg_prompt_ids
            )
        else:
            images = self._jit_generate(
                prompt_ids,
                params,
                prng_seed,
                num_inference_steps,
                height,
                width,
                jnp.asarray(guidance_scale, jnp.float32),
                latents,
                neg_prompt_ids,
            )
        images = np.array(images)  # a writable copy (upstream #5450)
        nsfw = self._run_safety_checker(images, params, jit)
        if not return_dict:
            return (images, nsfw)
        return PipelineOutput(images, nsfw)

    def _validate_call(self, prompt_ids, params, prng_seed, steps, height, width, guidance, latents, neg_ids, jit):
        for name, v in (("num_inference_steps", steps), ("height", height), ("width", width)):
            common.check_static(name, v)
        common.check_steps(steps)
        common.check_size(height, width, self._size_multiple())
        self._check_params(params, per_device=jit)
        ids = tuple(np.shape(prompt_ids))
        suffix = self.ids_suffix
        lead = ids[: len(ids) - len(suffix)]
        if ids[len(lead) :] != suffix or len(lead) != (2 if jit else 1):
            want = (
                f"(num_devices, batch_per_device, {', '.join(map(str, suffix))})"
                if jit
                else (f"(N, {', '.join(map(str, suffix))})")
            )
            how = "shard(pipeline.prepare_inputs(prompts))" if jit else "pipeline.prepare_inputs(prompts)"
            raise ValueError(
                f"prompt_ids has shape {ids}; with jit={jit} {type(self).__name__} expects {want}, as made by {how}"
            )
        if jit:
            ndev = jax.local_device_count()
            if lead[0] != ndev:
                raise ValueError(
                    f"prompt_ids has {lead[0]} device slices but there are {ndev} local devices: "
                    f"the prompt count must be divisible by {ndev} (shard() splits it per device)"
                )
            if np.shape(prng_seed)[:1] != (ndev,):
                raise ValueError(
                    f"prng_seed has shape {np.shape(prng_seed)}; with jit=True pass one key per "
                    f"device: jax.random.split(key, {ndev})"
                )
            g = np.shape(guidance)
            if g not in ((), (ndev,), (ndev, 1), (ndev, lead[1])):
                raise ValueError(
                    f"guidance_scale has shape {g}; with jit=True use a float or an array of shape "
                    f"({ndev},), ({ndev}, 1) or ({ndev}, {lead[1]})"
                )
        else:
            g = np.shape(guidance)
            if g not in ((), (1,), (lead[0],)):
                raise ValueError(f"guidance_scale has shape {g}; use a float or one value per prompt ({lead[0]},)")
        if neg_ids is not None and np.shape(neg_ids) != ids:
            raise ValueError(
                f"neg_prompt_ids has shape {np.shape(neg_ids)} but prompt_ids has shape {ids}: pass "
                f"one negative prompt per prompt"
            )
        if latents is not None:
            want = lead + (
                self.unet.config.in_channels,
                height // self.vae_scale_factor,
                width // self.vae_scale_factor,
            )
            if tuple(np.shape(latents)) != want:
                raise ValueError(f"latents has shape {np.shape(latents)}; expected {want} for {height}x{width}")

    ids_suffix: tuple[int, ...] = (77,)

    def _check_params(self, params, per_device: bool) -> None:
        if not isinstance(params, dict):
            raise TypeError(f"params must be the dict returned by from_pretrained, got {type(params).__name__}")
        missing = [k for k in ("text_encoder", "unet", "vae", "scheduler") if k not in params]
        if missing:
            raise KeyError(f"params is missing component(s) {missing}; pass the params from from_pretrained")
        if per_device:
            leaf = jax.tree_util.tree_leaves(params["unet"])[0]
            if leaf.ndim == 0 or leaf.shape[0] != jax.local_device_count():
                raise ValueError("with jit=True params must be replicated per device: p_params = replicate(params)")

    def _run_safety_checker(self, images: np.ndarray, params, jit: bool):
        if self.safety_checker is None or "safety_checker" not in params:
            return None
        flat = images.reshape((-1,) + images.shape[-3:])
        sc_params = params["safety_checker"]
        if jit:
            sc_params = jax.tree_util.tree_map(lambda x: x[0], sc_params)
        flat, nsfw = self.safety_checker.check(sc_params, flat)
        images[...] = flat.reshape(images.shape)
        return np.asarray(nsfw).reshape(images.shape[:-3])

    # ------------------------------------------------------------------ the one jitted function
    def _conditioning(self, params, prompt_ids, neg_prompt_ids, height: int, width: int, extra):
        """Text conditioning for the stacked (uncond, cond) batch: `(context (2B, 77, D), unet keyword args)`.

        Without negative ids the unconditional branch encodes the empty prompt, as diffusers does.
        """
        del height, width, extra
        if neg_prompt_ids is None:
            neg_prompt_ids = jnp.broadcast_to(jnp.asarray(self.tokenizer([""])), prompt_ids.shape)
        ids = jnp.concatenate([neg_prompt_ids, prompt_ids])
        out = self.text_encoder.apply({"params": params["text_encoder"]}, ids)
        return out.last_hidden_state, {}

    def _sample(
        self,
        params,
        prompt_ids,
        neg_prompt_ids,
        keys,
        guidance_scale,
        latents=None,
        extra=None,
        *,
        num_inference_steps: int,
        height: int,
        width: int,
        sampler,
        progress: bool = False,
        guidance_rescale: float = 0.0,
        return_latents: bool = False,
    ):
        """ids, keys `(B, 2)`, guidance scalar or `(B,)` -> images `(B, H, W, 3)` float32 in [0, 1]."""
        batch = prompt_ids.shape[0]
        context, added = self._conditioning(params, prompt_ids, neg_prompt_ids, height, width, extra)
        shape = (batch, self.unet.config.in_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)
        if latents is None:
            latents = common.per_image_normal(keys, 0, shape[1:])
        guidance = common.guidance_per_image(guidance_scale, batch)

        def predict_noise(x, t):
            return self.unet.apply({"params": params["unet"]}, x.astype(self.dtype), t, context, **added)

        latents = common.denoise(
            sampler=sampler,
            sampler_state=params["scheduler"],
            latents=latents.astype(jnp.float32),
            keys=keys,
            guidance=guidance,
            num_inference_steps=num_inference_steps,
            predict_noise=predict_noise,
            guidance_rescale=guidance_rescale,
            on_step=self._emit_step if progress else None,
        )
        if return_latents:
            return latents
        return self._decode(params, latents)

    def _decode(self, params, latents):
        cfg = self.vae.config
        z = latents / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        vae, vae_params = self.vae, params["vae"]
        if self.dtype == jnp.float16 and cfg.force_upcast:
            vae = vae.clone(dtype=jnp.float32)
            vae_params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), vae_params)
        images = vae.apply({"params": vae_params}, z.astype(vae.dtype), method=vae.decode)
        images = jnp.clip(images.astype(jnp.float32) / 2 + 0.5, 0, 1)
        return images.transpose(0, 2, 3, 1)

    def _emit_step(self, i, total) -> None:
        if self._progress is not None:
            self._progress("denoise", int(i) + 1, int(total))

    # ------------------------------------------------------------------ high-level API
    @property
    def default_sampler(self) -> str:
        return sampler_lib.name_of(self.scheduler)

    @property
    def sampler_names(self) -> list[str]:
        return sampler_lib.available()

    def validate(
        self,
        *,
        prompts: Sequence[str] | None = None,
        negative_prompts: Sequence[str] | None = None,
        steps: int | None = None,
        height: int | None = None,
        width: int | None = None,
        guidance_scales: Sequence[float] | None = None,
        sampler: str | None = None,
        num_images: int | None = None,
    ) -> None:
        """Check high-level arguments; raises ValueError naming the argument, before anything compiles."""
        if prompts is not None and (not prompts or not all(isinstance(p, str) for p in prompts)):
            raise ValueError("prompt must be a non-empty str or list of str")
        if negative_prompts is not None and prompts is not None and len(negative_prompts) not in (1, len(prompts)):
            raise ValueError(
                f"negative_prompt: got {len(negative_prompts)} for {len(prompts)} prompts; pass one, or one per prompt"
            )
        if steps is not None:
            common.check_steps(common.check_static("steps", steps))
        if height is not None or width is not None:
            dh, dw = self.default_size
            common.check_size(height or dh, width or dw, self._size_multiple())
        if guidance_scales is not None:
            for g in guidance_scales:
                if not np.isfinite(g):
                    raise ValueError(f"guidance_scale={g} must be a finite number")
        if num_images is not None and (not isinstance(num_images, int) or num_images < 1):
            raise ValueError(f"num_images={num_images!r} must be a positive int")
        if sampler is not None:
            sampler_lib.get_sampler(sampler, base_config=self.scheduler)

    def _sampler(self, name: str | None):
        if name is None:
            return self.scheduler
        return _cached_sampler(self.scheduler, name)

    def _batch_extra(self, negative_prompts: list[str], height: int, width: int, **conditioning):
        """Per-image conditioning beyond the text (SDXL's micro-conditioning); SD has none."""
        if conditioning:
            raise TypeError(f"unexpected keyword argument(s) {sorted(conditioning)} for {type(self).__name__}")
        return None

    def _placed_params(self, params, mesh: Mesh):
        """`params` placed on `mesh` by the sharding rules, kept between calls so a call does not copy them again."""
        key = (id(params), tuple(d.id for d in mesh.devices.flat), mesh.axis_names, mesh.devices.shape)
        if self._placed is None or self._placed[0] != key:
            self._placed = None
            self._placed = (key, sharding_lib.shard_params(params, mesh))
        return self._placed[1]

    def _with_sampler_state(self, placed, sampler: str | None, mesh: Mesh):
        """Params whose scheduler state belongs to `sampler` (the loaded one's state serves only the loaded one)."""
        chosen = self._sampler(sampler)
        if chosen == self.scheduler:
            return placed
        return {**placed, "scheduler": sharding_lib.shard_params(chosen.create_state(), mesh)}

    def _mesh(self) -> Mesh:
        """`self.mesh` if set, else a data-parallel mesh over `self.devices` (default: every device)."""
        if self.mesh is not None:
            return self.mesh
        devices = self.devices or jax.devices()
        return sharding_lib.make_mesh(len(devices), 1, devices)

    def generate_arrays(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str],
        seeds: Sequence[int],
        image_indices: Sequence[int],
        guidance_scales: Sequence[float],
        *,
        steps: int,
        height: int,
        width: int,
        sampler: str | None = None,
        pad_to: int | None = None,
        progress: Progress | None = None,
        params: dict | None = None,
        guidance_rescale: float = 0.0,
        **conditioning,
    ) -> np.ndarray:
        """Images `(N, H, W, 3)` uint8; image `i` uses key `fold_in(PRNGKey(seeds[i]), image_indices[i])`.

        The batch is padded to `pad_to` (or the next multiple of the device count) and sharded over a `data` mesh
        axis; padding images are dropped before returning.
        """
        n = len(prompts)
        if not (len(negative_prompts) == len(seeds) == len(image_indices) == len(guidance_scales) == n):
            raise ValueError(
                "generate_arrays: prompts, negative_prompts, seeds, image_indices and guidance_scales "
                "must have the same length"
            )
        self.validate(
            prompts=list(prompts),
            steps=steps,
            height=height,
            width=width,
            guidance_scales=list(guidance_scales),
            sampler=sampler,
        )
        params = self.params if params is None else params
        if params is None:
            raise ValueError("no params: pass params= or load the pipeline with from_pretrained")
        mesh = self._mesh()
        ndev = mesh.shape[sharding_lib.DATA]
        total = max(n, pad_to or 0)
        total = -(-total // ndev) * ndev
        pad = total - n
        ids = self.prepare_inputs(list(prompts) + [""] * pad)
        neg = self.prepare_inputs(list(negative_prompts) + [""] * pad)
        keys = np.stack(
            [
                np.asarray(jax.random.fold_in(jax.random.PRNGKey(int(s)), int(i)))
                for s, i in zip(list(seeds) + [0] * pad, list(image_indices) + [0] * pad)
            ]
        )
        g = np.asarray(list(guidance_scales) + [1.0] * pad, np.float32)
        extra = self._batch_extra(list(negative_prompts) + [""] * pad, height, width, **conditioning)
        ids, neg, keys, g, extra = jax.tree_util.tree_map(
            lambda x: sharding_lib.put_global_batch(x, mesh), (ids, neg, keys, g, extra)
        )
        params = self._with_sampler_state(self._placed_params(params, mesh), sampler, mesh)
        self._progress = progress
        try:
            if progress:
                progress("denoise", 0, self._sampler(sampler).num_model_calls(steps))
            images = self._jit_sample(
                params,
                ids,
                neg,
                keys,
                g,
                None,
                extra,
                num_inference_steps=steps,
                height=height,
                width=width,
                sampler=self._sampler(sampler),
                progress=progress is not None,
                guidance_rescale=float(guidance_rescale),
            )
            images = sharding_lib.gather_to_host(images)[:n]
        finally:
            self._progress = None
        if progress:
            progress("decode", 1, 1)
        return to_uint8(images)

    def generate(
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str] | None = None,
        num_images: int = 1,
        seed: int = 0,
        steps: int | None = None,
        guidance_scale: float | None = None,
        height: int | None = None,
        width: int | None = None,
        sampler: str | None = None,
        progress: Progress | None = None,
        params: dict | None = None,
        **conditioning,
    ):
        """Prompt(s) -> list of PIL images (`num_images` per prompt). Image `i` of the call uses
        `fold_in(PRNGKey(seed), i)`, whatever the device count."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        negs = (
            [negative_prompt or ""]
            if negative_prompt is None or isinstance(negative_prompt, str)
            else list(negative_prompt)
        )
        self.validate(prompts=prompts, negative_prompts=negs, num_images=num_images)
        negs = negs * len(prompts) if len(negs) == 1 else negs
        steps = self.default_steps if steps is None else steps
        guidance_scale = 7.5 if guidance_scale is None else guidance_scale
        dh, dw = self.default_size
        all_prompts = [p for p in prompts for _ in range(num_images)]
        all_negs = [q for q in negs for _ in range(num_images)]
        count = len(all_prompts)
        arrays = self.generate_arrays(
            all_prompts,
            all_negs,
            [seed] * count,
            list(range(count)),
            [guidance_scale] * count,
            steps=steps,
            height=height or dh,
            width=width or dw,
            sampler=sampler,
            progress=progress,
            params=params,
            **conditioning,
        )
        return numpy_to_pil(arrays)

    default_steps = 50

    def aot_compile(
        self,
        *,
        batch_size: int,
        height: int | None = None,
        width: int | None = None,
        steps: int | None = None,
        sampler: str | None = None,
        params: dict | None = None,
        guidance_rescale: float = 0.0,
    ):
        """Lower and compile generation for one static setting ahead of time (`jit(...).lower(...).compile()`).

        Returns `fn(prompt_ids, neg_prompt_ids, keys, guidance_scales, extra=None) -> images (B, H, W, 3)` float32
        that runs the compiled executable with the params placed on the pipeline's mesh; `keys` are per-image raw
        keys `(B, 2)`; `extra` is what `_batch_extra` builds (SDXL micro-conditioning; `None` for SD). The batch is
        split over the mesh's `data` axis, so `batch_size` must divide by it.
        """
        dh, dw = self.default_size
        height, width = height or dh, width or dw
        steps = self.default_steps if steps is None else steps
        self.validate(steps=steps, height=height, width=width, sampler=sampler)
        mesh = self._mesh()
        if batch_size % mesh.shape[sharding_lib.DATA]:
            raise ValueError(
                f"batch_size={batch_size} must be a multiple of the mesh's data axis "
                f"({mesh.shape[sharding_lib.DATA]} devices)"
            )
        placed = self._with_sampler_state(
            self._placed_params(self.params if params is None else params, mesh), sampler, mesh
        )
        batch = sharding_lib.batch_sharding(mesh)
        extra = self._batch_extra([""] * batch_size, height, width)

        def spec(shape, dtype):
            return jax.ShapeDtypeStruct(shape, dtype, sharding=batch)

        ids = spec((batch_size,) + self.ids_suffix, jnp.int32)
        extra_spec = jax.tree_util.tree_map(lambda x: spec(np.shape(x), np.asarray(x).dtype), extra)
        lowered = self._jit_sample.lower(
            placed,
            ids,
            ids,
            spec((batch_size, 2), jnp.uint32),
            spec((batch_size,), jnp.float32),
            None,
            extra_spec,
            num_inference_steps=steps,
            height=height,
            width=width,
            sampler=self._sampler(sampler),
            progress=False,
            guidance_rescale=float(guidance_rescale),
        )
        compiled = lowered.compile()

        def run(prompt_ids, neg_prompt_ids, keys, guidance_scales, extra_values=None):
            extra_values = extra if extra_values is None else extra_values
            args = (
                prompt_ids,
                neg_prompt_ids,
                np.asarray(keys, np.uint32),
                np.asarray(guidance_scales, np.float32),
                extra_values,
            )
            args = jax.tree_util.tree_map(lambda x: sharding_lib.put_global_batch(np.asarray(x), mesh), args)
            return compiled(placed, *args[:4], None, args[4])

        run.compiled = compiled
        return run

    def warmup(self, batch_size: int, height: int, width: int, steps: int, sampler: str | None = None) -> None:
        """Compile the high-level path for one shape ahead of time (by running it once on empty prompts)."""
        self.generate_arrays(
            [""] * batch_size,
            [""] * batch_size,
            [0] * batch_size,
            list(range(batch_size)),
            [1.0] * batch_size,
            steps=steps,
            height=height,
            width=width,
            sampler=sampler,
        )


@functools.lru_cache(maxsize=64)
def _cached_sampler(base, name: str):
    return sampler_lib.get_sampler(name, base_config=base)
