"""`sdjax generate`'s progress bars and timing summary: rich bars driven by the pipeline's progress callback, JAX's
compile time from its monitoring events, and the table of seconds per stage."""

from __future__ import annotations

import dataclasses
import threading
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from sdjax import metadata


@dataclasses.dataclass
class Timings:
    load: float = 0.0
    compile: float = 0.0
    generate: float = 0.0
    denoise: float = 0.0
    decode: float = 0.0
    save: float = 0.0
    steps: int = 0  # model calls per batch
    batches: int = 0


class _CompileClock:
    """Sums JAX's compile-time events (tracing, lowering, backend compile) while active."""

    EVENTS = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )

    def __init__(self):
        self.seconds = 0.0
        self._lock = threading.Lock()

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event in self.EVENTS:
            with self._lock:
                self.seconds += duration

    def __enter__(self):
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def __exit__(self, *exc):
        import jax.monitoring

        try:
            jax.monitoring.unregister_event_duration_listener(self._on_event)
        except (AttributeError, ValueError, KeyError):
            pass


class _Reporter:
    """Rich progress bars driven by the pipeline's `progress(stage, step, total)` callback (called from JAX's
    callback thread, possibly out of order: a bar never moves back)."""

    def __init__(self, progress: Progress | None, num_batches: int):
        self.progress = progress
        self.num_batches = num_batches
        self.batch = 0
        self.call_start = 0.0
        self.last_step_time: float | None = None
        self.first_step_time: float | None = None
        self.step = 0
        self.total = 0
        self.timings_denoise = 0.0
        self.timings_decode = 0.0
        self.compile_task = self.denoise_task = self.decode_task = None
        if progress is not None:
            self.compile_task = progress.add_task("Compiling / starting", total=None)
            # started (their clocks running) when the pipeline first reports them
            self.denoise_task = progress.add_task("Denoising", total=None, visible=False, start=False)
            self.decode_task = progress.add_task("Decoding", total=num_batches, visible=False, start=False)

    def start_batch(self, index: int) -> None:
        self.batch, self.step, self.total = index, 0, 0
        self.call_start = time.perf_counter()
        self.first_step_time = self.last_step_time = None

    def __call__(self, stage: str, step: int, total: int) -> None:
        now = time.perf_counter()
        if stage == "denoise" and step > self.step:
            self.step, self.total = step, total
            if self.first_step_time is None:
                self.first_step_time = now
                if self.progress is not None and self.batch == 0:
                    self.progress.update(self.compile_task, total=1, completed=1)
                    self.progress.start_task(self.denoise_task)
            self.last_step_time = now
            if self.progress is not None:
                self.progress.update(
                    self.denoise_task, total=total * self.num_batches, visible=True, completed=self.batch * total + step
                )
        elif stage == "denoise" and total and not self.total:
            self.total = total

    def end_batch(self) -> None:
        now = time.perf_counter()
        if self.first_step_time is not None and self.last_step_time is not None and self.step > 1:
            per_step = (self.last_step_time - self.first_step_time) / (self.step - 1)
            self.timings_denoise += per_step * self.step
            self.timings_decode += now - self.last_step_time
        if self.progress is not None:
            if self.batch == 0:
                self.progress.update(self.compile_task, total=1, completed=1)
                self.progress.start_task(self.decode_task)
            self.progress.update(self.decode_task, visible=True, completed=self.batch + 1)


def _progress_bars(console: Console) -> Progress:
    return Progress(
        SpinnerColumn(finished_text="[green]✓"),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _summary(console: Console, t: Timings, total: float, n: int, request: metadata.GenerationRequest) -> None:
    table = Table(
        title=f"{n} image(s), {request.width}x{request.height}, {request.steps} steps, {request.sampler}",
        title_justify="left",
        show_header=True,
        header_style="bold",
    )
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    table.add_row("load model", f"{t.load:.2f}")
    table.add_row("compile (JAX events)", f"{t.compile:.2f}")
    if t.denoise:
        table.add_row("denoise (from step times)", f"{t.denoise:.2f}")
        table.add_row("decode", f"{t.decode:.2f}")
    table.add_row("generate (all of the above but load)", f"{t.generate:.2f}")
    table.add_row("write PNGs", f"{t.save:.2f}")
    table.add_row("total", f"{total:.2f}")
    run = t.generate - t.compile
    if run > 0:
        table.add_row("images / s (excluding compile)", f"{n / run:.2f}")
    if t.denoise:
        table.add_row("batch steps / s", f"{t.steps * t.batches / t.denoise:.2f}")
    console.print(table)
