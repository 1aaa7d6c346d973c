"""Training images as people keep them: a folder of images with same-name `.txt` captions, kohya's `N_name`
repeat folders, aspect-ratio buckets, crop / flip, caption dropout and tag shuffling.

- `scan(folder, cfg)` walks the folder (and its direct subfolders) once, opens every image to the last pixel and
  returns a `Dataset`; unreadable images are reported by file name and skipped (`on_bad_image="skip"`, a warning
  listing them) or refused (`"error"`). A missing or empty folder, or one where no image is readable, is an error
  naming the folder. A caption file without an image is reported.
- kohya's repeat folders: `DIR/10_star/*.png` makes each image count 10 times an epoch; an image of such a folder
  without a caption file takes the folder's name after the number ("star") as its caption, as sd-scripts does.
- Buckets (sd-scripts' `BucketManager`): every `(height, width)` multiple of `bucket_step` between `min_bucket`
  and `max_bucket` whose area is at most `resolution ** 2`, largest area per width; each image goes to the bucket
  of nearest log aspect ratio and is resized to cover it, then cropped (center or random) to it. Without
  bucketing every image is cropped to `resolution x resolution`.
- `Sampler`: the batches of epoch `e` are a pure function of `(seed, e)` (each batch from one bucket, short ones
  filled from the same bucket), and each example's crop, flip, caption dropout and tag shuffle a pure function of
  `(seed, step, index)`, so a run resumed at step k reads exactly what the unbroken run read, and a process of a
  multi-host run can open only its own rows of a batch (`Sampler.load(step, rows)`) and get what one host gets;
  `part_rows` splits such rows over the samplers of a stacked batch (DreamBooth's instance and class examples).
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_REPEAT_DIR = re.compile(r"^(\d+)_(.*)$")


class DataError(ValueError):
    """A data folder that cannot be trained on (names the folder or file)."""


class BadImageWarning(UserWarning):
    """Images that could not be read; they are skipped."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """How images become training examples (see the module docstring)."""

    resolution: int = 512
    bucketing: bool = True
    bucket_step: int = 64
    min_bucket: int | None = None  # default resolution // 2
    max_bucket: int | None = None  # default resolution * 2
    random_crop: bool = False
    flip: bool = False  # horizontal flip with probability 1/2
    caption_dropout: float = 0.0  # share of captions replaced by the empty caption
    shuffle_tags: bool = False  # shuffle comma-separated tags after the first `keep_tokens`
    keep_tokens: int = 0
    caption_extension: str = ".txt"
    on_bad_image: str = "skip"  # or "error"

    def check(self) -> None:
        if self.resolution < 8 or self.resolution % 8:
            raise DataError(f"resolution={self.resolution} must be a positive multiple of 8")
        if self.bucketing and (self.bucket_step < 8 or self.bucket_step % 8):
            raise DataError(f"bucket_step={self.bucket_step} must be a positive multiple of 8")
        if not 0.0 <= self.caption_dropout <= 1.0:
            raise DataError(f"caption_dropout={self.caption_dropout} must be in [0, 1]")
        if self.on_bad_image not in ("skip", "error"):
            raise DataError(f"on_bad_image={self.on_bad_image!r} must be 'skip' or 'error'")
        if self.keep_tokens < 0:
            raise DataError(f"keep_tokens={self.keep_tokens} must be 0 or more")


@dataclasses.dataclass(frozen=True)
class Item:
    path: Path
    caption: str
    repeats: int
    size: tuple[int, int]  # (height, width) of the image
    bucket: tuple[int, int]  # (height, width) it is trained at


@dataclasses.dataclass(frozen=True)
class Dataset:
    folder: Path
    items: tuple[Item, ...]
    buckets: tuple[tuple[int, int], ...]
    skipped: tuple[str, ...] = ()  # "path: reason" of images left out
    orphan_captions: tuple[str, ...] = ()

    @property
    def examples_per_epoch(self) -> int:
        return sum(i.repeats for i in self.items)


# ------------------------------------------------------------------------------------------------ buckets
def make_buckets(cfg: DataConfig) -> tuple[tuple[int, int], ...]:
    """`(height, width)` buckets: multiples of `bucket_step` with area <= resolution^2 (sd-scripts' rule)."""
    if not cfg.bucketing:
        return ((cfg.resolution, cfg.resolution),)
    step = cfg.bucket_step
    lo = max(step, (cfg.min_bucket or cfg.resolution // 2) // step * step)
    hi = max(lo, (cfg.max_bucket or cfg.resolution * 2) // step * step)
    area = cfg.resolution**2
    out = set()
    for w in range(lo, hi + 1, step):
        h = min(hi, area // w // step * step)
        if h >= lo:
            out.add((h, w))
            out.add((w, h))
    out.add((cfg.resolution // step * step or step,) * 2)
    return tuple(sorted(out))


def nearest_bucket(size: tuple[int, int], buckets: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest (in log) to the image's `(height, width)`."""
    ratio = math.log(size[1] / size[0])
    return min(buckets, key=lambda b: (abs(math.log(b[1] / b[0]) - ratio), -b[0] * b[1]))


# ------------------------------------------------------------------------------------------------ scanning
def _open_rgb(path: Path):
    from PIL import Image, ImageOps

    with Image.open(path) as im:
        im.load()
        return ImageOps.exif_transpose(im).convert("RGB")


def _image_files(folder: Path) -> list[tuple[Path, int, str | None]]:
    """`(image, repeats, folder caption)` for the images of `folder` and of its direct subfolders."""
    found = []
    for entry in sorted(folder.iterdir()):
        if entry.is_file() and entry.suffix.lower() in IMAGE_SUFFIXES:
            found.append((entry, 1, None))
        elif entry.is_dir():
            m = _REPEAT_DIR.match(entry.name)
            repeats, caption = (int(m.group(1)), m.group(2).replace("_", " ").strip()) if m else (1, None)
            if repeats < 1:
                continue
            for f in sorted(entry.iterdir()):
                if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES:
                    found.append((f, repeats, caption))
    return found


def scan(folder: str | Path, cfg: DataConfig) -> Dataset:
    """The dataset of `folder` (see the module docstring)."""
    cfg.check()
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise DataError(f"data folder {folder} does not exist")
    if not folder.is_dir():
        raise DataError(f"data folder {folder} is not a folder")
    files = _image_files(folder)
    image_stems = {(f.parent, f.stem) for f, _, _ in files}
    captions = [p for p in [*folder.glob("*" + cfg.caption_extension), *folder.glob("*/*" + cfg.caption_extension)]]
    orphans = sorted(str(p) for p in captions if (p.parent, p.stem) not in image_stems)
    if not files:
        extra = f" (caption files without an image: {', '.join(orphans[:5])})" if orphans else ""
        raise DataError(
            f"data folder {folder} holds no images ({', '.join(IMAGE_SUFFIXES)}), neither directly nor in "
            f"N_name repeat subfolders{extra}"
        )
    buckets = make_buckets(cfg)
    items, bad = [], []
    for path, repeats, folder_caption in files:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                im = _open_rgb(path)
            size = (im.height, im.width)
        except Exception as e:  # PIL raises many types for broken files
            bad.append(f"{path}: {type(e).__name__}: {e}")
            continue
        caption_file = path.with_suffix(cfg.caption_extension)
        caption = caption_file.read_text(encoding="utf-8").strip() if caption_file.is_file() else folder_caption
        items.append(Item(path, caption or "", repeats, size, nearest_bucket(size, buckets)))
    if bad and cfg.on_bad_image == "error":
        raise DataError(f"{len(bad)} unreadable image(s) in {folder}: " + "; ".join(bad))
    if bad:
        warnings.warn(f"skipping {len(bad)} unreadable image(s): " + "; ".join(bad), BadImageWarning, stacklevel=2)
    if orphans:
        warnings.warn(f"caption file(s) without an image: {', '.join(orphans[:10])}", stacklevel=2)
    if not items:
        raise DataError(f"data folder {folder}: none of its {len(files)} image(s) is readable: " + "; ".join(bad))
    used = tuple(sorted({i.bucket for i in items}))
    return Dataset(folder, tuple(items), used, tuple(bad), tuple(orphans))


def with_buckets(dataset: Dataset, cfg: DataConfig) -> Dataset:
    """`dataset` bucketed for `cfg` (another resolution or bucket step), without opening the images again."""
    buckets = make_buckets(cfg)
    items = tuple(dataclasses.replace(i, bucket=nearest_bucket(i.size, buckets)) for i in dataset.items)
    return dataclasses.replace(dataset, items=items, buckets=tuple(sorted({i.bucket for i in items})))


# ------------------------------------------------------------------------------------------------ examples
def process_caption(caption: str, cfg: DataConfig, rng: np.random.Generator) -> str:
    """Caption dropout (-> ""), then tag shuffling after the first `keep_tokens` comma-separated tags."""
    if cfg.caption_dropout > 0 and rng.random() < cfg.caption_dropout:
        return ""
    if cfg.shuffle_tags:
        tags = [t.strip() for t in caption.split(",")]
        keep, rest = tags[: cfg.keep_tokens], tags[cfg.keep_tokens :]
        order = rng.permutation(len(rest))
        caption = ", ".join(keep + [rest[i] for i in order])
    return caption


def _resized(item: Item) -> tuple[int, int]:
    """`(height, width)` of `item`'s image resized to cover its bucket."""
    bh, bw = item.bucket
    scale = max(bh / item.size[0], bw / item.size[1])
    return max(bh, round(item.size[0] * scale)), max(bw, round(item.size[1] * scale))


def example_choices(item: Item, cfg: DataConfig, rng: np.random.Generator) -> tuple[int, int, bool]:
    """`(crop top, crop left, flipped)` of one example, drawn from `rng` in `load_example`'s order (a latent cache
    replays them without opening the image: `LatentCache`)."""
    (bh, bw), (rh, rw) = item.bucket, _resized(item)
    if cfg.random_crop:
        top, left = int(rng.integers(0, rh - bh + 1)), int(rng.integers(0, rw - bw + 1))
    else:
        top, left = (rh - bh) // 2, (rw - bw) // 2
    return top, left, bool(cfg.flip and rng.random() < 0.5)


def load_example(item: Item, cfg: DataConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`(pixels CHW float32 in [-1, 1], SDXL time ids (orig_h, orig_w, crop_top, crop_left, h, w))`: the image
    resized to cover its bucket, cropped to it (center or random) and maybe flipped."""
    return crop_example(item, *example_choices(item, cfg, rng))


def crop_example(item: Item, top: int, left: int, flipped: bool) -> tuple[np.ndarray, np.ndarray]:
    """`load_example` with its choices given."""
    from PIL import Image

    im = _open_rgb(item.path)
    bh, bw = item.bucket
    rh, rw = _resized(dataclasses.replace(item, size=(im.height, im.width)))
    if (rh, rw) != (im.height, im.width):
        scale = max(bh / im.height, bw / im.width)
        im = im.resize((rw, rh), Image.Resampling.LANCZOS if scale < 1 else Image.Resampling.BICUBIC)
    top, left = min(top, rh - bh), min(left, rw - bw)  # (an image that changed since the scan)
    x = np.asarray(im, np.float32)[top : top + bh, left : left + bw] / 127.5 - 1.0
    if flipped:
        x = x[:, ::-1]
    time_ids = np.asarray([item.size[0], item.size[1], top, left, bh, bw], np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1)), time_ids


class Sampler:
    """Fixed-size batches of one bucket each, deterministic in `(seed, step)` (see the module docstring)."""

    def __init__(self, dataset: Dataset, cfg: DataConfig, batch_size: int, seed: int):
        self.dataset, self.cfg, self.batch_size, self.seed = dataset, cfg, int(batch_size), int(seed)
        self._epochs: dict[int, list[np.ndarray]] = {}

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        if epoch not in self._epochs:
            rng = np.random.default_rng((self.seed, epoch, 7))
            by_bucket: dict[tuple[int, int], list[int]] = {}
            for i, item in enumerate(self.dataset.items):
                by_bucket.setdefault(item.bucket, []).extend([i] * item.repeats)
            batches = []
            for bucket in sorted(by_bucket):
                idx = rng.permutation(np.asarray(by_bucket[bucket]))
                short = -len(idx) % self.batch_size
                if short:
                    idx = np.concatenate([idx, rng.choice(idx, short)])
                batches += list(idx.reshape(-1, self.batch_size))
            order = rng.permutation(len(batches))
            self._epochs = {epoch: [batches[j] for j in order]}  # keep one epoch's lists
        return self._epochs[epoch]

    def batch(self, step: int) -> tuple[list[int], int]:
        """The item indices of micro-batch `step` and its epoch."""
        n = len(self.epoch_batches(0))
        epoch, within = divmod(int(step), n)
        return list(self.epoch_batches(epoch)[within]), epoch

    def _rows(self, step: int, rows: Sequence[int] | None) -> list[tuple[int, int]]:
        """`(row, item index)` of micro-batch `step`'s rows `rows` (None: all of them)."""
        indices, _ = self.batch(step)
        if rows is None:
            return list(enumerate(indices))
        bad = [j for j in rows if not 0 <= j < len(indices)]
        if bad:
            raise IndexError(f"rows {bad} of a micro-batch of {len(indices)} examples")
        return [(j, indices[j]) for j in rows]

    def plan(self, step: int, rows: Sequence[int] | None = None) -> list[tuple[int, tuple[int, int, bool], str]]:
        """Micro-batch `step` without opening an image: per example `(item index, (top, left, flipped), caption)`,
        the very draws of `load` (a latent cache's batches); `rows` as in `load`."""
        out = []
        for j, i in self._rows(step, rows):
            rng = np.random.default_rng((self.seed, int(step), j, 11))
            item = self.dataset.items[i]
            choices = example_choices(item, self.cfg, rng)
            out.append((i, choices, process_caption(item.caption, self.cfg, rng)))
        return out

    def load(self, step: int, rows: Sequence[int] | None = None) -> dict:
        """Micro-batch `step`: `pixels (B, 3, h, w)`, `time_ids (B, 6)`, `captions` (list), `paths`. With `rows`
        (indices into the micro-batch) only those examples are opened, each with the draws it has in the whole
        batch (a process of a multi-host run builds the rows of its own devices: `finetune.distributed`)."""
        pixels, time_ids, captions, paths = [], [], [], []
        for j, i in self._rows(step, rows):
            rng = np.random.default_rng((self.seed, int(step), j, 11))
            item = self.dataset.items[i]
            try:
                x, t = load_example(item, self.cfg, rng)
            except Exception as e:  # the file changed since the scan: take a readable image of the same bucket
                warnings.warn(
                    f"{item.path}: unreadable now ({type(e).__name__}: {e}); using another image",
                    BadImageWarning,
                    stacklevel=2,
                )
                item, x, t = self._substitute(item, rng)
            pixels.append(x)
            time_ids.append(t)
            captions.append(process_caption(item.caption, self.cfg, rng))
            paths.append(str(item.path))
        return {"pixels": np.stack(pixels), "time_ids": np.stack(time_ids), "captions": captions, "paths": paths}

    def _substitute(self, bad: Item, rng: np.random.Generator):
        for other in self.dataset.items:
            if other.bucket == bad.bucket and other.path != bad.path:
                try:
                    return (other, *load_example(other, self.cfg, rng))
                except Exception:
                    continue
        raise DataError(f"{bad.path}: unreadable, and no other image of its bucket {bad.bucket} is readable")


def part_rows(rows: Sequence[int] | None, sizes: Sequence[int]) -> list[list[int] | None]:
    """Rows `rows` of a micro-batch stacked from parts of `sizes` rows (DreamBooth's [instance; class]) as each
    part's own row indices, in order (None: every row of every part). A part none of whose rows is asked for gets
    an empty list: a process of a multi-host run opens nothing of it."""
    if rows is None:
        return [None] * len(sizes)
    bad = [r for r in rows if not 0 <= r < sum(sizes)]
    if bad:
        raise IndexError(f"rows {bad} of a micro-batch of {sum(sizes)} examples (parts of {list(sizes)})")
    out, start = [], 0
    for size in sizes:
        out.append([r - start for r in rows if start <= r < start + size])
        start += size
    return out
