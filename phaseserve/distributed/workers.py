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
(``max_restarts``) and a ping answers (:meth:`RemoteWorker.revive`); the decode worker then sends the full page
tag table with its next step (the restarted actor's tag mirror starts empty).
"""

from __future__ import annotations

import collections
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
from phaseserve.engine.workers import DecodeWorker, Launched, scrub_after_step


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
    """What both proxies share: the actor handle, calls that turn actor death into ``PeerDeadError``, liveness."""

    sharding = None  # payloads are descriptors, never device arrays here
    mesh = None
    params = None

    def __init__(self, phase: str, handle: Any, info: dict, *, transfer_timeout_s: float = 30.0):
        self.phase, self.handle, self.info = phase, handle, info
        self.incarnation = info["incarnation"]  # the actor incarnation whose pool this host half describes
        self.num_pages, self.page_size = info["num_pages"], info["page_size"]
        self.pool_dtype = info["pool_dtype"]
        self.allocator = PageAllocator(self.num_pages)
        self.transfer_timeout_s = transfer_timeout_s
        self.lost: Exception | None = None  # a death noticed and not yet handled by the engine
        self.down = False  # lost and handled (pool emptied here), until the restarted actor answers a ping
        self.deaths = 0
        self._ping: Any = None
        self._handoffs = 0

    # ---- calls ----------------------------------------------------------------------------------------------
    def _dead(self, why: str) -> PeerDeadError:
        if self.lost is None:
            self.lost = PeerDeadError(f"the {self.phase} actor died ({why})")
        return self.lost

    def call(self, method: str, *args: Any) -> Any:
        """``actor.method(*args)`` on the incarnation this host half knows, waited for. An actor death, or a
        restart since (another incarnation answers), raises ``PeerDeadError``; an error raised in the actor is
        re-raised as itself. While the worker is down (restarting), a call raises ``PeerDeadError`` at once."""
        if self.down:
            self.lost = self.lost or PeerDeadError(f"the {self.phase} actor is down (restarting)")
            raise self.lost
        try:
            return ray.get(self.handle.call.remote(self.incarnation, method, *args))
        except ray.exceptions.RayActorError as e:
            raise self._dead(type(e).__name__) from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, Exception) else e
            if isinstance(cause, PeerDeadError):
                raise self._dead(str(cause)) from None
            raise cause from None

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
        self.lost, self.down = None, True

    def probe(self, timeout_s: float = 0.0) -> bool:
        """Whether the actor is up, from a ping kept outstanding (waited up to ``timeout_s``; while it is pending,
        the last known state). A ping that fails, or a new incarnation while this one was believed up, marks the
        pool lost; a down worker is up again once its restarted incarnation answers."""
        if self._ping is None:
            self._ping = self.handle.ping.remote()
        ping = self._ping
        ready, _ = ray.wait([ping], timeout=timeout_s)
        if not ready:
            return not self.down and self.lost is None
        self._ping = None
        try:
            incarnation = ray.get(ping)
        except ray.exceptions.RayError as e:
            if not self.down:
                self._dead(type(e).__name__)
            return False
        if self.down:
            self.incarnation, self.down = incarnation, False
            self.on_revived()
        elif incarnation != self.incarnation:
            self._dead("restarted")
        return not self.down and self.lost is None

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
            self.call("pull_land", list(map(int, pages)), desc, self.transfer_timeout_s)
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

    def launch(self, group: list[Chunk]) -> Launched:
        """The actor's chunk step, waited for (the call returns host arrays): a :class:`Launched` already done."""
        return Launched(*self.call("run_batch", chunk_batch(self.tables, self.page_size, group)), rows=len(group))

    def shapes(self, max_rows: int, max_chunk: int, max_pages: int) -> list[tuple[int, int, int]]:
        return prefill_shapes(self.tables, self.page_size, self.max_prefill_tokens, max_rows, max_chunk, max_pages)

    def warm(self, b: int, c: int, w: int) -> None:
        self.call("run_batch", warm_chunk_batch(b, c, w))


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
