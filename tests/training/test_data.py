"""The synthetic scene generator: deterministic, held-out combinations never trained on, captions name
every attribute."""

import numpy as np
import pytest

from sdjax.training import data


def test_batches_are_deterministic_from_the_seed():
    a_images, a_captions = data.sample_batch(123, 8)
    b_images, b_captions = data.sample_batch(123, 8)
    c_images, c_captions = data.sample_batch(124, 8)
    assert a_images.shape == (8, 64, 64, 3) and a_images.dtype == np.uint8
    np.testing.assert_array_equal(a_images, b_images)
    assert a_captions == b_captions
    assert a_captions != c_captions
    s1, s2 = next(data.batches(7, 4)), next(data.batches(7, 4))
    np.testing.assert_array_equal(s1[0], s2[0])


def test_held_out_combinations_are_never_trained_on_but_every_word_is():
    assert len(data.HELD_OUT) == 14
    assert not set(data.TRAIN_COMBINATIONS) & data.HELD_OUT
    assert set(data.TRAIN_COMBINATIONS) | data.HELD_OUT == set(data.ALL_COMBINATIONS)
    for i, axis in enumerate(("colour", "shape", "background")):
        held = {t[i] for t in data.HELD_OUT}
        trained = {t[i] for t in data.TRAIN_COMBINATIONS}
        assert trained == set(data.SHAPES if axis == "shape" else data.COLOURS), axis
        assert len(held) >= 3, axis
    rng = np.random.default_rng(0)
    for _ in range(2000):
        assert data.random_scene(rng).combination not in data.HELD_OUT


def test_held_out_scenes_cover_each_combination_at_several_sizes_and_positions():
    scenes = data.held_out_scenes(2)
    assert len(scenes) == 2 * len(data.HELD_OUT)
    assert {s.combination for s in scenes} == set(data.HELD_OUT)
    assert {s.size for s in scenes} == set(data.SIZES)
    assert {s.position for s in scenes} == set(data.POSITIONS)


def test_render_draws_the_shape_in_its_colour_at_its_position():
    scene = data.Scene("square", "red", "blue", "large", "top left")
    image = data.render(scene)
    cx, cy = (int(v) for v in scene.centre)
    assert tuple(image[cy, cx]) == data.PALETTE["red"]
    assert tuple(image[60, 60]) == data.PALETTE["blue"]
    assert tuple(image[2, 2]) == data.PALETTE["blue"]  # the shape stays clear of the border
    # A triangle covers about half of its bounding box; a circle pi/4; a square all of it.
    for shape, fill in (("triangle", 0.5), ("circle", np.pi / 4), ("square", 1.0)):
        cover = data.shape_mask(shape, 32, 32, 26)
        assert cover.sum() / 26**2 == pytest.approx(fill, abs=0.03), shape


def test_captions_name_every_attribute():
    scene = data.Scene("triangle", "green", "white", "small", "bottom right")
    for v in range(15):
        text = data.caption(scene, v)
        for word in ("green", "triangle", "white", "small", "bottom right", "background"):
            assert word in text, (v, text)
    assert data.caption(scene) == "a small green triangle in the bottom right on a white background"


def test_partial_captions_leave_out_exactly_the_dropped_attributes():
    scene = data.Scene("triangle", "green", "white", "small", "bottom right")
    words = {"size": "small", "colour": "green", "background": "white", "position": "bottom right"}
    assert len(data.PARTIAL_DROPS) == 15  # every non-empty subset of the four attributes
    for drop in data.PARTIAL_DROPS:
        for v in range(6):
            text = data.partial_caption(scene, drop, v)
            assert "triangle" in text, text
            for attribute, word in words.items():
                assert (word in text) == (attribute not in drop), (drop, v, text)
    # The README's prompt is one of the training phrasings.
    assert data.partial_caption(scene, ("size", "position")) == "a green triangle on a white background"
    with pytest.raises(ValueError, match="shade"):
        data.partial_caption(scene, ("size", "shade"))


def test_random_captions_cover_full_and_partial_forms():
    rng = np.random.default_rng(0)
    scene = data.Scene("circle", "red", "blue", "large", "center")
    texts = [data.random_caption(rng, scene, partial_rate=0.3) for _ in range(2000)]
    full = sum(t in {data.caption(scene, v) for v in range(15)} for t in texts) / len(texts)
    assert full == pytest.approx(0.7, abs=0.04)
    assert "a red circle on a blue background" in texts
    assert data.random_caption(rng, scene, partial_rate=0.0) in {data.caption(scene, v) for v in range(15)}


def test_invalid_scenes_are_rejected():
    with pytest.raises(ValueError, match="invisible"):
        data.Scene("circle", "red", "red", "small", "center")
    with pytest.raises(ValueError, match="shape"):
        data.Scene("hexagon", "red", "blue", "small", "center")
