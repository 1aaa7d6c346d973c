"""`finetune.sharding`: a training step with FSDP-sharded arguments on 8 simulated CPU devices computes what the
replicated step (`loop.run_loop`'s layout) computes.

The tiny random SD 1.x preset (`build_pipeline("tiny")`) and Flux preset ("flux-tiny"); the FSDP threshold is
lowered to 256 elements so that nearly every kernel of these small models is split over the 8 devices (the
default 2^20 would split none of them). Each test runs the trainers' own step functions (`step.make_train_step`,
`flow.make_flow_train_step`, `step.jit_step`) twice, once on replicated arguments, once on the FSDP layout, from the
same state, batches and key, and compares the losses and the updated values (the LoRA steps with plain SGD, so
every leaf's update is its gradient; Adafactor's and Prodigy's states, with accumulation, on a toy problem); it also
checks on the device arrays themselves that the layout split what it says. The full fine-tune's step (`full.make_loss`
under `step.jit_step`, with the trainers' AdamW and accumulation, whose moments and accumulated gradients FSDP splits)
is held leaf by leaf to the replicated one in a whole run, and whole runs with FSDP (stopped and resumed, each
trainer): tests/finetune/test_fsdp_runs.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from sdjax.finetune import lora as lora_lib
from sdjax.finetune import sharding as train_sharding
from sdjax.finetune import step as step_lib
from sdjax.parallel.sharding import batch_sharding, make_mesh

MIN_SIZE = 256
# Another layout sums the gradients in another order, so the runs differ by float32 rounding. With SGD the update is
# the gradient itself, so each leaf can be held to RTOL (AdamW's first updates are about lr * sign(g) in every
# coordinate, however small |g|, and would move a coordinate whose gradient is rounding noise by a full step either
# way: the AdamW fine-tune, tests/finetune/test_fsdp_runs.py).
RTOL = 1e-5  # relative (L2): the losses, each updated leaf of an SGD step


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets --xla_force_host_platform_device_count=8)")
    return make_mesh(devices=jax.devices()[:8])


@pytest.fixture(scope="module")
def tiny_sd():
    from sdjax.pipelines.presets import build_pipeline

    return build_pipeline("tiny", jnp.float32)


def _sd_batch(pipe, n: int = 8, size: int = 16, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    captions = [f"a red star, number {i}" for i in range(n)]
    return {
        "pixels": rng.uniform(-1, 1, (n, 3, size, size)).astype(np.float32),
        "ids": np.asarray(pipe.generator.models.conditioning.tokenize(captions), np.int32),
        "clip_skip": np.ones((n,), np.int32),
        "time_ids": np.zeros((n, 6), np.float32),
    }


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _host(tree):
    return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def _run(train_step, state, frozen, batches, key, mesh, *, fsdp: bool, trained: str):
    """`len(batches)` steps from `state` on the replicated layout (as `loop.run_loop` places them) or on
    `finetune.sharding`'s FSDP layout -> (losses, host state after, the state's layout)."""
    lay = train_sharding.layout(mesh, state, frozen, trained=trained, fsdp=fsdp, min_size=MIN_SIZE)
    if fsdp:
        state, frozen = lay.place(state, frozen)
        step = lay.step(train_step)
    else:
        state, frozen = jax.device_put((state, frozen), NamedSharding(mesh, PartitionSpec()))
        step = train_step
    losses = []
    for batch in batches:
        state, loss = step(state, frozen, jax.device_put(batch, batch_sharding(mesh)), key)
        losses.append(float(loss))
    return losses, state, frozen, lay


def _both_layouts(train_step, init, frozen, batches, key, mesh, *, trained: str, label: str):
    """`_run` from a fresh state `init()` (the step donates its state) on the replicated layout and on the FSDP
    one -> (worst relative loss error, `_compare`'s errors of the values, the FSDP run's state, its placed frozen
    params, its layout, the replicated run's state); printed under `label`."""
    initial = _host(init()[trained])
    ref_losses, ref_state, _, _ = _run(train_step, init(), frozen, batches, key, mesh, fsdp=False, trained=trained)
    losses, state, placed, lay = _run(train_step, init(), frozen, batches, key, mesh, fsdp=True, trained=trained)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    errors = _compare(ref_state, state, initial, trained)
    print(f"{label}: losses {losses} vs {ref_losses} (worst relative {loss_err:.1e}); after the run: {errors}")
    return loss_err, errors, state, placed, lay, ref_state


def _assert_sgd_close(loss_err: float, errors: dict) -> None:
    """An SGD run's tolerances (module docstring): the losses and each leaf to RTOL, each leaf's change too."""
    assert loss_err <= RTOL
    assert errors["leaf"] <= RTOL and errors["update_median"] <= RTOL and errors["update_max"] <= 10 * RTOL


def _compare(ref_state, got_state, initial, trained: str) -> dict[str, float]:
    """Relative errors of the updated values of two runs that started from `initial`: over the whole tree, the
    worst leaf, and the worst and median leaf of the changes (new - initial)."""
    ref_flat = jax.tree_util.tree_flatten_with_path(_host(ref_state[trained]))[0]
    got_flat = jax.tree_util.tree_leaves(_host(got_state[trained]))
    start = jax.tree_util.tree_leaves(_host(initial))
    leaf, update, diff2, ref2 = {}, [], 0.0, 0.0
    for (path, ref), got, x0 in zip(ref_flat, got_flat, start, strict=True):
        leaf[jax.tree_util.keystr(path)] = _rel(got, ref)
        update.append(_rel(got - x0, ref - x0))
        diff2 += float(np.sum((np.asarray(got, np.float64) - ref) ** 2))
        ref2 += float(np.sum(np.asarray(ref, np.float64) ** 2))
    worst = max(leaf, key=leaf.get)
    return {
        "tree": (diff2 / ref2) ** 0.5,
        "leaf": leaf[worst],
        "worst_leaf": worst,
        "update_max": max(update),
        "update_median": float(np.median(update)),
    }


def _perturbed(lora, seed: int = 0):
    """`lora` with random factors (a fresh LoRA's up factors are zero, and a constant shift would give some
    factors a zero gradient in exact arithmetic: a LayerNorm after an output projection cancels it)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda x: (x + 0.05 * rng.standard_normal(x.shape)).astype(np.float32), lora)


def _sharded_fraction(placed) -> float:
    """Bytes one device holds of `placed` over the bytes of the whole tree (read from the arrays' shards)."""
    held = total = 0
    for x in jax.tree_util.tree_leaves(placed):
        total += x.nbytes
        held += x.addressable_shards[0].data.nbytes
    return held / total


# ------------------------------------------------------------------------------------------------ LoRA
def test_lora_step_fsdp_equals_replicated(tiny_sd, mesh):
    pipe, params = tiny_sd
    conditioning = pipe.generator.models.conditioning
    models = step_lib.Models(conditioning, pipe.unet, pipe.vae, jnp.float32, unet_scale=2.0, text_scale=2.0)
    objective = step_lib.Objective(min_snr_gamma=5.0)
    optimizer = optax.sgd(1.0)  # the update is the gradient (module constants)
    frozen = {c: params[c] for c in ("unet", "vae", *conditioning.components)}
    targets = {"unet": lora_lib.UNET_TARGETS, "text_encoder": lora_lib.TEXT_TARGETS}
    lora = _perturbed(lora_lib.init_lora(jax.random.PRNGKey(0), frozen, targets, 4))
    train_step = step_lib.make_train_step(models, objective, pipe.scheduler.alphas_cumprod, optimizer)  # train lora's
    batches = [_sd_batch(pipe, seed=0), _sd_batch(pipe, seed=1)]
    init = lambda: step_lib.init_state(lora, optimizer)
    loss_err, errors, state, placed, lay, _ = _both_layouts(
        train_step, init, frozen, batches, jax.random.PRNGKey(3), mesh, trained="lora", label="LoRA"
    )
    _assert_sgd_close(loss_err, errors)
    # the step moved the LoRA (the comparison is not of two unchanged copies)
    first = next(iter(lora["unet"]))
    assert _rel(_host(state["lora"])["unet"][first]["up"], lora["unet"][first]["up"]) > 1e-3
    # the frozen UNet and text encoder are split: a device holds well under their whole size; the VAE is whole
    assert _sharded_fraction(placed["unet"]) < 0.25
    assert _sharded_fraction(placed["text_encoder"]) < 0.25
    assert _sharded_fraction(placed["vae"]) == 1.0
    conv = placed["unet"]["conv_in"]["kernel"]  # (3, 3, 4, 32): the output channels over the 8 devices
    assert conv.addressable_shards[0].data.shape == (3, 3, 4, 4)
    # the updated state comes back in the layout it went in (the next update reuses the executable)
    for got, want in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(lay.state), strict=True):
        assert got.sharding.is_equivalent_to(want, got.ndim)


# ------------------------------------------------------------------------------------------------ Flux LoRA
def test_flux_lora_step_fsdp_equals_replicated(mesh):
    from sdjax.families.flux.presets import build_flux_pipeline
    from sdjax.finetune import flow, flow_models

    pipe, params = build_flux_pipeline("flux-tiny", jnp.float32, abstract=False)
    adapter = flow_models.adapter_for(pipe, jnp.float32, guidance_scale=3.5, remat=True)
    lora = _perturbed(flow_models.init_lora(jax.random.PRNGKey(0), params["transformer"], adapter.default_targets, 4))
    objective = flow.FlowObjective(weighting_scheme="logit_normal", num_train_timesteps=1000, shift=3.0)
    models = flow.FlowModels(adapter, pipe.vae, jnp.float32, 1.0)
    optimizer = optax.sgd(1.0)
    train_step = flow.make_flow_train_step(models, objective, optimizer)
    frozen = {"transformer": params["transformer"], "vae": params["vae"]}
    rng = np.random.default_rng(0)
    width = pipe.transformer.config.joint_attention_dim
    pooled = pipe.transformer.config.pooled_projection_dim
    batches = [
        {
            "pixels": rng.uniform(-1, 1, (8, 3, 16, 16)).astype(np.float32),
            "text": rng.standard_normal((8, 6, width)).astype(np.float32),
            "pooled": rng.standard_normal((8, pooled)).astype(np.float32),
        }
        for _ in range(2)
    ]
    init = lambda: step_lib.init_state(lora, optimizer)
    loss_err, errors, _, placed, _, _ = _both_layouts(
        train_step, init, frozen, batches, jax.random.PRNGKey(7), mesh, trained="lora", label="Flux LoRA"
    )
    _assert_sgd_close(loss_err, errors)
    assert _sharded_fraction(placed["transformer"]) < 0.25


# ------------------------------------------------------------------------------------------------ the layout alone
def test_state_specs_follow_the_values_through_optax_wrappers(mesh):
    """The values' specs come from the rules table by name and size; every optimiser leaf that mirrors a value
    (AdamW's moments and `MultiSteps`' accumulated gradients inside optax's wrappers) copies its value's spec, as
    optax's own `tree_map_params` pairs them; counters stay replicated."""
    values = {"down_blocks_0": {"to_q": {"kernel": jnp.zeros((32, 128))}}, "norm": {"scale": jnp.zeros((64,))}}
    optimizer = optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), 2)
    state = {"unet": values, "opt_state": optimizer.init(values), "step": jnp.zeros((), jnp.int32)}
    specs = train_sharding.state_specs(state, mesh, trained="unet", fsdp=True, min_size=64)
    kernel = specs["unet"]["down_blocks_0"]["to_q"]["kernel"]
    assert kernel == PartitionSpec(None, "data")  # the larger dimension
    assert specs["unet"]["norm"]["scale"] == PartitionSpec("data")
    expected = optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        state["opt_state"],
        specs["unet"],
        transform_non_params=lambda _: PartitionSpec(),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    leaves = lambda t: jax.tree_util.tree_leaves(t, is_leaf=lambda x: isinstance(x, PartitionSpec))
    assert leaves(specs["opt_state"]) == leaves(expected)
    assert specs["step"] == PartitionSpec()


