"""The actor side of distributed serving: one phase's devices, weights, page pool and KV transfer endpoint.

A :class:`PhaseActor` runs in its own process (a Ray actor; ``phaseserve.distributed.engine`` starts it with the
phase's device count in its environment) and holds the *device half* of one engine worker
(:func:`~phaseserve.engine.workers.build_prefill` / :func:`~phaseserve.engine.workers.build_decode`): the jitted
steps, the pool, the weights in the phase's representation. It keeps no scheduling state -- page tables,
allocators, admission and the finish rule stay in the engine -- so its methods take arrays and page ids only:

- ``run_batch``: one jitted chunk step (prefill) or one integrity-checked decode step (decode; the engine's page
  tag changes come with the call and are pushed to the device tag mirror first);
- ``stage``: export pages (quantized to the receiver's storage dtype) into a tag-checked
  :class:`~phaseserve.distributed.transfer.StagingArea` and return the :class:`TransferDescriptor` naming them;
  ``arm``: verify a descriptor and arm its pull; ``release``: free a staged entry;
- ``pull_land``: pull a peer's staged KV over ``jax.experimental.transfer`` into fresh buffers (a deadline polled
  with ``is_ready()``, never blocking on an unready array) and write it into pages of this pool.

KV never passes through Ray: only descriptors, token ids and page ids do. Its transfer server listens behind a
:class:`~phaseserve.distributed.gate.TransferGate` (``gate``, the default): peers must prove the deployment's
secret before a byte reaches the jax server, whose raw port dies of some malformed frames.

Two methods run on the actor's ``health`` thread (a Ray concurrency group), beside whatever call is running:
``ping`` (the engine's heartbeat) and ``abandon_pull`` (the engine saw a pull's source die or hang: the pull in
progress gives up at once instead of at its deadline).
"""

from __future__ import annotations

import collections
import os
import random
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from phaseserve.config import ServeConfig
from phaseserve.distributed.protocol import (
    ModelSource,
    PeerDeadError,
    TransferDescriptor,
    TransferError,
    TransferTimeoutError,
)
from phaseserve.distributed.transfer import Puller, StagingArea, start_endpoint
from phaseserve.engine.handoff import export_pages, join_chunks, split_chunks
from phaseserve.engine.workers import build_decode, build_prefill, prefill_params
from phaseserve.sharding import make_mesh

PHASES = ("prefill", "decode")
CALLS = frozenset({"info", "kernels", "snapshot", "pool_ok", "reset_pool", "run_batch", "warm_tags", "scrub",
                   "swap_out", "swap_in", "copy_pages", "stage", "arm", "release", "pull_land"})


