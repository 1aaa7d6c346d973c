"""The run directory's files besides config.json (`loop.run_loop`): orbax checkpoints of the train state (restored as
host arrays), the refusal to resume a run written with other settings, the loss log kept up to a resumed step, and
`loss.png`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np


def checkpoints(run_dir: Path, keep: int = 2):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options)


def restore(manager, state: dict) -> tuple[dict, int]:
    """`(the latest checkpoint's tree as host arrays, its micro-step)`, or `(state, 0)` without one. Host arrays:
    the run places them in its layout without compiling a resharding program per array shape."""
    import jax

    step = manager.latest_step()
    if step is None:
        return state, 0
    import orbax.checkpoint as ocp

    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
    return manager.restore(step, args=ocp.args.StandardRestore(abstract)), int(step)


def check_resume(run_dir: Path, cfg: Any, keys: tuple[str, ...], what: str = "a run") -> None:
    """Refuse to resume from `run_dir` when its config.json differs from `cfg` in one of `keys` (compared as JSON
    values; a key the saved config lacks, a setting added since, counts as that setting's default)."""
    saved = run_dir / "config.json"
    if not saved.is_file():
        return
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    old, new = json.loads(saved.read_text()), json.loads(json.dumps(dataclasses.asdict(cfg)))
    old = {k: old.get(k, defaults.get(k)) for k in keys}
    diff = [f"{k}: {old[k]!r} -> {new[k]!r}" for k in keys if old[k] != new[k]]
    if diff:
        raise ValueError(
            f"{run_dir}: its checkpoints come from {what} with other settings ({'; '.join(diff)}); use another "
            "run_dir or resume=False"
        )


def keep_log_lines(path: Path, upto: int) -> None:
    """Keep the loss log's lines of updates before `upto` (a resumed run rewrites the rest)."""
    if not path.is_file():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] < upto]
    path.write_text("".join(ln + "\n" for ln in lines))


def plot_losses(log_path: Path, png: Path) -> bool:
    """`loss.png` from `loss.jsonl` (False when matplotlib is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [json.loads(ln) for ln in log_path.read_text().splitlines() if ln.strip()]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=0.8)
    ax.set_xlabel("update")
    ax.set_ylabel("loss")
    ax.set_title(log_path.parent.name)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return True


def save_args(state):
    import orbax.checkpoint as ocp

    return ocp.args.StandardSave(state)
