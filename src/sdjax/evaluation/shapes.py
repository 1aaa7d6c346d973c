"""Deterministic scorer for generated shape scenes: does the image show what its prompt asked for?

`analyze(image)` reads one RGB image (any size; the scenes of `sdjax.training.data` are 64x64):

- background: the median of the border pixels, snapped to the nearest palette colour;
- foreground: pixels farther than `threshold` (RGB distance) from the measured background colour, keeping the
  largest 4-connected component (stray speckles are ignored);
- colour: the median of the foreground pixels, snapped to the nearest palette colour;
- shape: the foreground compared (intersection over union) with an ideal circle, square and up-pointing
  triangle fitted to its bounding box; the best match wins (their fill ratios are 0.79, 1 and 0.5);
- position: the bounding-box centre, "center" within 1/8 of the side from the image centre, else its quadrant;
- size: the bounding-box side against the midpoint of the small and large sizes;
- count: how many 4-connected foreground components have at least `min_pixels` pixels. The attributes above
  read the largest one; a prompt asks for one shape, so `score` reports `one_shape`, the fraction of images
  with exactly one (not part of `all`: the attributes are what the issue's targets name).

`score(images, scenes)` returns the fraction of images right on each attribute. The command
`python -m sdjax.evaluation.shapes [--model PATH]` generates the held-out prompts with the sdjax pipeline
and prints the scores (see `main`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import deque
from collections.abc import Sequence

import numpy as np

from sdjax.training.data import (
    HELD_OUT,
    IMAGE_SIZE,
    PALETTE,
    SIZE_PIXELS,
    Scene,
    caption,
    held_out_scenes,
    partial_caption,
    shape_mask,
)

ATTRIBUTES = ("colour", "background", "shape", "position", "size")
_PALETTE_NAMES = tuple(PALETTE)
_PALETTE_RGB = np.asarray([PALETTE[n] for n in _PALETTE_NAMES], np.float32)


@dataclasses.dataclass(frozen=True)
class Analysis:
    """What the scorer sees in one image; attributes are None when there is no foreground."""

    background: str
    colour: str | None
    shape: str | None
    position: str | None
    size: str | None
    foreground_fraction: float
    shape_iou: float
    count: int = 0

    def matches(self, scene: Scene) -> dict[str, bool]:
        return {
            "colour": self.colour == scene.colour,
            "background": self.background == scene.background,
            "shape": self.shape == scene.shape,
            "position": self.position == scene.position,
            "size": self.size == scene.size,
        }


def nearest_colour(rgb: np.ndarray) -> str:
    """Name of the palette colour nearest to `rgb` (Euclidean in RGB)."""
    d = np.sum((_PALETTE_RGB - np.asarray(rgb, np.float32)) ** 2, axis=-1)
    return _PALETTE_NAMES[int(np.argmin(d))]


def _components(mask: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Labels (1..n, 0 for background) of the 4-connected components of a boolean mask and their sizes
    (breadth-first fill; images are small)."""
    h, w = mask.shape
    labels = np.zeros((h, w), np.int32)
    sizes, current = [], 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if labels[y0, x0]:
            continue
        current += 1
        labels[y0, x0] = current
        queue, size = deque([(y0, x0)]), 0
        while queue:
            y, x = queue.popleft()
            size += 1
            for ny, nx in ((y - 1, x), (y + 1, x), (y, x - 1), (y, x + 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not labels[ny, nx]:
                    labels[ny, nx] = current
                    queue.append((ny, nx))
        sizes.append(size)
    return labels, sizes


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return float(np.logical_and(a, b).sum() / union) if union else 0.0


def analyze(image, *, threshold: float = 90.0, min_pixels: int = 12) -> Analysis:
    """Analyse one RGB image (PIL image or uint8 array `(H, W, 3)`), as described in the module docstring.

    `threshold` is the RGB distance from the background above which a pixel is foreground (palette colours are
    at least ~150 apart); fewer than `min_pixels` foreground pixels means "no shape".
    """
    rgb = np.asarray(image)
    if rgb.ndim != 3 or rgb.shape[-1] != 3:
        raise ValueError(f"analyze: expected an RGB image of shape (H, W, 3), got {rgb.shape}")
    rgb = rgb.astype(np.float32)
    h, w, _ = rgb.shape
    border = np.concatenate(
        [rgb[:2].reshape(-1, 3), rgb[-2:].reshape(-1, 3), rgb[:, :2].reshape(-1, 3), rgb[:, -2:].reshape(-1, 3)]
    )
    bg_rgb = np.median(border, axis=0)
    background = nearest_colour(bg_rgb)
    far = np.sqrt(np.sum((rgb - bg_rgb) ** 2, axis=-1)) > threshold
    labels, sizes = _components(far)
    mask = labels == 1 + int(np.argmax(sizes)) if sizes else np.zeros_like(far)
    count = int(mask.sum())
    if count < min_pixels:
        return Analysis(background, None, None, None, None, count / (h * w), 0.0)
    shapes_seen = sum(n >= min_pixels for n in sizes)
    colour = nearest_colour(np.median(rgb[mask], axis=0))
    ys, xs = np.nonzero(mask)
    # Bounding box in continuous pixel coordinates (a pixel i covers [i, i + 1)).
    x0, x1, y0, y1 = xs.min(), xs.max() + 1, ys.min(), ys.max() + 1
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    side = ((x1 - x0) + (y1 - y0)) / 2
    scale = IMAGE_SIZE / max(h, w)  # sizes and positions are defined on the 64x64 canvas
    ious = {}
    for shape in ("circle", "square", "triangle"):
        template = _template(shape, cx, cy, side, h, w) >= 0.5
        ious[shape] = _iou(mask, template)
    shape = max(ious, key=ious.get)
    dx, dy = (cx - w / 2) * scale, (cy - h / 2) * scale
    if max(abs(dx), abs(dy)) < IMAGE_SIZE / 8:
        position = "center"
    else:
        position = ("top" if dy < 0 else "bottom") + " " + ("left" if dx < 0 else "right")
    size = "large" if side * scale > (SIZE_PIXELS["small"] + SIZE_PIXELS["large"]) / 2 else "small"
    return Analysis(background, colour, shape, position, size, count / (h * w), ious[shape], shapes_seen)


def _template(shape: str, cx: float, cy: float, side: float, h: int, w: int) -> np.ndarray:
    if h == w:
        return shape_mask(shape, cx, cy, side, size=h)
    n = max(h, w)
    return shape_mask(shape, cx, cy, side, size=n)[:h, :w]


def score(images: Sequence, scenes: Sequence[Scene]) -> dict[str, float]:
    """Fraction of `images` whose analysis matches their `scenes`, per attribute (and `all` of them)."""
    if len(images) != len(scenes):
        raise ValueError(f"score: {len(images)} images for {len(scenes)} scenes")
    if not scenes:
        raise ValueError("score: no images")
    hits = {a: 0 for a in ATTRIBUTES + ("all", "one_shape")}
    for image, scene in zip(images, scenes):
        found = analyze(image)
        m = found.matches(scene)
        for a in ATTRIBUTES:
            hits[a] += m[a]
        hits["all"] += all(m.values())
        hits["one_shape"] += found.count == 1
    return {a: hits[a] / len(scenes) for a in hits}


def held_out_prompts(per_combination: int = 2) -> tuple[list[str], list[Scene]]:
    """The prompts of the held-out combinations (first phrasing) and the scenes they describe."""
    scenes = held_out_scenes(per_combination)
    return [caption(s) for s in scenes], scenes


def negative_colour_test(pipe, scenes: Sequence[Scene], **generate_kwargs) -> dict[str, float]:
    """Generate each scene's prompt with the negative prompt of its colour (e.g. "red"); return how often the
    shape's colour is still the prompt's colour, and how often it is the prompt's colour without the negative
    prompt (same seed), so that the change is measured against the same noise."""
    prompts = [caption(s) for s in scenes]
    negatives = [s.colour for s in scenes]
    plain = pipe.generate(prompts, **generate_kwargs)
    negated = pipe.generate(prompts, negative_prompt=negatives, **generate_kwargs)
    kept_plain = sum(analyze(im).colour == s.colour for im, s in zip(plain, scenes)) / len(scenes)
    kept_negated = sum(analyze(im).colour == s.colour for im, s in zip(negated, scenes)) / len(scenes)
    changed = sum(analyze(a).colour != analyze(b).colour for a, b in zip(plain, negated)) / len(scenes)
    return {
        "colour_kept_without_negative": kept_plain,
        "colour_kept_with_negative": kept_negated,
        "colour_changed": changed,
    }


def _next_colour(colour: str, background: str) -> str:
    """The palette colour after `colour` (cyclically) that is neither `colour` nor `background`."""
    k = _PALETTE_NAMES.index(colour)
    rotated = _PALETTE_NAMES[k + 1 :] + _PALETTE_NAMES[:k]
    return next(c for c in rotated if c != background)


def negative_drawn_colour_test(pipe, scenes: Sequence[Scene], **generate_kwargs) -> dict[str, float]:
    """Generate each scene's prompt without its colour (e.g. "a small circle in the top left on a blue
    background"), read the colour the model chose, then generate again with the same seed and that colour as
    the negative prompt. `colour_avoided`: how often the second image has another colour. Control: the same
    with the negative prompt of another colour (neither the drawn one nor the background);
    `colour_changed_by_other_negative` is how often that alone changes the colour (a colour-free prompt leaves
    the colour to chance, so any change of the negative prompt can flip it)."""
    prompts = [partial_caption(s, "colour") for s in scenes]
    plain = [analyze(im).colour for im in pipe.generate(prompts, **generate_kwargs)]
    found = [i for i, c in enumerate(plain) if c is not None]
    if not found:
        raise ValueError("negative_drawn_colour_test: the scorer found no shape in any image")
    drawn = [plain[i] for i in found]
    others = [_next_colour(colour, scenes[i].background) for i, colour in zip(found, drawn)]
    chosen = [prompts[i] for i in found]
    negated = [analyze(im).colour for im in pipe.generate(chosen, negative_prompt=drawn, **generate_kwargs)]
    control = [analyze(im).colour for im in pipe.generate(chosen, negative_prompt=others, **generate_kwargs)]
    return {
        "images": len(found),
        "colour_avoided": sum(a != b for a, b in zip(drawn, negated)) / len(found),
        "colour_changed_by_other_negative": sum(a != b for a, b in zip(drawn, control)) / len(found),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    """Generate the held-out prompts with `sdjax.StableDiffusionPipeline` and print the scores as JSON."""
    parser = argparse.ArgumentParser(prog="python -m sdjax.evaluation.shapes", description=main.__doc__)
    parser.add_argument("--model", default=None, help="diffusers folder (default: the embedded model)")
    parser.add_argument("--per-combination", type=int, default=2, help="prompts per held-out combination")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--guidance", type=float, default=None)
    parser.add_argument("--sampler", default=None)
    parser.add_argument("--negative", action="store_true", help="also run the negative-prompt colour test")
    parser.add_argument("--save", default=None, help="write the generated images as a grid PNG here")
    args = parser.parse_args(argv)

    from sdjax.pipelines import StableDiffusionPipeline
    from sdjax.pipelines.images import make_image_grid

    model = args.model
    if model is None:
        from sdjax.training.export import EMBEDDED_MODEL_DIR

        model = str(EMBEDDED_MODEL_DIR)
    pipe, _ = StableDiffusionPipeline.from_pretrained(model)
    prompts, scenes = held_out_prompts(args.per_combination)
    kwargs = dict(seed=args.seed, steps=args.steps, guidance_scale=args.guidance, sampler=args.sampler)
    images = pipe.generate(prompts, **kwargs)
    result = {"held_out_combinations": len(HELD_OUT), "prompts": len(prompts), **score(images, scenes)}
    if args.negative:
        result["negative_prompt"] = negative_colour_test(pipe, scenes, **kwargs)
        result["negative_drawn_colour"] = negative_drawn_colour_test(pipe, scenes, **kwargs)
    if args.save:
        cols = 2 * args.per_combination
        make_image_grid(images, rows=-(-len(images) // cols), cols=cols).save(args.save)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
