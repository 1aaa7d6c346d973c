"""Prometheus metrics of one server, in a registry of its own (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds: from a few milliseconds (the tiny model on CPU) to minutes (SDXL at many steps).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
FILL_BUCKETS = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)


class Metrics:
    """Requests, queue, batches and latency. `render()` is the `/metrics` body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, max_batch: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "sdjax_requests", "HTTP requests answered, by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "sdjax_request_latency_seconds",
            "Time from request to response, by endpoint",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("sdjax_requests_in_flight", "HTTP requests being answered", registry=r)
        self.queue_images = Gauge("sdjax_queue_depth_images", "Images waiting for a batch", registry=r)
        self.queue_requests = Gauge(
            "sdjax_queue_depth_requests", "Requests with images waiting for a batch", registry=r
        )
        self.rejected = Counter(
            "sdjax_rejected",
            "Requests turned away, by reason (queue_full, timeout, unauthorized, request_too_large, truncated_body, "
            "body_timeout, disconnected, over_budget)",
            ["reason"],
            registry=r,
        )
        self.cancelled = Counter(
            "sdjax_cancelled",
            "Requests whose work was cancelled, by reason (timeout, disconnect, interrupt, skip, shutdown)",
            ["reason"],
            registry=r,
        )
        self.stopped_batches = Counter(
            "sdjax_stopped_batches",
            "Batches stopped before their last step (every request in them cancelled)",
            registry=r,
        )
        self.batches = Counter("sdjax_batches", "Batches run by the pipeline", registry=r)
        self.batch_images = Histogram(
            "sdjax_batch_images", "Real images per batch", buckets=tuple(range(1, max_batch + 1)), registry=r
        )
        self.batch_fill = Histogram(
            "sdjax_batch_fill_ratio", "Real images / compiled batch size, per batch", buckets=FILL_BUCKETS, registry=r
        )
        self.batch_seconds = Histogram(
            "sdjax_batch_seconds", "Pipeline time per batch (compilation included)", buckets=LATENCY_BUCKETS, registry=r
        )
        self.images = Counter("sdjax_images_generated", "Images generated and returned to a request", registry=r)
        self.errors = Counter("sdjax_batch_errors", "Batches that raised in the pipeline", registry=r)
        self.ready = Gauge("sdjax_ready", "1 once start-up compilation is done and the server takes work", registry=r)
        self.warmup_seconds = Gauge("sdjax_warmup_seconds", "Time spent compiling at start-up", registry=r)
        self.programs = Gauge("sdjax_compiled_programs", "Compiled programs held by the generator's cache", registry=r)
        self.program_events = Gauge(
            "sdjax_program_cache",
            "The generator's compile cache since start: compiles, hits, evictions",
            ["event"],
            registry=r,
        )
        self._cache = None

    def watch_cache(self, cache) -> None:
        """Report this compile cache (`sdjax.core.ProgramCache`) in /metrics."""
        self._cache = cache

    def render(self) -> bytes:
        if self._cache is not None:
            self.programs.set(len(self._cache))
            for event in ("compiles", "hits", "evictions"):
                self.program_events.labels(event).set(getattr(self._cache.stats, event))
        return generate_latest(self.registry)
