"""`models.shapes_cache`: abstract params trees kept on disk between processes.

A second process reads the tree instead of tracing; the tree read equals the traced one for every model family; a
changed config, model source or imported module misses; corrupt, truncated or foreign files are ignored and
rewritten; `SDJAX_SHAPE_CACHE=off` and an unwritable folder leave loading as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
import reference
import t5_reference

from sdjax.families.flux import presets as flux_presets
from sdjax.families.sd3 import presets as sd3_presets
from sdjax.models import clip, controlnet, flux, sd3, sd3_controlnet, shapes_cache, t5, unet, vae

CACHED_FUNCTIONS = [
    unet._init_params_shape,
    vae._init_params_shape,
    controlnet._init_params_shape,
    flux._init_params_shape,
    sd3._init_params_shape,
    sd3_controlnet._init_params_shape,
]

# the families' own seconds-long presets
FLUX_TINY = flux_presets.ARCHITECTURES["flux-tiny"].transformer
SD3_TINY = sd3_presets.ARCHITECTURES["sd3-tiny"].transformer

# (model class, config) of each family whose `init_params_shape` goes through the cache.
CASES = {
    "unet-sd1": (unet.UNet2DConditionModel, lambda: unet.UNet2DConditionConfig(**reference.UNET_SD1)),
    "unet-sdxl": (unet.UNet2DConditionModel, lambda: unet.UNet2DConditionConfig(**reference.UNET_SDXL)),
    "vae": (vae.AutoencoderKL, lambda: vae.AutoencoderKLConfig(**reference.VAE)),
    "clip": (clip.CLIPTextModel, lambda: clip.CLIPTextConfig.from_dict(reference.CLIP_SD1, source="test")),
    "clip-proj": (
        clip.CLIPTextModelWithProjection,
        lambda: clip.CLIPTextConfig.from_dict(reference.CLIP_SDXL_2, source="test"),
    ),
    "t5": (t5.T5EncoderModel, lambda: t5.T5Config.from_dict(t5_reference.T5_TINY)),
    "flux": (flux.FluxTransformer2DModel, lambda: flux.FluxTransformerConfig.from_dict(FLUX_TINY)),
    "sd3": (sd3.SD3Transformer2DModel, lambda: sd3.SD3TransformerConfig.from_dict(SD3_TINY)),
    "controlnet": (
        controlnet.ControlNetModel,
        lambda: controlnet.ControlNetConfig.from_dict(
            dict(
                block_out_channels=(4, 8),
                layers_per_block=1,
                in_channels=4,
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                cross_attention_dim=32,
                conditioning_embedding_out_channels=(16, 32),
                norm_num_groups=1,
            )
        ),
    ),
    "sd3-controlnet-no-pos": (
        sd3_controlnet.SD3ControlNetModel,
        lambda: sd3_controlnet.SD3ControlNetConfig.from_dict(
            {**{k: v for k, v in SD3_TINY.items() if k != "sample_size"}, "pos_embed_max_size": None}
            | {"pos_embed_type": None, "use_pos_embed": False, "joint_attention_dim": None, "num_layers": 1}
            | {"dual_attention_layers": (), "qk_norm": None}  # joint-block options of the preset
        ),
    ),
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache in a fresh folder, the in-process (lru) caches emptied before and after, and a count of traces."""
    folder = tmp_path / "shapes"
    monkeypatch.setenv(shapes_cache.ENV, str(folder))
    for fn in CACHED_FUNCTIONS:
        fn.cache_clear()
    traces = []
    real = jax.eval_shape
    monkeypatch.setattr(jax, "eval_shape", lambda *a, **k: traces.append(1) or real(*a, **k))
    yield folder, traces
    for fn in CACHED_FUNCTIONS:
        fn.cache_clear()


def _clear():
    for fn in CACHED_FUNCTIONS:
        fn.cache_clear()


def _rows(tree) -> list:
    """Every leaf as (path, shape, dtype, weak_type), in the tree's own (dict insertion) order."""
    from flax.traverse_util import flatten_dict

    return [(p, v.shape, v.dtype, v.weak_type, type(v)) for p, v in flatten_dict(tree).items()]


