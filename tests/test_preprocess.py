"""ControlNet control maps: the model-free preprocessors against OpenCV and hand-made images, the registry of
sd-webui-controlnet names, and `prepare_control_image` against diffusers' `VaeImageProcessor` (exact)."""

from __future__ import annotations

import builtins

import numpy as np
import PIL.Image
import pytest

from sdjax import preprocess as P

cv2 = pytest.importorskip("cv2")


def square_image(size=64, lo=40, hi=220, box=(16, 48)) -> np.ndarray:
    """A bright square on a dark background, RGB uint8: its edges are the four lines at rows/columns 16 and 47."""
    img = np.full((size, size, 3), lo, np.uint8)
    img[box[0] : box[1], box[0] : box[1]] = hi
    return img


def noise_image(shape=(48, 40, 3), seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


# ------------------------------------------------------------------------------------------------ canny
def test_canny_equals_opencv_on_the_rgb_image():
    img = noise_image()
    for low, high in [(100, 200), (30, 90), (0, 0)]:
        got = P.canny(img, low, high)
        want = cv2.Canny(img, low, high)
        assert got.dtype == np.uint8 and got.shape == img.shape
        np.testing.assert_array_equal(got, np.repeat(want[:, :, None], 3, axis=2))


def test_canny_finds_the_edges_of_a_square():
    got = P.canny(PIL.Image.fromarray(square_image()))[:, :, 0]
    assert set(np.unique(got)) == {0, 255}
    edge = got > 0
    # Every edge pixel lies within one pixel of the square's border (rows/columns 15..16 or 47..48 inside the
    # square's span), the inside and the far background are empty, and each side is found along its length.
    rows, cols = np.nonzero(edge)
    near = lambda v: (np.abs(v - 16) <= 1) | (np.abs(v - 47) <= 1)
    assert np.all((near(rows) & (cols >= 15) & (cols <= 48)) | (near(cols) & (rows >= 15) & (rows <= 48)))
    assert not edge[20:44, 20:44].any() and not edge[:12].any() and not edge[:, 52:].any()
    for side in (edge[15:18, 20:44], edge[46:49, 20:44]):  # top and bottom
        assert side.any(axis=0).all()
    for side in (edge[20:44, 15:18], edge[20:44, 46:49]):  # left and right
        assert side.any(axis=1).all()


def test_canny_bad_thresholds():
    with pytest.raises(ValueError, match="low=200, high=100"):
        P.canny(square_image(), 200, 100)


def test_missing_opencv_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_cv2(name, *args, **kwargs):
        if name == "cv2":
            raise ImportError("No module named 'cv2'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cv2)
    with pytest.raises(ImportError, match=r"sdjax\[controlnet\]"):
        P.canny(square_image())
    P.threshold(square_image())  # needs no OpenCV


# ------------------------------------------------------------------------------------------------ other maps
def test_threshold_by_hand():
    img = np.array(
        [[[200, 200, 200], [128, 255, 255], [127, 200, 250]], [[0, 0, 0], [255, 255, 255], [130, 140, 128]]],
        np.uint8,
    )
    # white where the darkest channel is above 127
    want = np.array([[255, 255, 0], [0, 255, 255]], np.uint8)
    np.testing.assert_array_equal(P.threshold(img), np.repeat(want[:, :, None], 3, axis=2))
    np.testing.assert_array_equal(P.threshold(img, level=150)[:, :, 0], [[255, 0, 0], [0, 255, 0]])


def test_scribble_xdog_marks_a_dark_line_on_white():
    img = np.full((64, 64, 3), 255, np.uint8)
    img[30:33, 8:56] = 0  # a 3-pixel black stroke
    got = P.scribble_xdog(PIL.Image.fromarray(img))[:, :, 0]
    assert set(np.unique(got)) <= {0, 255}
    assert (got[30:33, 12:52] == 255).all()  # the stroke is a white line
    assert not got[:20].any() and not got[44:].any()  # far from it: black
    assert not P.scribble_xdog(np.full((32, 32, 3), 128, np.uint8)).any()  # a flat image has no lines


def test_scribble_xdog_is_monotone_in_line_darkness():
    # A 3-pixel stroke of grey level v on white: the darker the stroke, the stronger the line, so the levels
    # drawn as a line form one run from black up. The extension's uint8 arithmetic (2 d wraps at 256) drops the
    # strokes of levels 72..88 here (d just above 128) while keeping lighter ones; sdjax keeps them.
    marked = []
    for v in range(0, 256, 4):
        img = np.full((64, 64, 3), 255, np.uint8)
        img[30:33, 8:56] = v
        marked.append(P.scribble_xdog(img)[31, 32, 0] == 255)
    n = marked.index(False)
    assert n * 4 > 200 and not any(marked[n:])  # a run from v=0 past v=200, then nothing
    assert all(marked[72 // 4 : 92 // 4])


def test_invert_and_none():
    img = noise_image((5, 7, 3))
    np.testing.assert_array_equal(P.invert(img), 255 - img)
    np.testing.assert_array_equal(P.none(PIL.Image.fromarray(img)), img)


def test_input_forms():
    gray = np.arange(12, dtype=np.uint8).reshape(3, 4)
    np.testing.assert_array_equal(P.none(gray), np.repeat(gray[:, :, None], 3, axis=2))
    rgba = np.concatenate([noise_image((3, 4, 3)), np.zeros((3, 4, 1), np.uint8)], axis=2)
    np.testing.assert_array_equal(P.none(rgba), rgba[:, :, :3])  # alpha dropped, as PIL's convert("RGB")
    np.testing.assert_array_equal(P.none(PIL.Image.fromarray(rgba)), rgba[:, :, :3])
    with pytest.raises(ValueError, match="uint8 pixels.*float32"):
        P.none(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ValueError, match=r"shape \(4, 4, 2\)"):
        P.none(np.zeros((4, 4, 2), np.uint8))
    with pytest.raises(TypeError, match="list"):
        P.none([[0, 1]])


# ------------------------------------------------------------------------------------------------ registry
def test_registry_names_and_aliases():
    computed = {name for name, p in P.PREPROCESSORS.items() if p.computes}
    assert computed == {"none", "canny", "threshold", "scribble_xdog", "invert"}
    # the extension's internal names and UI labels resolve to the same entry
    assert P.get_preprocessor("depth") is P.get_preprocessor("depth_midas")
    assert P.get_preprocessor("hed") is P.get_preprocessor("softedge_hed")
    assert P.get_preprocessor("pidinet_scribble") is P.get_preprocessor("scribble_pidinet")
    for name in ("depth_midas", "openpose_full", "lineart_realistic", "normal_bae", "seg_ofade20k", "mlsd"):
        assert not P.get_preprocessor(name).computes
    img = square_image()
    np.testing.assert_array_equal(P.run_preprocessor("canny", img, low=50, high=150), P.canny(img, 50, 150))
    np.testing.assert_array_equal(P.run_preprocessor("depth_midas", img), img)  # the user's map, unchanged
    with pytest.raises(ValueError, match="passthrough-only.*low"):
        P.run_preprocessor("openpose", img, low=3)
    with pytest.raises(ValueError, match=r"unknown ControlNet preprocessor 'sobel'.*'canny'"):
        P.get_preprocessor("sobel")


# ------------------------------------------------------------------------------------------------ resizing
@pytest.mark.parametrize("mode", P.RESIZE_MODES)
def test_prepare_control_image_equals_diffusers(mode):
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(do_normalize=False, do_convert_rgb=True)  # the ControlNet pipelines' settings
    sizes = [(37, 53, 3), (53, 37, 3), (40, 40, 4), (64, 32, 3)]
    for k, shape in enumerate(sizes):
        pil = PIL.Image.fromarray(noise_image(shape, seed=k))
        for width, height in [(64, 64), (40, 72), (96, 32), (64, 32)]:
            want = processor.preprocess(pil, height=height, width=width, resize_mode=mode).numpy()
            got = P.prepare_control_image(pil, width, height, mode)
            assert got.dtype == np.float32 and got.shape == (1, 3, height, width)
            np.testing.assert_array_equal(got, want, err_msg=f"{shape} -> {width}x{height} {mode}")


def test_prepare_control_image_uint8_array_and_range():
    img = noise_image((30, 20, 3))
    got = P.prepare_control_image(img, 16, 24)
    np.testing.assert_array_equal(got, P.prepare_control_image(PIL.Image.fromarray(img), 16, 24))
    assert got.min() >= 0.0 and got.max() <= 1.0
    same = P.prepare_control_image(img, 20, 30)  # no resize: exactly the pixels / 255
    np.testing.assert_array_equal(same[0].transpose(1, 2, 0), img.astype(np.float32) / 255.0)


def test_prepare_control_image_bad_arguments():
    with pytest.raises(ValueError, match="resize_mode='stretch'"):
        P.prepare_control_image(square_image(), 64, 64, "stretch")
    with pytest.raises(ValueError, match="width must be a positive int"):
        P.prepare_control_image(square_image(), 0, 64)
    with pytest.raises(ValueError, match="control image: expected uint8"):
        P.prepare_control_image(np.zeros((8, 8, 3)), 8, 8)
