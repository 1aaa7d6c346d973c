"""`finetune.sharding`: a training step with FSDP-sharded arguments on 8 simulated CPU devices computes what the
replicated step (`run.run_loop`'s layout) computes.

The tiny random SD 1.x preset (`build_pipeline("tiny")`) and Flux preset ("flux-tiny"); the FSDP threshold is
lowered to 256 elements so that nearly every kernel of these small models is split over the 8 devices (the
default 2^20 would split none of them). Each test runs the trainers' own step functions (`step.make_train_step`,
`full.make_loss` under `step.jit_step`, `flow.make_flow_train_step`) twice, once on replicated arguments, once on
the FSDP layout, from the same state, batches and key, and compares the losses and the updated values (the LoRA
steps with plain SGD, so every leaf's update is its gradient; the full fine-tune with the trainers' AdamW and
accumulation, whose moments and accumulated gradients FSDP splits); it also checks on the device arrays themselves
that the layout split what it says.
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
RTOL = 1e-5  # relative (L2): the losses, each updated leaf of an SGD step, all updated values of an AdamW run
# Why two optimisers: another layout sums the gradients in another order, so the runs differ by float32 rounding,
# and AdamW's first updates are about lr * sign(g) in every coordinate, however small |g|: a coordinate whose
# gradient is rounding noise moves by a full step either way. With SGD the update is the gradient itself, so
# each leaf can be held to RTOL; the AdamW run (the trainers' optimiser, whose moments FSDP shards) is held to RTOL
# over the whole UNet and to LEAF_RTOL per leaf. Measured on the full fine-tune below (208 leaves, 2 updates):
# FSDP against replicated 9.6e-7 over the whole UNet, 1.2e-5 worst leaf; the replicated run on 1 device against 8
# (the same program, no FSDP) differs more: 1.9e-6 and 1.7e-5.
LEAF_RTOL = 5e-5
UNET_RTOL = 1e-4  # the whole written UNet of two `train_finetune` runs (their test)


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
    """`len(batches)` steps from `state` on the replicated layout (as `run.run_loop` places them) or on
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
    key = jax.random.PRNGKey(3)

    ref_losses, ref_state, _, _ = _run(
        train_step, step_lib.init_state(lora, optimizer), frozen, batches, key, mesh, fsdp=False, trained="lora"
    )
    losses, state, placed, lay = _run(
        train_step, step_lib.init_state(lora, optimizer), frozen, batches, key, mesh, fsdp=True, trained="lora"
    )
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    errors = _compare(ref_state, state, lora, "lora")
    print(f"LoRA: losses {losses} vs {ref_losses} (worst relative {loss_err:.1e}); after 2 updates: {errors}")
    assert loss_err <= RTOL
    assert errors["leaf"] <= RTOL and errors["update_median"] <= RTOL and errors["update_max"] <= 10 * RTOL
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


