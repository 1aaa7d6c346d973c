"""`sdjax train finetune --save-precision fp16|bf16` (`FinetuneConfig.save_precision`): the written UNet of the
diffusers folder, and every model of the `--single-file`, are the float32 weights cast to that precision (no
training needed: `full.write_folder` and `full.write_single_file` are what the run's end calls)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from typer.testing import CliRunner

from sdjax.finetune import full


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
    dtype = full.save_dtype(precision)
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
