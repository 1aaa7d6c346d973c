"""The run loop every trainer shares (`run_loop`: checkpoints, resuming, EMA, logs, TensorBoard, validation images,
FSDP placement, one compiled step per program) and the row-wise micro-batches it asks for (`RowBatches`). The
trainers (`finetune.run`, `full`, `textual_inversion`, `dreambooth`, `flow_run`) build their state, step and
batches and hand them here through `run.Session.loop`."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sdjax.finetune.run_dir import checkpoints as _checkpoints
from sdjax.finetune.run_dir import keep_log_lines as _log_lines
from sdjax.finetune.run_dir import plot_losses
from sdjax.finetune.run_dir import restore as _restore
from sdjax.finetune.run_dir import save_args as _save_args

OnStep = Callable[[int, int, float, float], None]  # (update, total updates, loss, seconds of the update)


@dataclasses.dataclass(frozen=True)
class RowBatches:
    """Micro-batches built row by row: `load(micro, rows)` -> the host arrays of rows `rows` (indices into the
    global micro-batch of `size` rows; None: all of them). `run_loop` asks each process of a multi-host run for the
    rows of its own devices only (`distributed.local_rows`). A trainer's plain `batches(micro)` instead builds the
    whole global batch on every process; calling a `RowBatches` does that too."""

    load: Callable[[int, Sequence[int] | None], dict]
    size: int

    def __call__(self, micro: int) -> dict:
        return self.load(micro, None)


def run_loop(
    cfg: Any,
    state: dict,
    frozen: dict,
    train_step: Callable,
    batches: Callable[[int], dict] | RowBatches,
    *,
    mesh: Any,
    schedule: Callable,
    finish: Callable[[dict], None],
    on_step: OnStep | None = None,
    log: Callable[[str], None] = lambda s: None,
    stop_after: int | None = None,
    trained: str = "lora",
    validate: Callable[[Any, int], Sequence[Path]] | None = None,
) -> tuple[list[float], int, int]:
    """The run loop every trainer shares: restore the run directory's latest checkpoint into `state` (with
    `cfg.resume`), write config.json, then per update `cfg.accumulation` micro-batches `batches(micro)` (host
    arrays; of `RowBatches`, each process's own rows) through `train_step(state, frozen, batch, key)`, the EMA of
    `state[trained]` (with `cfg.ema_decay`; checkpointed as `ema` beside the state), the loss log, checkpoints,
    `validate(values, update) -> PNG paths` (before the first update, every `cfg.validation_every` and at the last;
    the EMA values when on; with `cfg.tensorboard` the images go on the board too, `_board_images`) and `on_step`;
    a finished run (not cut short by `stop_after`) ends with `finish(state)` (`state[trained]` the EMA values when
    on) and `loss.png`. Returns the losses of this call, the first update and the end."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from sdjax.finetune import distributed
    from sdjax.finetune import ema as ema_lib
    from sdjax.finetune import validation as validation_lib
    from sdjax.parallel.sharding import batch_sharding

    distributed.check_supported(validation=validate is not None)
    primary = distributed.is_primary()  # the one process that writes logs and outputs (all of them checkpoint)
    run_dir = cfg.run_path
    run_dir.mkdir(parents=True, exist_ok=True)
    manager = _checkpoints(run_dir)
    ema_schedule = ema_lib.EmaSchedule.of(cfg)
    ema = ema_lib.init(state[trained]) if ema_schedule is not None else None
    start = 0
    if cfg.resume:
        saved, micro = _restore(manager, _with_ema(state, ema))
        state, ema = _without_ema(saved)
        start = micro // cfg.accumulation
        if start:
            log(f"resuming {run_dir} at update {start}")
    loss_log = run_dir / "loss.jsonl"
    board = None
    if primary:
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
        _log_lines(loss_log, start)
        board = _board(run_dir, start) if cfg.tensorboard else None
    if board is not None and validate is not None and start:
        # the resumed file's purge from update `start` on drops that update's images too, and they are not drawn
        # again: put the earlier run's files of it (when it drew them) back on the board
        drawn = [validation_lib.image_path(run_dir, start, i) for i in range(len(cfg.validation_prompts))]
        _board_images(board, drawn, start)

    def validated(values: Any, update: int) -> None:
        paths = validate(values, update)
        if board is not None:  # the primary process's, beside its scalars
            _board_images(board, paths or (), update)

    if cfg.fsdp:
        state, frozen, ema, train_step = _fsdp_layout(cfg, mesh, state, frozen, ema, train_step, trained, log)
    else:  # data parallel: every weight on every device
        replicated = NamedSharding(mesh, PartitionSpec())
        state, frozen, ema = distributed.place((state, frozen, ema), replicated)
    train_step = _compiled_once(train_step)
    key = jax.random.PRNGKey(cfg.seed)
    losses: list[float] = []
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    if validate is not None and start == 0:
        validated(state[trained] if ema is None else ema, 0)
    for update in range(start, end):
        t0 = time.perf_counter()
        micro_losses = []
        for micro in range(update * cfg.accumulation, (update + 1) * cfg.accumulation):
            batch = _placed_batch(batches, micro, batch_sharding(mesh))
            state, loss = train_step(state, frozen, batch, key)
            micro_losses.append(loss)
        done = update + 1
        if ema is not None:  # once per optimiser update, as diffusers' examples step their EMAModel
            ema = ema_lib.update(ema, state[trained], done, ema_schedule)
        loss = float(np.mean([float(v) for v in micro_losses]))
        seconds = time.perf_counter() - t0
        losses.append(loss)
        row = {"step": update, "loss": loss, "lr": float(schedule(update)), "seconds": round(seconds, 4)}
        if primary:
            with loss_log.open("a") as f:
                f.write(json.dumps(row) + "\n")
        if board is not None:
            board.add_scalar("train/loss", loss, update)
            board.add_scalar("train/lr", row["lr"], update)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at update {update}; lower lr ({cfg.lr}) or check the data")
        if (cfg.save_every and done % cfg.save_every == 0) or done == end:
            manager.save(done * cfg.accumulation, args=_save_args(_with_ema(state, ema)), force=True)
            if board is not None:
                board.flush()
        if validate is not None and validation_lib.due(done, cfg.validation_every, cfg.steps):
            validated(state[trained] if ema is None else ema, done)
        if on_step is not None:
            on_step(done, cfg.steps, loss, seconds)
    manager.wait_until_finished()
    manager.close()
    if board is not None:
        board.close()
    if end == cfg.steps and primary:
        finish(state if ema is None else {**state, trained: ema})
        if loss_log.is_file():
            plot_losses(loss_log, run_dir / "loss.png")
    return losses, start, end


def _placed_batch(batches: Callable[[int], dict] | RowBatches, micro: int, sharding: Any) -> Any:
    """Micro-batch `micro` as global arrays of `sharding`: of `RowBatches`, each process builds only the rows its
    own devices hold (every row with one process); of a plain callable, each builds the whole batch."""
    from sdjax.finetune import distributed

    if not isinstance(batches, RowBatches):
        return distributed.place(batches(micro), sharding)
    rows = distributed.local_rows(sharding, batches.size)
    return distributed.place_rows(batches.load(micro, rows), sharding, batches.size, rows)


def _fsdp_layout(cfg: Any, mesh: Any, state: dict, frozen: dict, ema: Any, train_step: Callable, trained: str, log):
    """FSDP (`finetune.sharding`): the state, frozen params and EMA placed in the layout that splits every param of
    at least `cfg.fsdp_min_size` elements over the mesh, and the step re-jitted to return the state in that layout
    (one executable for every update)."""
    from sdjax.finetune import distributed
    from sdjax.finetune import sharding as train_sharding

    kw = {} if cfg.fsdp_min_size is None else {"min_size": cfg.fsdp_min_size}
    layout = train_sharding.layout(mesh, state, frozen, trained=trained, fsdp=True, **kw)
    held = [train_sharding.bytes_per_device(t, s) for t, s in ((frozen, layout.frozen), (state, layout.state))]
    whole = [_nbytes(frozen), _nbytes(state)]
    log(
        f"FSDP over {mesh.size} devices: a device holds {held[0] / 2**20:.1f} of {whole[0] / 2**20:.1f} MiB of the "
        f"frozen weights, {held[1] / 2**20:.1f} of {whole[1] / 2**20:.1f} MiB of the trained values and optimiser state"
    )
    state, frozen = layout.place(state, frozen, put=distributed.place)
    return state, frozen, layout.place_values(ema, put=distributed.place), layout.step(train_step)


# This process's last few compiled train steps by (program text, argument layout, JAX settings): a trainer call that
# builds the very step of an earlier call (a resumed run after the run it resumes) runs that executable again.
_COMPILED: dict[tuple, Any] = {}
_COMPILED_KEEP = 4


def _compiled_once(train_step: Callable) -> Callable:
    """`train_step` (a `jit`) compiled once per process and program: each new argument signature (a new bucket's
    shapes) is lowered, and a program whose text, signature and JAX settings are an earlier call's (`_COMPILED`)
    reuses that executable. The same program runs, so no number changes; only the compile (most of a small run's
    time) is saved. A step that calls back into Python is not shared (`core.cache.has_host_callbacks`)."""
    import hashlib

    import jax

    from sdjax.core.cache import has_host_callbacks

    if not hasattr(train_step, "lower"):
        return train_step
    by_signature: dict[tuple, Any] = {}

    def step(*args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        signature = (tree, *((jax.typeof(x), getattr(x, "sharding", None)) for x in leaves))
        compiled = by_signature.get(signature)
        if compiled is None:
            lowered = train_step.lower(*args)
            if has_host_callbacks(lowered):  # its callbacks are this lowering's: the text names them by index only
                compiled = lowered.compile()
            else:
                program = hashlib.sha256(lowered.as_text().encode()).hexdigest()
                key = (program, signature, repr(sorted(jax.config.values.items())))
                compiled = _COMPILED.pop(key, None) or lowered.compile()
                _COMPILED[key] = compiled
                while len(_COMPILED) > _COMPILED_KEEP:
                    del _COMPILED[next(iter(_COMPILED))]
            by_signature[signature] = compiled
        return compiled(*args)

    return step


def _nbytes(tree: Any) -> int:
    import jax

    return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


def _board(run_dir: Path, start: int):
    """A tensorboardX writer into `run_dir/tensorboard/` (scalars `train/loss`, `train/lr` per update, the
    loss.jsonl steps; validation images, `_board_images`); a resumed run's file purges the older files' events from
    update `start` on. tensorboardX names a file by the second it was opened (and truncates a file of that name), so
    the name ends in the first update too: a run resumed within the second of its start keeps the earlier file, and
    the files sort in the order TensorBoard must read them."""
    from tensorboardX import SummaryWriter

    suffix = f".from-{start:08d}"
    return SummaryWriter(str(run_dir / "tensorboard"), purge_step=start or None, flush_secs=30, filename_suffix=suffix)


def _board_images(board: Any, paths: Sequence[Path], update: int) -> None:
    """The validation images `paths` (prompt i's at `paths[i]`; a missing file is skipped) on the board as
    `validation/i` at step `update` (the update count of their file names), pixel for pixel (uint8 RGB)."""
    from PIL import Image

    for i, path in enumerate(paths):
        if Path(path).is_file():
            with Image.open(path) as image:
                board.add_image(f"validation/{i}", np.asarray(image.convert("RGB")), update, dataformats="HWC")
    board.flush()


def _with_ema(state: dict, ema: Any) -> dict:
    """The checkpointed tree: the state, and the EMA values under `ema` when on."""
    return state if ema is None else {**state, "ema": ema}


def _without_ema(saved: dict) -> tuple[dict, Any]:
    state = {k: v for k, v in saved.items() if k != "ema"}
    return state, saved.get("ema")