# ------------------------------------------------------------------------------------------------ full fine-tune
def test_full_finetune_step_fsdp_equals_replicated(tiny_sd, mesh):
    from sdjax.finetune import full

    pipe, params = tiny_sd
    conditioning = pipe.generator.models.conditioning
    models = step_lib.Models(conditioning, pipe.unet, pipe.vae, jnp.float32, remat=True)
    objective = step_lib.Objective(prediction_type="v_prediction", noise_offset=0.05)
    schedule = step_lib.lr_schedule(1e-3, 10, 0, "constant")
    optimizer = step_lib.make_optimizer(schedule, accumulation=2)  # optax.MultiSteps: accumulated gradients too
    frozen = {c: params[c] for c in ("vae", *conditioning.components)}
    loss_fn = full.make_loss(models, objective, pipe.scheduler.alphas_cumprod)
    train_step = step_lib.jit_step(loss_fn, optimizer, "unet")
    batches = [_sd_batch(pipe, seed=s) for s in range(4)]  # two updates of two micro-batches
    key = jax.random.PRNGKey(5)

    initial = _host(params["unet"])

    def fresh():  # a copy: the step donates its state, and the fixture's params are shared
        return full.init_state(jax.tree_util.tree_map(np.array, initial), optimizer)

    ref_losses, ref_state, _, _ = _run(train_step, fresh(), frozen, batches, key, mesh, fsdp=False, trained="unet")
    losses, state, _, lay = _run(train_step, fresh(), frozen, batches, key, mesh, fsdp=True, trained="unet")
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    errors = _compare(ref_state, state, initial, "unet")
    print(f"full: losses {losses} vs {ref_losses} (worst relative {loss_err:.1e}); after 2 updates: {errors}")
    assert loss_err <= RTOL
    assert errors["tree"] <= RTOL and errors["leaf"] <= LEAF_RTOL
    assert int(state["opt_state"].gradient_step) == 2
    assert _rel(_host(state["unet"])["conv_in"]["kernel"], initial["conv_in"]["kernel"]) > 1e-5
    # the master copy, the AdamW moments and the accumulated gradients are split
    assert _sharded_fraction(state["unet"]) < 0.25
    inner = state["opt_state"].inner_opt_state
    adam = next(s for s in jax.tree_util.tree_leaves(inner, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    for tree in (adam.mu, adam.nu, state["opt_state"].acc_grads):
        assert _sharded_fraction(tree) < 0.25
    # every optimiser leaf that optax itself maps to a parameter has that parameter's sharding; the rest replicated
    expected = optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        jax.eval_shape(lambda: fresh()["opt_state"]),
        lay.state["unet"],
        transform_non_params=lambda _: NamedSharding(mesh, PartitionSpec()),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    for got, want in zip(
        jax.tree_util.tree_leaves(state["opt_state"]), jax.tree_util.tree_leaves(expected), strict=True
    ):
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
    key = jax.random.PRNGKey(7)
    ref_losses, ref_state, _, _ = _run(
        train_step, step_lib.init_state(lora, optimizer), frozen, batches, key, mesh, fsdp=False, trained="lora"
    )
    losses, state, placed, _ = _run(
        train_step, step_lib.init_state(lora, optimizer), frozen, batches, key, mesh, fsdp=True, trained="lora"
    )
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    errors = _compare(ref_state, state, lora, "lora")
    print(f"Flux LoRA: losses {losses} vs {ref_losses} (worst relative {loss_err:.1e}); after 2 updates: {errors}")
    assert loss_err <= RTOL
    assert errors["leaf"] <= RTOL and errors["update_median"] <= RTOL and errors["update_max"] <= 10 * RTOL
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


def test_layout_refuses_a_missing_trained_entry(mesh):
    state = {"lora": {}, "opt_state": (), "step": jnp.zeros((), jnp.int32)}
    with pytest.raises(ValueError, match="trained='unet'"):
        train_sharding.layout(mesh, state, {}, trained="unet")


# ------------------------------------------------------------------------------------------------ the run, end to end
def _cats(root, n: int = 3):
    from PIL import Image

    rng = np.random.default_rng(2)
    root.mkdir()
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), np.uint8)).save(root / f"c{i}.png")
        (root / f"c{i}.txt").write_text(f"a cat, pose {i}")
    return root


