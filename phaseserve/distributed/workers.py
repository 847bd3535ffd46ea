"""Engine-side proxies of the phase workers: the host half here, the device half in a Ray actor.

:class:`RemotePrefill` and :class:`RemoteDecode` have the interface of the engine's ``PrefillWorker`` and
``DecodeWorker`` (``engine.workers``), so the one :class:`~phaseserve.engine.engine.Engine` drives them
unchanged. Each keeps this phase's page allocator and page tables in the engine's process (the scheduler admits,
grows, preempts and releases against them as in process) and builds each step's batch with the same functions the
local workers use (:func:`~phaseserve.engine.batches.chunk_batch`, :func:`~phaseserve.engine.batches.decode_inputs`,
:func:`~phaseserve.engine.workers.scrub_after_step`); only arrays and page ids go to the actor
(:class:`~phaseserve.distributed.actor.PhaseActor`).

A payload between the phases is a :class:`Staged` descriptor, not arrays: ``export`` stages the pages in the
source actor; ``land`` has the source verify and arm it, the destination actor pull it over
``jax.experimental.transfer`` and write it, then the source frees it.

Death. Any call that finds its actor dead (Ray's ``RayActorError``: ``ActorDiedError``, ``ActorUnavailableError``)
raises :class:`~phaseserve.distributed.protocol.PeerDeadError` and marks the pool lost (``pool_ok()`` False): the
engine then ends the requests whose KV was there (``Engine._pool_lost``: requeued when nothing was emitted yet,
since ``requeue_lost``), and ``reset_pool()`` marks the worker *down* until Ray has restarted the actor
(``max_restarts``) and a ping answers (:meth:`RemoteWorker.probe`); the decode worker then sends the full page
tag table with its next step (the restarted actor's tag mirror starts empty).

Hangs. Liveness comes from heartbeats: a ``ping`` kept outstanding, answered by the actor's own ``health`` thread
(a Ray concurrency group), so an actor busy in a long call -- a first compile, a big step -- still answers and one
whose process stopped (SIGSTOP, a wedged host) does not. A ping unanswered for ``heartbeat_timeout_s`` makes the
worker *not answering* (``RayEngine.health`` names it: ``/health`` 503) until it answers again. Every call is
bounded: its result is waited for in slices, and a call is abandoned as hung once the actor's heartbeat has been
silent for ``call_timeout_s`` (or the call has run ``max_call_s`` whatever the heartbeat says: a step that never
ends in a live process). A hung actor is then treated as dead -- killed, so that Ray restarts it with an empty
pool -- and the call raises ``PeerDeadError``: its requests end or are requeued as on a death. An actor that
stops answering for less than ``call_timeout_s`` (a pause, a stall) is waited for and resumes where it was.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from phaseserve.cache.allocator import PageAllocator, PageTables
from phaseserve.cache.integrity import KVIntegrityError
from phaseserve.distributed.protocol import PeerDeadError, TransferDescriptor
from phaseserve.engine.batches import chunk_batch, decode_inputs, warm_chunk_batch, warm_decode_inputs
from phaseserve.engine.request import Limits, Sequence
from phaseserve.engine.scheduler import Chunk
from phaseserve.engine.shapes import chunk_groups, decode_shapes, prefill_shapes
from phaseserve.engine.workers import DecodeWorker, scrub_after_step


@dataclass(frozen=True)
class Staged:
    """Pages staged in ``source``'s actor for a pull (the payload a remote ``export`` returns)."""

    source: RemoteWorker
    descriptor: TransferDescriptor

    @property
    def nbytes(self) -> int:
        return self.descriptor.nbytes


class RayHandoff:
    """The engine's handoff for remote workers: the payload is a :class:`Staged` descriptor (the KV crosses in
    ``RemoteWorker.land``); counts the bytes as the in-process handoff does."""

    def __init__(self) -> None:
        self.bytes_moved = 0

    def transfer(self, staged: Staged, dst: Any) -> Staged:
        self.bytes_moved += staged.nbytes
        return staged