# Per optimiser, the fields of its state that hold one array per trained value, shaped like it (they take its
# sharding); every other leaf (counters, Prodigy's scalar estimates, Adafactor's factored moments and the (1,)
# placeholders it keeps for unfactored values) is whole on every device.
MIRRORS = {
    "adafactor": ("v", "acc_grads"),
    "prodigy": ("exp_avg", "exp_avg_sq", "grad_sum", "params0", "acc_grads"),
}


def _toy_values() -> dict:
    """A (128, 256) kernel (Adafactor factors its second moment: both dims >= 128), a conv kernel and a bias (not
    factored), all at least MIN_SIZE elements (FSDP splits each on its largest dimension)."""
    rng = np.random.default_rng(0)
    shapes = {"to_q": (128, 256), "conv_in": (3, 3, 8, 32), "bias": (256,)}
    return {k: (0.1 * rng.standard_normal(v)).astype(np.float32) for k, v in shapes.items()}


def _toy_loss(values, frozen, batch, key):
    h = jnp.tanh(batch["x"] @ values["to_q"] + values["bias"]) @ frozen["head"]
    conv = batch["z"] @ values["conv_in"].reshape(72, 32)
    return jnp.mean((h - batch["y"]) ** 2) + jnp.mean(conv**2)


def _toy_batches(n: int) -> list[dict]:
    rng = np.random.default_rng(1)
    shapes = {"x": (8, 128), "y": (8, 16), "z": (8, 72)}
    return [{k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()} for _ in range(n)]