class PhaseActor:
    """One phase's device half (see the module docstring); ``phase``: ``"prefill"`` or ``"decode"``."""

    def __init__(self, phase: str, model: ModelSource, serve: ServeConfig, *, decode_pages: int | None = None,
                 attn_impl: str = "auto", matmul_impl: str = "auto", bind: str | None = "127.0.0.1",
                 staging_pages: int = 4096, staging_ttl_s: float = 120.0, gate: bool = True):
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self.phase, self.serve = phase, serve
        cfg, params = model.load()
        devices = jax.local_devices()
        m = serve.mesh
        if phase == "decode":
            self.worker = build_decode(cfg, params, serve, devices[: m.decode_tp * m.decode_ep],
                                       attn_impl=attn_impl, matmul_impl=matmul_impl)
        else:
            mesh = make_mesh(devices[: m.prefill_tp], tp=m.prefill_tp)
            self.worker = build_prefill(cfg, prefill_params(cfg, params, serve, mesh), serve, mesh, decode_pages,
                                        attn_impl=attn_impl, matmul_impl=matmul_impl)
        # what this pool receives (a payload in its own storage dtype): the tree the pulled flat leaves form
        self._tree = jax.tree.structure(jax.eval_shape(
            lambda pool: export_pages(pool, jnp.zeros(1, jnp.int32), self.worker.pool_dtype), self.worker.pool))
        self.device = devices[0]
        self.endpoint = start_endpoint(bind or _node_ip(), self.device, gate=gate)  # None: the node's Ray address
        self.staging = StagingArea(self.endpoint, staging_pages, serve.cache.page_size, staging_ttl_s)
        self.puller = Puller(self.endpoint, self.device)
        self.stats = collections.Counter()
        self.incarnation = random.getrandbits(63)  # a restarted actor is a new incarnation with an empty pool
        self._pulling: int | None = None  # the uuid pull_land is waiting for
        self._abandon: int | None = None  # the uuid the engine asked to give up (set on the health thread)

    def call(self, incarnation: int, method: str, *args: Any) -> Any:
        """The engine's one entry point: ``method(*args)`` if the caller's state is about this incarnation (else
        ``PeerDeadError``: the actor was restarted since, and the pool the caller's page tables describe is
        gone)."""
        if incarnation != self.incarnation:
            raise PeerDeadError(f"the {self.phase} actor was restarted (incarnation {self.incarnation:x}, the "
                                f"engine knew {incarnation:x})")
        if method not in CALLS:
            raise ValueError(f"{method!r} is not a PhaseActor call")
        return getattr(self, method)(*args)

    # ---- status ---------------------------------------------------------------------------------------------
    def info(self) -> dict:
        w = self.worker
        return dict(phase=self.phase, incarnation=self.incarnation, num_pages=w.num_pages, page_size=w.page_size,
                    pool_dtype=w.pool_dtype, address=self.staging.address, pid=os.getpid(),
                    node_id=_node_id(), devices=[str(d) for d in jax.local_devices()])

    def ping(self) -> int:
        """This incarnation's id."""
        return self.incarnation

    def abandon_pull(self, uuid: int) -> bool:
        """Give up the pull of ``uuid`` (its source died or hung): at once if it is in progress (True), as soon as it
        starts if it has not (uuids are never reused)."""
        self._abandon = uuid
        return self._pulling == uuid

    def kernels(self) -> collections.Counter:
        return self.worker.kernels

    def snapshot(self) -> dict:
        """Counters: staged entries and pages, refusals by kind, expired entries, transfers."""
        self.staging.expire()
        gate = getattr(self.endpoint, "gate", None)
        return dict(self.stats, staged=len(self.staging.entries), staging_pages_in_use=self.staging.pages_in_use,
                    refused=dict(self.staging.refused), expired=self.staging.expired,
                    pool_pages=self.worker.num_pages, port=gate.snapshot() if gate is not None else None)

    def pool_ok(self) -> bool:
        return self.worker.pool_ok()

    def reset_pool(self) -> None:
        self.worker.reset_pool()

    # ---- steps ----------------------------------------------------------------------------------------------
    def run_batch(self, batch: Any, check: tuple | None = None, ids: list[str] | None = None,
                  tags: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
        """Prefill: ``run_batch(ChunkBatch)`` -> (first tokens i32[B], logprob arrays or None, prompt logprob arrays
        or None). Decode: ``run_batch(DecodeBatch, check, ids, tags)`` -> (next tokens i32[B], failures by id, device
        seconds, logprob arrays or None), after pushing ``tags`` (pages i32[n],
        tags u32[n]: the engine allocator's changes since the last step) to the device tag mirror."""
        if self.phase == "prefill":
            return self.worker.run_batch(batch)
        if tags is not None:
            self.worker.tracker.push(*tags)
        return self.worker.run_batch(batch, check, ids)

    def scrub(self, pages: list[int]) -> None:
        self.worker.scrub(pages)

    def warm_tags(self) -> int:
        return self.worker.warm_tags()

    def swap_out(self, pages: list[int]) -> tuple[int, Any]:
        return self.worker.swap_out(pages)

    def swap_in(self, pages: list[int], host: tuple[int, Any]) -> None:
        self.worker.swap_in(pages, host)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.worker.copy_pages(src, dst)

    # ---- KV transfer ----------------------------------------------------------------------------------------
    def stage(self, pages: list[int], dtype: str | None, request_id: str) -> TransferDescriptor:
        """Export ``pages`` (prefill: to the decode storage dtype; decode: to ``dtype``) and stage them for a pull;
        the descriptor naming them. Raises ``TransferError`` while the staging area is full."""
        chunks = self.worker.export(pages) if self.phase == "prefill" else self.worker.export(pages, dtype)
        leaves = [jax.device_put(x[0], self.device) for x in jax.tree.leaves(join_chunks(chunks))]  # [T, ...]
        desc = self.staging.stage(request_id, leaves, len(pages) * self.worker.page_size,
                                  str(dtype or self.worker.export_dtype))
        if desc is None:
            raise TransferError(f"the {self.phase} staging area is full ({self.staging.pages_in_use} pages)")
        self.stats["staged"] += 1
        return desc

    def arm(self, desc: TransferDescriptor, requester: str) -> None:
        """Verify ``desc`` against what was staged and arm its pull (``StaleDescriptorError`` if it does not
        match: nothing is armed then)."""
        self.staging.serve(desc, requester)

    def release(self, uuid: int) -> bool:
        self.staging.expire()
        return self.staging.release(uuid)

    def pull_land(self, pages: list[int], desc: TransferDescriptor, timeout_s: float) -> int:
        """Pull an armed descriptor's KV from its peer and write it into ``pages`` of this pool; the bytes pulled.
        ``TransferTimeoutError`` if it has not landed within ``timeout_s`` (its buffers are then never written),
        ``TransferError`` if the pulled buffers carry an error or do not fit."""
        t0 = time.monotonic()
        self._pulling = desc.uuid
        try:
            arrays = self.puller.pull(desc)
            while not all(x.is_ready() for x in arrays):
                if self._abandon == desc.uuid:
                    self.stats["abandoned"] += 1
                    self.puller.forget(desc.address)
                    raise TransferError(f"KV transfer {desc.uuid} from {desc.address} abandoned: its source died "
                                        f"or stopped answering")
                if time.monotonic() - t0 > timeout_s:
                    self.stats["timeouts"] += 1
                    self.puller.forget(desc.address)
                    raise TransferTimeoutError(f"KV transfer {desc.uuid} from {desc.address} did not land in "
                                               f"{timeout_s:.1f}s")
                time.sleep(0.0005)
        finally:
            self._pulling = None
        try:
            jax.block_until_ready(arrays)  # raises if the pull errored (the peer died mid-pull)
            kv = jax.tree.unflatten(self._tree, jax.device_put([x[None] for x in arrays], self.worker.sharding))
            self.worker.land(pages, split_chunks(kv, self.worker.page_size))
            self.worker.block()
        except Exception as e:
            self.stats["transfer_errors"] += 1
            self.puller.forget(desc.address)
            raise TransferError(f"KV transfer {desc.uuid} into the {self.phase} pool failed: {e!r:.300}") from None
        self.stats["transfers"] += 1
        self.stats["seconds"] += time.monotonic() - t0
        return desc.nbytes


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:
        return None