class RemoteWorker:
    """What both proxies share: the actor handle, bounded calls that turn actor death (or a hang) into
    ``PeerDeadError``, liveness from heartbeats (module docstring)."""

    sharding = None  # payloads are descriptors, never device arrays here
    mesh = None
    params = None
    WAIT_SLICE_S = 0.25  # a call's result is waited for in slices this long, the heartbeat polled in between

    def __init__(self, phase: str, handle: Any, info: dict, *, transfer_timeout_s: float = 30.0,
                 call_timeout_s: float = 30.0, heartbeat_timeout_s: float = 2.0, max_call_s: float = 600.0):
        self.phase, self.handle, self.info = phase, handle, info
        self.incarnation = info["incarnation"]  # the actor incarnation whose pool this host half describes
        self.num_pages, self.page_size = info["num_pages"], info["page_size"]
        self.pool_dtype = info["pool_dtype"]
        self.allocator = PageAllocator(self.num_pages)
        self.transfer_timeout_s = transfer_timeout_s
        self.call_timeout_s, self.heartbeat_timeout_s, self.max_call_s = call_timeout_s, heartbeat_timeout_s, max_call_s
        self.lost: Exception | None = None  # a death noticed and not yet handled by the engine
        self.down = False  # lost and handled (pool emptied here), until the restarted actor answers a ping
        self.deaths = 0
        self.hangs = 0  # calls abandoned because the actor stopped answering (each killed it)
        self._lock = threading.Lock()  # the heartbeat state: probed from the engine loop and from /health
        self._ping: Any = None
        self._ping_sent = 0.0
        self._gone: int | None = None  # the incarnation last lost
        self._handoffs = 0

    # ---- calls ----------------------------------------------------------------------------------------------
    def _dead(self, why: str) -> PeerDeadError:
        if self.lost is None:
            self.lost = PeerDeadError(f"the {self.phase} actor died ({why})")
        return self.lost

    def call(self, method: str, *args: Any) -> Any:
        """``actor.method(*args)`` on the incarnation this host half knows, waited for (bounded: :meth:`wait`). An
        actor death, a restart since (another incarnation answers) or a hang raises ``PeerDeadError``; an error
        raised in the actor is re-raised as itself. While the worker is down (restarting), a call raises
        ``PeerDeadError`` at once."""
        return self.wait(self.submit(method, *args), method)

    def submit(self, method: str, *args: Any) -> Any:
        """Send ``actor.method(*args)`` (the ref of its result; :meth:`wait` for it); ``PeerDeadError`` at once while
        the worker is down (restarting)."""
        if self.down:
            self.lost = self.lost or PeerDeadError(f"the {self.phase} actor is down (restarting)")
            raise self.lost
        return self.handle.call.remote(self.incarnation, method, *args)

    def wait(self, ref: Any, what: str, peer: RemoteWorker | None = None, abandon: Any = None,
             since: float | None = None, incarnation: int | None = None) -> Any:
        """The result of the call ``ref`` to this actor. Waited for while the actor answers its heartbeat; once
        it has been silent for ``call_timeout_s``, or the call has run ``max_call_s``, the actor is killed as hung
        (Ray restarts it) and ``PeerDeadError`` raised. ``peer`` (a transfer's source) is watched too: once it
        died or hung, ``abandon()`` asks this actor to give the call up, which then ends soon (bounded the same).
        ``since``: when the call was sent (default: now); ``incarnation``: the one it was sent to (default: the
        current one; a call to an incarnation gone since raises ``PeerDeadError`` without touching the worker)."""
        t0 = time.monotonic() if since is None else since
        incarnation = self.incarnation if incarnation is None else incarnation
        while True:
            try:
                value = ray.get(ref, timeout=self.WAIT_SLICE_S)  # one call when it is done: no ray.wait first
            except ray.exceptions.GetTimeoutError:
                self._check_sent_to(incarnation, what)
                self._watch(what, t0)
                if peer is not None:
                    try:
                        peer._watch(what, None)
                    except PeerDeadError:
                        abandon()
                        peer = None
                continue
            except Exception as e:
                self._check_sent_to(incarnation, what)  # a failure about a pool handled already is not this one's
                raise self._sorted(e) from None
            self._check_sent_to(incarnation, what)  # nor a result (a hung incarnation resumed before its kill)
            return value

    def _check_sent_to(self, incarnation: int, what: str) -> None:
        if incarnation != self.incarnation or self.down:
            raise PeerDeadError(f"the {self.phase} actor this {what} was sent to is gone")

    def _watch(self, what: str, since: float | None) -> None:
        """Raise ``PeerDeadError`` if the actor died, or hung: silent for ``call_timeout_s``, or busy in one call
        (started at ``since``) for ``max_call_s`` -- then it is killed first, so that Ray restarts it."""
        self.probe(0)
        if self.lost is None:
            silent = self.silent_s()
            ran = 0.0 if since is None else time.monotonic() - since
            if silent <= self.call_timeout_s and ran <= self.max_call_s:
                return
            self.hangs += 1
            self._dead(f"hung: no heartbeat for {silent:.1f} s during {what}" if silent > self.call_timeout_s
                       else f"hung: {what} ran {ran:.1f} s")
            self.kill()
        raise self.lost

    def _sorted(self, e: Exception) -> Exception:
        """What a failed call raises here: actor death as ``PeerDeadError`` (the pool marked lost), an error the actor
        raised as itself."""
        if isinstance(e, ray.exceptions.RayActorError):
            return self._dead(type(e).__name__)
        if isinstance(e, ray.exceptions.RayTaskError):
            cause = e.cause if isinstance(e.cause, Exception) else e
            return self._dead(str(cause)) if isinstance(cause, PeerDeadError) else cause
        return e

    def pool_ok(self) -> bool:
        """False when the actor died, or (asked after a call raised) a failed call consumed its pool."""
        if self.lost is not None:
            return False
        try:
            return bool(self.call("pool_ok"))
        except PeerDeadError:
            return False

    @property
    def requeue_lost(self) -> bool:
        """A pool lost with its actor (not consumed by a failing call): the actor restarts, so the requests that
        emitted nothing are served again instead of failing (a request whose own step keeps failing is not)."""
        return self.lost is not None

    def reset_pool(self) -> None:
        """After the engine ended (or requeued) every request whose KV was in the pool: it is empty here; a lost
        actor's restarted incarnation starts empty too, and the worker is down until it answers (:meth:`probe`)."""
        if self.lost is None:  # a pool consumed by a failed call in a live actor: rebuild it there
            self.call("reset_pool")
            return
        if not self.down:
            self.deaths += 1
        with self._lock:
            self.lost, self.down = None, True
            self._gone = self.incarnation  # a hung one killed may still answer (resumed before Ray's kill lands)
            self._ping = None  # a fresh heartbeat for the restarted incarnation (the old one's may never answer)

    # ---- liveness -------------------------------------------------------------------------------------------
    def silent_s(self) -> float:
        """How long the outstanding heartbeat has gone unanswered (as of the last :meth:`probe`)."""
        ping = self._ping
        return 0.0 if ping is None else time.monotonic() - self._ping_sent

    def answering(self) -> bool:
        """The actor answered its heartbeat within ``heartbeat_timeout_s`` (as of the last :meth:`probe`)."""
        return self.silent_s() <= self.heartbeat_timeout_s

    def probe(self, timeout_s: float = 0.0) -> bool:
        """Whether the actor is up and answering, from a heartbeat ping kept outstanding (waited up to
        ``timeout_s``). A ping that fails, or a new incarnation while this one was believed up, marks the pool lost;
        a down worker is up again once its restarted incarnation answers. Safe from any thread."""
        with self._lock:
            if self._ping is None:
                self._ping = self.handle.ping.options(concurrency_group="health").remote()
                self._ping_sent = time.monotonic()
            ping = self._ping
        if ray.wait([ping], timeout=timeout_s)[0]:
            with self._lock:
                if self._ping is ping:
                    self._ping = None
                    self._answered(ping)
        return not self.down and self.lost is None and self.answering()

    def _answered(self, ping: Any) -> None:
        try:
            incarnation = ray.get(ping)
        except ray.exceptions.RayError as e:
            if not self.down:
                self._dead(type(e).__name__)
            return
        if self.down and incarnation == self._gone:
            return  # the lost incarnation itself (a hung actor resumed while Ray kills it): not a restart yet
        if self.down:
            self.incarnation, self.down = incarnation, False
            self.on_revived()
        elif incarnation != self.incarnation:
            self._dead("restarted")

    def state(self) -> str | None:
        """None while up and answering; else what is wrong, for ``/health`` (after a :meth:`probe`)."""
        if self.down or self.lost is not None:
            return "down"
        if not self.answering():
            return f"not answering (no heartbeat for {self.silent_s():.1f} s)"
        return None

    def on_revived(self) -> None:
        pass

    def block(self) -> None:
        pass  # every call waits for its result

    @property
    def kernels(self) -> collections.Counter:
        return self.call("kernels")

    def snapshot(self) -> dict:
        return self.call("snapshot")

    # ---- KV between the phases ------------------------------------------------------------------------------
    def export(self, pages: list[int], dtype: str | None = None) -> Staged:
        self._handoffs += 1
        rid = f"{self.phase}-{id(self):x}-{self._handoffs}"
        return Staged(self, self.call("stage", list(map(int, pages)), dtype, rid))

    def land(self, pages: list[int], staged: Staged) -> None:
        """Pull ``staged`` from its source actor into ``pages`` of this one's pool; the source frees it after
        (landed or not). The source's death raises from the source (its pool is the one lost)."""
        src, desc = staged.source, staged.descriptor
        try:
            src.call("arm", desc, desc.request_id)
            ref = self.submit("pull_land", list(map(int, pages)), desc, self.transfer_timeout_s)
            abandon = lambda: self.handle.abandon_pull.options(concurrency_group="health").remote(desc.uuid)  # noqa: E731
            try:
                self.wait(ref, "pull_land", peer=src, abandon=abandon)
            except Exception:
                if src.lost is not None:  # the source died or hung mid-pull: its pool is the one lost
                    raise src.lost from None
                raise
        finally:
            if src.lost is None:
                src.handle.release.remote(desc.uuid)  # fire and forget; the staging TTL frees it otherwise

    def scrub(self, pages: list[int]) -> None:
        if pages:
            self.call("scrub", list(map(int, pages)))

    def kill(self, no_restart: bool = False) -> None:
        ray.kill(self.handle, no_restart=no_restart)


