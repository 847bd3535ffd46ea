"""A jitted step's executables by padded shape, compiled off the serving path.

The engine pads every prefill group and decode batch to a bucketed shape, and a jitted step compiles once per
shape: seconds on a CPU, and every request in flight waits for it when a shape is first met while serving.
:class:`ShapeCache` keeps each shape's ahead-of-time compiled executable (``jit(...).lower(...).compile()``). A
shape met for the first time runs on the smallest ready shape that covers it (at least as large in every padded
dimension; the batch is padded further, which changes no valid row's result) while a background thread compiles
the exact shape from abstract arguments; later calls use it once it is ready. Only when no ready shape covers it
does the caller compile it in place, as before. ``Engine.warm_up`` compiles shapes in place (``exact``), so a
warmed server never compiles while serving.

    cache = ShapeCache(step, "prefill")
    use = cache.choose(key, abstract)   # key itself, or a ready cover (``abstract(key)`` queued for compiling)
    exe = cache.executable(use, concrete_args)   # compiled in place when ``use`` is not ready

Counters (``stats``): ``exact`` (a ready executable of the shape), ``cover`` (ran on a larger ready shape),
``inline`` (compiled in the caller), ``background`` (compiled by the background thread), ``cover_at_limit``
(covered, its own compile not queued: see below).

The kernel's memory-map limit (:func:`memory_map_use`): every CPU executable holds hundreds of memory maps, and a
process past Linux's ``vm.max_map_count`` segfaults in its next compile. From :data:`MAP_USE_STOP` of the limit a
covered shape keeps running on its cover (no background compile), and from :data:`MAP_USE_REFUSE` a shape that
must compile in the caller raises :class:`CompileLimitError` instead (the engine ends the requests of that batch
with it, narrowing a failed batch down to single requests, and serves the rest).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

Key = tuple[int, ...]
MAP_USE_STOP = 0.8  # warm-up stops, and covered shapes stop queueing their own compile, at this share of the limit
MAP_USE_REFUSE = 0.95  # a compile in the caller is refused (CompileLimitError) from this share of the limit


class CompileLimitError(RuntimeError):
    """A shape had to be compiled while the process held most of the kernel's memory-map limit (``vm.max_map_count``):
    the compile would crash the process. Raise the limit (``sysctl -w vm.max_map_count=262144``) or serve with
    fewer compiled shapes (a smaller ``max_batch``, ``max_prefill_tokens`` or context)."""


def memory_map_use() -> float | None:
    """The fraction of the kernel's per-process limit on memory maps (Linux ``vm.max_map_count``, 65,530 by default)
    this process holds; None where it cannot be read. Each CPU executable XLA loads maps its kernels one by one:
    ~400-470 maps per prefill shape of the race's 4-layer model (measured on 2026-12-06), so about 140 compiled shapes
    reach the default limit, and the next compile fails in LLVM ("Cannot allocate memory") and the process segfaults.
    (Three maps per compiled kernel: code, read-only data, data.)"""
    held = memory_maps()
    return held[0] / held[1] if held is not None and held[1] > 0 else None


def memory_maps() -> tuple[int, int] | None:
    """(memory maps this process holds, the kernel's per-process limit ``vm.max_map_count``); None where Linux's
    ``/proc`` cannot be read."""
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f), limit
    except (OSError, ValueError):
        return None


class ShapeCache:
    """Compiled executables of one jitted ``step`` by padded-shape key (a tuple of ints, larger = more padding)."""

    def __init__(self, step: Any, name: str, background: bool = True):
        self.step, self.name = step, name
        self._ready: dict[Key, Any] = {}
        self._pending: set[Key] = set()
        self._lock = threading.Lock()
        self._compiling: dict[Key, threading.Lock] = {}  # a key's in-caller compile (replicas share one cache)
        self._pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"phaseserve-compile-{name}")
                      if background else None)
        self.stats: collections.Counter = collections.Counter()
        self._capped: set[Key] = set()  # shapes met at MAP_USE_STOP: they run on their cover for good
        self.errors: dict[Key, BaseException] = {}  # background compiles that raised: the key then compiles in the
        # caller when next met (so its error reaches the request that needs it), never again in the background

    def ready(self, key: Key) -> bool:
        return key in self._ready

    def cover(self, key: Key) -> Key | None:
        """The ready shape with every dimension >= ``key``'s and the fewest padded elements, or None."""
        covers = [k for k in list(self._ready)
                  if len(k) == len(key) and all(a >= b for a, b in zip(k, key, strict=True))]
        return min(covers, key=lambda k: (int(np.prod(k)), k)) if covers else None

    def choose(self, key: Key, abstract: Callable[[Key], tuple]) -> Key:
        """The shape to run ``key``'s batch at: ``key`` when ready (or when nothing covers it: the caller compiles
        it), else its cover, with ``key`` queued for the background thread (``abstract(key)``: the step's
        arguments as ``jax.ShapeDtypeStruct`` trees, built now, in the caller)."""
        if key in self._ready or key in self.errors or self._pool is None:
            return key
        cover = self.cover(key)
        if cover is None:
            return key
        self.stats["cover" if self.compile_later(key, abstract) else "cover_at_limit"] += 1
        return cover

    def compile_later(self, key: Key, abstract: Callable[[Key], tuple]) -> bool:
        """Queue ``key``'s compile on the background thread (once); False, and never queued, from
        :data:`MAP_USE_STOP` of the map limit (or without a background thread, or after its compile failed)."""
        if key in self._ready or key in self.errors or self._pool is None:
            return False
        if key in self._capped or ((use := memory_map_use()) is not None and use >= MAP_USE_STOP):
            self._capped.add(key)  # read the maps once per key (a read of /proc/self/maps at the limit takes ms)
            return False
        with self._lock:
            queue = key not in self._pending
            self._pending.add(key)
        if queue:
            self._pool.submit(self._compile_later, key, abstract(key))
        return True

    def _compile_later(self, key: Key, args: tuple) -> None:
        try:
            exe = self.step.lower(*args).compile()
        except BaseException as e:  # noqa: BLE001 (recorded; the caller compiles the key in place when next met)
            self.errors[key] = e
        else:
            self._ready.setdefault(key, exe)
            self.stats["background"] += 1
        finally:
            with self._lock:
                self._pending.discard(key)

    def executable(self, key: Key, args: tuple) -> Any:
        """``key``'s executable; compiled here from the concrete ``args`` when not ready yet (CompileLimitError from
        :data:`MAP_USE_REFUSE` of the memory-map limit)."""
        exe = self._ready.get(key)
        if exe is not None:
            self.stats["exact"] += 1
            return exe
        with self._lock:
            key_lock = self._compiling.setdefault(key, threading.Lock())
        with key_lock:  # two threads meeting the same new shape compile it once
            exe = self._ready.get(key)
            if exe is not None:
                self.stats["exact"] += 1
                return exe
            if (use := memory_map_use()) is not None and use >= MAP_USE_REFUSE:
                raise CompileLimitError(f"the {self.name} step's shape {key} is not compiled, and this process holds "
                                        f"{use:.0%} of the kernel's memory-map limit (vm.max_map_count): compiling "
                                        "it would crash the process")
            exe = self.step.lower(*args).compile()
            self._ready[key] = exe
            self.stats["inline"] += 1
            return exe

    def wait(self) -> None:
        """Block until the queued background compiles are done (tests, benchmarks)."""
        if self._pool is not None:
            self._pool.submit(lambda: None).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def abstract(tree: Any) -> Any:
    """``jax.ShapeDtypeStruct`` leaves (with their shardings) for a tree of arrays: what ``lower`` needs, without
    holding the arrays (a donated pool may be gone by the time a background compile reads it)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=getattr(a, "sharding", None)),
                        tree)
