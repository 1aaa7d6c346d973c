"""Validation images during a run: the pipeline's `generate` with the values being trained applied to a copy of the
base params, written as PNGs into the run directory.

`validation/step-000050-0.png` is prompt 0 after update 50 (`step-000000-*`: before the first update, the base
model with the initial values: a fresh LoRA's up factors are zero, so these are the base model's images; a
textual-inversion run's are the init word's). Every image uses the seed `validation_seed` (each prompt its own
`generate` call, so a prompt's images at different steps differ only by the training), the training resolution,
`validation_steps` denoising steps (default: the pipeline's) and the pipeline's guidance and sampler. With EMA the
images show the EMA values, which are what the run writes at the end.

LoRA values are merged as training merges them (`lora.merge`: `W + alpha/r * (up @ down)^T` in float32, cast to
the kernel's dtype); the merge runs outside `jit`, and the generation program is compiled once and reused, since
the merged params keep the base params' shapes and dtypes.

After each round the run directory's `validation-grid.png` is written anew: a row per update drawn so far (oldest
on top, its update count in a left margin), a column per prompt, so a run's progress reads at a glance.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

FOLDER = "validation"
GRID = "validation-grid.png"
LABEL_WIDTH = 72  # the grid's left margin, where each row's update count is written


def image_path(run_dir: Path, step: int, index: int) -> Path:
    return Path(run_dir) / FOLDER / f"step-{int(step):06d}-{int(index)}.png"


def lora_params(params: dict, values: dict, scale: float, conv_scale: float | None = None) -> dict:
    """`params` with each component's LoRA of `values` merged (a new dict; `params` is not changed; `conv_scale`:
    the UNet's convolutions wider than 1x1, LoCon)."""
    import jax

    from sdjax.finetune import lora as lora_lib

    host = jax.device_get(values)  # the run's values live on its mesh; the pipeline's params may not
    out = dict(params)
    for component, layers in host.items():
        out[component] = lora_lib.merge(params[component], layers, scale, conv_scale=conv_scale)
    return out


def make_validator(
    cfg: Any,
    pipe: Any,
    with_values: Callable[[Any], dict],
    resolution: tuple[int, int],
    log: Callable[[str], None] = lambda s: None,
) -> Callable[[Any, int], list[Path]] | None:
    """`validate(values, step) -> paths`: one image per `cfg.validation_prompts` with `with_values(values)` as the
    pipeline's params, saved under the run directory; None when the run has no validation prompts."""
    prompts = tuple(cfg.validation_prompts)
    if not prompts:
        return None
    height, width = resolution
    run_dir = cfg.run_path

    def validate(values: Any, step: int) -> list[Path]:
        params = with_values(values)
        paths = []
        for i, prompt in enumerate(prompts):
            image = pipe.generate(
                prompt,
                seed=cfg.validation_seed,
                steps=cfg.validation_steps,
                height=height,
                width=width,
                params=params,
            )[0]
            path = image_path(run_dir, step, i)
            path.parent.mkdir(parents=True, exist_ok=True)
            image.save(path)
            paths.append(path)
        write_grid(run_dir, len(prompts))
        log(f"validation images of update {step}: {paths[0].parent}")
        return paths

    return validate


def write_grid(run_dir: Path, prompts: int) -> Path:
    """`run_dir/validation-grid.png` from the validation images there (a resumed run's earlier ones included): a row
    per update with all `prompts` images, oldest first, labelled "update N"; a column per prompt. Written to a
    temporary name and renamed, so a reader never sees half a file."""
    import os

    from PIL import Image, ImageDraw

    run_dir = Path(run_dir)
    drawn = sorted({int(p.name.split("-")[1]) for p in (run_dir / FOLDER).glob("step-*-*.png")})
    rows = [s for s in drawn if all(image_path(run_dir, s, i).is_file() for i in range(prompts))]
    cells = [[Image.open(image_path(run_dir, s, i)).convert("RGB") for i in range(prompts)] for s in rows]
    width, height = cells[0][0].size
    grid = Image.new("RGB", (LABEL_WIDTH + prompts * width, len(rows) * height), "white")
    draw = ImageDraw.Draw(grid)
    for r, (step, images) in enumerate(zip(rows, cells, strict=True)):
        draw.text((4, r * height + 4), f"update {step}", fill="black")
        for i, image in enumerate(images):
            grid.paste(image, (LABEL_WIDTH + i * width, r * height))
    path, partial = run_dir / GRID, run_dir / f".{GRID}.partial"
    grid.save(partial, format="PNG")
    os.replace(partial, path)
    return path


def due(step: int, every: int, end: int) -> bool:
    """Whether the images of update count `step` are drawn: before the first update, every `every` updates (0:
    never in between) and at the last one."""
    return step == 0 or step == end or (every > 0 and step % every == 0)
