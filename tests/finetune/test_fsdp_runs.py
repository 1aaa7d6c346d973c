"""Whole training runs with `--fsdp` (`loop.run_loop` placing the state and frozen params with `finetune.sharding`)
on 8 simulated CPU devices, each compared with the same run replicated and unbroken. The full fine-tune with AdamW,
accumulation and gradient checkpointing (its moments and accumulated gradients split with the master copy, an EMA
beside them) is stopped after update 1 and resumed from its orbax checkpoint, and its state after the last update is
held leaf by leaf to the replicated run's (the step-level check of `full.make_loss` under `step.jit_step`, in the
trainer's own loop); textual inversion and DreamBooth with prior preservation (their frozen models split, the
trained token rows or LoRA whole) run unbroken: resuming is `run_loop`'s for every trainer (restore, then the same
`--fsdp` placement), held here by the full fine-tune's split state and EMA, and per trainer without FSDP by
tests/finetune/test_finetune_textual_inversion.py::test_prompts_and_resume and tests/finetune/test_run.py (LoRA,
whose loop DreamBooth's is). The FSDP threshold is lowered to 256 elements so that nearly every kernel of the tiny
SD 1.x model is split (the LoRA steps' checks, each leaf with plain SGD: tests/finetune/test_train_sharding.py,
which also holds Adafactor's and Prodigy's split states to the replicated ones over two updates and brings them back
from a run's checkpoint bit for bit; a whole Prodigy run resumed:
tests/finetune/test_flux_lora_train.py::test_a_stopped_run_resumes_exactly).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from PIL import Image
from safetensors.numpy import load_file

from sdjax.finetune import sharding as train_sharding
from sdjax.finetune import train_dreambooth

pytestmark = pytest.mark.all_devices  # FSDP splits over the data axis of all eight simulated devices

MIN_SIZE = 256
# Another layout sums the gradients in another order, so the runs differ by float32 rounding, and AdamW's first
# updates are about lr * sign(g) in every coordinate whose |g| is well above AdamW's epsilon: a coordinate whose
# exact gradient is zero and computed one rounding noise moves by a full step either way. The tiny SD 1.x UNet has
# such coordinates (biases that a GroupNorm of one channel per group cancels: with the default epsilon 1e-8 the
# fine-tune's master copy differed by 3.0e-5 over the UNet and 3.8e-3 in up_blocks_1's resnets_1 conv1 bias). The
# fine-tune runs with epsilon 1e-4, far above that noise (the run still moves the UNet by 1.6e-2, 2.2e-2 with 1e-8),
# and is held to RTOL over the UNet and LEAF_RTOL per leaf (measured: 1.1e-7 and 5.0e-7; the written EMA 1.0e-7).
RTOL = 1e-5  # the losses (relative), the fine-tune's master copy and written UNet (relative L2 over the whole UNet)
LEAF_RTOL = 5e-5  # each leaf of the fine-tune's master copy
# A trained LoRA or token rows (relative L2; AdamW's default epsilon); a LoRA's worst single tensor to 10x that
# (rank 2: a few coordinates a step apart weigh more in a small tensor; measured 3.2e-3 on DreamBooth's).
LORA_RTOL = 1e-3


@pytest.fixture(scope="module")
def eight_devices():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (tests/conftest.py sets --xla_force_host_platform_device_count=8)")


def _cats(root, n: int = 3, captions: bool = True, seed: int = 2):
    rng = np.random.default_rng(seed)
    root.mkdir()
    for i in range(n):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), np.uint8)).save(root / f"c{i}.png")
        if captions:
            (root / f"c{i}.txt").write_text(f"a cat, pose {i}")
    return root


def _held(tree) -> tuple[float, bool]:
    """`(bytes one device holds of tree / the tree's bytes, whether every split leaf is split in 8 equal parts)`,
    read from the placed arrays' own shards."""
    held = total = 0
    eighths = True
    for x in jax.tree_util.tree_leaves(tree):
        shard = x.addressable_shards[0].data.nbytes
        held, total = held + shard, total + x.nbytes
        if x.sharding.spec != PartitionSpec():
            eighths = eighths and shard * 8 == x.nbytes
    return held / total, eighths


