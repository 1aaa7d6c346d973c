"""Synthetic captioned scenes: one flat shape on a flat background, with a plain-English caption.

A scene is a `Scene` (shape, colour, background, size, position, plus small jitters); `render` draws it as a
64x64 RGB uint8 image (4x supersampled, so edges are anti-aliased like a downscaled photo) and `caption`
writes one of a few phrasings. Everything is deterministic from a seed: `sample_scenes(seed, n)` returns the
same scenes on every machine.

Held-out combinations: `HELD_OUT` lists exact (colour, shape, background) triples that training never
shows; the quality check (`sdjax.evaluation.shapes`) generates their prompts to test that the model composes
words it learned separately. Every colour, shape and background still appears in training, in other triples.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Iterator

import numpy as np

# Colours far apart in RGB so that a scorer (and a small model) cannot confuse them.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 70, 230),
    "yellow": (245, 220, 30),
    "purple": (150, 40, 190),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
COLOURS: tuple[str, ...] = tuple(PALETTE)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SIZES: tuple[str, ...] = ("small", "large")
POSITIONS: tuple[str, ...] = ("top left", "top right", "bottom left", "bottom right", "center")

IMAGE_SIZE = 64
_SUPERSAMPLE = 4
# Width of the shape's bounding box, in pixels of the 64x64 image.
SIZE_PIXELS = {"small": 15.0, "large": 26.0}
# Centre of the shape for each position, as fractions of the image side (x, y).
POSITION_CENTRES = {
    "top left": (0.28, 0.28),
    "top right": (0.72, 0.28),
    "bottom left": (0.28, 0.72),
    "bottom right": (0.72, 0.72),
    "center": (0.5, 0.5),
}


def _held_out() -> frozenset[tuple[str, str, str]]:
    """Two (colour, shape, background) triples per colour (14 of 126), picked by a fixed rule so that every
    colour, shape and background is held out about equally often and is still seen in training."""
    out = set()
    n = len(COLOURS)
    for i, colour in enumerate(COLOURS):
        out.add((colour, SHAPES[i % 3], COLOURS[(i + 1) % n]))
        out.add((colour, SHAPES[(i + 1) % 3], COLOURS[(i + 3) % n]))
    return frozenset(out)


HELD_OUT: frozenset[tuple[str, str, str]] = _held_out()
ALL_COMBINATIONS: tuple[tuple[str, str, str], ...] = tuple(
    (c, s, b) for c in COLOURS for s in SHAPES for b in COLOURS if c != b
)
TRAIN_COMBINATIONS: tuple[tuple[str, str, str], ...] = tuple(t for t in ALL_COMBINATIONS if t not in HELD_OUT)


@dataclasses.dataclass(frozen=True)
class Scene:
    """One shape on a background. `dx`, `dy` (pixels) and `scale` are small jitters of position and size."""

    shape: str
    colour: str
    background: str
    size: str
    position: str
    dx: float = 0.0
    dy: float = 0.0
    scale: float = 1.0

    def __post_init__(self):
        for name, value, allowed in (
            ("shape", self.shape, SHAPES),
            ("colour", self.colour, COLOURS),
            ("background", self.background, COLOURS),
            ("size", self.size, SIZES),
            ("position", self.position, POSITIONS),
        ):
            if value not in allowed:
                raise ValueError(f"Scene.{name}={value!r}; expected one of {allowed}")
        if self.colour == self.background:
            raise ValueError(f"Scene: colour and background are both {self.colour!r}; the shape would be invisible")

    @property
    def combination(self) -> tuple[str, str, str]:
        return (self.colour, self.shape, self.background)

    @property
    def centre(self) -> tuple[float, float]:
        fx, fy = POSITION_CENTRES[self.position]
        return fx * IMAGE_SIZE + self.dx, fy * IMAGE_SIZE + self.dy

    @property
    def width(self) -> float:
        return SIZE_PIXELS[self.size] * self.scale


def _inside(shape: str, x: np.ndarray, y: np.ndarray, cx: float, cy: float, w: float) -> np.ndarray:
    """Boolean mask of points (x, y) inside `shape` of bounding-box width `w` centred at (cx, cy)."""
    h = w / 2
    if shape == "circle":
        return (x - cx) ** 2 + (y - cy) ** 2 <= h * h
    if shape == "square":
        return (np.abs(x - cx) <= h) & (np.abs(y - cy) <= h)
    if shape == "triangle":  # pointing up, apex at the top centre, base at the bottom of the box
        t = (y - (cy - h)) / w  # 0 at the apex, 1 at the base
        return (t >= 0) & (t <= 1) & (np.abs(x - cx) <= h * t)
    raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def shape_mask(shape: str, cx: float, cy: float, w: float, size: int = IMAGE_SIZE) -> np.ndarray:
    """Coverage in [0, 1] of each pixel of a `size`x`size` image by the shape (4x4 supersampled), float32.

    Only the pixels of the shape's bounding box are supersampled; the rest are 0.
    """
    s = _SUPERSAMPLE
    out = np.zeros((size, size), np.float32)
    h = w / 2
    x0, x1 = max(int(np.floor(cx - h)) - 1, 0), min(int(np.ceil(cx + h)) + 1, size)
    y0, y1 = max(int(np.floor(cy - h)) - 1, 0), min(int(np.ceil(cy + h)) + 1, size)
    if x1 <= x0 or y1 <= y0:
        return out
    xs = x0 + (np.arange((x1 - x0) * s, dtype=np.float64) + 0.5) / s
    ys = y0 + (np.arange((y1 - y0) * s, dtype=np.float64) + 0.5) / s
    x, y = np.meshgrid(xs, ys)
    inside = _inside(shape, x, y, cx, cy, w).astype(np.float32)
    out[y0:y1, x0:x1] = inside.reshape(y1 - y0, s, x1 - x0, s).mean(axis=(1, 3))
    return out


def render(scene: Scene) -> np.ndarray:
    """The scene as an RGB uint8 image `(64, 64, 3)`."""
    cx, cy = scene.centre
    cover = shape_mask(scene.shape, cx, cy, scene.width)[..., None]
    fg = np.asarray(PALETTE[scene.colour], np.float32)
    bg = np.asarray(PALETTE[scene.background], np.float32)
    return np.round(cover * fg + (1 - cover) * bg).astype(np.uint8)


def _position_phrase(position: str, variant: int) -> str:
    if position == "center":
        return ("in the center", "in the middle", "at the center")[variant % 3]
    return (f"in the {position}", f"at the {position}", f"in the {position} corner")[variant % 3]


def caption(scene: Scene, variant: int = 0) -> str:
    """A plain-English caption; `variant` (any int) picks one of several phrasings of the full description."""
    size, colour, shape, bg = scene.size, scene.colour, scene.shape, scene.background
    pos = _position_phrase(scene.position, variant // 5)
    forms = (
        f"a {size} {colour} {shape} {pos} on a {bg} background",
        f"a {size} {colour} {shape} on a {bg} background, {pos}",
        f"{size} {colour} {shape} {pos}, {bg} background",
        f"a {colour} {shape}, {size}, {pos} on a {bg} background",
        f"a {bg} background with a {size} {colour} {shape} {pos}",
    )
    return forms[variant % len(forms)]


ATTRIBUTES: tuple[str, ...] = ("size", "position", "colour", "background")


def partial_caption(scene: Scene, drop: str | Collection[str], variant: int = 0) -> str:
    """A caption that leaves out the attributes in `drop` (one name or several of size, position, colour,
    background; the shape is always named), so that the model also learns each word on its own and follows
    short prompts such as "a red circle on a blue background"."""
    dropped = {drop} if isinstance(drop, str) else set(drop)
    unknown = dropped - set(ATTRIBUTES)
    if unknown:
        raise ValueError(f"partial_caption: drop={sorted(unknown)!r}; expected names from {ATTRIBUTES}")
    size = "" if "size" in dropped else scene.size + " "
    colour = "" if "colour" in dropped else scene.colour + " "
    thing = f"{size}{colour}{scene.shape}"
    pos = "" if "position" in dropped else " " + _position_phrase(scene.position, variant)
    if "background" in dropped:
        return f"a {thing}{pos}"
    if variant % 2:
        return f"a {thing}{pos}, {scene.background} background"
    return f"a {thing}{pos} on a {scene.background} background"


def random_scene(rng: np.random.Generator, combinations=TRAIN_COMBINATIONS) -> Scene:
    colour, shape, background = combinations[rng.integers(len(combinations))]
    return Scene(
        shape=shape,
        colour=colour,
        background=background,
        size=SIZES[rng.integers(len(SIZES))],
        position=POSITIONS[rng.integers(len(POSITIONS))],
        dx=float(rng.uniform(-2.5, 2.5)),
        dy=float(rng.uniform(-2.5, 2.5)),
        scale=float(rng.uniform(0.9, 1.1)),
    )


# Every non-empty subset of ATTRIBUTES, each equally likely to be left out of a partial caption.
PARTIAL_DROPS: tuple[tuple[str, ...], ...] = tuple(
    c for n in range(1, len(ATTRIBUTES) + 1) for c in itertools.combinations(ATTRIBUTES, n)
)


def random_caption(rng: np.random.Generator, scene: Scene, partial_rate: float = 0.2) -> str:
    """A full caption in one of its phrasings, or (with probability `partial_rate`) one that leaves out a
    random non-empty subset of size, position, colour and background."""
    if rng.uniform() < partial_rate:
        return partial_caption(scene, PARTIAL_DROPS[rng.integers(len(PARTIAL_DROPS))], int(rng.integers(6)))
    return caption(scene, int(rng.integers(15)))


def sample_batch(
    seed: int, batch_size: int, *, partial_rate: float = 0.2, combinations=TRAIN_COMBINATIONS
) -> tuple[np.ndarray, list[str]]:
    """Images `(B, 64, 64, 3)` uint8 and their captions, deterministic from `seed`."""
    rng = np.random.default_rng(seed)
    scenes = [random_scene(rng, combinations) for _ in range(batch_size)]
    captions = [random_caption(rng, s, partial_rate) for s in scenes]
    return np.stack([render(s) for s in scenes]), captions


def batches(seed: int, batch_size: int, **kwargs) -> Iterator[tuple[np.ndarray, list[str]]]:
    """An endless stream of `sample_batch`es; batch `i` uses the seed `(seed, i)`."""
    for i in itertools.count():
        yield sample_batch(int(np.random.SeedSequence([seed, i]).generate_state(1)[0]), batch_size, **kwargs)


def held_out_scenes(per_combination: int = 2) -> list[Scene]:
    """The evaluation set: each held-out combination `per_combination` times, at sizes and positions that
    rotate over the set (no jitter), in a fixed order."""
    scenes = []
    for i, (colour, shape, background) in enumerate(sorted(HELD_OUT)):
        for j in range(per_combination):
            k = i * per_combination + j
            scenes.append(
                Scene(
                    shape=shape,
                    colour=colour,
                    background=background,
                    size=SIZES[k % len(SIZES)],
                    position=POSITIONS[(i + j * 2) % len(POSITIONS)],
                )
            )
    return scenes
