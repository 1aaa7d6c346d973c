"""The shape-scene scorer on ground truth from the generator: it must read every rendered scene right."""

import numpy as np
import pytest
from PIL import Image

from sdjax.evaluation import shapes
from sdjax.training import data


def _scenes(n, seed=0):
    rng = np.random.default_rng(seed)
    return [data.random_scene(rng, data.ALL_COMBINATIONS) for _ in range(n)]


def test_scorer_reads_rendered_scenes_perfectly():
    scenes = _scenes(400) + data.held_out_scenes(2)
    result = shapes.score([data.render(s) for s in scenes], scenes)
    assert result == {a: 1.0 for a in shapes.ATTRIBUTES + ("all", "one_shape")}


def test_scorer_counts_the_shapes():
    one = data.Scene("square", "red", "white", "small", "top left")
    other = data.Scene("triangle", "red", "white", "large", "bottom right")
    both = np.minimum(data.render(one), data.render(other))  # red is darker than white in G and B: a union
    assert shapes.analyze(data.render(one)).count == 1
    found = shapes.analyze(both)
    assert found.count == 2
    assert (found.shape, found.size, found.position) == ("triangle", "large", "bottom right")  # the larger one
    assert shapes.score([both, data.render(other)], [other, other])["one_shape"] == 0.5


def test_scorer_tolerates_noise_and_blur():
    scenes = _scenes(150, seed=1)
    rng = np.random.default_rng(0)
    images = []
    for s in scenes:
        im = Image.fromarray(data.render(s)).resize((32, 32), Image.BILINEAR).resize((64, 64), Image.BILINEAR)
        noisy = np.asarray(im, np.float32) + rng.normal(0, 12, (64, 64, 3))
        images.append(np.clip(noisy, 0, 255).astype(np.uint8))
    result = shapes.score(images, scenes)
    assert min(result[a] for a in ("colour", "background", "position", "size")) >= 0.97, result
    assert result["shape"] >= 0.9, result


def test_scorer_accepts_pil_images_and_other_sizes():
    scene = data.Scene("circle", "yellow", "purple", "large", "bottom left")
    big = Image.fromarray(data.render(scene)).resize((128, 128), Image.NEAREST)
    a = shapes.analyze(big)
    assert (a.colour, a.background, a.shape, a.position, a.size) == (
        "yellow",
        "purple",
        "circle",
        "bottom left",
        "large",
    )


def test_empty_image_has_no_foreground():
    flat = np.full((64, 64, 3), data.PALETTE["green"], np.uint8)
    a = shapes.analyze(flat)
    assert a.background == "green" and a.colour is None and a.shape is None
    m = a.matches(data.Scene("circle", "red", "green", "small", "center"))
    assert m == {"colour": False, "background": True, "shape": False, "position": False, "size": False}


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="RGB"):
        shapes.analyze(np.zeros((64, 64)))
    with pytest.raises(ValueError, match="2 images for 1 scenes"):
        shapes.score([np.zeros((64, 64, 3), np.uint8)] * 2, _scenes(1))


def test_held_out_prompts_describe_held_out_scenes():
    prompts, scenes = shapes.held_out_prompts(2)
    assert len(prompts) == len(scenes) == 28
    assert all(s.combination in data.HELD_OUT for s in scenes)
    assert prompts[0] == data.caption(scenes[0])
