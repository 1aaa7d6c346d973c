"""Training data folders: captions, kohya repeat folders, buckets, bad images, augmentations, determinism."""

import warnings

import numpy as np
import pytest
from PIL import Image

from sdjax.finetune import data


def _image(path, h, w, seed=0):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), np.uint8)).save(path)


def test_missing_and_empty_folders_name_the_path(tmp_path):
    with pytest.raises(data.DataError, match=str(tmp_path / "nope")):
        data.scan(tmp_path / "nope", data.DataConfig())
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "orphan.txt").write_text("a star")
    with pytest.raises(data.DataError, match=r"empty holds no images.*orphan\.txt"):
        data.scan(tmp_path / "empty", data.DataConfig())


def test_bad_image_is_skipped_and_named_or_refused(tmp_path):
    _image(tmp_path / "good.png", 64, 64)
    (tmp_path / "good.txt").write_text("a star")
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated jpeg")
    with pytest.warns(data.BadImageWarning, match="broken.jpg"):
        ds = data.scan(tmp_path, data.DataConfig(resolution=64))
    assert [i.path.name for i in ds.items] == ["good.png"] and "broken.jpg" in ds.skipped[0]
    with pytest.raises(data.DataError, match="broken.jpg"):
        data.scan(tmp_path, data.DataConfig(resolution=64, on_bad_image="error"))
    (tmp_path / "good.png").unlink()
    with pytest.raises(data.DataError, match="none of its 1 image"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data.scan(tmp_path, data.DataConfig(resolution=64))


def test_repeat_folders_captions_and_orphans(tmp_path):
    _image(tmp_path / "a.png", 64, 64)
    (tmp_path / "a.txt").write_text("red star, white background")
    (tmp_path / "5_blue star").mkdir()
    _image(tmp_path / "5_blue star" / "b.png", 64, 64, seed=1)
    (tmp_path / "notes.txt").write_text("no image of this name")
    with pytest.warns(UserWarning, match="notes.txt"):
        ds = data.scan(tmp_path, data.DataConfig(resolution=64))
    by_name = {i.path.name: i for i in ds.items}
    assert by_name["a.png"].repeats == 1 and by_name["a.png"].caption == "red star, white background"
    assert by_name["b.png"].repeats == 5 and by_name["b.png"].caption == "blue star"  # kohya: the folder's name
    assert ds.examples_per_epoch == 6
    sampler = data.Sampler(ds, data.DataConfig(resolution=64), batch_size=2, seed=0)
    epoch = [ds.items[i].path.name for b in sampler.epoch_batches(0) for i in b]
    assert sorted(epoch) == ["a.png"] + ["b.png"] * 5


def test_buckets_are_multiples_around_the_area_and_shapes_follow(tmp_path):
    cfg = data.DataConfig(resolution=512)
    buckets = data.make_buckets(cfg)
    assert all(h % 64 == 0 and w % 64 == 0 and h * w <= 512 * 512 for h, w in buckets)
    assert (512, 512) in buckets and (384, 640) in buckets and (640, 384) in buckets
    assert data.nearest_bucket((600, 1000), buckets) == (384, 640)
    assert data.nearest_bucket((1000, 600), buckets) == (640, 384)
    assert data.make_buckets(data.DataConfig(resolution=512, bucketing=False)) == ((512, 512),)

    small = data.DataConfig(resolution=64, bucket_step=16)
    _image(tmp_path / "wide.png", 60, 120)
    _image(tmp_path / "tall.png", 130, 70, seed=2)
    ds = data.scan(tmp_path, small)
    sampler = data.Sampler(ds, small, batch_size=1, seed=0)
    shapes = {sampler.load(s)["paths"][0].rsplit("/", 1)[1]: sampler.load(s)["pixels"].shape for s in range(2)}
    assert shapes["wide.png"] == (1, 3, 48, 80) and shapes["tall.png"] == (1, 3, 80, 48)
    time_ids = sampler.load(0)["time_ids"][0]
    assert time_ids[4] * time_ids[5] <= 64 * 64  # (orig h, orig w, crop top, crop left, h, w)
    square = data.with_buckets(ds, data.DataConfig(resolution=32, bucketing=False))
    assert square.buckets == ((32, 32),) and [i.size for i in square.items] == [i.size for i in ds.items]
    with pytest.raises(data.DataError, match="multiple of 8"):
        data.scan(tmp_path, data.DataConfig(resolution=100, bucketing=False))


def test_augmentations_are_deterministic_per_step(tmp_path):
    _image(tmp_path / "a.png", 80, 64)
    (tmp_path / "a.txt").write_text("star, red, small, white background")
    cfg = data.DataConfig(resolution=64, bucketing=False, random_crop=True, flip=True, shuffle_tags=True, keep_tokens=1)
    ds = data.scan(tmp_path, cfg)
    one = data.Sampler(ds, cfg, 1, seed=3)
    two = data.Sampler(ds, cfg, 1, seed=3)
    batches = [one.load(s) for s in range(8)]
    for s in (5, 2, 7):  # any order, a fresh sampler: the same examples (what resuming relies on)
        again = two.load(s)
        np.testing.assert_array_equal(again["pixels"], batches[s]["pixels"])
        assert again["captions"] == batches[s]["captions"]
    captions = {b["captions"][0] for b in batches}
    assert len(captions) > 1 and all(c.startswith("star, ") for c in captions)
    assert len({b["time_ids"][0][2] for b in batches}) > 1  # random crops
    assert all(b["pixels"].min() >= -1 and b["pixels"].max() <= 1 for b in batches)
    dropped = data.process_caption("star", data.DataConfig(caption_dropout=1.0), np.random.default_rng(0))
    assert dropped == ""
