"""Dynamic batching: concurrent requests of one compiled shape share one padded pipeline call.

One worker thread owns the pipeline (JAX releases the GIL while it computes, so the event loop stays
responsive). Requests wait on the event loop in a FIFO of jobs; a collector coroutine takes the oldest job's shape
(`ImageParameters.shape_key`), waits up to `window_s` from that job's arrival for more images of the same shape,
takes up to `max_batch` images in arrival order (a request's images may span batches) and pads the batch to the
smallest configured compiled size (`batch_sizes`) that holds it. Each image has its own seed and fold-in index,
so its pixels do not depend on what it was batched with; results go back to the owning request by position.

The queue is bounded in images: a request that does not fit raises `QueueFull` with a retry estimate.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from sdjax.metadata import ImageParameters, generate_images
from sdjax.server.metrics import Metrics

log = logging.getLogger("sdjax.server")


class QueueFull(Exception):
    """The queue cannot take the request now; retry after `retry_after` seconds."""

    def __init__(self, queued: int, capacity: int, retry_after: int):
        super().__init__(f"the queue holds {queued} of {capacity} images; retry in about {retry_after} s")
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The server is draining and takes no new work."""


@dataclasses.dataclass(eq=False)
class Job:
    """One request's images; `images[next:]` are not yet in a batch."""

    task_id: str
    images: list[ImageParameters]
    future: asyncio.Future
    arrived: float
    arrays: list[np.ndarray | None] = dataclasses.field(default_factory=list)
    next: int = 0
    done: int = 0
    cancelled: bool = False

    @property
    def key(self):
        return self.images[0].shape_key

    @property
    def waiting(self) -> int:
        return len(self.images) - self.next


@dataclasses.dataclass
class BatchStatus:
    """What the worker is doing now (read by the progress endpoint)."""

    task_ids: tuple[str, ...]
    images: int
    padded_to: int
    started: float
    stage: str = "start"
    step: int = 0
    total: int = 0


