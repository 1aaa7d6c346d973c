"""The generator: one jitted program per static setting, run on a `Mesh`, with a bounded cache of executables.

`program(models, spec, params, inputs, window)` is the whole generation as one pure function: text conditioning
-> the task's initial latents and hooks -> `loop.denoise` over the window -> VAE decode. Everything that changes
the compiled program is in the hashable `ProgramSpec` (task, batch, size, steps, sampler, guidance mode, outputs);
everything else is an array input: prompt ids, per-image keys and guidance scales, the family's micro-conditioning,
the task's images and masks, the features' arrays and params (`core.features`), and the window `[start, end)` (so
changing the strength does not recompile).

`Generator` owns what is constant for a model -- the modules, the default sampler, the params -- and runs
programs:
- on a `Mesh` (`jit` with the batch split over the `data` axis and the params placed by `parallel.sharding`'s
  rules), padding the batch to a multiple of the data axis;
- from a cache of AOT-compiled executables keyed by `(ProgramSpec, mesh)`, least recently used out (count and
  generated-code bytes bounded); an evicted executable is dropped, so XLA frees it;
- placing params once per leaf: a leaf is placed again only when it is a different array (params are never cached
  by the id of their dict, so new or edited params are always the ones used); on CPU the Winograd-transformed
  kernels are computed with the placement and kept the same way, per kernel array (`keep_winograd_kernels`).

`run` executes the program up to the latents and the VAE decode as two executables (`split_decode`, on by
default): the decode executable depends only on the image shape, so programs that differ in steps, sampler, task or
guidance share it (one decode compile per shape, not per program), and on XLA:CPU the two run faster than one
program holding both (docs/benchmarks.md, "loop vs alone"). The whole program stays one function for `lower`,
`sdjax.aot` and the guide API.

The guide API's `pmap` path (`pipeline(..., jit=True)`) runs the same `program` under `jax.pmap`, and
`pipeline._generate` traces it inside a user's own `pmap`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sdjax import rng
from sdjax.core import autoencoder, loop
from sdjax.core import features as feature_lib
from sdjax.core.cache import ProgramCache, callback_sites, compile_shared
from sdjax.core.protocols import PROMPT_SYNTAXES, Conditioning, Denoiser, Feature, FeatureRequest
from sdjax.core.tasks.base import Context, TaskRequest, TaskSpec, window
from sdjax.core.tasks.txt2img import Txt2Img
from sdjax.ops import attention as ops_attention
from sdjax.ops import conv as ops_conv
from sdjax.parallel import sharding as sharding_lib

Progress = Callable[[str, int, int], None]
OUTPUTS = ("images", "latents")


class Cancelled(Exception):
    """A run stopped by its `should_stop` callback before the last denoising step."""


@dataclasses.dataclass(frozen=True)
class ProgramSpec:
    """Everything that fixes a compiled generation program (hashable: the compile cache key)."""

    task: TaskSpec
    batch: int
    height: int
    width: int
    steps: int
    sampler: Any
    cfg: bool = True  # compute the unconditional branch (False when every guidance scale is <= 1)
    guidance_rescale: float = 0.0
    output: str = "images"  # "images" (NHWC float32 in [0, 1]) or "latents" (NCHW float32)
    interactive: bool = False  # a host callback per model call (progress, cancellation)
    previews: bool = False  # ... that also receives the current latents (progress(..., latents=))
    explicit_noise: bool = False  # the initial noise is an input instead of drawn from the keys
    text_chunks: int = 0  # A1111 prompt syntax: that many 77-token chunks per prompt, with token weights (0: plain)
    features: tuple[Feature, ...] = ()  # conditioning features run as loop hooks, in order (`core.features`)
    vae_tiling: Any = None  # a `models.vae_tiling.VaeTiling`: encode/decode tile by tile (diffusers' VAE tiling)
    vae_slicing: int = 0  # encode/decode this many images at a time (`models.vae_slicing`); 0: the whole batch

    def __post_init__(self):
        object.__setattr__(self, "features", feature_lib.check(self.features))

    @property
    def control(self) -> Feature | None:
        """The one feature of a spec that has at most one (the earlier single slot), else an error."""
        if len(self.features) > 1:
            raise ValueError(f"this spec has {len(self.features)} features: read spec.features")
        return self.features[0] if self.features else None


@dataclasses.dataclass(frozen=True, eq=False)
class Models:
    """The modules of one model (constant for a generator): a family's conditioning and denoiser, and the VAE."""

    conditioning: Conditioning
    denoiser: Denoiser
    vae: Any
    dtype: Any = jnp.float32

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        return int(self.vae.config.latent_channels)

    def components(self) -> tuple[str, ...]:
        return (*self.conditioning.components, self.denoiser.component, "vae")


