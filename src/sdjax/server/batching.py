"""Dynamic batching with cancellation: concurrent requests of one compiled shape share one padded pipeline call,
and a request that nobody waits for any more stops costing compute within one denoising step.

One daemon thread owns the pipeline (JAX releases the GIL while it computes, so the event loop stays responsive;
a daemon thread never holds the process open at exit). Requests wait on the event loop in a FIFO of jobs; a
collector coroutine takes the oldest job's shape (`ImageParameters.shape_key`), waits up to `window_s` from that
job's arrival for more images of the same shape, takes up to `max_batch` images in arrival order (a request's
images may span batches) and pads the batch to the smallest configured compiled size (`batch_sizes`) that holds
it. Results go back to the owning request by position.

Determinism: each image has its own seed and fold-in index, so its pixels do not depend on its position in the
batch or on its batch-mates. They can depend on the compiled batch size: XLA may pick other kernels for another
batch shape (measured on the embedded model, one CPU device: batch 1 vs batch 8 differ by 1/255 in one pixel;
positions and batch-mates within batch 8 give identical bytes). A server compiled for one batch size
(`batch_sizes=(N,)`) therefore returns the same bytes for the same request whatever the load.

Cancellation: a job is cancelled by its request's timeout (504), its client's disconnect, `/sdapi/v1/interrupt`
(the request ends with the images made so far, and those of the running batch decoded from its latents at the
interrupt when the pipeline reports latents: `server.partial`) or shutdown; `/sdapi/v1/skip` drops the running
batch's images and lets the jobs go on. The pipeline call gets `should_stop()`, polled once per denoising step,
which turns True when every job of the running batch is cancelled (or the batch is skipped); batch-mates of a
cancelled request keep running and only its results are dropped. A pipeline whose `generate_arrays` takes no
`should_stop` runs each batch to its end (cancelled images are then only dropped); queued images of a cancelled job
never run.

Bounds: the queue holds at most `max_queue_images` images and, if set, `max_queue_cost` pixel-steps (a request
that does not fit now raises `QueueFull` with a retry estimate, one that can never fit an `APIError` 422).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sdjax.metadata import ImageParameters, generate_images
from sdjax.server import partial
from sdjax.server.errors import APIError
from sdjax.server.metrics import Metrics
from sdjax.server.schemas import image_cost

log = logging.getLogger("sdjax.server")

CANCEL_REASONS = ("timeout", "disconnect", "interrupt", "shutdown")


class QueueFull(Exception):
    """The queue cannot take the request now; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The server is draining and takes no new work, or stopped before this request ran."""


@dataclasses.dataclass
class Outcome:
    """What a finished job gives its request: the images made, in request order, and why fewer than asked."""

    images: list[ImageParameters]
    arrays: np.ndarray  # (len(images), H, W, 3) uint8
    stopped: str | None = None  # "interrupt" | "skip" | None


@dataclasses.dataclass(eq=False)
class Job:
    """One request's images; `images[next:]` are not yet in a batch; `settled` counts those made or dropped."""

    task_id: str
    images: list[ImageParameters]
    future: asyncio.Future
    arrived: float
    arrays: list[np.ndarray | None]
    next: int = 0
    settled: int = 0
    cancelled: str | None = None  # one of CANCEL_REASONS
    skipped: int = 0

    @property
    def key(self):
        return self.images[0].shape_key

    @property
    def waiting(self) -> int:
        return len(self.images) - self.next

    @property
    def image_cost(self) -> int:
        im = self.images[0]
        return image_cost(im)


@dataclasses.dataclass
class BatchStatus:
    """What the worker is doing now (read by the progress and health endpoints)."""

    jobs: tuple[Job, ...]
    images: int
    padded_to: int
    started: float
    heartbeat: float  # last sign of life from the pipeline (start, a progress report or a should_stop poll)
    stage: str = "start"
    step: int = 0
    total: int = 0
    skip: bool = False
    latents: Any = None  # the batch's latents at the last step, when the pipeline reports them
    owners: tuple[str, ...] = ()  # the task id of each image of the batch, by position

    @property
    def task_ids(self) -> tuple[str, ...]:
        return tuple(j.task_id for j in self.jobs)