class RemotePrefill(RemoteWorker):
    """The prefill worker's host half (its pool's allocator and page tables) over a prefill actor."""

    def __init__(self, handle: Any, info: dict, limits: Limits, max_prefill_tokens: int, **kw: Any):
        super().__init__("prefill", handle, info, **kw)
        self.max_prefill_tokens = max_prefill_tokens
        self.tables = PageTables(self.allocator, limits.max_pages)

    def groups(self, chunks: list[Chunk]) -> list[list[Chunk]]:
        return chunk_groups(chunks, self.max_prefill_tokens)

    def launch(self, group: list[Chunk]) -> RemoteLaunched:
        """The actor's chunk step, sent and not waited for: the engine decodes meanwhile (``overlap_prefill``) and
        takes its result once :meth:`RemoteLaunched.ready` (or waits for it: bounded, as every call)."""
        return RemoteLaunched(self, self.submit("run_batch", chunk_batch(self.tables, self.page_size, group)),
                              len(group))

    def shapes(self, max_rows: int, max_chunk: int, max_pages: int) -> list[tuple[int, int, int]]:
        return prefill_shapes(self.tables, self.page_size, self.max_prefill_tokens, max_rows, max_chunk, max_pages)

    def warm(self, b: int, c: int, w: int) -> None:
        self.call("run_batch", warm_chunk_batch(b, c, w))


