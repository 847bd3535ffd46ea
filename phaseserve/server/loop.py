"""The engine loop: one thread owns the engine and the HTTP layer never blocks it.

::

    HTTP handlers (asyncio)                     engine-loop thread
    ---------------------------                 -----------------------------------------------------
    loop.submit(req) -> Handle  --inbox-->      backend.submit(req)         (validated there; typed errors)
    loop.cancel(id)             --inbox-->      backend.cancel(id)          (pages released at once)
    await handle.get()  <--call_soon_threadsafe--  after each backend.advance(): new tokens, the finish
                                                (one call per iteration for all requests; a handler that is
                                                behind gets every token since its last get in one Update);
                                                and inside an engine step, between its prefill and its decode:
                                                new requests' first tokens, a decode step sooner

Every request in flight, from every HTTP client, is in the same engine, so continuous batching works across
clients. The loop reads each request's progress off its :class:`~phaseserve.RequestOutput` (tokens appended,
``finish_reason`` set), which the engine updates in place. :class:`EngineBackend` drives a
:class:`phaseserve.Engine` (colocated or disaggregated in process, or a :class:`phaseserve.distributed.RayEngine`
whose workers are Ray actors) by ``add_request`` / ``step`` / ``cancel``, and reports its ``health()``.

The backend also reports gauges and running totals (:meth:`EngineBackend.stats`) for ``/metrics``. When idle,
the engine backend starts a fresh measurement window (``Engine.reset_metrics``) so a long-running server does
not keep every finished output; the totals it reports carry over.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from phaseserve.engine import Request, RequestOutput

KEEP_FINISHED = 1024  # finished outputs a served engine keeps (Engine.keep_finished)
TOTALS = ("preemptions", "integrity_aborts", "nonfinite_errors", "prefix_lookup_pages", "prefix_hit_pages")


class EngineBackend:
    """An in-process :class:`phaseserve.Engine` driven one ``step`` at a time."""

    def __init__(self, engine: Any):
        self.engine = engine
        engine.keep_finished = min(engine.keep_finished, KEEP_FINISHED)  # bounded under load, not only when idle
        self._carried = dict.fromkeys(TOTALS, 0)  # totals from measurement windows already reset
        self._busy = False

    @property
    def limits(self) -> Any:
        return self.engine.limits

    def submit(self, req: Request) -> RequestOutput:
        if not self._busy:  # a measurement window per busy period: summary() counts busy time only
            self.engine.metrics.begin()
            self._busy = True
        return self.engine.add_request(req)

    def cancel(self, rid: str) -> bool:
        return self.engine.cancel(rid)

    def health(self) -> str | None:
        """None while it can serve, else why not (``Engine.health``: a Ray engine names the actor that is down)."""
        return self.engine.health()

    @property
    def has_work(self) -> bool:
        return self.engine.has_work

    def advance(self, deliver: Callable[[], None] | None = None) -> None:
        """One engine step; ``deliver`` is called between its prefill and its decode (new requests' first tokens)."""
        self.engine.step(after_prefill=deliver)

    def idle(self) -> None:
        """Nothing in flight: close the measurement window and start a fresh one (totals carry over)."""
        if not self._busy:
            return
        self.engine.metrics.finish()
        self._busy = False
        if len(self.engine.outputs) > 1024:
            for k, v in self._totals().items():
                self._carried[k] += v
            self.engine.reset_metrics()

    def _totals(self) -> dict[str, int]:
        e = self.engine
        return {"preemptions": e.metrics.preemptions, "integrity_aborts": e.metrics.aborts,
                "nonfinite_errors": e.metrics.nonfinite,
                "prefix_lookup_pages": e.scheduler.lookup_pages, "prefix_hit_pages": e.scheduler.hit_pages}

    def stats(self) -> dict[str, float]:
        """Gauges now and totals since start: running / waiting requests, KV pages used / free, and :data:`TOTALS`."""
        e = self.engine
        free = e.allocator.num_free
        out = {"running": len(e.scheduler.running), "waiting": len(e.scheduler.waiting),
               "kv_pages_used": e.num_pages - 1 - free, "kv_pages_free": free}
        out.update({k: v + self._carried[k] for k, v in self._totals().items()})
        return out

    def close(self) -> None:
        self.engine.close()


@dataclass
class Update:
    """Everything that happened to one request since its handler last looked: new token ids, and on the last update
    the finished output (``done``) or why the loop itself stopped (``failed``)."""

    tokens: list[int]
    done: RequestOutput | None = None
    failed: BaseException | None = None

    @property
    def final(self) -> bool:
        return self.done is not None or self.failed is not None


@dataclass
class Handle:
    """One submitted request as the HTTP side sees it: ``await get()`` -> an :class:`Update` holding every token
    delivered since the previous ``get`` (a handler that falls behind gets them coalesced, not one wake-up each)."""

    request: Request
    aio: asyncio.AbstractEventLoop
    output: RequestOutput | None = None  # set by the loop thread on submission
    received: float = field(default_factory=time.perf_counter)  # when submit() queued it (its metrics' ``received``)
    sent: int = 0  # tokens handed over so far (loop thread only)
    stop_string: bool = False  # the HTTP side ended it at a stop string (then cancelled it in the engine)
    _pending: Update = field(default_factory=lambda: Update([]))  # event-loop thread only
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    async def get(self) -> Update:
        await self._ready.wait()
        self._ready.clear()
        up, self._pending = self._pending, Update([])
        return up

    def _add(self, tokens: list[int], done: RequestOutput | None = None, failed: BaseException | None = None) -> None:
        """Event-loop thread: merge a delivery into the pending update and wake the handler."""
        self._pending.tokens += tokens
        self._pending.done = done or self._pending.done
        self._pending.failed = failed or self._pending.failed
        self._ready.set()


class EngineLoop:
    """Runs ``backend`` in a thread; :meth:`submit` and :meth:`cancel` are safe from any thread.

    ``on_finish(handle)`` and ``on_step(stats)`` (optional) are called from the loop thread (metrics).
    ``stream_interval``: a request's tokens are handed over once at least this many are new (its first token, and its
    end, at once): 1 streams every token as it is made; more means fewer wake-ups and server-sent events per request
    (each costs CPU in the server and in the client), in bursts of that many tokens."""

    def __init__(self, backend: Any, on_finish=None, on_step=None, stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.backend, self.on_finish, self.on_step = backend, on_finish, on_step
        self.stream_interval = stream_interval
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[int, Handle] = {}  # by handle identity: two submissions of one id never collide
        self._calls: list[tuple] = []  # run_exclusive calls waiting for the backend to drain
        self._stop = threading.Event()
        self.error: BaseException | None = None  # what ended the loop thread, if anything did
        self._thread = threading.Thread(target=self._run, name="phaseserve-engine-loop", daemon=True)
        self._thread.start()

    # ---- any thread ---------------------------------------------------------------------------------------
    def submit(self, req: Request, aio: asyncio.AbstractEventLoop | None = None) -> Handle:
        h = Handle(request=req, aio=aio or asyncio.get_running_loop())
        self._inbox.put(("submit", h))
        return h

    def cancel(self, rid: str) -> None:
        self._inbox.put(("cancel", rid))

    def run_exclusive(self, fn) -> concurrent.futures.Future:
        """Run ``fn(backend)`` in the loop thread once nothing is in flight (no request is stepped meanwhile); e.g.
        an in-process measurement on the served engine. Returns a future of its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (fn, fut)))
        return fut

    @property
    def queued(self) -> int:
        """Items waiting in the inbox (submissions, cancels, calls) that the loop thread has not taken yet. While a
        :meth:`run_exclusive` call holds the loop, submissions wait here and are all admitted by its next
        iteration, before one engine step: a burst admitted together, whatever the arrival times."""
        return self._inbox.qsize()

    @property
    def native_id(self) -> int | None:
        """The loop thread's OS thread id (per-thread CPU accounting)."""
        return self._thread.native_id

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout_s)
        self.backend.close()

    # ---- the loop thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.backend.has_work or bool(self._active)
                self._drain(block=not busy)
                if self.backend.has_work:
                    self.backend.advance(self._deliver)  # first tokens handed over after the prefill, then the rest
                self._deliver()
                if not self.backend.has_work and not self._active:
                    self.backend.idle()
                    self._run_calls()
                if self.on_step is not None:
                    self.on_step(self.backend.stats())
        except BaseException as e:  # the loop itself broke (not one request): fail every waiter, say why
            self.error = e
            for h in self._active.values():
                h.aio.call_soon_threadsafe(h._add, [], None, e)
            raise

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                kind, arg = item
                if kind == "submit":
                    arg.output = self.backend.submit(arg.request)
                    arg.output.metrics.received = arg.received
                    self._active[id(arg)] = arg  # a refused duplicate id gets its own error, not the first's slot
                elif kind == "cancel":
                    self.backend.cancel(arg)
                elif kind == "call":
                    self._calls.append(arg)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _run_calls(self) -> None:
        calls, self._calls = self._calls, []
        for fn, fut in calls:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.backend))
                except Exception as e:
                    fut.set_exception(e)

    def _deliver(self) -> None:
        """Hand new tokens and finishes to the handlers: one wake-up per event loop per iteration, not per request."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for key, h in list(self._active.items()):
            out = h.output
            n = len(out.tokens)
            done = out if out.finish_reason is not None else None
            if done is None and (n == h.sent or 0 < h.sent and n - h.sent < self.stream_interval):
                continue
            batches.setdefault(h.aio, []).append((h, list(out.tokens[h.sent:n]), done))
            h.sent = n
            if done is not None:
                if out.metrics.finished is None:
                    out.metrics.finished = time.perf_counter()
                del self._active[key]
                if self.on_finish is not None:
                    self.on_finish(h)
        for aio, items in batches.items():
            aio.call_soon_threadsafe(_add_all, items)


def _add_all(items: list[tuple[Handle, list[int], RequestOutput | None]]) -> None:
    for h, tokens, done in items:
        h._add(tokens, done)
