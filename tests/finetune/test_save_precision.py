"""`sdjax train ... --save-precision fp16|bf16` (`TrainConfig.save_precision`): the written files hold the float32
trained values cast to that precision: a fine-tune's UNet in the diffusers folder and every model of its
`--single-file`, a LoRA (kohya's file and diffusers' `--peft` file), a textual-inversion embedding (no training
needed: the writers are what each run's end calls)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from typer.testing import CliRunner

from sdjax.finetune import full
from sdjax.finetune import run as run_lib


def _tensors(path) -> dict[str, np.ndarray]:
    with safe_open(str(path), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (a safe_open handle)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_written_weights_are_the_float32_ones_cast(sd1_dir, tmp_path, precision):
    import jax

    from sdjax.loading.single_file import load_single_file
    from sdjax.models.convert import params_to_state_dict
    from sdjax.pipelines import load_pipeline

    _, params = load_pipeline(str(sd1_dir))
    rng = np.random.default_rng(0)  # "trained" weights: not already representable in 16 bits
    unet = jax.tree_util.tree_map(
        lambda x: (np.asarray(x) + rng.normal(0, 1e-3, np.shape(x))).astype(np.float32), params["unet"]
    )
    dtype = run_lib.save_dtype(precision)
    ref32 = params_to_state_dict(unet, dtype=np.float32)

    folder = full.write_folder(tmp_path / precision, str(sd1_dir), unet, dtype)
    written = _tensors(folder / "unet" / full.WEIGHTS)
    assert written.keys() == ref32.keys()
    for k, v in written.items():
        assert v.dtype == dtype and np.array_equal(v, ref32[k].astype(dtype)), k
    assert any(not np.array_equal(v.astype(np.float32), ref32[k]) for k, v in written.items())  # really rounded

    fp32 = _tensors(full.write_single_file(tmp_path / "fp32.safetensors", folder, "epsilon", {}))
    single = _tensors(full.write_single_file(tmp_path / f"{precision}.safetensors", folder, "epsilon", {}, dtype))
    assert single.keys() == fp32.keys()
    assert all(v.dtype == dtype and np.array_equal(v, fp32[k].astype(dtype)) for k, v in single.items())

    _, loaded = load_pipeline(str(folder))  # both load in sdjax, the UNet as the cast weights
    _, from_file, _ = load_single_file(str(tmp_path / f"{precision}.safetensors"), config=str(folder))
    want = params_to_state_dict(jax.tree_util.tree_map(lambda x: np.asarray(x, dtype), unet), dtype=np.float32)
    for tree in (loaded["unet"], from_file["unet"]):
        got = params_to_state_dict(tree, dtype=np.float32)
        assert all(np.array_equal(got[k], want[k]) for k in want)


def test_a_bad_precision_is_named_before_loading(tmp_path):
    from sdjax.cli import app

    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (32, 32)).save(data / "a.png")
    with pytest.raises(ValueError, match=r"save_precision='fp8' \(--save-precision\) must be one of fp32, fp16"):
        full.train_finetune(data, tmp_path / "o", model=str(tmp_path / "none"), save_precision="fp8")
    r = CliRunner().invoke(
        app, ["train", "finetune", "--data", str(data), "--out", str(tmp_path / "o"), "--save-precision", "fp8"]
    )
    assert r.exit_code == 2 and "--save-precision" in r.output and not (tmp_path / "o-run").exists()


def test_lora_and_embedding_files_at_the_save_precision(sd1_dir, tmp_path):
    import jax

    from sdjax.finetune import lora as lora_lib
    from sdjax.finetune import textual_inversion
    from sdjax.pipelines import load_pipeline

    pipe, params = load_pipeline(str(sd1_dir))
    rng = np.random.default_rng(1)
    lora = lora_lib.init_lora(jax.random.PRNGKey(0), params, {"unet": lora_lib.UNET_TARGETS}, 2)
    lora = jax.tree_util.tree_map(lambda x: (x + rng.normal(0, 0.1, x.shape)).astype(np.float32), lora)  # "trained"
    files = {}
    for precision in ("fp32", "fp16"):
        out = tmp_path / f"{precision}.safetensors"
        cfg = run_lib.LoraTrainConfig(data="d", out=str(out), rank=2, peft=True, save_precision=precision)
        run_dir = tmp_path / f"{precision}-run"
        run_dir.mkdir()
        run_lib.write_lora(cfg, lora, pipe.unet.config, "epsilon", run_dir)
        files[precision] = (_tensors(out), _tensors(run_dir / "pytorch_lora_weights.safetensors"))
    for full32, half in zip(files["fp32"], files["fp16"], strict=True):
        assert half.keys() == full32.keys()
        assert all(v.dtype == np.float16 and np.array_equal(v, full32[k].astype(np.float16)) for k, v in half.items())
    before = pipe.generate("a cat", steps=2, seed=0, width=32, height=32, output_type="np")
    pipe.load_lora(str(tmp_path / "fp16.safetensors"))  # sdjax reads the half-precision file
    try:
        after = pipe.generate("a cat", steps=2, seed=0, width=32, height=32, output_type="np")
    finally:
        pipe.unload_loras()
    assert np.abs(np.asarray(after) - np.asarray(before)).max() > 1e-3

    rows = {"text_encoder": rng.normal(size=(2, 32)).astype(np.float32)}
    bf16 = run_lib.save_dtype("bf16")
    textual_inversion.write_a1111(tmp_path / "emb.safetensors", rows, {}, bf16)
    (path,) = textual_inversion.write_diffusers(tmp_path, "<t>", rows, bf16)
    for got in (_tensors(tmp_path / "emb.safetensors")["emb_params"], _tensors(path)["<t>"]):
        assert got.dtype == bf16 and np.array_equal(got, rows["text_encoder"].astype(bf16))