def _recording(monkeypatch, trained: str, layouts: list | None = None) -> list[dict]:
    """`Layout.place` wrapped: per call (a run placing its arrays), a device's share of the trained values, the
    optimiser state and each frozen component (and the layout itself, appended to `layouts`)."""
    placed: list[dict] = []
    place = train_sharding.Layout.place

    def recording_place(self, state, frozen, put=None):
        state, frozen = place(self, state, frozen, put)
        shares = {"values": _held(state[trained]), "opt_state": _held(state["opt_state"])}
        placed.append(shares | {c: _held(v) for c, v in frozen.items()})
        if layouts is not None:
            layouts.append(self)
        return state, frozen

    monkeypatch.setattr(train_sharding.Layout, "place", recording_place)
    return placed


def _saving(monkeypatch) -> list[dict]:
    """`loop._save_args` wrapped: the tree of each checkpoint a run writes (its state after an update, as the step
    returned it, and the EMA)."""
    from sdjax.finetune import loop as loop_lib

    saved: list[dict] = []
    save_args = loop_lib._save_args

    def recording_save_args(tree):
        saved.append(tree)
        return save_args(tree)

    monkeypatch.setattr(loop_lib, "_save_args", recording_save_args)
    return saved


def _runs(train, data, tmp_path, suffix: str, resume: bool = True, **options):
    """`train` replicated and unbroken, then with FSDP (`resume`: stopped after update 1 and resumed; else unbroken)
    -> (the replicated result, the FSDP run's last call's result)."""
    ref = train(data, tmp_path / f"ref{suffix}", **options)
    fsdp = dict(options, fsdp=True, fsdp_min_size=MIN_SIZE)
    if resume:
        first = train(data, tmp_path / f"fsdp{suffix}", stop_after=1, **fsdp)
        got = train(data, tmp_path / f"fsdp{suffix}", **fsdp)
        assert (len(first.losses), got.start_step, len(got.losses)) == (1, 1, len(ref.losses) - 1)
        losses = first.losses + got.losses
    else:
        got = train(data, tmp_path / f"fsdp{suffix}", **fsdp)
        assert (got.start_step, len(got.losses)) == (0, len(ref.losses))
        losses = got.losses
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref.losses, strict=True))
    how = "stopped and resumed" if resume else "unbroken"
    print(f"losses: FSDP {how} {losses}, replicated {ref.losses} (worst relative {loss_err:.1e})")
    assert loss_err <= RTOL
    return ref, got


def _rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(np.asarray(b, np.float64)), 1e-30))


def _flat(tensors: dict, keys) -> np.ndarray:
    return np.concatenate([np.ravel(tensors[k]) for k in sorted(keys)])


def _worst_leaf(a, b) -> tuple[float, str]:
    """The largest relative error of a leaf of tree `a` from the same leaf of `b`, and its path."""
    pairs = zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b), strict=True)
    return max((_rel(x, y), jax.tree_util.keystr(path)) for (path, x), y in pairs)


