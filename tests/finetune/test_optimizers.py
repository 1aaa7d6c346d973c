"""`--optimizer adamw|adafactor|prodigy|lion` (`step.update_rule`, `step.make_optimizer`).

- Each optimiser's first update, after global-norm clipping, equals the update computed by hand in numpy from the
  papers' rules at step 1 (AdamW's bias-corrected moments, Adafactor's factored second moment and block-RMS clip,
  Prodigy's first step at its initial estimate d0, Lion's sign), with decoupled weight decay `lr * wd * p`.
- A Prodigy LoRA run stopped after update 1 and resumed from its orbax checkpoint repeats the unbroken run's losses
  and file exactly, and resuming it with another optimiser is refused: `tests/finetune/test_flux_lora_train.py`
  (`test_a_stopped_run_resumes_exactly`, whose unbroken run, the schnell CLI run, trains with Prodigy: one whole
  run and its compile fewer than a Prodigy run here).
- An unknown name is refused before anything is loaded, naming `--optimizer`.
"""

import dataclasses
import json

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from sdjax.cli import app
from sdjax.finetune import step as step_lib
from sdjax.finetune import train_lora

LR, WD, B1, B2, EPS = 0.01, 0.1, 0.9, 0.999, 1e-8


def _one_image(tmp_path):
    """A data folder of one black image (enough for the settings to be checked)."""
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (32, 32)).save(data / "a.png")
    return data


def _problem():
    """Params and gradients: a (128, 256) kernel (Adafactor factors its second moment) and a bias; the gradients'
    global norm is well above the clipping threshold 1."""
    rng = np.random.default_rng(0)
    params = {
        "kernel": rng.standard_normal((128, 256)).astype(np.float32),
        "bias": rng.standard_normal(8).astype(np.float32),
    }
    grads = {
        "kernel": 0.1 * rng.standard_normal((128, 256)).astype(np.float32),
        "bias": rng.standard_normal(8).astype(np.float32),
    }
    return params, grads


def _clipped(grads: dict) -> dict:
    g64 = {k: v.astype(np.float64) for k, v in grads.items()}
    norm = np.sqrt(sum(np.sum(v**2) for v in g64.values()))
    assert norm > 1.0
    return {k: v / norm for k, v in g64.items()}


def _adafactor_direction(g: np.ndarray) -> np.ndarray:
    """Step 1 of Adafactor (decay 1 - 1^-0.8 = 0, eps 1e-30): the factored estimate for a matrix whose two dims
    are >= 128, the plain one otherwise; then the update clipped to block RMS 1."""
    sq = g**2 + 1e-30
    if g.ndim == 2 and min(g.shape) >= 128:
        row, col = sq.mean(axis=1), sq.mean(axis=0)
        u = g * (row / row.mean())[:, None] ** -0.5 * col[None, :] ** -0.5
    else:
        u = g / np.sqrt(sq)
    return u / max(1.0, np.sqrt(np.mean(u**2)))


def _expected(name: str, p: np.ndarray, g: np.ndarray) -> np.ndarray:
    p = p.astype(np.float64)
    if name == "adamw":  # bias-corrected m = g, v = g^2
        return -LR * (g / (np.abs(g) + EPS) + WD * p)
    if name == "adafactor":
        return -LR * (_adafactor_direction(g) + WD * p)
    if name == "lion":  # sign((1 - b1) g + b1 * 0)
        return -LR * (np.sign(g) + WD * p)
    # prodigy at d = d0 = 1e-6: dlr = d0 lr sqrt(1 - b2) / (1 - b1), m = (1 - b1) d0 g, v = (1 - b2) d0^2 g^2
    d0 = 1e-6
    dlr = d0 * LR * np.sqrt(1 - B2) / (1 - B1)
    m, v = (1 - B1) * d0 * g, (1 - B2) * d0**2 * g**2
    return -WD * dlr * p - dlr * m / (np.sqrt(v) + d0 * EPS)


