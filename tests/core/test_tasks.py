"""Properties of the image tasks, and bad input rejected with a message naming the argument before any compile."""

import io

import inject
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from sdjax import StableDiffusionPipeline, rng
from sdjax.core import autoencoder
from sdjax.core import images as image_lib
from sdjax.core.tasks import window


@pytest.fixture(scope="module")
def sd(sd1_dir):
    return StableDiffusionPipeline.from_pretrained(str(sd1_dir))


def _image(seed=0, size=64):
    r = np.random.default_rng(seed)
    a = r.integers(0, 255, (size // 8, size // 8, 3), dtype=np.uint8)
    return Image.fromarray(a).resize((size, size), Image.NEAREST)


def _mask(size=64):
    m = np.zeros((size, size), np.uint8)
    m[16:40, 8:32] = 255
    return Image.fromarray(m)


def test_strength_zero_returns_the_vae_round_trip(sd):
    pipe, params = sd
    img = _image(1)
    out = pipe.generate("a cat", image=img, strength=0.0, steps=5, seed=4, output_type="np")
    x = jnp.asarray(image_lib.image_array(img)[None])
    eps = inject.stream(inject.image_keys(4, 1), rng.ENCODE_IMAGE, (4, 8, 8))
    z = autoencoder.encode(pipe.vae, params["vae"], x, jnp.asarray(eps), jnp.float32)
    expected = np.asarray(autoencoder.decode(pipe.vae, params["vae"], z, jnp.float32))
    np.testing.assert_allclose(out, expected, atol=1e-5)
    assert window(pipe.scheduler, 5, strength=0.0) == (pipe.scheduler.num_model_calls(5),) * 2


def test_paste_back_keeps_unmasked_pixels_exactly(sd):
    pipe, _ = sd
    img, mask = _image(2), _mask()
    out = np.asarray(pipe.generate("a dog", image=img, mask_image=mask, steps=3, paste_back=True)[0])
    keep = np.asarray(mask) == 0
    np.testing.assert_array_equal(out[keep], np.asarray(img)[keep])
    assert np.abs(out[~keep].astype(int) - np.asarray(img)[~keep]).mean() > 5  # the masked region was repainted


def test_padding_mask_crop_repaints_only_the_region_at_the_original_size(sd):
    pipe, _ = sd
    img = _image(3, size=128)
    m = np.zeros((128, 128), np.uint8)
    m[20:36, 90:110] = 255
    out = np.asarray(
        pipe.generate(
            "a dog", image=img, mask_image=Image.fromarray(m), steps=3, width=64, height=64, padding_mask_crop=8
        )[0]
    )
    assert out.shape == (128, 128, 3)  # the original's size, not the generation size
    x1, y1, x2, y2 = image_lib.crop_region(Image.fromarray(m), 64, 64, 8)
    assert (x2 - x1) == (y2 - y1) and x1 <= 82 and x2 >= 118
    outside = np.ones((128, 128), bool)
    outside[y1:y2, x1:x2] = False
    np.testing.assert_array_equal(out[outside], np.asarray(img)[outside])
    assert np.abs(out[m > 0].astype(int) - np.asarray(img)[m > 0]).mean() > 5


def test_crop_region_matches_hand_computed_boxes():
    m = np.zeros((100, 200), np.uint8)
    m[40:50, 60:80] = 255  # 20 wide, 10 high
    # pad 5 -> x 55..85 (30), y 35..55 (20); widened to 1:1 -> height 30: y 30..60
    assert image_lib.crop_region(Image.fromarray(m), 64, 64, 5) == (55, 30, 85, 60)
    # against the bottom edge: the box slides up inside the image
    m = np.zeros((100, 200), np.uint8)
    m[95:100, 10:70] = 255
    assert image_lib.crop_region(Image.fromarray(m), 64, 64, 0) == (10, 40, 70, 100)


def test_resize_modes_keep_the_aspect_ratio_where_they_should():
    img = Image.new("RGB", (200, 100), (255, 0, 0))
    img.paste((0, 0, 255), (0, 0, 100, 100))
    crop = np.asarray(image_lib.resize(img, 64, 64, "crop"))  # the centre square: half blue, half red
    assert crop[32, 5, 2] > 200 and crop[32, 58, 0] > 200
    fill = np.asarray(image_lib.resize(img, 64, 64, "fill"))  # scaled to 64x32, borders stretched from the edges
    assert fill.shape == (64, 64, 3) and fill[0, 5, 2] > 200 and fill[63, 58, 0] > 200
    with pytest.raises(ValueError, match="resize_mode='zoom'"):
        image_lib.resize(img, 64, 64, "zoom")


# ----------------------------------------------------------------------------------------------- bad input
@pytest.fixture
def no_compile(monkeypatch):
    import jax._src.compiler as compiler

    original = compiler.compile_or_get_cached

    def guarded(backend, computation, *args, **kwargs):
        name = str(computation.operation.attributes["sym_name"]).strip('"')
        if "program" in name:
            raise AssertionError(f"compilation of {name} started before the input was rejected")
        return original(backend, computation, *args, **kwargs)

    monkeypatch.setattr(compiler, "compile_or_get_cached", guarded)


@pytest.mark.usefixtures("no_compile")
def test_bad_image_inputs_are_named(sd, tmp_path):
    pipe, _ = sd
    with pytest.raises(ValueError, match="mask_image 0 is 32x32 but image 0 is 64x64"):
        pipe.generate("a", image=_image(), mask_image=_mask(32))
    with pytest.raises(ValueError, match="strength=1.5"):
        pipe.generate("a", image=_image(), strength=1.5)
    with pytest.raises(ValueError, match="strength=-0.1"):
        pipe.generate("a", image=_image(), mask_image=_mask(), strength=-0.1)
    with pytest.raises(ValueError, match="image is 72x64, not a multiple of 16"):
        pipe.generate("a", image=_image().resize((72, 64)))
    with pytest.raises(ValueError, match="image: the given bytes is not a readable image"):
        pipe.generate("a", image=b"certainly not a PNG")
    with pytest.raises(ValueError, match="no such file"):
        pipe.generate("a", image=str(tmp_path / "missing.png"))
    with pytest.raises(ValueError, match="mask_image= needs image="):
        pipe.generate("a", mask_image=_mask())
    with pytest.raises(ValueError, match="the mask is empty"):
        pipe.generate("a", image=_image(), mask_image=Image.new("L", (64, 64)))
    with pytest.raises(ValueError, match="float image must hold finite values in \\[0, 1\\]"):
        pipe.generate("a", image=np.full((64, 64, 3), 2.0, np.float32))


@pytest.mark.usefixtures("no_compile")
def test_decompression_bomb_is_refused_before_decoding(sd):
    pipe, _ = sd
    # Valid PNG headers claiming 10000 x 10000 pixels (above sdjax's limit) and 40000 x 40000 (above Pillow's):
    # refused from the header, before any pixel is decoded.
    for side, message in ((10000, "10000x10000 = 100000000 pixels, above the limit"), (40000, "too large to decode")):
        buf = io.BytesIO()
        Image.new("1", (side, side)).save(buf, format="PNG")
        with pytest.raises(ValueError, match=f"image.*{message}"):
            pipe.generate("a", image=buf.getvalue())


@pytest.mark.usefixtures("no_compile")
def test_inpainting_unet_needs_a_mask(tmp_path_factory, torch_sd1):
    import diffusers
    import reference

    unet9 = reference.unet({**reference.UNET_SD1, "in_channels": 9}, seed=7)
    folder = tmp_path_factory.mktemp("tiny-inpaint-bad")
    diffusers.StableDiffusionInpaintPipeline(**{**torch_sd1.components, "unet": unet9}).save_pretrained(
        folder, safe_serialization=True
    )
    pipe, _ = StableDiffusionPipeline.from_pretrained(str(folder))
    with pytest.raises(ValueError, match="9 input channels .* needs mask_image="):
        pipe.generate("a", image=_image())
    with pytest.raises(ValueError, match="9 input channels .* pass image= and mask_image="):
        pipe.generate("a")