def _worst_tensor(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(_rel(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------------ full fine-tune
def test_finetune_run_with_fsdp_repeats_the_replicated_run(sd1_dir, eight_devices, tmp_path, monkeypatch):
    """`train_finetune(fsdp=True)` with AdamW (epsilon 1e-4: the module constants), accumulation
    (`optax.MultiSteps`, 2 micro-batches per update), gradient checkpointing, v-prediction and a noise offset: the
    same losses, master copy (RTOL over the UNet, LEAF_RTOL per leaf) and written UNet (the EMA) as the replicated
    unbroken run, while the master copy and AdamW's moments were split over the 8 devices, each split leaf in
    eighths, in both calls; after the last update the master copy, the moments and the accumulated gradients are
    split, every leaf of the state in the layout's sharding, and every optimiser leaf that optax itself maps to a
    value has that value's sharding (the rest replicated)."""
    import optax
    from jax.sharding import NamedSharding

    from sdjax.finetune import full
    from sdjax.finetune import step as step_lib
    from sdjax.pipelines import load_pipeline

    data = _cats(tmp_path / "cats")
    options = dict(model=str(sd1_dir), steps=2, batch_size=8, accumulation=2, resolution=32, bucketing=False)
    options |= dict(lr=1e-3, adam_epsilon=1e-4, ema_decay=0.5, seed=1, gradient_checkpointing=True)
    options |= dict(prediction_type="v_prediction", noise_offset=0.05)
    layouts: list[train_sharding.Layout] = []
    placed = _recording(monkeypatch, "unet", layouts)
    saved = _saving(monkeypatch)
    logs: list[str] = []
    ref, got = _runs(full.train_finetune, data, tmp_path, "", optimizer="adamw", log=logs.append, **options)
    flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(tree)])
    initial = load_pipeline(str(sd1_dir))[1]["unet"]
    unet_err = _rel(flat(got.unet), flat(ref.unet))
    moved = _rel(flat(ref.unet), flat(initial))
    print(f"UNet {unet_err:.1e} (the run moved it by {moved:.1e}); placed {placed}")
    print([line for line in logs if "FSDP" in line])
    assert unet_err <= RTOL and unet_err < 0.01 * moved
    assert len(placed) == 2  # the two FSDP calls (the replicated run builds no layout)
    for shares in placed:  # a device's share: ~1/8 of the master copy and optimiser state; the VAE whole
        assert shares["values"][0] < 0.2 and shares["opt_state"][0] < 0.2, shares
        assert shares["values"][1] and shares["opt_state"][1] and shares["text_encoder"][0] < 0.25
        assert shares["vae"][0] == 1.0
    assert any(line.startswith("FSDP over 8 devices") for line in logs)

    # the state after the last update of the replicated run and of the resumed FSDP run (their last checkpoints)
    assert len(saved) == 3  # one checkpoint per call: the end of each run, the stop after update 1
    ref_state, state = saved[0], saved[2]
    master, leaf = _rel(flat(state["unet"]), flat(ref_state["unet"])), _worst_leaf(state["unet"], ref_state["unet"])
    print(f"master copy: {master:.1e} over the UNet, worst leaf {leaf[0]:.1e} ({leaf[1]})")
    assert master <= RTOL and leaf[0] <= LEAF_RTOL
    assert int(state["opt_state"].gradient_step) == 2
    assert _rel(state["unet"]["conv_in"]["kernel"], initial["conv_in"]["kernel"]) > 1e-5
    lay = layouts[-1]  # the state comes back from each update in the layout it was placed in
    stepped = {k: state[k] for k in lay.state}  # (the checkpoint's tree holds the EMA beside the state)
    for got_leaf, want in zip(jax.tree_util.tree_leaves(stepped), jax.tree_util.tree_leaves(lay.state), strict=True):
        assert got_leaf.sharding.is_equivalent_to(want, got_leaf.ndim)
    inner = state["opt_state"].inner_opt_state
    adam = next(s for s in jax.tree_util.tree_leaves(inner, is_leaf=lambda s: hasattr(s, "mu")) if hasattr(s, "mu"))
    for tree in (state["unet"], adam.mu, adam.nu, state["opt_state"].acc_grads):
        assert _held(tree)[0] < 0.2 and _held(tree)[1]
    optimizer = step_lib.make_optimizer(step_lib.lr_schedule(1e-3, 2, 0, "constant"), accumulation=2, eps=1e-4)
    expected = optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        state["opt_state"],
        lay.state["unet"],
        transform_non_params=lambda _: lay.replicated,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    for got_leaf, want in zip(
        jax.tree_util.tree_leaves(state["opt_state"]), jax.tree_util.tree_leaves(expected), strict=True
    ):
        assert got_leaf.sharding.is_equivalent_to(want, got_leaf.ndim)


# ------------------------------------------------------------------------------------------------ the LoRA-like runs
def test_textual_inversion_run_with_fsdp_repeats_the_replicated_run(sd1_dir, eight_devices, tmp_path, monkeypatch):
    """Textual inversion supports `--fsdp` as a LoRA does: the frozen UNet and text encoder (its token table too)
    are split, the trained token rows and their moments stay whole; losses and embedding as the replicated run
    (unbroken: a resumed FSDP run, the module docstring)."""
    from sdjax.finetune.textual_inversion import train_textual_inversion

    data = _cats(tmp_path / "cats", captions=False)  # object templates, chosen by row
    options = dict(model=str(sd1_dir), token="<cat>", init_word="cat", vectors=2, steps=2, batch_size=8)
    options |= dict(resolution=32, bucketing=False, lr=1e-2, seed=1)
    placed = _recording(monkeypatch, "rows")
    ref, got = _runs(train_textual_inversion, data, tmp_path, ".safetensors", resume=False, **options)
    a, b = load_file(str(ref.out))["emb_params"], load_file(str(got.out))["emb_params"]
    init = load_file(str(got.run_dir / "init.safetensors"))["emb_params"]
    err, moved = _rel(b, a), _rel(a, init)
    print(f"embedding: {err:.1e} from the replicated run's (the run moved it by {moved:.1e}); placed {placed}")
    assert err <= LORA_RTOL and err < 0.01 * moved
    assert len(placed) == 1  # the one FSDP call
    for shares in placed:
        assert shares["values"] == (1.0, True) and shares["opt_state"] == (1.0, True)  # whole on every device
        assert shares["unet"][0] < 0.25 and shares["text_encoder"][0] < 0.25 and shares["vae"][0] == 1.0


def test_dreambooth_run_with_fsdp_repeats_the_replicated_run(sd1_dir, eight_devices, tmp_path, monkeypatch):
    """DreamBooth with prior preservation and `--fsdp` ([instance; class] micro-batches of 4 + 4 over the 8
    devices): the frozen UNet split, the LoRA whole; losses and LoRA as the replicated run (unbroken)."""
    instance, classes = _cats(tmp_path / "sks"), _cats(tmp_path / "cats", n=4, captions=False, seed=3)
    options = dict(model=str(sd1_dir), instance_prompt="a photo of sks cat", with_prior_preservation=True)
    options |= dict(class_data=str(classes), class_prompt="a photo of a cat", num_class_images=4, prior_loss_weight=0.5)
    options |= dict(steps=2, rank=2, batch_size=4, resolution=32, lr=1e-3, seed=1)
    placed = _recording(monkeypatch, "lora")
    ref, got = _runs(train_dreambooth, instance, tmp_path, ".safetensors", resume=False, **options)
    a, b = load_file(str(ref.out)), load_file(str(got.out))
    ups = sorted(k for k in a if "lora_up" in k)  # zero at the start: their size is what the run moved them
    up_err, worst = _rel(_flat(b, ups), _flat(a, ups)), _worst_tensor(b, a)
    print(f"DreamBooth LoRA: up factors {up_err:.1e}, whole LoRA {_rel(_flat(b, a), _flat(a, a)):.1e}, worst tensor")
    print(f"{worst:.1e} from the replicated run's; placed {placed}")
    assert up_err <= LORA_RTOL and _rel(_flat(b, a), _flat(a, a)) <= LORA_RTOL and worst <= 10 * LORA_RTOL
    assert len(placed) == 1
    for shares in placed:
        assert shares["values"][0] == 1.0 and shares["unet"][0] < 0.25 and shares["vae"][0] == 1.0


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


@pytest.mark.parametrize("command", ["textual-inversion", "dreambooth"])
def test_fsdp_reaches_textual_inversion_and_dreambooth_from_the_cli(tmp_path, command):
    """`--fsdp` is an option of both commands and is checked before any model is loaded: one image per batch on
    one device has nothing to split over."""
    from typer.testing import CliRunner

    from sdjax.cli import app

    data, out = _cats(tmp_path / "cats", 1), tmp_path / "x.safetensors"
    if command == "textual-inversion":
        cli = [command, "--data", str(data), "--token", "<cat>", "--init-word", "cat"]
    else:
        cli = [command, "--instance-data", str(data), "--instance-prompt", "a sks cat"]
    cli = ["train", *cli, "--out", str(out), "--model", str(tmp_path / "nowhere"), "--fsdp"]
    result = CliRunner().invoke(app, cli)
    assert result.exit_code == 2 and "fsdp=True (--fsdp) splits the weights" in result.output, result.output
    assert not out.exists()
