"""Schemathesis hooks for the server's published schema: its image fields (`format: byte`: base64 images in JSON
bodies; `format: binary`: the files of the multipart forms) get real small images, so that generated requests reach
the generation instead of stopping at the image decoder.

    SCHEMATHESIS_HOOKS=schemathesis_hooks PYTHONPATH=tests/server \\
        schemathesis run http://127.0.0.1:PORT/openapi.json --checks not_a_server_error

(tests/server/test_schemathesis.py runs that, bounded.) Images: mostly 64x64 (an image and its mask must have one
size), else 8..64 pixels a side; PNG (RGBA with opaque and fully transparent parts: what /v1/images/edits
repaints; or RGB), JPEG or WebP; a background and a rectangle of random colours (so that a mask repaints
something, or nothing).
"""

from __future__ import annotations

import base64
import io

import schemathesis
from hypothesis import strategies as st
from PIL import Image, ImageDraw

_COLOURS = st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(0, 255), st.sampled_from([0, 255]))
_SIDES = st.one_of(
    st.just((64, 64)), st.just((64, 64)), st.just((64, 64)), st.tuples(st.integers(8, 64), st.integers(8, 64))
)


@st.composite
def image_bytes(draw) -> bytes:
    width, height = draw(_SIDES)
    kind = draw(st.sampled_from(["RGBA", "RGBA", "RGB", "JPEG", "WEBP"]))
    mode = "RGBA" if kind == "RGBA" else "RGB"
    image = Image.new(mode, (width, height), draw(_COLOURS)[: len(mode)])
    x0, y0 = draw(st.integers(0, width - 1)), draw(st.integers(0, height - 1))
    x1, y1 = draw(st.integers(x0, width - 1)), draw(st.integers(y0, height - 1))
    ImageDraw.Draw(image).rectangle((x0, y0, x1, y1), fill=draw(_COLOURS)[: len(mode)])
    buf = io.BytesIO()
    image.save(buf, format="PNG" if kind in ("RGB", "RGBA") else kind)
    return buf.getvalue()


schemathesis.openapi.format("byte", image_bytes().map(lambda data: base64.b64encode(data).decode("ascii")))
schemathesis.openapi.format("binary", image_bytes())