@pytest.mark.parametrize("name", step_lib.OPTIMIZERS)
def test_first_update_is_the_hand_computed_one(name):
    import jax

    params, grads = _problem()
    tx = step_lib.make_optimizer(step_lib.lr_schedule(LR, 10, 0, "constant"), optimizer=name, weight_decay=WD)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    clipped = _clipped(grads)
    for key in params:
        want = _expected(name, params[key], clipped[key])
        got = np.asarray(updates[key], np.float64)
        err = np.linalg.norm(got - want) / np.linalg.norm(want)
        print(f"{name} {key}: relative error {err:.1e}")
        assert err < 2e-5, (name, key, err)  # float32: 1 - 0.999 alone is off by 1.3e-5 (then a square root)
    if name == "adafactor":  # the factored rule is not the plain one (the check above is not AdamW's sign)
        assert np.linalg.norm(_adafactor_direction(clipped["kernel"]) - np.sign(clipped["kernel"])) > 1.0


def test_unknown_optimizer_is_refused_before_loading(tmp_path):
    nowhere = str(tmp_path / "no-model")
    data = _one_image(tmp_path)
    with pytest.raises(ValueError, match=r"optimizer='sgd' \(--optimizer\) must be one of adamw, adafactor, prodigy"):
        train_lora(data, tmp_path / "x.safetensors", model=nowhere, optimizer="sgd")
    with pytest.raises(ValueError, match=r"optimizer='adam' \(--optimizer\)"):
        step_lib.make_optimizer(step_lib.lr_schedule(1e-4, 10, 0, "constant"), optimizer="adam")
    result = CliRunner().invoke(
        app, ["train", "finetune", "--data", str(data), "--out", str(tmp_path / "o"), "--optimizer", "sgd"]
    )
    assert result.exit_code == 2 and "--optimizer" in result.output
    assert not (tmp_path / "o-run").exists()


