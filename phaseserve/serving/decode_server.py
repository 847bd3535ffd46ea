"""The decode server process: pulls prompt KV into freshly allocated (FP8) pages and runs the decode batch.

One process, its own devices and mesh, its own copy of the weights in the *decode* representation, its own page
pool, allocator, page tables and integrity tracker (the in-process engine's ``DecodeWorker``). Per request::

    waiting  --(pages allocated: prompt + max_tokens, reserve policy; tags recorded in PageTables)-->
    requested  --("serve" to the prefill side; it verifies the descriptor and arms await_pull)-->
    pulling  --(connect(address).pull(uuid, avals): arrays land in fresh buffers; is_ready() polled)-->
    landed: scatter_prompts into the request's pages, ("release", uuid) to the prefill side  -->  running

Page safety. A request's pages are held from admission until its transfer is *done*: landed and scattered, or
refused, or abandoned at the deadline (its buffers are then never scattered). A cancel that arrives while the
transfer is in flight only marks the request; the pages go back to the free queue at completion, so they
cannot be reissued to another request while a write into them is still possible. Every allocation, landing and
release is logged with a timestamp (``events``) so tests can check that order from outside the process.

Failures end only the affected request: a refusal -> :class:`StaleDescriptorError`, a missed deadline (slow or
dead prefill peer) -> :class:`TransferTimeoutError`, a cancel -> ``CancelledError``, an integrity failure in the
decode step -> ``KVIntegrityError`` (as in the engine). The decode round is the engine's ``DecodeWorker.step``:
integrity check as a separate jitted launch, one jitted step for the whole running batch, then host bookkeeping.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from typing import Any

import jax
import numpy as np

from phaseserve.cache.paged import is_scaled
from phaseserve.config import canonical_dtype
from phaseserve.engine.request import CancelledError, InvalidParameterError, Request, RequestOutput
from phaseserve.engine.scheduler import Sequence
from phaseserve.engine.workers import DecodeWorker, stop_reason
from phaseserve.quant.policy import phase_policy
from phaseserve.quant.quantize import quantize_params
from phaseserve.serving.protocol import (
    ServerSpec,
    TransferDescriptor,
    TransferTimeoutError,
    error_tuple,
    exit_child,
    rebuild_error,
)
from phaseserve.serving.transfer import PendingPull, Puller, start_endpoint
from phaseserve.sharding import make_mesh, replicated, shard_params


class DecodeServer:
    def __init__(self, spec: ServerSpec, inbox: Any, router_q: Any):
        self.spec, self.inbox, self.router_q = spec, inbox, router_q
        serve, c = spec.serve, spec.serve.cache
        m = serve.mesh
        self.cfg, params = spec.model.load()
        devices = jax.local_devices()[: m.decode_tp * m.decode_ep]
        self.mesh = make_mesh(devices, tp=m.decode_tp, ep=m.decode_ep)
        self.params = shard_params(self.cfg, quantize_params(params, phase_policy(serve.quant, "decode")), self.mesh)
        self.kv_dtype = canonical_dtype(serve.quant.kv_dtype)
        if c.num_pages is None:
            raise ValueError("the decode server needs CacheConfig.num_pages")
        self.worker = DecodeWorker(self.cfg, self.params, self.mesh, kv_dtype=self.kv_dtype, num_pages=c.num_pages,
                                   page_size=c.page_size, max_pages_per_seq=c.max_pages_per_seq,
                                   integrity=c.integrity)
        self.allocator, self.tables, self.tracker = self.worker.allocator, self.worker.tables, self.worker.tracker
        self._rep = replicated(self.mesh)
        self.page_size, self.max_batch = c.page_size, serve.max_batch
        self.endpoint = start_endpoint(spec.bind, devices[0])
        self.puller = Puller(self.endpoint, devices[0])
        parts = 1 if self.cfg.is_mla else 2
        scaled = is_scaled(self.kv_dtype)
        self._kv_tree = jax.tree.structure([[(0, 0 if scaled else None) for _ in range(parts)]
                                            for _ in range(self.cfg.num_layers)])
        self.waiting: deque[tuple[Sequence, TransferDescriptor]] = deque()
        self.pulls: dict[str, tuple[Sequence, PendingPull]] = {}
        self.running: list[Sequence] = []
        self.events: list[tuple[float, str, str, tuple[int, ...]]] = []  # (time, kind, rid, pages)
        self.stats = dict(decode_steps=0, decode_tokens=0, decode_time=0.0, transfers=0, transfer_time=0.0,
                          bytes_pulled=0, valid_kv_tokens=0, aborts=0, timeouts=0, refusals=0, cancels=0)
        self._out: list[tuple[str, int]] = []
        self.alive = True

    @property
    def pool(self):
        """The decode page pool (device pytree), owned by the worker."""
        return self.worker.pool

    # ---- bookkeeping --------------------------------------------------------------------------------------
    def _log(self, kind: str, rid: str, pages=()) -> None:
        self.events.append((time.time(), kind, rid, tuple(int(p) for p in pages)))

    def _release(self, rid: str) -> None:
        if rid in self.tables:
            pages = self.tables.owned(rid)
            self.tables.release(rid)
            self._log("release", rid, pages)

    def _finish(self, seq: Sequence, reason: str, err: Exception | None = None) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq.id)
        if err is not None and not isinstance(err, CancelledError):
            self.stats["aborts"] += 1
        self._flush()  # a request's tokens always reach the router before its end
        self.router_q.put(("finished", seq.id, reason, error_tuple(err)))

    def _flush(self) -> None:
        if self._out:
            self.router_q.put(("tokens", self._out))
            self._out = []

    # ---- messages -----------------------------------------------------------------------------------------
    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "kv_ready":
            req, first, desc = msg[1], msg[2], msg[3]
            seq = Sequence(request=req, output=RequestOutput(id=req.id), tokens=list(req.prompt) + [first],
                           num_prompt=len(req.prompt))
            self.waiting.append((seq, desc))
        elif kind == "serve_reply":
            self._on_grant(msg[1], msg[2], rebuild_error(msg[3]))
        elif kind == "cancel":
            self._cancel(msg[1])
        elif kind == "stats":
            self.router_q.put(("stats", "decode", self.snapshot()))
        elif kind == "shutdown":
            self.alive = False

    def _cancel(self, rid: str) -> None:
        self.stats["cancels"] += 1
        for item in self.waiting:
            if item[0].id == rid:
                self.waiting.remove(item)
                return self._finish(item[0], "aborted", CancelledError(f"request {rid!r} was cancelled"))
        if rid in self.pulls:  # in flight: mark only; pages are released when the transfer is done
            self.pulls[rid][1].cancelled = True
            self._log("cancel", rid)
            return
        for seq in self.running:
            if seq.id == rid:
                return self._finish(seq, "aborted", CancelledError(f"request {rid!r} was cancelled"))

    def _on_grant(self, rid: str, uuid: int, err: Exception | None) -> None:
        item = self.pulls.get(rid)
        if item is None or item[1].descriptor.uuid != uuid or item[1].state != "requested":
            return  # a late reply for a transfer already abandoned
        seq, pull = item
        if err is not None:  # refused: nothing was armed, nothing can land; the pages go back now
            del self.pulls[rid]
            self.stats["refusals"] += 1
            self._log("refused", rid)
            self._finish(seq, "aborted", CancelledError(f"request {rid!r} was cancelled") if pull.cancelled else err)
            return
        pull.arrays = self.puller.pull(pull.descriptor)
        pull.state = "pulling"

    # ---- admission and transfers --------------------------------------------------------------------------
    def admit(self) -> None:
        while self.waiting and len(self.running) + len(self.pulls) < self.max_batch:
            seq, desc = self.waiting[0]
            req = seq.request
            need = -(-(len(req.prompt) + max(req.max_tokens, 2) - 1) // self.page_size)
            if need > min(self.allocator.num_pages - 1, self.tables.max_pages):
                self.waiting.popleft()
                self._finish(seq, "error", InvalidParameterError(f"request {req.id!r} needs {need} pages"))
                continue
            if self.allocator.num_free < need:
                return
            self.waiting.popleft()
            self.tables.add(req.id)
            pages = self.tables.allocate(req.id, need)
            self._log("alloc", req.id, pages)
            self.pulls[req.id] = (seq, PendingPull(desc, time.monotonic() + self.spec.transfer_timeout_s))
            self.router_q.put(("serve", req.id, desc))

    def _kvq(self, leaves: list) -> list:
        leaves = jax.device_put([x[None] for x in leaves], self._rep)
        return jax.tree.unflatten(self._kv_tree, leaves)

    def poll_transfers(self) -> None:
        now = time.monotonic()
        for rid in list(self.pulls):
            seq, pull = self.pulls[rid]
            if pull.state == "pulling" and pull.ready():
                del self.pulls[rid]
                self._land(seq, pull)
            elif pull.expired(now):  # abandoned: its buffers (if any) are never scattered, so pages are free to go
                del self.pulls[rid]
                self.stats["timeouts"] += 1
                self._log("timeout", rid)
                self.router_q.put(("release", pull.descriptor.uuid))
                err = (CancelledError(f"request {rid!r} was cancelled") if pull.cancelled else
                       TransferTimeoutError(f"KV transfer of {rid!r} ({pull.state}) missed its "
                                            f"{self.spec.transfer_timeout_s:.1f}s deadline"))
                self._finish(seq, "aborted", err)

    def _land(self, seq: Sequence, pull: PendingPull) -> None:
        desc = pull.descriptor
        self.stats["transfers"] += 1
        self.stats["transfer_time"] += time.monotonic() - pull.started
        self.stats["bytes_pulled"] += desc.nbytes
        self.stats["valid_kv_tokens"] += desc.length
        self.worker.land([seq.id], self._kvq(pull.arrays), np.asarray([desc.length], np.int32),
                         np.zeros(1, np.int32))
        jax.block_until_ready(self.worker.pool)  # the write has landed before anything else may touch these pages
        self._log("landed", seq.id)
        self.router_q.put(("release", desc.uuid))
        if pull.cancelled:
            self._finish(seq, "aborted", CancelledError(f"request {seq.id!r} was cancelled"))
        else:
            self.running.append(seq)

    # ---- decode -------------------------------------------------------------------------------------------
    def decode(self) -> None:
        t0 = time.perf_counter()
        rows = list(self.running)
        nxt, failures, _ = self.worker.step(rows)  # nonfinite rows' pages are scrubbed before it returns
        for i, s in enumerate(rows):
            err = failures.get(s.id)
            if err is not None:
                self._finish(s, "aborted", err)
                continue
            tok = int(nxt[i])
            s.tokens.append(tok)
            self._out.append((s.id, tok))
            reason = stop_reason(s.request, tok, s.num_generated, self.cfg.eos_token_ids)
            if reason:
                self._finish(s, reason)
        self.stats["decode_steps"] += 1
        self.stats["decode_tokens"] += len(rows) - len(failures)
        self.stats["decode_time"] += time.perf_counter() - t0

    def snapshot(self) -> dict:
        self.tables.check_invariants()
        return dict(self.stats, pages_in_use=self.allocator.num_used, num_pages=self.allocator.num_pages,
                    waiting=len(self.waiting), in_flight=len(self.pulls), running=len(self.running),
                    events=list(self.events))

    def run(self) -> None:
        self.router_q.put(("ready", "decode", self.endpoint.address()))
        while self.alive:
            busy = bool(self.running or self.pulls)
            msgs = []
            try:
                msgs.append(self.inbox.get(timeout=0.001 if busy else 0.05))
                while True:
                    msgs.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
            for m in msgs:
                self.handle(m)
            self.admit()
            self.poll_transfers()
            if self.running:
                self.decode()
            self._flush()


def serve_decode(spec: ServerSpec, inbox: Any, router_q: Any) -> None:
    """Process entry point (``multiprocessing`` spawn target)."""
    server = DecodeServer(spec, inbox, router_q)
    server.run()
    exit_child(router_q)


__all__ = ["DecodeServer", "Request", "serve_decode"]