def _field_and_value(path) -> tuple[str, tuple[str, ...]]:
    """The optimiser-state field of a leaf's path (the last attribute name: `v_row`, `exp_avg`, `acc_grads`, ...)
    and the dict keys below it (the value it belongs to)."""
    field, below = "", ()
    for k in path:
        if isinstance(k, jax.tree_util.GetAttrKey):
            field, below = k.name, ()
        elif isinstance(k, jax.tree_util.DictKey):
            below = (*below, k.key)
    return field, below


@pytest.mark.parametrize("name", ["adafactor", "prodigy"])
def test_optimizer_states_fsdp_equal_replicated(mesh, name, tmp_path):
    """Adafactor's and Prodigy's states (other shapes than AdamW's: factored moments, scalar step-size estimates)
    under FSDP, with accumulation (`optax.MultiSteps`): every leaf that holds an array per value has that value's
    sharding, a device holds 1/8 of each of those leaves, everything else is whole; two updates of the FSDP layout
    give the replicated layout's losses, values and every optimiser-state leaf; and the split state comes back
    from a run's checkpoint (`run._checkpoints`, `run._restore`, placed by the layout, as a resumed FSDP run does)
    bit for bit, each leaf in its sharding. (A whole resumed FSDP run: tests/finetune/test_fsdp_runs.py, AdamW.)"""
    lr = 1.0 if name == "prodigy" else 1e-2  # Prodigy's lr multiplies its own step-size estimate
    optimizer = step_lib.make_optimizer(step_lib.lr_schedule(lr, 10, 0, "constant"), optimizer=name, accumulation=2)
    values = _toy_values()
    frozen = {"head": np.random.default_rng(2).standard_normal((256, 16)).astype(np.float32)}
    train_step = step_lib.jit_step(_toy_loss, optimizer, "unet")
    init = lambda: step_lib.init_state(jax.tree_util.tree_map(np.array, values), optimizer, "unet")
    loss_err, errors, state, _, lay, ref = _both_layouts(
        train_step, init, frozen, _toy_batches(4), jax.random.PRNGKey(0), mesh, trained="unet", label=name
    )
    opt_err = max(
        _rel(a, b) if np.any(b) else float(np.abs(a).max())
        for a, b in zip(jax.tree_util.tree_leaves(_host(state)), jax.tree_util.tree_leaves(_host(ref)), strict=True)
    )
    print(f"{name}: every state leaf (values and optimiser) within {opt_err:.1e} of the replicated run")
    assert loss_err <= 1e-6 and errors["tree"] <= 1e-6 and opt_err <= 1e-5
    assert int(state["opt_state"].gradient_step) == 2 and errors["update_median"] < 1e-5
    moved = min(_rel(_host(state["unet"])[k], v) for k, v in values.items())
    print(f"{name}: the least moved value changed by {moved:.1e} (relative)")
    assert moved > 1e-6, moved  # every value moved (float32 resolves 6e-8): not a comparison of unchanged copies

    value_specs = {k: s.spec for k, s in lay.state["unet"].items()}
    assert value_specs == {"to_q": PartitionSpec(None, "data"), "conv_in": PartitionSpec(None, None, None, "data"),
                           "bias": PartitionSpec("data")}  # fmt: skip
    mirrored = held = whole = 0
    for path, x in jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]:
        field, below = _field_and_value(path)
        mirrors = field in MIRRORS[name] and len(below) == 1 and x.shape == values[below[0]].shape
        want = value_specs[below[0]] if mirrors else PartitionSpec()
        assert x.sharding.spec == want, (jax.tree_util.keystr(path), x.sharding.spec, want)
        shard = x.addressable_shards[0].data.nbytes
        assert shard * (8 if mirrors else 1) == x.nbytes, jax.tree_util.keystr(path)
        mirrored += mirrors
        held, whole = held + shard, whole + x.nbytes
    print(f"{name}: {mirrored} optimiser leaves split; a device holds {held} of {whole} bytes of the state")
    assert mirrored == {"adafactor": 2 + 3, "prodigy": 4 * 3 + 3}[name]  # Adafactor: v of conv_in and bias
    if name == "adafactor":  # the kernel's factored moments: its row and column means, whole on every device
        inner = state["opt_state"].inner_opt_state[-1][0]
        assert inner.v_row["to_q"].shape == (128,) and inner.v_col["to_q"].shape == (256,)
        assert inner.v["to_q"].shape == (1,)
    assert held < 0.2 * whole

    from sdjax.finetune import run_dir

    manager = run_dir.checkpoints(tmp_path)
    manager.save(2, args=run_dir.save_args(state), force=True)
    manager.wait_until_finished()
    manager.close()
    saved, micro = run_dir.restore(run_dir.checkpoints(tmp_path), init())
    back, _ = lay.place(saved, frozen)
    pairs = zip(*(jax.tree_util.tree_flatten_with_path(t)[0] for t in (state, back)), strict=True)
    for (path, a), (_, b) in pairs:
        where = jax.tree_util.keystr(path)
        assert b.sharding.spec == a.sharding.spec and np.array_equal(np.asarray(b), np.asarray(a)), where
    assert micro == 2


def test_layout_refuses_a_missing_trained_entry(mesh):
    state = {"lora": {}, "opt_state": (), "step": jnp.zeros((), jnp.int32)}
    with pytest.raises(ValueError, match="trained='unet'"):
        train_sharding.layout(mesh, state, {}, trained="unet")