def pick_batch_size(n: int, batch_sizes: Sequence[int]) -> int:
    """The smallest compiled batch size holding `n` images."""
    for size in sorted(batch_sizes):
        if size >= n:
            return size
    raise ValueError(f"{n} images exceed the largest compiled batch size {max(batch_sizes)}")


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
        warm_shapes: Sequence[tuple[int, int, int, str]] = (),
        progress: bool = True,
    ):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be at least 1")
        self.pipeline = pipeline
        self.metrics = metrics
        self.max_batch = max_batch
        self.batch_sizes = tuple(sorted(set(batch_sizes or _powers_of_two(max_batch)) | {max_batch}))
        if self.batch_sizes[-1] > max_batch or self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes={self.batch_sizes} must lie in 1..max_batch={max_batch}")
        self.window_s = window_s
        self.max_queue_images = max_queue_images
        self.warm_shapes = tuple(warm_shapes)
        self.use_progress = progress
        self.ready = False
        self.stopping = False
        self.current: BatchStatus | None = None
        self.batch_seconds_ema: float | None = None
        self._pending: collections.deque[Job] = collections.deque()
        self._jobs: dict[str, Job] = {}  # task id -> job, while queued or running
        self._queued_images = 0
        self._ids = itertools.count()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="sdjax-pipeline")
        self._wakeup: asyncio.Event | None = None
        self._collector: asyncio.Task | None = None
        self._warmup: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._wakeup = asyncio.Event()
        self._warmup = asyncio.create_task(self._run_warmup())
        self._collector = asyncio.create_task(self._collect())

    async def stop(self, timeout_s: float = 30.0) -> None:
        """Finish queued and running work (up to `timeout_s`), then stop the worker."""
        self.stopping = True
        if self._warmup is not None and not self._warmup.done():
            self._warmup.cancel()  # a compilation already running finishes on the worker thread, unwaited
        if self._wakeup is not None:
            self._wakeup.set()
        if self._collector is not None:
            try:
                await asyncio.wait_for(self._collector, timeout_s)
            except (TimeoutError, asyncio.CancelledError):
                self._collector.cancel()
        for job in list(self._jobs.values()):
            if not job.future.done():
                job.future.set_exception(ShuttingDown("the server stopped before this request ran"))
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run_warmup(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        for steps, height, width, sampler in self.warm_shapes:
            for size in self.batch_sizes:
                if self.stopping:
                    return
                log.info("compiling batch %d, %dx%d, %d steps, sampler %s", size, width, height, steps, sampler)
                try:
                    await loop.run_in_executor(
                        self._executor, self.pipeline.warmup, size, height, width, steps, sampler
                    )
                except Exception:  # a failed warm-up is logged; requests of that shape report their own error
                    log.exception("warm-up failed for batch %d %dx%d", size, width, height)
        self.metrics.warmup_seconds.set(time.perf_counter() - t0)
        self.ready = True
        self.metrics.ready.set(1)
        log.info("ready: warm-up took %.1f s", time.perf_counter() - t0)

    # ------------------------------------------------------------------ the request side
    @property
    def queued_images(self) -> int:
        return self._queued_images

    def retry_after(self) -> int:
        per_batch = self.batch_seconds_ema or 1.0
        return max(1, math.ceil((self._queued_images / self.max_batch + 1) * per_batch))

    def submit(self, images: list[ImageParameters], task_id: str | None = None) -> Job:
        """Queue a request's images (all of one shape); await `job.future` for `(N, H, W, 3)` uint8."""
        if self.stopping:
            raise ShuttingDown("the server is shutting down")
        if not images:
            raise ValueError("a request needs at least one image")
        if len({im.shape_key for im in images}) != 1:
            raise ValueError("a request's images must share steps, size and sampler")
        n = len(images)
        if self._queued_images + n > self.max_queue_images:
            raise QueueFull(self._queued_images, self.max_queue_images, self.retry_after())
        task_id = task_id or f"task-{next(self._ids)}"
        if task_id in self._jobs:
            task_id = f"{task_id}-{next(self._ids)}"
        job = Job(task_id, list(images), asyncio.get_running_loop().create_future(), time.monotonic(), [None] * n)
        self._pending.append(job)
        self._jobs[task_id] = job
        self._queued_images += n
        self._update_queue_metrics()
        self._wakeup.set()
        return job

    def cancel(self, job: Job) -> None:
        """Drop a job's images that are not yet in a batch (after a timeout); a running batch still finishes."""
        job.cancelled = True
        self._queued_images -= job.waiting
        job.next = len(job.images)
        self._jobs.pop(job.task_id, None)
        if job in self._pending:
            self._pending.remove(job)
        self._update_queue_metrics()

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
        self._update_queue_metrics()
        return slots

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
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
            slots = self._take(head.key)
            await self._run_batch(loop, slots)

    async def _run_batch(self, loop, slots: list[tuple[Job, int]]) -> None:
        images = [job.images[i] for job, i in slots]
        pad_to = pick_batch_size(len(images), self.batch_sizes)
        jobs = list(dict.fromkeys(job for job, _ in slots))
        self.current = BatchStatus(tuple(j.task_id for j in jobs), len(images), pad_to, time.monotonic())
        t0 = time.perf_counter()
        try:
            arrays = await loop.run_in_executor(self._executor, self._generate, images, pad_to)
        except Exception as e:  # the pipeline failed: fail these requests, keep serving
            log.exception("batch of %d images failed", len(images))
            self.metrics.errors.inc()
            for job in jobs:
                self._finish(job, error=e)
            return
        finally:
            self.current = None
        dt = time.perf_counter() - t0
        self.batch_seconds_ema = dt if self.batch_seconds_ema is None else 0.8 * self.batch_seconds_ema + 0.2 * dt
        self.metrics.batches.inc()
        self.metrics.batch_images.observe(len(images))
        self.metrics.batch_fill.observe(len(images) / pad_to)
        self.metrics.batch_seconds.observe(dt)
        for (job, i), array in zip(slots, arrays):
            job.arrays[i] = array
            job.done += 1
        for job in jobs:
            if job.done == len(job.images):
                self._finish(job)

    def _finish(self, job: Job, error: Exception | None = None) -> None:
        self._jobs.pop(job.task_id, None)
        if job.cancelled or job.future.done():  # timed out earlier: nobody waits for it
            return
        if error is not None and job.waiting:
            self.cancel(job)
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(np.stack(job.arrays))

    def _generate(self, images: list[ImageParameters], pad_to: int) -> np.ndarray:
        """Runs on the worker thread."""
        return generate_images(
            self.pipeline, images, pad_to=pad_to, progress=self._on_progress if self.use_progress else None
        )

    def _on_progress(self, stage: str, step: int, total: int) -> None:
        current = self.current
        if current is not None and (stage != current.stage or step >= current.step):
            current.stage, current.step, current.total = stage, step, total


def _powers_of_two(n: int) -> list[int]:
    return [2**k for k in range(int(math.log2(n)) + 1)] if n >= 1 else [1]