def _adamw_numpy(params: dict, grads: list[dict], *, lr, b1, b2, eps, wd, clip) -> dict:
    """AdamW (bias-corrected, decoupled decay `lr * wd * p`) after global-norm clipping, in float64."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: 0.0 for k in p}
    v = {k: 0.0 for k in p}
    for t, g in enumerate(grads, 1):
        g = {k: x.astype(np.float64) for k, x in g.items()}
        norm = np.sqrt(sum(np.sum(x**2) for x in g.values()))
        if clip is not None and norm > clip:
            g = {k: x * clip / norm for k, x in g.items()}
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            mh, vh = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            p[k] = p[k] - lr * (mh / (np.sqrt(vh) + eps) + wd * p[k])
    return p


@pytest.mark.parametrize(
    "settings",
    [
        dict(adam_beta1=0.5, adam_beta2=0.9, adam_epsilon=0.05, weight_decay=0.3, max_grad_norm=2.0),
        dict(max_grad_norm=None, weight_decay=0.0),
    ],
)
def test_the_optimizer_settings_reach_adamw(tmp_path, settings):
    """`--adam-beta1/2`, `--adam-epsilon`, `--weight-decay`, `--max-grad-norm` (a trainer's config ->
    `run._optimizer`): two AdamW updates equal numpy's with those settings (the second update is where the betas
    show)."""
    import jax
    import optax

    from sdjax.finetune import run as run_lib

    cfg = run_lib.LoraTrainConfig(data=str(tmp_path), out="x.safetensors", lr=LR, steps=10, **settings)
    cfg._check_optimizer_settings()
    _, tx = run_lib._optimizer(cfg)
    params, grads = _problem()
    second = {k: np.roll(g, 1) * 3 for k, g in grads.items()}
    state, values = tx.init(params), params
    for g in (grads, second):
        updates, state = jax.jit(tx.update)(g, state, values)
        values = optax.apply_updates(values, updates)
    want = _adamw_numpy(
        params,
        [grads, second],
        lr=LR,
        b1=cfg.adam_beta1,
        b2=cfg.adam_beta2,
        eps=cfg.adam_epsilon,
        wd=cfg.weight_decay,
        clip=cfg.max_grad_norm,
    )
    for key in params:
        err = np.linalg.norm(np.asarray(values[key], np.float64) - want[key]) / np.linalg.norm(want[key])
        assert err < 1e-6, (key, err)
    # the defaults give another trajectory (the settings are not ignored)
    default = _adamw_numpy(params, [grads, second], lr=LR, b1=B1, b2=B2, eps=EPS, wd=1e-2, clip=1.0)
    assert max(np.abs(want[k] - default[k]).max() for k in params) > 1e-4


@pytest.mark.parametrize(
    "settings, named",
    [
        (dict(adam_beta1=1.0), r"adam_beta1 \(--adam-beta1\)=1.0 must be a number in \[0, 1\)"),
        (dict(adam_beta2=-0.1), r"adam_beta2 \(--adam-beta2\)=-0.1"),
        (dict(adam_epsilon=0.0), r"adam_epsilon \(--adam-epsilon\)=0.0 must be a positive number"),
        (dict(weight_decay=float("nan")), r"weight_decay \(--weight-decay\)=nan"),
        (dict(max_grad_norm=0.0), r"max_grad_norm \(--max-grad-norm\)=0.0 must be a positive number"),
        (dict(optimizer="lion", adam_beta1=0.8), r"adam_beta1 \(--adam-beta1\)=0.8: optimizer='lion' has no such"),
    ],
)
def test_bad_optimizer_settings_are_named_before_loading(tmp_path, settings, named):
    data = _one_image(tmp_path)
    with pytest.raises(ValueError, match=named):
        train_lora(data, tmp_path / "x.safetensors", model=str(tmp_path / "no-model"), **settings)
    assert not (tmp_path / "x-run").exists()


def test_cli_optimizer_settings_and_the_trainers_defaults(tmp_path, monkeypatch):
    """Given, the options reach the trainer (`--max-grad-norm 0`: no clipping); not given, each trainer keeps its
    own default (textual inversion does not clip, as diffusers' script); a bad one exits 2 naming it; resuming a
    run with other optimiser settings is refused."""
    from sdjax.finetune import run as run_lib
    from sdjax.finetune import textual_inversion

    data = _one_image(tmp_path)
    seen = {}

    def fake_train(data, out, **options):
        seen.update(options)
        raise SystemExit(0)

    monkeypatch.setattr(textual_inversion, "train_textual_inversion", fake_train)
    ti = ["train", "textual-inversion", "--data", str(data), "--token", "<t>", "--init-word", "cat"]
    ti += ["--out", str(tmp_path / "t.safetensors")]
    CliRunner().invoke(app, ti)
    assert "steps" in seen and not {"max_grad_norm", "weight_decay", "adam_beta1"} & set(seen)  # config defaults
    default = textual_inversion.TextualInversionConfig(data="d", out="t.safetensors", token="<t>", init_word="cat")
    assert default.max_grad_norm is None
    seen.clear()
    CliRunner().invoke(app, [*ti, "--max-grad-norm", "0", "--adam-beta2", "0.99", "--weight-decay", "0"])
    assert (seen["max_grad_norm"], seen["adam_beta2"], seen["weight_decay"]) == (None, 0.99, 0.0)
    bad = CliRunner().invoke(app, [*ti, "--optimizer", "adafactor", "--adam-epsilon", "1e-6"])
    assert bad.exit_code == 2 and "--adam-epsilon" in bad.output and "adafactor" in bad.output

    run_dir = tmp_path / "run"
    cfg = run_lib.LoraTrainConfig(data=str(data), out=str(tmp_path / "x.safetensors"), run_dir=str(run_dir))
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    run_lib.Session.begin(cfg)  # the same settings resume
    with pytest.raises(ValueError, match="adam_beta2: 0.999 -> 0.95"):
        run_lib.Session.begin(dataclasses.replace(cfg, adam_beta2=0.95))


def _lora_problem():
    """A LoRA-shaped tree `{component: {layer: {down, up}}}` of a denoiser and two text encoders, and gradients."""
    rng = np.random.default_rng(3)
    tree, grads = {}, {}
    for c in ("unet", "text_encoder", "text_encoder_2"):
        tree[c] = {"layer": {"down": rng.standard_normal((4, 16)).astype(np.float32)}}
        grads[c] = {"layer": {"down": rng.standard_normal((4, 16)).astype(np.float32)}}
    return tree, grads


def _flat(tree: dict) -> dict:
    return {c: v["layer"]["down"] for c, v in tree.items()}


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_text_encoder_lr_moves_only_the_text_encoders_at_their_rate(tmp_path, name, monkeypatch):
    """`--text-encoder-lr` (`text_encoder_lr`): two updates of a LoRA tree, the text encoders' values at their
    learning rate and the denoiser's at `lr`, gradients clipped together (numpy's AdamW; Lion: the same run with
    each part's own rate); their optimiser state survives an orbax round trip (`run_dir.checkpoints`)."""
    import jax
    import optax

    from sdjax.finetune import run as run_lib
    from sdjax.finetune import run_dir

    te_lr = LR / 7
    cfg = run_lib.LoraTrainConfig(
        data=str(tmp_path), out="x.safetensors", lr=LR, steps=10, train_text_encoder=True, text_encoder_lr=te_lr,
        optimizer=name,
    )  # fmt: skip
    _, tx = run_lib._optimizer(cfg)
    params, grads = _lora_problem()
    second = jax.tree_util.tree_map(lambda g: np.roll(g, 1) * 3, grads)

    def run(tx, state=None):
        state, values = (tx.init(params) if state is None else state), params
        for g in (grads, second):
            updates, state = jax.jit(tx.update)(g, state, values)
            values = optax.apply_updates(values, updates)
        return _flat(values), state

    got, state = run(tx)
    if name == "adamw":
        fp, fg, fs = _flat(params), _flat(grads), _flat(second)
        want = {lr: _adamw_numpy(fp, [fg, fs], lr=lr, b1=B1, b2=B2, eps=EPS, wd=1e-2, clip=1.0) for lr in (LR, te_lr)}
        want = {c: want[te_lr if c.startswith("text") else LR][c] for c in fp}
    else:  # each part as its own optimiser at its own rate, after the clipping of the whole tree
        one = {lr: run(step_lib.make_optimizer(step_lib.lr_schedule(lr, 10, 0, "constant"), optimizer=name))[0]
               for lr in (LR, te_lr)}  # fmt: skip
        want = {c: one[te_lr if c.startswith("text") else LR][c] for c in got}
    for c in got:
        err = np.linalg.norm(np.asarray(got[c], np.float64) - want[c]) / np.linalg.norm(want[c])
        assert err < 1e-6, (c, err)
    moved = {c: np.abs(got[c] - _flat(params)[c]).mean() for c in got}
    assert moved["text_encoder"] < 0.5 * moved["unet"] and moved["text_encoder_2"] < 0.5 * moved["unet"]

    manager = run_dir.checkpoints(tmp_path / "run")
    manager.save(2, args=run_dir.save_args({"lora": params, "opt_state": state}))
    manager.wait_until_finished()
    restored, step = run_dir.restore(manager, {"lora": params, "opt_state": tx.init(params)})
    assert step == 2
    flat_state, flat_restored = jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored["opt_state"])
    assert len(flat_state) == len(flat_restored)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(flat_state, flat_restored, strict=True))


@pytest.mark.parametrize(
    "settings, named",
    [
        (dict(text_encoder_lr=1e-5), r"text_encoder_lr=1e-05 \(--text-encoder-lr\) applies to the text encoders"),
        (dict(text_encoder_lr=0.0, train_text_encoder=True), r"text_encoder_lr=0.0 \(--text-encoder-lr\) must be"),
        (dict(text_encoder_lr=1.0, train_text_encoder=True, optimizer="prodigy", lr=1.0), "optimizer='prodigy'"),
    ],
)
def test_bad_text_encoder_lr_is_named(tmp_path, settings, named):
    data = _one_image(tmp_path)
    with pytest.raises(ValueError, match=named):
        train_lora(data, tmp_path / "x.safetensors", model=str(tmp_path / "no-model"), **settings)
