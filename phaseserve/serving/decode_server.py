"""The decode server process: pulls prompt KV into freshly allocated (FP8) pages and runs the decode batch.

One process, its own devices and mesh, its own copy of the weights in the *decode* representation, its own page
pool, allocator, page tables and integrity tracker (the in-process engine's ``DecodeWorker``). Per request::

    waiting  --(pages allocated: prompt + max_tokens, reserve policy; tags recorded in PageTables)-->
    requested  --("serve" to the prefill side; it verifies the descriptor and arms await_pull)-->
    pulling  --(connect(address).pull(uuid, avals): arrays land in fresh buffers; is_ready() polled)-->
    landed: whole pages written into the request's pages, ("release", uuid) to the prefill side  -->  running

Page safety. A request's pages are held from admission until its transfer is *done*: landed and scattered, or
refused, or abandoned at the deadline (its buffers are then never scattered). A cancel that arrives while the
transfer is in flight only marks the request; the pages go back to the free queue at completion, so they
cannot be reissued to another request while a write into them is still possible. Every allocation, landing and
release is logged with a timestamp (``events``) so tests can check that order from outside the process.

Failures end only the affected request: a refusal -> :class:`StaleDescriptorError`, a missed deadline (slow or
dead prefill peer) -> :class:`TransferTimeoutError`, pulled buffers that carry an error (the prefill peer died
mid-pull) or a landing that raises -> :class:`TransferError` (all ``"aborted"``), a cancel -> ``CancelledError``,
an integrity failure in the decode step -> ``KVIntegrityError`` (as in the engine). A request is validated on
arrival with the engine's ``validate`` and its descriptor is checked against it and this server's cache (request
id, staged length = prompt length, page size, KV dtype, leaf count, shapes and dtypes): a mismatch ends it with
``StaleDescriptorError(kind="mismatch")`` before any page is allocated. Containment: a control message that raises
ends the request it names (``BadMessageError``); a decode step that raises ends that step's requests with
``"error"``; if it consumed the page pool, the pool is rebuilt. Nothing a request or a message does ends the
process. The decode round is the engine's ``DecodeWorker.step``:
integrity check as a separate jitted launch, one jitted step for the whole running batch, then host bookkeeping.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from typing import Any

import jax

from phaseserve.cache.paged import has_index_keys, is_scaled
from phaseserve.config import canonical_dtype
from phaseserve.engine.handoff import split_chunks
from phaseserve.engine.request import (
    CancelledError,
    Limits,
    Request,
    RequestOutput,
    nonfinite_logits,
    pages_ever,
    validate,
)
from phaseserve.engine.sampling import NONFINITE_TOKEN
from phaseserve.engine.scheduler import Sequence
from phaseserve.engine.workers import DecodeWorker, cache_pages, stop_reason
from phaseserve.quant.policy import phase_policy
from phaseserve.quant.quantize import quantize_params
from phaseserve.serving.protocol import (
    BadMessageError,
    ServerSpec,
    StaleDescriptorError,
    TransferDescriptor,
    TransferError,
    TransferTimeoutError,
    bad_message,
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
        num_pages = cache_pages(self.cfg, c, self.kv_dtype, devices[0])
        self.limits = Limits.of(self.cfg, serve, num_pages)
        self.worker = DecodeWorker(self.cfg, self.params, self.mesh, kv_dtype=self.kv_dtype, num_pages=num_pages,
                                   page_size=c.page_size, max_pages_per_seq=c.max_pages_per_seq,
                                   integrity=c.integrity)
        self.allocator, self.tables, self.tracker = self.worker.allocator, self.worker.tables, self.worker.tracker
        self._rep = replicated(self.mesh)
        self.page_size, self.max_batch = c.page_size, serve.max_batch
        self.endpoint = start_endpoint(spec.bind, devices[0])
        self.puller = Puller(self.endpoint, devices[0])
        # parts per layer: GQA K and V; MLA the latent, plus GLM-5's DSA index keys on layers with an indexer
        parts = [2 if not self.cfg.is_mla or has_index_keys(self.cfg, i) else 1 for i in range(self.cfg.num_layers)]
        scaled = is_scaled(self.kv_dtype)
        self._kv_tree = jax.tree.structure([[(0, 0 if scaled else None) for _ in range(n)] for n in parts])
        # the dtype of each flat leaf of a request's KV (per layer and part: values, then the FP8 scale)
        self._leaf_dtypes = [d for _ in range(sum(parts)) for d in ([self.kv_dtype, "float32"] if scaled
                                                                    else [self.kv_dtype])]
        self.waiting: deque[tuple[Sequence, TransferDescriptor]] = deque()
        self.pulls: dict[str, tuple[Sequence, PendingPull]] = {}
        self.running: list[Sequence] = []
        self.events: list[tuple[float, str, str, tuple[int, ...]]] = []  # (time, kind, rid, pages)
        self.stats = dict(decode_steps=0, decode_tokens=0, decode_time=0.0, transfers=0, transfer_time=0.0,
                          bytes_pulled=0, valid_kv_tokens=0, aborts=0, timeouts=0, refusals=0, cancels=0,
                          transfer_errors=0, errors=0, bad_messages=0)
        self._out: list[tuple[str, int]] = []
        self.alive = True

    @property
    def pool(self):
        """The decode page pool (device pytree), owned by the worker."""
        return self.worker.pool

    def check_descriptor(self, req: Request, desc: Any) -> None:
        """Raise ``StaleDescriptorError(kind="mismatch")`` unless ``desc`` can describe ``req``'s prompt KV for this
        server's cache (checked before any page is allocated; the prefill side checks it against what it staged)."""
        def bad(why: str):
            return StaleDescriptorError(f"descriptor for {req.id!r} refused by the decode server: {why}", "mismatch")

        if not isinstance(desc, TransferDescriptor):
            raise bad(f"not a TransferDescriptor: {type(desc).__name__}")
        if desc.request_id != req.id:
            raise bad(f"it names request {desc.request_id!r:.60}")
        if desc.length != len(req.prompt):
            raise bad(f"staged length {desc.length!r:.20} != prompt length {len(req.prompt)}")
        if desc.page_size != self.page_size or desc.kv_dtype != self.kv_dtype:
            raise bad(f"page size / KV dtype {desc.page_size!r:.20}/{desc.kv_dtype!r:.30} != "
                      f"{self.page_size}/{self.kv_dtype}")
        t = len(desc.pages) * self.page_size if isinstance(desc.pages, tuple) else -1
        if t != -(-len(req.prompt) // self.page_size) * self.page_size:
            raise bad(f"{desc.pages!r:.60} staging pages cannot hold exactly the prompt's pages")
        leaves = desc.leaves if isinstance(desc.leaves, tuple) else ()
        if [d for _, d in leaves] != self._leaf_dtypes or any(
                not isinstance(shape, tuple) or not shape or shape[0] != t or not all(type(n) is int for n in shape)
                for shape, _ in leaves):
            raise bad("leaf count, shapes or dtypes do not match this cache")

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
    def handle(self, msg: Any) -> None:
        """Apply one control message; one that raises ends the request it names with the error."""
        try:
            self._handle(msg)
        except Exception as e:
            self.stats["bad_messages"] += 1
            rid, err = bad_message(msg, e)
            if rid is not None and not self._known(rid):
                self._flush()
                self.router_q.put(("finished", rid, "error", error_tuple(err)))

    def _known(self, rid: str) -> bool:
        return (rid in self.pulls or any(s.id == rid for s in self.running)
                or any(s.id == rid for s, _ in self.waiting))

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "kv_ready":
            req, first, desc = validate(msg[1], self.limits), msg[2], msg[3]
            if self._known(req.id):
                raise BadMessageError(f"request {req.id!r} is already here")
            if type(first) is not int or not 0 <= first < self.cfg.vocab_size:
                raise BadMessageError(f"first token {first!r:.30} of {req.id!r} is not a token id")
            self.check_descriptor(req, desc)
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
        else:
            raise BadMessageError(f"unknown message kind {kind!r:.40}")

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
        item = self.pulls.get(rid) if isinstance(rid, str) else None
        if item is None or item[1].descriptor.uuid != uuid or item[1].state != "requested":
            return  # a late reply for a transfer already abandoned
        seq, pull = item
        if err is not None:  # refused: nothing was armed, nothing can land; the pages go back now
            del self.pulls[rid]
            self.stats["refusals"] += 1
            self._log("refused", rid)
            self._finish(seq, "aborted", CancelledError(f"request {rid!r} was cancelled") if pull.cancelled else err)
            return
        try:
            pull.arrays = self.puller.pull(pull.descriptor)
        except Exception as e:  # nothing was armed for us, or the peer is gone: nothing can land
            del self.pulls[rid]
            self.stats["transfer_errors"] += 1
            self._finish(seq, "aborted", TransferError(f"pull of {rid!r} failed: {e!r:.200}"))
            return
        pull.state = "pulling"

    # ---- admission and transfers --------------------------------------------------------------------------
    def admit(self) -> None:
        while self.waiting and len(self.running) + len(self.pulls) < self.max_batch:
            seq, desc = self.waiting[0]
            req = seq.request
            need = pages_ever(len(req.prompt), req.max_tokens, self.page_size)  # validate() bounds it by the cache
            if self.allocator.num_free < need:
                return
            self.waiting.popleft()
            try:
                self.tables.add(req.id)
                pages = self.tables.allocate(req.id, need)
            except Exception as e:  # this request alone (its table, if any, is released by _finish)
                self._finish(seq, "error", e)
                continue
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
            try:
                ready = pull.state == "pulling" and pull.ready()
            except Exception:  # an errored buffer: let _land turn it into this request's TransferError
                ready = True
            if ready:
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
        self.router_q.put(("release", desc.uuid))  # landed or failed: the prefill side may free its staging now
        try:
            jax.block_until_ready(pull.arrays)  # raises if the pull errored (e.g. the prefill peer died mid-pull)
            n = -(-len(seq.request.prompt) // self.page_size)  # the staged pages (both sides checked the descriptor)
            self.worker.land(self.tables.owned(seq.id)[:n], split_chunks(self._kvq(pull.arrays), self.page_size))
            jax.block_until_ready(self.worker.pool)  # the write has landed before anything may touch these pages
        except Exception as e:
            self.stats["transfer_errors"] += 1
            self._log("transfer_error", seq.id)
            err = TransferError(f"KV transfer of {seq.id!r} failed: {e!r:.300}")
            self._finish(seq, "aborted", err)
            self._check_pool(err)
            return
        self._log("landed", seq.id)
        if pull.cancelled:
            self._finish(seq, "aborted", CancelledError(f"request {seq.id!r} was cancelled"))
        else:
            self.running.append(seq)

    # ---- decode -------------------------------------------------------------------------------------------
    def _check_pool(self, err: Exception) -> None:
        """After a device call raised: if it consumed the donated pool, end every running request and rebuild."""
        if not self.worker.pool_ok():
            for s in list(self.running):
                self._finish(s, "error", err)
            self.worker.reset_pool()

    def decode(self) -> None:
        t0 = time.perf_counter()
        rows = list(self.running)
        try:
            nxt, failures, _, _ = self.worker.step(rows)  # nonfinite rows' pages are scrubbed before it returns
        except Exception as e:  # not narrowed here: this step's requests end, the server goes on
            self.stats["errors"] += len(rows)
            for s in rows:
                self._finish(s, "error", e)
            self._check_pool(e)
            return
        for i, s in enumerate(rows):
            err = failures.get(s.id)
            if err is not None:
                self._finish(s, "aborted", err)
                continue
            tok = int(nxt[i])
            if tok == NONFINITE_TOKEN:
                self._finish(s, "error", nonfinite_logits(s.id, s.num_generated))
                continue
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