@pytest.mark.parametrize("case", list(CASES))
def test_the_tree_read_back_equals_the_traced_one(case, cache, monkeypatch):
    folder, traces = cache
    model_cls, make = CASES[case]
    config = make()
    monkeypatch.setenv(shapes_cache.ENV, "off")
    traced = model_cls.init_params_shape(config)
    assert traces and not folder.exists()
    _clear()
    monkeypatch.setenv(shapes_cache.ENV, str(folder))
    written = model_cls.init_params_shape(config)  # a miss: traced and written
    assert len(list(folder.glob(f"{model_cls.__name__}-*.json"))) == 1
    _clear()
    traces.clear()
    read = model_cls.init_params_shape(config)
    assert not traces, "read from disk, not traced"
    assert _rows(read) == _rows(traced) == _rows(written)
    assert jax.tree_util.tree_structure(read) == jax.tree_util.tree_structure(traced)
    read[next(iter(read))] = None  # each call hands out its own tree
    assert _rows(model_cls.init_params_shape(config)) == _rows(traced)


CHILD = """
import json, jax
calls = []
real = jax.eval_shape
jax.eval_shape = lambda *a, **k: calls.append(1) or real(*a, **k)
from sdjax.models import unet
config = unet.UNet2DConditionConfig(**{config})
tree = unet.init_params_shape(config)
leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
print(json.dumps({{"traces": len(calls), "leaves": [[jax.tree_util.keystr(p), list(v.shape), str(v.dtype)]
                                                    for p, v in leaves]}}))
"""


def test_a_second_process_reads_the_tree_instead_of_tracing(tmp_path):
    env = {**os.environ, shapes_cache.ENV: str(tmp_path / "shapes")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(shapes_cache.__file__).parents[2]), env.get("PYTHONPATH", "")])
    script = textwrap.dedent(CHILD).format(config=repr(reference.UNET_SD1))
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["traces"] == 1 and runs[1]["traces"] == 0
    assert runs[0]["leaves"] == runs[1]["leaves"] and len(runs[0]["leaves"]) > 50


def test_a_changed_config_misses(cache):
    folder, traces = cache
    a = unet.UNet2DConditionConfig(**reference.UNET_SD1)
    b = unet.UNet2DConditionConfig(**{**reference.UNET_SD1, "cross_attention_dim": 48})
    unet.init_params_shape(a)
    _clear()
    traces.clear()
    shapes = unet.init_params_shape(b)
    assert traces, "another config is traced"
    assert shapes["down_blocks_0"]["attentions_0"]["transformer_blocks_0"]["attn2"]["to_k"]["kernel"].shape == (48, 32)
    assert len(list(folder.glob("*.json"))) == 2


def test_a_changed_source_or_imported_module_misses(tmp_path, monkeypatch):
    """The key holds the source of the model's module and of the sdjax modules it imports (lazily too)."""
    pkg = tmp_path / "sdjax"
    (pkg / "models").mkdir(parents=True)
    (pkg / "ops").mkdir()
    for f in (pkg / "__init__.py", pkg / "models" / "__init__.py", pkg / "ops" / "__init__.py"):
        f.write_text("")
    (pkg / "models" / "a.py").write_text(
        "from sdjax.models.b import (\n    thing,  # a comment\n)\nfrom sdjax.ops import c as ops_c\n"
    )
    (pkg / "models" / "b.py").write_text("def thing():\n    from sdjax.ops.d import x\n")
    (pkg / "ops" / "c.py").write_text("C = 1\n")
    (pkg / "ops" / "d.py").write_text("x = 1\n")
    (pkg / "ops" / "unused.py").write_text("u = 1\n")
    monkeypatch.setattr(shapes_cache, "_PACKAGE", pkg)
    monkeypatch.setitem(sys.modules, "fake_model", type(sys)("fake_model"))
    sys.modules["fake_model"].__file__ = str(pkg / "models" / "a.py")

    def digest():
        shapes_cache.source_digest.cache_clear()
        return shapes_cache.source_digest("fake_model")

    seen = {digest()}
    for name in ("models/a.py", "models/b.py", "ops/c.py", "ops/d.py"):
        (pkg / name).write_text((pkg / name).read_text() + "# edited\n")
        seen.add(digest())
    assert len(seen) == 5, "each edit along the import chain changes the key"
    (pkg / "ops" / "unused.py").write_text("u = 2\n")
    assert digest() in seen, "a module not imported does not"
    shapes_cache.source_digest.cache_clear()