class RemoteLaunched:
    """A chunk step in flight in the prefill actor (``Launched``'s interface: ``ready``, ``result``, ``rows``)."""

    def __init__(self, worker: RemotePrefill, ref: Any, rows: int):
        self.worker, self.ref, self.rows = worker, ref, rows
        self.incarnation, self.sent = worker.incarnation, time.monotonic()

    def ready(self) -> bool:
        """The step finished, or taking its result will raise at once (its actor died or hung, or was restarted)."""
        if ray.wait([self.ref], timeout=0)[0]:
            return True
        w = self.worker
        if self.incarnation != w.incarnation or w.down:
            return True
        try:
            w._watch("run_batch", self.sent)
        except PeerDeadError:
            return True
        return False

    def result(self) -> tuple[np.ndarray, tuple | None, tuple | None]:
        first, gen, prompt = self.worker.wait(self.ref, "run_batch", since=self.sent, incarnation=self.incarnation)
        return np.asarray(first)[: self.rows], gen, prompt


class RemoteTracker:
    """The engine's view of a remote decode worker's integrity tracker (the check runs in the actor)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled


class RemoteDecode(RemoteWorker):
    """The decode worker's host half (the decode cache's allocator and page tables) over a decode actor."""

    def __init__(self, handle: Any, info: dict, max_pages_per_seq: int, integrity: bool, **kw: Any):
        super().__init__("decode", handle, info, **kw)
        self.tables = PageTables(self.allocator, max_pages_per_seq)
        self.tracker = RemoteTracker(integrity)
        self._full_tags = False

    def on_revived(self) -> None:
        self._full_tags = True  # the restarted actor's tag mirror starts from zeros

    def _tag_updates(self) -> tuple[np.ndarray, np.ndarray]:
        pages, tags = self.allocator.drain_tag_updates()
        if self._full_tags:
            self._full_tags = False
            return np.arange(self.num_pages, dtype=np.int32), self.allocator.tags.copy()
        return pages, tags

    ahead_ids = None  # nothing is launched ahead of a remote call

    def step(self, rows: list[Sequence], lookahead: bool = False,
             ) -> tuple[np.ndarray, dict[str, KVIntegrityError], float, tuple | None]:
        """``DecodeWorker.step`` over the actor (one call per step; ``lookahead`` is not done: nothing is launched
        ahead of a remote call)."""
        batch, check = decode_inputs(self.tables, rows)
        nxt, failures, device_s, lps = self._run(batch, check, [s.id for s in rows])
        scrub_after_step(self, rows, nxt)
        return np.asarray(nxt)[: len(rows)], failures, device_s, lps

    def _run(self, batch: Any, check: tuple, ids: list[str]) -> tuple:
        try:
            return self.call("run_batch", batch, check, ids, self._tag_updates())
        except Exception:
            self._full_tags = True  # the drained tag changes may not have reached the actor's mirror
            raise

    def shapes(self, max_rows: int, max_pages: int) -> list[tuple[int, int]]:
        return decode_shapes(self.tables, max_rows, max_pages)

    def warm(self, b: int, w: int) -> None:
        self._run(*warm_decode_inputs(b, w), [])

    def warm_tags(self) -> int:
        return self.call("warm_tags")

    def swap_out(self, pages: list[int]) -> tuple[int, Any]:
        return self.call("swap_out", list(map(int, pages)))

    def swap_in(self, pages: list[int], host: tuple[int, Any]) -> None:
        self.call("swap_in", list(map(int, pages)), host)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.call("copy_pages", list(map(int, src)), list(map(int, dst)))

    swap_nbytes = staticmethod(DecodeWorker.swap_nbytes)