def pick_batch_size(n: int, batch_sizes: Sequence[int]) -> int:
    """The smallest compiled batch size holding `n` images."""
    for size in sorted(batch_sizes):
        if size >= n:
            return size
    raise ValueError(f"{n} images exceed the largest compiled batch size {max(batch_sizes)}")


def accepts_should_stop(pipeline: Any) -> bool:
    """Whether `pipeline.generate_arrays` names a `should_stop` parameter (a `**kwargs` catch-all does not count:
    the current pipelines pass those on as conditioning and refuse unknown names)."""
    try:
        return "should_stop" in inspect.signature(pipeline.generate_arrays).parameters
    except (TypeError, ValueError, AttributeError):
        return False


class _Worker:
    """One daemon thread running functions in order; results come back to the caller's event loop."""

    def __init__(self, name: str = "sdjax-pipeline"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable, *args) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((loop, future, fn, args))
        return future

    def close(self) -> None:
        self._queue.put(None)

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            loop, future, fn, args = item
            try:
                result, ok = fn(*args), True
            except BaseException as e:  # handed to the awaiting coroutine
                result, ok = e, False
            try:
                loop.call_soon_threadsafe(_settle, future, ok, result)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass


def _settle(future: asyncio.Future, ok: bool, result: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(result)
    else:
        future.set_exception(result)


class Batcher:
    """Queue + collector coroutine + the pipeline's worker thread. Create, `await start()`, `await stop()`."""

    def __init__(
        self,
        pipeline: Any,
        *,
        metrics: Metrics,
        max_batch: int = 8,
        batch_sizes: Sequence[int] = (),
        window_s: float = 0.01,
        max_queue_images: int = 64,
        max_queue_cost: int | None = None,
        warm_shapes: Sequence[tuple[int, int, int, str]] = (),
        warm_guidance: float = 7.5,
        warm_no_guidance: bool = False,
        progress: bool = True,
        params_for: Callable[[Any, ImageParameters], dict | None] | None = None,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be at least 1")
        self.metrics = metrics
        self.max_batch = max_batch
        self.batch_sizes = tuple(sorted(set(batch_sizes or _powers_of_two(max_batch)) | {max_batch}))
        if self.batch_sizes[-1] > max_batch or self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes={self.batch_sizes} must lie in 1..max_batch={max_batch}")
        self.window_s = window_s
        self.max_queue_images = max_queue_images
        self.max_queue_cost = max_queue_cost
        self.warm_shapes = tuple(warm_shapes)
        self.warm_guidance = warm_guidance
        self.warm_no_guidance = warm_no_guidance
        self.use_progress = progress
        self.params_for = params_for  # per-batch params (LoRA sets, VAEs: `server.networks`); None: the pipeline's
        self.set_pipeline(pipeline)
        self.ready = False
        self.stopping = False
        self.draining = False
        self.current: BatchStatus | None = None
        self.batch_seconds_ema: float | None = None
        self._pending: collections.deque[Job] = collections.deque()
        self._jobs: dict[str, Job] = {}  # task id -> job, while queued or running
        self._queued_images = 0
        self._queued_cost = 0
        self._ids = itertools.count()
        self._worker = _Worker()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._collector: asyncio.Task | None = None
        self._warmup: asyncio.Task | None = None

    def set_pipeline(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        self.supports_stop = accepts_should_stop(pipeline)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._warmup = asyncio.create_task(self._run_warmup())
        self._collector = asyncio.create_task(self._collect())

    async def stop(self, timeout_s: float = 30.0, worker_join_s: float = 10.0) -> None:
        """Finish queued and running work (up to `timeout_s`), cancel what is left, then stop the worker (waiting
        up to `worker_join_s` for a running batch to notice its cancellation)."""
        self.stopping = True
        if self._warmup is not None and not self._warmup.done():
            self._warmup.cancel()  # a compilation already running stops at its next step (should_stop)
        if self._wakeup is not None:
            self._wakeup.set()
        if self._collector is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._collector), timeout_s)
            except (TimeoutError, asyncio.CancelledError):
                pass
        self.cancel_all("shutdown")
        if self._collector is not None and not self._collector.done():
            try:
                await asyncio.wait_for(self._collector, worker_join_s)
            except (TimeoutError, asyncio.CancelledError):
                self._collector.cancel()
        self._worker.close()
        if not await asyncio.to_thread(self._worker.join, worker_join_s):
            log.warning("the pipeline thread is still busy after %.0f s; exiting without it", worker_join_s)

    def begin_drain(self, timeout_s: float) -> None:
        """SIGTERM: take no new work; after `timeout_s`, cancel whatever has not finished. Thread-safe (called from
        a signal handler)."""
        self.draining = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._loop.call_later, timeout_s, self.cancel_all, "shutdown")

    async def _run_warmup(self) -> None:
        """Compile each warm shape at each batch size by running it through the same call that serves requests
        (same progress and should_stop arguments, so the same program), on blank prompts."""
        t0 = time.perf_counter()
        # Guidance above 1 and at most 1 are two programs (the unconditional half is skipped at <= 1): a pinned
        # server warms both, so that no request compiles.
        guidances = (
            (self.warm_guidance, 1.0) if self.warm_guidance > 1 and self.warm_no_guidance else (self.warm_guidance,)
        )
        shapes = [(shape, g) for shape in self.warm_shapes for g in guidances]
        for (steps, height, width, sampler), guidance in shapes:
            for size in self.batch_sizes:
                if self.stopping:
                    return
                log.info(
                    "compiling batch %d, %dx%d, %d steps, sampler %s, guidance %s",
                    size,
                    width,
                    height,
                    steps,
                    sampler,
                    guidance,
                )
                images = [
                    ImageParameters("", "", steps, sampler, guidance, 0, width, height, image_index=i)
                    for i in range(size)
                ]
                try:
                    progress = _ignore_progress if self.use_progress else None
                    await self._worker.run(self._generate, self.pipeline, images, size, lambda: self.stopping, progress)
                except Exception:  # a failed warm-up is logged; requests of that shape report their own error
                    if self.stopping:
                        return
                    log.exception("warm-up failed for batch %d %dx%d", size, width, height)
        self.metrics.warmup_seconds.set(time.perf_counter() - t0)
        self.ready = True
        self.metrics.ready.set(1)
        log.info("ready: warm-up took %.1f s", time.perf_counter() - t0)

    async def warm(self, warm_shapes: Sequence[tuple[int, int, int, str]]) -> None:
        """Compile `warm_shapes` now (after a model switch); not ready meanwhile."""
        self.ready = False
        self.metrics.ready.set(0)
        self.warm_shapes = tuple(warm_shapes)
        await self._run_warmup()

    async def idle(self) -> None:
        """Wait until nothing is queued or running."""
        while self._pending or self.current is not None:
            await asyncio.sleep(0.02)

    async def run_on_worker(self, fn: Callable, *args) -> Any:
        """Run `fn(*args)` on the pipeline's thread, in order with the batches (e.g. loading another model)."""
        return await self._worker.run(fn, *args)

    # ------------------------------------------------------------------ the request side
    @property
    def queued_images(self) -> int:
        return self._queued_images

    @property
    def queued_cost(self) -> int:
        return self._queued_cost

    def retry_after(self) -> int:
        per_batch = self.batch_seconds_ema or 1.0
        return max(1, math.ceil((self._queued_images / self.max_batch + 1) * per_batch))

    def stuck_for(self) -> float:
        """Seconds since the running batch last showed life (0 when idle)."""
        current = self.current
        return time.monotonic() - current.heartbeat if current is not None else 0.0

    def submit(self, images: list[ImageParameters], task_id: str | None = None) -> Job:
        """Queue a request's images (all of one shape); await `job.future` for an `Outcome`."""
        if self.stopping:  # while draining, requests already received still run (uvicorn accepts no new ones)
            raise ShuttingDown("the server is shutting down")
        if not images:
            raise ValueError("a request needs at least one image")
        if len({im.shape_key for im in images}) != 1:
            raise ValueError("a request's images must share steps, size and sampler")
        n = len(images)
        cost = image_cost(images[0]) * n
        if self.max_queue_cost is not None and cost > self.max_queue_cost:
            raise APIError(
                422,
                f"the request costs {cost} pixel-steps (width x height x steps x images), over the queue's whole "
                f"budget of {self.max_queue_cost} (max_queue_cost); it could never run here",
                None,
                code="over_budget",
            )
        if self._queued_images + n > self.max_queue_images:
            raise QueueFull(
                f"the queue holds {self._queued_images} of {self.max_queue_images} images; "
                f"retry in about {self.retry_after()} s",
                self.retry_after(),
            )
        if self.max_queue_cost is not None and self._queued_cost + cost > self.max_queue_cost:
            raise QueueFull(
                f"the queue holds {self._queued_cost} of its {self.max_queue_cost} pixel-steps (max_queue_cost); "
                f"retry in about {self.retry_after()} s",
                self.retry_after(),
            )
        task_id = task_id or f"task-{next(self._ids)}"
        if task_id in self._jobs:
            task_id = f"{task_id}-{next(self._ids)}"
        job = Job(task_id, list(images), asyncio.get_running_loop().create_future(), time.monotonic(), [None] * n)
        self._pending.append(job)
        self._jobs[task_id] = job
        self._queued_images += n
        self._queued_cost += cost
        self._update_queue_metrics()
        self._wakeup.set()
        return job

    def cancel(self, job: Job, reason: str) -> None:
        """Nobody waits for this job any more (`reason`: timeout, disconnect or shutdown): its queued images are
        dropped, and a running batch of only cancelled jobs stops at its next step."""
        if job.cancelled is not None and job.cancelled != "interrupt":
            return
        job.cancelled = reason
        self._drop_waiting(job)
        self._jobs.pop(job.task_id, None)
        if not job.future.done():
            if reason == "shutdown":
                job.future.set_exception(ShuttingDown("the server stopped before this request finished"))
            else:
                job.future.cancel()
        self.metrics.cancelled.labels(reason).inc()

    def cancel_all(self, reason: str = "shutdown") -> None:
        for job in list(self._jobs.values()):
            self.cancel(job, reason)
        current = self.current
        if current is not None:
            for job in current.jobs:
                self.cancel(job, reason)

    def interrupt(self, task_id: str | None = None) -> list[str]:
        """AUTOMATIC1111's interrupt: end the running requests (or the one task) with the images made so far.
        Returns the interrupted task ids."""
        if task_id is not None:
            job = self._jobs.get(task_id)
            targets = [job] if job is not None else []
        else:
            targets = list(self.current.jobs) if self.current is not None else []
        done = []
        for job in targets:
            if job.cancelled is not None:
                continue
            job.cancelled = "interrupt"
            self._drop_waiting(job)
            self.metrics.cancelled.labels("interrupt").inc()
            done.append(job.task_id)
            self._maybe_finish(job)
        return done

    def skip(self) -> bool:
        """AUTOMATIC1111's skip: drop the running batch's images; its requests go on with their other images."""
        current = self.current
        if current is None:
            return False
        current.skip = True
        self.metrics.cancelled.labels("skip").inc()
        return True

    def position(self, task_id: str) -> tuple[str, int]:
        """("queued", images ahead) | ("running", 0) | ("unknown", 0) for a task id."""
        job = self._jobs.get(task_id)
        if job is None:
            return "unknown", 0
        if self.current is not None and task_id in self.current.task_ids:
            return "running", 0
        ahead = 0
        for other in self._pending:
            if other is job:
                break
            ahead += other.waiting
        return "queued", ahead

    def _drop_waiting(self, job: Job) -> None:
        n = job.waiting
        if n:
            job.next = len(job.images)
            job.settled += n
            self._queued_images -= n
            self._queued_cost -= n * job.image_cost
        if job in self._pending:
            self._pending.remove(job)
        self._update_queue_metrics()

    def _update_queue_metrics(self) -> None:
        self.metrics.queue_images.set(self._queued_images)
        self.metrics.queue_requests.set(sum(1 for j in self._pending if j.waiting))

    # ------------------------------------------------------------------ the collector
    def _available(self, key) -> int:
        return sum(j.waiting for j in self._pending if j.key == key)

    def _take(self, key) -> list[tuple[Job, int]]:
        """Up to `max_batch` (job, image index) slots of shape `key`, oldest first."""
        slots: list[tuple[Job, int]] = []
        for job in self._pending:
            if job.key != key:
                continue
            while job.waiting and len(slots) < self.max_batch:
                slots.append((job, job.next))
                job.next += 1
            if len(slots) == self.max_batch:
                break
        self._pending = collections.deque(j for j in self._pending if j.waiting)
        self._queued_images -= len(slots)
        self._queued_cost -= sum(job.image_cost for job, _ in slots)
        self._update_queue_metrics()
        return slots

    async def _collect(self) -> None:
        while True:
            if not self._pending:
                if self.stopping:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            head = self._pending[0]
            deadline = head.arrived + self.window_s
            while self._available(head.key) < self.max_batch and not self.stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except TimeoutError:
                    break
            if not self._pending or self._pending[0] is not head:  # the head was cancelled meanwhile
                continue
            await self._run_batch(self._take(head.key))

    async def _run_batch(self, slots: list[tuple[Job, int]]) -> None:
        images = [job.images[i] for job, i in slots]
        pad_to = pick_batch_size(len(images), self.batch_sizes)
        jobs = tuple(dict.fromkeys(job for job, _ in slots))
        now = time.monotonic()
        status = BatchStatus(jobs, len(images), pad_to, now, now, owners=tuple(job.task_id for job, _ in slots))
        self.current = status
        t0 = time.perf_counter()
        progress = (lambda *a, **k: self._on_progress(status, *a, **k)) if self.use_progress else None
        error: Exception | None = None
        arrays = None
        try:
            arrays = await self._worker.run(
                self._generate, self.pipeline, images, pad_to, lambda: self._should_stop(status), progress
            )
        except Exception as e:
            error = e
        finally:
            self.current = None
        dt = time.perf_counter() - t0
        stop_requested = self._should_stop(status, beat=False)
        if error is not None and stop_requested:  # sdjax.core.Cancelled, or whatever a stopped pipeline raised
            log.info("batch of %d images stopped after %.2f s (%s)", len(images), dt, _why(status))
            self.metrics.stopped_batches.inc()
            decoded = await self._partial_images(status, images)
            for k, (job, i) in enumerate(slots):
                if job.cancelled == "interrupt" and decoded[k] is not None:
                    job.arrays[i] = decoded[k]
                job.settled += 1
                job.skipped += int(status.skip and job.cancelled is None)
        elif error is not None:  # the pipeline failed: fail these requests, keep serving
            log.error("batch of %d images failed", len(images), exc_info=error)
            self.metrics.errors.inc()
            for job in jobs:
                self._fail(job, error)
            return
        else:
            self.batch_seconds_ema = dt if self.batch_seconds_ema is None else 0.8 * self.batch_seconds_ema + 0.2 * dt
            self.metrics.batches.inc()
            self.metrics.batch_images.observe(len(images))
            self.metrics.batch_fill.observe(len(images) / pad_to)
            self.metrics.batch_seconds.observe(dt)
            for (job, i), array in zip(slots, arrays):
                job.arrays[i] = array
                job.settled += 1
        for job in jobs:
            self._maybe_finish(job)

    async def _partial_images(self, status: BatchStatus, images: list[ImageParameters]) -> list[np.ndarray | None]:
        """An interrupted batch's images decoded from its last reported latents (`server.partial`), for the
        interrupted requests (A1111's interrupt answers with the partly denoised image); None where there is none:
        a skipped batch, no latents reported, an image whose finished size differs, or a failed decode."""
        none: list[np.ndarray | None] = [None] * len(images)
        latents = status.latents
        if status.skip or latents is None or not any(job.cancelled == "interrupt" for job in status.jobs):
            return none
        try:
            arrays = await self._worker.run(self._decode, self.pipeline, np.asarray(latents)[: len(images)], images)
        except Exception:  # the request still ends, without the partial images
            log.exception("decoding the interrupted batch's latents failed")
            return none
        return [a if a.shape[:2] == partial.output_size(im) else None for a, im in zip(arrays, images)]

    def _decode(self, pipeline: Any, latents: np.ndarray, images: list[ImageParameters]) -> np.ndarray:
        """Runs on the worker thread: the batch's latents through its VAE (the batch's params: a request's VAE)."""
        params = self.params_for(pipeline, images[0]) if self.params_for is not None else None
        return partial.decode_latents(pipeline, latents, params)

    def _should_stop(self, status: BatchStatus, beat: bool = True) -> bool:
        if beat:
            status.heartbeat = time.monotonic()
        return status.skip or all(job.cancelled is not None for job in status.jobs)

    def _maybe_finish(self, job: Job) -> None:
        if job.settled < len(job.images) or job.future.done():
            return
        self._jobs.pop(job.task_id, None)
        if job.cancelled not in (None, "interrupt"):  # timed out, disconnected or shut down: nobody waits
            return
        kept = [i for i, a in enumerate(job.arrays) if a is not None]
        stopped = "interrupt" if job.cancelled == "interrupt" else ("skip" if job.skipped else None)
        if kept:
            arrays = np.stack([job.arrays[i] for i in kept])
        else:
            im = job.images[0]
            arrays = np.zeros((0, im.height, im.width, 3), np.uint8)
        job.future.set_result(Outcome([job.images[i] for i in kept], arrays, stopped))

    def _fail(self, job: Job, error: Exception) -> None:
        self._drop_waiting(job)
        self._jobs.pop(job.task_id, None)
        if not job.future.done() and job.cancelled in (None, "interrupt"):
            job.future.set_exception(error)

    # ------------------------------------------------------------------ the worker side
    def _generate(self, pipeline: Any, images: list[ImageParameters], pad_to: int, should_stop, progress):
        """Runs on the worker thread: one `metadata.generate_images` call -> uint8 `(N, H, W, 3)`."""
        kwargs: dict[str, Any] = {}
        if self.supports_stop if pipeline is self.pipeline else accepts_should_stop(pipeline):
            kwargs["should_stop"] = should_stop
        params = self.params_for(pipeline, images[0]) if self.params_for is not None else None
        if params is not None:
            kwargs["params"] = params
        return generate_images(pipeline, images, pad_to=pad_to, progress=progress, **kwargs)

    def _on_progress(self, status: BatchStatus, stage: str, step: int, total: int, latents=None, **_: Any) -> None:
        status.heartbeat = time.monotonic()
        if stage != status.stage or step >= status.step:
            status.stage, status.step, status.total = stage, step, total
        if latents is not None:
            status.latents = latents


def _ignore_progress(*args, **kwargs) -> None:
    """Warm-up's progress callback: present (so the compiled program is the served one), ignored."""


def _why(status: BatchStatus) -> str:
    if status.skip:
        return "skipped"
    return ", ".join(sorted({str(j.cancelled) for j in status.jobs}))


def _powers_of_two(n: int) -> list[int]:
    return [2**k for k in range(int(math.log2(n)) + 1)] if n >= 1 else [1]