def test_finetune_run_with_fsdp_repeats_the_replicated_run(sd1_dir, mesh, tmp_path, monkeypatch):
    """`train_finetune(fsdp=True)` (`run.run_loop` placing the state with `finetune.sharding`), stopped after update
    1 and resumed from its checkpoint, against the same run replicated and unbroken: the same losses and written
    UNet within float32 summation-order noise, while the master copy and the AdamW moments were split over the 8
    devices."""
    from sdjax.finetune import full
    from sdjax.pipelines import load_pipeline

    data = _cats(tmp_path / "cats")
    options = dict(
        model=str(sd1_dir), steps=2, batch_size=8, resolution=32, bucketing=False, lr=1e-3, ema_decay=0.5, seed=1
    )
    placed: list[dict] = []
    place = train_sharding.Layout.place

    def recording_place(self, state, frozen, put=None):  # what the run's arrays look like on the devices
        state, frozen = place(self, state, frozen, put)
        placed.append({"state": _sharded_fraction(state["unet"]), "frozen": _sharded_fraction(frozen)})
        placed[-1]["adam_mu"] = _sharded_fraction(
            [
                s.mu
                for s in jax.tree_util.tree_leaves(state["opt_state"], is_leaf=lambda s: hasattr(s, "mu"))
                if hasattr(s, "mu")
            ]
        )
        placed[-1]["conv_in"] = state["unet"]["conv_in"]["kernel"].sharding.spec
        return state, frozen

    monkeypatch.setattr(train_sharding.Layout, "place", recording_place)
    logs: list[str] = []
    ref = full.train_finetune(data, tmp_path / "ref", **options)
    assert not placed  # the replicated run never builds a layout
    fsdp = dict(fsdp=True, fsdp_min_size=MIN_SIZE, log=logs.append, **options)
    first = full.train_finetune(data, tmp_path / "fsdp", stop_after=1, **fsdp)  # checkpointed from the split arrays
    got = full.train_finetune(data, tmp_path / "fsdp", **fsdp)  # resumed at update 1 into the layout
    assert (len(first.losses), got.start_step, len(got.losses)) == (1, 1, 1)
    got.losses = first.losses + got.losses
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses, strict=True))
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])
    unet_err = _rel(flat(got.unet), flat(ref.unet))
    moved = _rel(flat(ref.unet), flat(load_pipeline(str(sd1_dir))[1]["unet"]))
    print(f"fine-tune run: losses {got.losses} vs {ref.losses} (worst relative {loss_err:.1e}); UNet {unet_err:.1e}")
    print(f"(the run moved the UNet by {moved:.1e}); {placed}; {[line for line in logs if 'FSDP' in line]}")
    # The losses to RTOL; the written UNet (EMA of AdamW updates at lr 1e-3) to UNET_RTOL: AdamW's first update moves
    # a coordinate whose gradient is summation noise by a full lr either way (module docstring). Measured: losses
    # 1.1e-7 (update 1) and 0 (update 2), UNet 2.2e-5 against a change of 2.2e-2.
    assert loss_err <= RTOL and unet_err <= UNET_RTOL and unet_err < 0.01 * moved
    assert len(placed) == 2  # the first call and the resumed one
    for held in placed:  # a device's share of the master copy, the AdamW moments, the frozen weights (VAE whole)
        assert held["state"] < 0.25 and held["adam_mu"] < 0.25 and held["frozen"] < 0.5
        assert held["conv_in"] != PartitionSpec()
    assert any(line.startswith("FSDP over 8 devices") for line in logs)


def test_fsdp_refusals(sd1_dir, tmp_path):
    from typer.testing import CliRunner

    from sdjax.cli import app
    from sdjax.finetune import full, train_lora

    data = _cats(tmp_path / "cats", 1)
    with pytest.raises(ValueError, match=r"fsdp_min_size=64 \(--fsdp-min-size\) applies with fsdp=True"):
        train_lora(data, tmp_path / "x.safetensors", model=str(tmp_path / "nowhere"), fsdp_min_size=64)
    with pytest.raises(ValueError, match=r"fsdp_min_size=0 \(--fsdp-min-size\) must be a positive integer"):
        full.train_finetune(data, tmp_path / "o", model=str(tmp_path / "nowhere"), fsdp=True, fsdp_min_size=0)
    # one device to split over: refused before anything compiles (the CLI before the model is loaded)
    with pytest.raises(ValueError, match=r"fsdp=True \(--fsdp\) splits the weights .* this run has one"):
        full.train_finetune(data, tmp_path / "o", model=str(sd1_dir), fsdp=True, batch_size=1, resolution=32)
    assert not (tmp_path / "o-run" / "checkpoints").exists()
    cli = ["train", "lora", "--data", str(data), "--out", str(tmp_path / "x.safetensors"), "--fsdp"]
    result = CliRunner().invoke(app, cli + ["--model", str(tmp_path / "nowhere")])  # batch size 1: one device
    assert result.exit_code == 2 and "fsdp=True (--fsdp) splits the weights" in result.output
