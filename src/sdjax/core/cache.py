"""The bounded cache of compiled programs (`Generator.cache`): executables kept least recently used first out,
beyond a count or a budget of generated-code bytes; evicted executables are freed. `compile_shared`: one executable
for the same program lowered twice in a process (two pipelines of one model), while either holds it."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading
import weakref
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    compiles: int = 0
    evictions: int = 0


class ProgramCache:
    """Compiled executables, least recently used out beyond `max_entries` or `max_bytes` of generated code."""

    def __init__(self, max_entries: int = 16, max_bytes: int | None = None):
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries} must be at least 1")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.stats = CacheStats()
        # key -> (value, ((executable, its generated code bytes), ...)): sizes measured once, when built
        self._entries: collections.OrderedDict[Any, tuple[Any, tuple]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[Any, threading.Event] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def keys(self) -> list:
        with self._lock:
            return list(self._entries)

    @property
    def nbytes(self) -> int:
        """Generated code of the cached executables, each counted once (program pairs share decode executables)."""
        seen: dict[int, int] = {}
        for _, parts in self._entries.values():
            seen.update((id(exe), n) for exe, n in parts)
        return sum(seen.values())

    def get(self, key, build: Callable[[], Any]):
        """The executable for `key`, built (outside the lock; one builder per key) when missing."""
        while True:
            with self._lock:
                if key in self._entries:
                    self._entries.move_to_end(key)
                    self.stats.hits += 1
                    return self._entries[key][0]
                event = self._building.get(key)
                if event is None:
                    event = self._building[key] = threading.Event()
                    self.stats.misses += 1
                    break
            event.wait()
        try:
            value = build()
            exes = value if isinstance(value, tuple) else (value,)  # a split pair: (loop, decode)
            parts = tuple((exe, _code_bytes(exe)) for exe in exes if exe is not None)
            with self._lock:
                self.stats.compiles += 1
                self._entries[key] = (value, parts)
                self._evict()
            return value
        finally:
            with self._lock:
                self._building.pop(key, None)
            event.set()

    def _evict(self) -> None:
        evicted = False
        while len(self._entries) > self.max_entries or (
            self.max_bytes is not None and len(self._entries) > 1 and self.nbytes > self.max_bytes
        ):
            self._entries.popitem(last=False)
            self.stats.evictions += 1
            evicted = True
        if evicted:
            release_memory()

    def clear(self) -> None:
        with self._lock:
            self.stats.evictions += len(self._entries)
            self._entries.clear()


def release_memory() -> None:
    """Return freed heap pages to the system (glibc's `malloc_trim`): an evicted executable's memory is freed by
    XLA, but the allocator keeps most of it in its arenas otherwise (benchmarks/bench_compile_cache.py)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to do
        pass


def host_callback_count(lowered: Any) -> int | None:
    """How many Python callbacks `lowered` registered with its executable (io_callback, pure_callback,
    jax.debug.callback), from JAX's list of them; None where that internal is gone."""
    try:
        return len(lowered._lowering.compile_args["host_callbacks"])
    except (AttributeError, KeyError, TypeError):
        return None


def has_host_callbacks(lowered: Any, text: str | None = None) -> bool:
    """Whether `lowered` calls back into Python (io_callback, pure_callback, jax.debug.callback): from JAX's list of
    the lowering's callbacks, or (where that internal is gone) from the text, erring towards yes."""
    count = host_callback_count(lowered)
    if count is not None:
        return count > 0
    text = lowered.as_text() if text is None else text
    return "callback" in text or "stablehlo.send" in text or "stablehlo.recv" in text


def callback_sites(jaxpr: Any, accept: Callable[[Any], bool]) -> int | None:
    """The number of host-callback equations in `jaxpr` (a traced program's, with its sub-programs, each visited
    once) when `accept(function)` takes the Python function of every one of them; None when it refuses one, or an
    equation's function cannot be found. (`Generator` uses it to show that all its program's callbacks are its
    process-wide step dispatcher.)"""
    seen: set[int] = set()
    count = 0

    def sub_jaxprs(value):
        if hasattr(value, "eqns"):
            yield value
        elif hasattr(getattr(value, "jaxpr", None), "eqns"):
            yield value.jaxpr
        elif isinstance(value, (tuple, list)):
            for v in value:
                yield from sub_jaxprs(v)

    def walk(j) -> bool:
        nonlocal count
        if id(j) in seen:
            return True
        seen.add(id(j))
        for eqn in j.eqns:
            if "callback" in eqn.params or "callback" in eqn.primitive.name:
                function = getattr(eqn.params.get("callback"), "callback_func", None)
                if function is None or not accept(function):
                    return False
                count += 1
            for value in eqn.params.values():
                if not all(walk(sub) for sub in sub_jaxprs(value)):
                    return False
        return True

    return count if walk(getattr(jaxpr, "jaxpr", jaxpr)) else None


def _code_bytes(executable) -> int:
    try:
        analysis = executable.memory_analysis()
        return int(getattr(analysis, "generated_code_size_in_bytes", 0) or 0)
    except Exception:  # not every backend reports it
        return 0


# Executables by (program text, devices, JAX settings), held weakly: alive only while some cache (a pipeline's
# `ProgramCache`, a decoder table) holds them, so sharing never keeps an evicted executable's memory.
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def compile_shared(lowered: Any, devices: tuple, *, shared_callbacks: int = 0) -> Any:
    """`lowered.compile()`, or the executable of an identical lowering that this process compiled before and that
    is still alive: the same program text (StableHLO with its shapes, dtypes and shardings), on the same `devices`
    (ids in mesh order: the text names no device) under the same JAX settings. The same program runs, so no number
    changes; only the compile is saved (a second pipeline of one model, a CLI run beside the Python API's).

    The text names a host callback only by its position in the lowering's list, so two lowerings calling different
    Python functions print the same text, and a shared executable would call the other lowering's functions. A
    program with host callbacks is therefore shared only when the caller vouches for all of them:
    `shared_callbacks` is how many of its callbacks call a process-wide function, the same in every lowering
    (`callback_sites`; the generator's step dispatcher, which finds the run by the id the program is given), and
    it must be every callback JAX registered. Anything else (calibration's observers, a callback the caller did not
    count, a JAX without the list) compiles its own executable."""
    import jax

    text = lowered.as_text()
    if has_host_callbacks(lowered, text) and host_callback_count(lowered) != shared_callbacks:
        return lowered.compile()
    key = (hashlib.sha256(text.encode()).hexdigest(), len(text), devices, repr(sorted(jax.config.values.items())))
    with _SHARED_LOCK:
        compiled = _SHARED.get(key)
    if compiled is None:
        compiled = lowered.compile()
        with _SHARED_LOCK:
            _SHARED[key] = compiled
    return compiled