def test_a_changed_source_digest_retraces(cache, monkeypatch):
    folder, traces = cache
    config = unet.UNet2DConditionConfig(**reference.UNET_SD1)
    unet.init_params_shape(config)
    _clear()
    traces.clear()
    monkeypatch.setattr(shapes_cache, "source_digest", lambda module: "another source")
    unet.init_params_shape(config)
    assert traces and len(list(folder.glob("*.json"))) == 2


@pytest.mark.parametrize(
    "content",
    [b"", b"{not json", b'{"key": {}, "leaves": []}', b"\xff\xfe\x00", b'{"key": null}', b"[1, 2]"],
    ids=["empty", "truncated", "another-key", "binary", "no-leaves", "a-list"],
)
def test_a_corrupt_file_is_ignored_and_rewritten(content, cache):
    folder, traces = cache
    config = vae.AutoencoderKLConfig(**reference.VAE)
    good = vae.init_params_shape(config)
    (path,) = folder.glob("*.json")
    path.write_bytes(content)
    _clear()
    traces.clear()
    assert _rows(vae.init_params_shape(config)) == _rows(good)
    assert traces, "traced again"
    assert json.loads(path.read_text())["key"] == shapes_cache.cache_key(vae.AutoencoderKL, config)
    _clear()
    traces.clear()
    vae.init_params_shape(config)
    assert not traces, "the rewritten file is read"


def test_a_right_key_with_broken_leaves_is_retraced(cache):
    folder, traces = cache
    config = vae.AutoencoderKLConfig(**reference.VAE)
    vae.init_params_shape(config)
    (path,) = folder.glob("*.json")
    data = json.loads(path.read_text())
    data["leaves"][0][2] = "no such dtype"
    path.write_text(json.dumps(data))
    _clear()
    traces.clear()
    vae.init_params_shape(config)
    assert traces


def test_off_switch_traces_every_time_and_writes_nothing(cache, monkeypatch):
    folder, traces = cache
    for value in ("off", "0", "false", "NO"):
        monkeypatch.setenv(shapes_cache.ENV, value)
        assert shapes_cache.cache_dir() is None
        _clear()
        traces.clear()
        unet.init_params_shape(unet.UNet2DConditionConfig(**reference.UNET_SD1))
        assert traces
    assert not folder.exists()


def test_default_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(shapes_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert shapes_cache.cache_dir() == tmp_path / "sdjax" / "shapes"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert shapes_cache.cache_dir() == Path.home() / ".cache" / "sdjax" / "shapes"


def test_an_unwritable_folder_still_loads(cache, tmp_path, monkeypatch):
    _, traces = cache
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(shapes_cache.ENV, str(blocker / "shapes"))  # a folder under a file cannot be made
    config = unet.UNet2DConditionConfig(**reference.UNET_SD1)
    want = _rows(unet.init_params_shape(config))
    _clear()
    assert _rows(unet.init_params_shape(config)) == want
    assert len(traces) == 2


def test_trees_it_cannot_write_exactly_are_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(shapes_cache.ENV, str(tmp_path))
    config = unet.UNet2DConditionConfig(**reference.UNET_SD1)
    odd = {"a": [jax.ShapeDtypeStruct((2,), "float32")]}  # a list inside
    assert shapes_cache.cached(unet.UNet2DConditionModel, config, lambda: odd) is odd
    assert shapes_cache.cached(unet.UNet2DConditionModel, {"not": "a dataclass"}, lambda: 7) == 7
    assert not list(tmp_path.glob("*.json"))