def program(
    models: Models, spec: ProgramSpec, params: dict, inputs: dict, win: dict, on_step: Callable | None = None
) -> tuple[jax.Array, jax.Array]:
    """The whole generation -> `(images or latents, stopped)`. `inputs` hold per-image arrays with a leading batch
    dimension; `win` holds the scalars `start`, `end` (and `run`, the id the host callback is called with)."""
    batch = inputs["keys"].shape[0]
    cond = models.conditioning.encode(params, inputs, cfg=spec.cfg)
    f = models.vae_scale_factor
    shape = (batch, models.latent_channels, spec.height // f, spec.width // f)
    sampler = spec.sampler
    state = sampler.set_timesteps(sampler.create_state(), spec.steps, shape)
    keys = inputs["keys"]
    if spec.explicit_noise:
        noise = inputs["noise"].astype(jnp.float32)
    else:
        noise = rng.per_image_normal(keys, rng.LATENTS, shape[1:])

    def encode(images_nchw, stream):
        eps = rng.per_image_normal(keys, stream, shape[1:])
        return autoencoder.encode(
            models.vae, params["vae"], images_nchw, eps, models.dtype, spec.vae_tiling, spec.vae_slicing
        )

    ctx = Context(
        sampler=sampler,
        state=state,
        calls=int(sampler.num_model_calls(spec.steps)),
        shape=shape,
        keys=keys,
        noise=noise,
        start=win["start"],
        end=win["end"],
        cfg=spec.cfg,
        model_in_channels=int(models.denoiser.in_channels),
        encode=encode,
    )
    latents, hooks = spec.task.prepare(ctx, inputs)
    for feature in spec.features:  # after the task's hooks, in the spec's order
        hook = feature.hook(
            params[feature.params_key], inputs, cond=cond, cfg=spec.cfg, latent_channels=shape[1], encode=encode
        )
        hooks = [*hooks, hook]
    # Everything constant over the loop (prepared kernels, embeddings, token ids) is computed here, once.
    model = models.denoiser.bind(params, cond, inputs, cfg=spec.cfg)

    interactive = spec.interactive and on_step is not None
    latents, stopped = loop.denoise(
        model=model,
        sampler=sampler,
        state=state,
        latents=latents.astype(jnp.float32),
        start=win["start"],
        end=win["end"],
        keys=keys,
        guidance=inputs["guidance"],
        cfg=spec.cfg,
        guidance_rescale=spec.guidance_rescale,
        hooks=hooks,
        on_step=on_step if interactive else None,
        on_step_args=(win["run"],) if interactive else (),
        on_step_latents=interactive and spec.previews,
    )
    if spec.output == "latents":
        return latents, stopped
    height, width = spec.height, spec.width
    images = jax.lax.cond(
        stopped,
        lambda z: jnp.zeros((z.shape[0], height, width, 3), jnp.float32),
        lambda z: autoencoder.decode(models.vae, params["vae"], z, models.dtype, spec.vae_tiling, spec.vae_slicing),
        latents,
    )
    return images, stopped


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """What fixes a compiled VAE decode (the second executable of a split run): the image shape and the tiling."""

    batch: int
    height: int
    width: int
    vae_tiling: Any = None
    vae_slicing: int = 0


def decode_program(models: Models, spec: DecodeSpec, vae_params: dict, latents: jax.Array) -> jax.Array:
    """The denoiser's latents -> images NHWC float32 in [0, 1] (the decode of `program`, as its own function)."""
    return autoencoder.decode(models.vae, vae_params, latents, models.dtype, spec.vae_tiling, spec.vae_slicing)


# ------------------------------------------------------------------------------------------------- the generator
class Generator:
    """Runs generation programs for one model (see the module docstring)."""

    def __init__(
        self,
        *,
        conditioning: Conditioning,
        denoiser: Denoiser,
        vae,
        sampler,
        params: dict | None = None,
        dtype=jnp.float32,
        mesh: Mesh | None = None,
        devices: Sequence[Any] | None = None,
        cache_size: int = 16,
        cache_bytes: int | None = None,
    ):
        self.models = Models(conditioning, denoiser, vae, dtype)
        self.sampler = sampler
        self.params = params
        self.vae_tiling = None  # a `models.vae_tiling.VaeTiling` that `spec()` puts in every program, or None
        # Encode/decode a slice of the batch at a time (`models.vae_slicing`; `spec()` makes a slice one image per
        # device of the mesh's data axis).
        self.vae_slicing = False
        # How a strength becomes the first step (`tasks.base.window`): "int" or "float", as the family's diffusers
        # pipeline rounds it; the family's pipeline sets it.
        self.strength_rule = "int"
        self.split_decode = True  # `run` decodes with a second executable (module docstring); False: one program
        # On CPU, keep the Winograd-transformed kernels of the denoiser and VAE between runs
        # (`ops.conv.PreparedKernels`: about 2 s less per 512 px float32 generation of an 860M-parameter denoiser,
        # 3.8 GB held) while they fit `self.kernels.budget` (bytes; None: half the host memory available when
        # first decided); False, or beyond the budget: each program computes them (less memory held between runs,
        # a lower peak during the decode).
        self.keep_winograd_kernels = True
        self.kernels = ops_conv.PreparedKernels()
        self.mesh = mesh
        self.devices = list(devices) if devices is not None else None
        self.cache = ProgramCache(cache_size, cache_bytes)
        self._placed: dict[Any, dict[int, tuple[Any, Any]]] = {}
        self._place_lock = threading.Lock()
        self._pmapped: dict[Any, Any] = {}
        self._decoders: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def set_attention(self, attention: str) -> None:
        """Trace the denoiser's and VAE's attention as `attention` (`sdjax.ops.attention.IMPLEMENTATIONS`) from now
        on; programs compiled with the previous one are dropped (the attention is not part of a `ProgramSpec`)."""
        if attention not in ops_attention.IMPLEMENTATIONS:
            raise ValueError(f"attention={attention!r}: expected one of {ops_attention.IMPLEMENTATIONS}")
        m = self.models
        self.models = dataclasses.replace(
            m, denoiser=m.denoiser.with_attention(attention), vae=m.vae.clone(attention=attention)
        )
        self.cache.clear()
        self._pmapped.clear()
        self._decoders.clear()

    # ------------------------------------------------------------------ placement
    def get_mesh(self) -> Mesh:
        """`self.mesh` if set, else a data-parallel mesh over `self.devices` (default: every device, or
        `SDJAX_DEVICES` of them: `parallel.sharding.default_devices`)."""
        if self.mesh is not None:
            return self.mesh
        devices = self.devices or sharding_lib.default_devices()
        return sharding_lib.make_mesh(len(devices), 1, devices)

    def place_params(self, params: dict, mesh: Mesh) -> dict:
        """`params` on `mesh` by the sharding rules. A leaf seen before (the same immutable array object, kept
        alive by this cache so its id is not reused) keeps its placed copy; any other leaf is placed now."""
        mesh_key = _mesh_key(mesh)
        specs = sharding_lib.param_specs(params, mesh)
        with self._place_lock:
            old = self._placed.get(mesh_key, {})
            new: dict[int, tuple[Any, Any]] = {}

            def place(x, spec):
                hit = old.get(id(x))
                if hit is not None and hit[0] is x and isinstance(x, jax.Array):
                    new[id(x)] = hit
                    return hit[1]
                placed = jax.device_put(x, NamedSharding(mesh, spec))
                if isinstance(x, jax.Array):
                    new[id(x)] = (x, placed)
                return placed

            placed = jax.tree_util.tree_map(place, params, specs)
            self._placed = {mesh_key: new}
        return self._with_kernels(placed, mesh)

    def _keeps_kernels(self, mesh: Mesh, params: Any) -> bool:
        """Whether `params` run with kept prepared kernels: on CPU meshes, when kept at all and within the budget."""
        cpu = bool(self.keep_winograd_kernels) and _platform(mesh) == "cpu"
        return cpu and self.kernels.fits(params)

    def _program_key(self, spec: ProgramSpec, mesh: Mesh, params: Any) -> tuple:
        """What fixes a compiled program besides `spec`: the mesh, whether kept kernels are inputs, and the params'
        tree, shapes and dtypes (params passed with `params=` in another dtype, or quantized, get their own program
        instead of failing the cached one's)."""
        checked = self.check_params(self.params if params is None else params, features=spec.features)
        return spec, _mesh_key(mesh), self._keeps_kernels(mesh, checked), _tree_key(checked)

    def _with_kernels(self, placed: dict, mesh: Mesh) -> dict:
        """Placed (or abstract) params with the prepared Winograd kernels, where they are kept (CPU meshes); the
        kept ones of other params are dropped when these are not kept."""
        if self._keeps_kernels(mesh, placed):
            return self.kernels.add(placed)
        if not any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(placed)):
            self.kernels.clear()
        return placed

    def check_params(self, params: Any, *, features: Sequence[Feature] = ()) -> dict:
        """The entries the program reads from `params`: the model's components and each feature's
        `params_key`."""
        if params is None:
            raise ValueError("no params: pass params= or load the pipeline with from_pretrained")
        if not isinstance(params, dict):
            raise TypeError(f"params must be the dict returned by from_pretrained, got {type(params).__name__}")
        components = self.models.components()
        missing = [k for k in components if k not in params]
        if missing:
            raise KeyError(f"params is missing component(s) {missing}; pass the params from from_pretrained")
        keys = feature_lib.params_keys(features, components)
        for f, key in zip(features, keys):
            if key not in params:
                raise KeyError(f"params has no {key!r} entry, which the {f.name} feature reads: set params[{key!r}]")
        return {k: params[k] for k in (*components, *keys)}

    # ------------------------------------------------------------------ specs and windows
    def spec(
        self,
        *,
        task: TaskSpec | None = None,
        batch: int,
        height: int,
        width: int,
        steps: int,
        sampler=None,
        cfg: bool = True,
        guidance_rescale: float = 0.0,
        output: str = "images",
        interactive: bool = False,
        explicit_noise: bool = False,
        previews: bool = False,
        text_chunks: int = 0,
        features: Sequence[Feature] = (),
        control: Feature | None = None,
        mesh: Mesh | None = None,
        vae_slice: int | None = None,
    ) -> ProgramSpec:
        """The program for these settings, with the generator's VAE tiling and slicing. With slicing on, a slice is
        `vae_slice` images (default: one per device of the data axis of `mesh`, default the generator's; the
        per-device programs of `pmap` pass 1). `control` is one more feature after `features` (the earlier
        single-feature argument)."""
        if output not in OUTPUTS:
            raise ValueError(f"output={output!r} must be one of {list(OUTPUTS)}")
        return ProgramSpec(
            task=task or Txt2Img(),
            batch=int(batch),
            height=int(height),
            width=int(width),
            steps=int(steps),
            sampler=sampler if sampler is not None else self.sampler,
            cfg=bool(cfg),
            guidance_rescale=float(guidance_rescale),
            output=output,
            interactive=bool(interactive),
            explicit_noise=bool(explicit_noise),
            previews=bool(previews) and bool(interactive),
            text_chunks=int(text_chunks),
            features=(*features, *(() if control is None else (control,))),
            vae_tiling=self.vae_tiling,
            vae_slicing=(vae_slice or (mesh or self.get_mesh()).shape[sharding_lib.DATA]) if self.vae_slicing else 0,
        )

    def window(self, spec: ProgramSpec, task: TaskRequest) -> tuple[int, int]:
        return window(
            spec.sampler,
            spec.steps,
            strength=task.strength,
            denoising_start=task.denoising_start,
            denoising_end=task.denoising_end,
            start_step=task.start_step,
            strength_rule=self.strength_rule,
        )

    # ------------------------------------------------------------------ programs
    def _jitted(self, spec: ProgramSpec):
        return jax.jit(functools.partial(program, self.models, spec, on_step=_dispatch_step))

    def lower(
        self, spec: ProgramSpec, *, params: Any = None, mesh: Mesh | None = None, inputs: dict | None = None
    ) -> jax.stages.Lowered:
        """Lower the program for `spec` on `mesh` (default: the generator's). `params` may be arrays or abstract
        `jax.ShapeDtypeStruct`s (nothing allocated: shapes from the config, e.g. for a TPU topology); they are
        placed, or given shardings, by the rules table. `inputs` are example host arrays, used for their shapes."""
        return self._lower(spec, params=params, mesh=mesh, inputs=inputs)[0]

    def _lower(
        self, spec: ProgramSpec, *, params: Any = None, mesh: Mesh | None = None, inputs: dict | None = None
    ) -> tuple[jax.stages.Lowered, int | None]:
        """`lower`'s program and how many host callbacks it makes, all to `_dispatch_step` (None: some other)."""
        mesh = mesh or self.get_mesh()
        params = self.check_params(self.params if params is None else params, features=spec.features)
        if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(params)):
            specs = sharding_lib.param_specs(params, mesh)
            placed = jax.tree_util.tree_map(
                lambda x, p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, p)), params, specs
            )
            placed = self._with_kernels(placed, mesh)
        else:
            placed = self.place_params(params, mesh)
        example = inputs if inputs is not None else self.example_inputs(spec)
        abstract = jax.tree_util.tree_map(lambda x: _abstract(x, mesh), example)
        with ops_attention.lowering_for(_platform(mesh), mesh):  # "auto" attention: the choice of the mesh's devices
            traced = self._jitted(spec).trace(placed, abstract, self._window_spec(mesh))
            lowered = traced.lower()
        return lowered, callback_sites(traced.jaxpr, _is_step_dispatch)

    def compile(self, spec: ProgramSpec, *, params: dict | None = None, inputs: dict | None = None):
        """The AOT-compiled executable for `spec` on the current mesh (from the cache, or compiled now).

        `inputs` are example host arrays (default: zeros of the right shapes), used only for their shapes."""
        mesh = self.get_mesh()
        key = self._program_key(spec, mesh, params)
        return self.cache.get(key, lambda: self._compile(spec, params, mesh, inputs))

    def _compile(self, spec: ProgramSpec, params: Any, mesh: Mesh, inputs: dict | None):
        lowered, dispatches = self._lower(spec, params=params, mesh=mesh, inputs=inputs)
        return compile_shared(lowered, _mesh_key(mesh), shared_callbacks=dispatches or 0)

    def executables(self, spec: ProgramSpec, *, params: dict | None = None, inputs: dict | None = None):
        """What `run` executes for `spec`, compiled (or from the cache): `(main, decode)`. With `split_decode` and
        image output, `main` is the program up to the latents and `decode` the VAE decode of its output (one cache
        entry; programs of one image shape share the decode executable); else `main` is the whole program and
        `decode` is None."""
        if not (self.split_decode and spec.output == "images"):
            return self.compile(spec, params=params, inputs=inputs), None
        mesh = self.get_mesh()

        def build():
            latents_spec = dataclasses.replace(spec, output="latents")
            main = self._compile(latents_spec, params, mesh, inputs)
            checked = self.check_params(self.params if params is None else params, features=spec.features)
            vae = self.place_params(checked, mesh)["vae"]
            decode = DecodeSpec(spec.batch, spec.height, spec.width, spec.vae_tiling, spec.vae_slicing)
            return main, self._decoder(decode, vae, main.output_shardings[0], mesh)

        return self.cache.get(("split", *self._program_key(spec, mesh, params)), build)

    def _decoder(self, spec: DecodeSpec, vae_params: dict, latents_sharding: NamedSharding, mesh: Mesh):
        """The VAE decode executable for `spec` (latents laid out as `latents_sharding`, the main program's output),
        shared while any cached program pair holds it."""
        key = (spec, _mesh_key(mesh), latents_sharding, _tree_key(vae_params))  # kept kernels: leaves in the tree
        with self._place_lock:
            decoder = self._decoders.get(key)
        if decoder is None:
            f = self.models.vae_scale_factor
            shape = (spec.batch, self.models.latent_channels, spec.height // f, spec.width // f)
            latents = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=latents_sharding)
            fn = jax.jit(functools.partial(decode_program, self.models, spec))
            with ops_attention.lowering_for(_platform(mesh), mesh):
                decoder = compile_shared(fn.lower(vae_params, latents), _mesh_key(mesh))
            with self._place_lock:
                self._decoders[key] = decoder
        return decoder

    def _window_spec(self, mesh: Mesh) -> dict:
        rep = NamedSharding(mesh, PartitionSpec())
        return {k: jax.ShapeDtypeStruct((), jnp.int32, sharding=rep) for k in ("start", "end", "run")}

    def example_inputs(self, spec: ProgramSpec) -> dict[str, np.ndarray]:
        """Zero host inputs of the shapes `spec` takes (for compiling ahead of time)."""
        n = spec.batch
        cond = self.models.conditioning
        text = cond.text_inputs([""] * n, [""] * n)
        if spec.text_chunks:  # A1111 prompt syntax: that many 77-token chunks, with token weights
            text = {k: np.tile(v, (1,) * (v.ndim - 1) + (spec.text_chunks,)) for k, v in text.items()}
            text["weights"] = text["neg_weights"] = np.ones((n, text["ids"].shape[-1]), np.float32)
        out = {
            **{k: np.zeros_like(v) for k, v in text.items()},
            "keys": np.zeros((n, 2), np.uint32),
            "guidance": np.ones((n,), np.float32),
            **cond.host_inputs(negative_prompts=[""] * n, height=spec.height, width=spec.width, task=spec.task.name),
        }
        f = self.models.vae_scale_factor
        for name in spec.task.inputs:
            out[name] = np.zeros(
                _task_input_shape(name, n, spec.height, spec.width, f, self.models.latent_channels), np.float32
            )
        if spec.explicit_noise:
            out["noise"] = np.zeros((n, self.models.latent_channels, spec.height // f, spec.width // f), np.float32)
        calls = int(spec.sampler.num_model_calls(spec.steps))
        out.update(
            feature_lib.example_inputs(
                spec.features, batch=n, height=spec.height, width=spec.width, calls=calls, taken=out
            )
        )
        return out

    def feature_inputs(
        self, spec: ProgramSpec, requests: Sequence[FeatureRequest], *, start: int, end: int, taken: dict
    ) -> dict[str, Any]:
        """The input arrays of a call's feature requests (the features of `spec`, in order) for the window
        `[start, end)`, checked against each other and against the program's other inputs `taken`."""
        calls = int(spec.sampler.num_model_calls(spec.steps))
        return feature_lib.request_inputs(spec.features, requests, start=start, end=end, calls=calls, taken=taken)

    # ------------------------------------------------------------------ running
    def run(
        self,
        *,
        prompts: Sequence[str],
        negative_prompts: Sequence[str],
        keys: np.ndarray,
        guidance_scales: Sequence[float],
        steps: int,
        height: int,
        width: int,
        sampler=None,
        task: TaskRequest | None = None,
        conditioning: dict | None = None,
        noise: np.ndarray | None = None,
        pad_to: int | None = None,
        params: dict | None = None,
        output: str = "images",
        guidance_rescale: float = 0.0,
        progress: Progress | None = None,
        should_stop: Callable[[], bool] | None = None,
        interactive: bool | None = None,
        ids: np.ndarray | None = None,
        neg_ids: np.ndarray | None = None,
        cfg: bool | None = None,
        prompt_syntax: str | None = None,
        features: Sequence[FeatureRequest] = (),
    ) -> np.ndarray:
        """Images `(N, H, W, 3)` float32 in [0, 1] (or latents `(N, C, h, w)` with `output="latents"`).

        `keys` `(N, 2)` uint32: image `i` draws all of its noise from `keys[i]` (`sdjax.rng`). The batch is padded
        to `pad_to` (or the next multiple of the mesh's data axis) and split over the `data` axis; padding images
        are dropped. A negative prompt of None means "none given" (the empty prompt; a conditioning may treat it
        apart, e.g. zero embeddings under `force_zeros_for_empty_prompt`). `ids`/`neg_ids` (already tokenized)
        replace the tokenization of `prompts`/`negative_prompts`. `cfg` (default: whether any guidance scale exceeds
        1) computes the unconditional branch. `prompt_syntax="a1111"` reads prompts as AUTOMATIC1111 does
        (emphasis, BREAK, chunks of 75 tokens; `sdjax.text.prompt_syntax`) where the conditioning accepts it
        (`Conditioning.accepts_prompt_syntax`). `features` (`protocols.FeatureRequest`s) add their features' loop
        hooks, in order; each request's params go in as `params[request.spec.params_key]`.
        Raises `Cancelled` when `should_stop()` returned True between two model calls.
        """
        task = task or TaskRequest(Txt2Img())
        n = len(prompts) if ids is None else int(np.shape(ids)[0])
        keys = np.asarray(keys, np.uint32).reshape(n, 2)
        guidance = np.asarray(guidance_scales, np.float32).reshape(-1)
        if guidance.shape != (n,):
            raise ValueError(f"guidance_scales: got {guidance.shape[0]} values for {n} images")
        mesh = self.get_mesh()
        ndata = mesh.shape[sharding_lib.DATA]
        total = -(-max(n, pad_to or 0) // ndata) * ndata
        pad = total - n
        negs = list(negative_prompts) + [""] * pad
        if len(negative_prompts) != n:
            raise ValueError(f"negative_prompts: got {len(negative_prompts)} for {n} images")
        neg_texts = [p if isinstance(p, str) else "" for p in negs]
        # Options the conditioning takes one value per image: padding images repeat the last value.
        for key in self.models.conditioning.per_image_options:
            value = (conditioning or {}).get(key)
            if pad and isinstance(value, (list, tuple, np.ndarray)) and len(value) == n and n:
                conditioning = {**conditioning, key: [*value, *[value[-1]] * pad]}
        if prompt_syntax not in (None, *PROMPT_SYNTAXES):
            raise ValueError(f"prompt_syntax={prompt_syntax!r} must be 'plain' or 'a1111'")
        chunks = 0
        if prompt_syntax == "a1111":
            if not self.models.conditioning.accepts_prompt_syntax("a1111"):
                raise ValueError(
                    "prompt_syntax='a1111' (weights, BREAK, 75-token chunks) is not read by this model's "
                    f"conditioning ({self.models.conditioning.name}): use prompt_syntax='plain'"
                )
            if ids is not None or neg_ids is not None:
                raise ValueError("prompt_syntax='a1111' reads prompt text; pass prompts instead of ids")
            text = self.models.conditioning.text_inputs(list(prompts) + [""] * pad, neg_texts, syntax="a1111")
            chunks = text.pop("chunks")
        else:
            texts = list(prompts) + [""] * pad if ids is None else [""] * total
            text = self.models.conditioning.text_inputs(texts, neg_texts)
            if ids is not None:
                text["ids"] = _pad(np.asarray(ids), pad)
            if neg_ids is not None:
                text["neg_ids"] = _pad(np.asarray(neg_ids), pad)
        host = {
            **text,
            "keys": _pad(keys, pad),
            "guidance": _pad(guidance, pad, fill=1.0),
            **self.models.conditioning.host_inputs(
                negative_prompts=negs, height=height, width=width, task=task.spec.name, **(conditioning or {})
            ),
        }
        for name in task.spec.inputs:
            if name not in task.arrays:
                raise ValueError(f"the {task.spec.name} task needs the input {name!r}")
            host[name] = _pad(np.asarray(task.arrays[name], np.float32), pad)
        if noise is not None:
            host["noise"] = _pad(np.asarray(noise, np.float32), pad)
        interactive = (progress is not None or should_stop is not None) if interactive is None else interactive
        spec = self.spec(
            task=task.spec,
            batch=total,
            height=height,
            width=width,
            steps=steps,
            sampler=sampler,
            cfg=(bool((guidance > 1).any()) and not self.models.denoiser.distilled_guidance) if cfg is None else cfg,
            guidance_rescale=guidance_rescale,
            output=output,
            interactive=interactive,
            explicit_noise=noise is not None,
            previews=wants_latents(progress),
            text_chunks=chunks,
            features=tuple(r.spec for r in features),
        )
        start, end = self.window(spec, task)
        params = feature_lib.with_params(self.check_params(self.params if params is None else params), features)
        extra = self.feature_inputs(spec, features, start=start, end=end, taken=host)
        host.update({k: _pad(v, pad) for k, v in extra.items()})
        executable, decode = self.executables(spec, params=params, inputs=host)
        placed = self.place_params(params, mesh)
        inputs = {k: sharding_lib.put_global_batch(v, mesh) for k, v in host.items()}
        run_id = next(_RUN_IDS)
        win = {
            k: jax.device_put(np.int32(v), NamedSharding(mesh, PartitionSpec()))
            for k, v in (("start", start), ("end", end), ("run", run_id))
        }
        _RUNS[run_id] = (progress, should_stop)
        try:
            if progress is not None:
                progress("denoise", 0, end - start)
            out, stopped = executable(placed, inputs, win)
            if spec.interactive and bool(np.asarray(stopped)):  # (only a host callback can stop a run)
                raise Cancelled("stopped by should_stop() before the last denoising step")
            if decode is not None:
                out = decode(placed["vae"], out)
            out = sharding_lib.gather_to_host(out)
        finally:
            _RUNS.pop(run_id, None)
        if progress is not None and output == "images":
            progress("decode", 1, 1)
        return out[:n]

    # ------------------------------------------------------------------ the guide API (pmap)
    def pmapped(self, spec: ProgramSpec):
        """`pmap` of the program for `spec`: `(params, inputs, window) -> (outputs, stopped)`, params and inputs
        with a leading device axis, the window broadcast."""
        fn = self._pmapped.get(spec)
        if fn is None:
            fn = jax.pmap(functools.partial(program, self.models, spec), in_axes=(0, 0, None))
            if len(self._pmapped) >= self.cache.max_entries:
                self._pmapped.pop(next(iter(self._pmapped)))
            self._pmapped[spec] = fn
        return fn


# The runs in progress in this process, by run id: (progress, should_stop). One table for every generator: a
# program's step callback is `_dispatch_step`, the same function in every lowering, and finds the run by the id it
# is given, so an executable that `compile_shared` hands to another pipeline of the model reports to that
# pipeline's run. (A generator's own table made the text of two pipelines' programs identical while their
# callbacks were not: a progress bar, a preview or a stop went to the other pipeline.)
_RUNS: dict[int, tuple[Progress | None, Callable[[], bool] | None]] = {}
_RUN_IDS = itertools.count(1)


def _dispatch_step(run_id: int, step: int, total: int, latents=None) -> bool:
    progress, should_stop = _RUNS.get(run_id, (None, None))
    if progress is not None:
        if latents is not None:
            progress("denoise", step, total, latents=latents)
        else:
            progress("denoise", step, total)
    return bool(should_stop()) if should_stop is not None else False


def _is_step_dispatch(function) -> bool:
    return getattr(function, "on_step", None) is _dispatch_step  # `loop._host`'s wrapper of it


def _tree_key(tree: Any) -> tuple:
    """A pytree's structure, shapes and dtypes (hashable): what a compiled program fixes of an argument."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)


def wants_latents(progress) -> bool:
    """Whether a progress callback takes the current latents (a `latents` parameter or `**kwargs`)."""
    if progress is None:
        return False
    import inspect

    try:
        params = inspect.signature(progress).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "latents" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _task_input_shape(name: str, n: int, height: int, width: int, f: int, latent_channels: int):
    if name == "image":
        return (n, 3, height, width)
    if name == "mask":
        return (n, 1, height, width)
    if name == "image_latents":
        return (n, latent_channels, height // f, width // f)
    raise ValueError(f"unknown task input {name!r}")


def _pad(x: np.ndarray, pad: int, fill: float = 0.0) -> np.ndarray:
    if pad == 0:
        return x
    return np.concatenate([x, np.full((pad,) + x.shape[1:], fill, x.dtype)])


def _abstract(x, mesh: Mesh):
    x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding_lib.batch_sharding(mesh))


def _platform(mesh: Mesh) -> str:
    return mesh.devices.flat[0].platform


def _mesh_key(mesh: Mesh):
    return (tuple(d.id for d in mesh.devices.flat), mesh.axis_names, mesh.devices.shape)
