"""The prefill server process: batched prefill on its own mesh and weight representation, KV staged for pulls.

One process, its own devices (on CPU: simulated host devices), its own copy of the weights in the *prefill*
representation (``QuantConfig.prefill_weights``). Its loop::

    drain the inbox  ->  answer pull requests ("serve": verify the descriptor, arm await_pull, reply)
                     ->  prefill the queued prompts in chunks over this server's prefill pool (prefill KV
                         dtype), ``max_prefill_tokens`` per round: the engine's chunk step and grouping
                     ->  stage each finished prompt's pages (quantized to the decode storage dtype, e.g. FP8:
                         whole pages only) and send the router ("prefilled", rid, first_token, descriptor)
                     ->  free staged KV whose TTL passed (the decode side died or never asked)

A request whose first token already finishes it (``max_tokens == 1`` or a stop token) is not staged at all.

Containment: every prompt is checked on arrival with the engine's ``validate`` (the staging capacity included, so a
prompt that could never be staged is refused, not re-prefilled forever); a prefill batch that raises is retried one
request at a time; a request that still fails, and a control message that cannot be acted on, get
``("failed", rid, error)`` back to the router. Nothing a request or a message does ends the process.
Fault injection (``ServerSpec.faults``): ``arm_delay_s: {request_id: seconds}`` grants a pull at once but arms
it only after the delay -- a slow wire, so a test can act while the transfer is in flight.
"""

from __future__ import annotations

import queue
import time
from typing import Any

import jax

from phaseserve.config import canonical_dtype
from phaseserve.engine.handoff import join_chunks
from phaseserve.engine.request import Limits, Request, RequestOutput, nonfinite_logits, validate
from phaseserve.engine.sampling import NONFINITE_TOKEN
from phaseserve.engine.scheduler import Chunk, Sequence
from phaseserve.engine.workers import PrefillWorker, prefill_pages, stop_reason
from phaseserve.quant.policy import phase_policy
from phaseserve.quant.quantize import quantize_params
from phaseserve.serving.protocol import (
    BadMessageError,
    ServerSpec,
    StaleDescriptorError,
    TransferDescriptor,
    bad_message,
    error_tuple,
    exit_child,
)
from phaseserve.serving.transfer import StagingArea, deadline_after, start_endpoint
from phaseserve.sharding import make_mesh, shard_params


class PrefillServer:
    def __init__(self, spec: ServerSpec, inbox: Any, router_q: Any):
        self.spec, self.inbox, self.router_q = spec, inbox, router_q
        serve = spec.serve
        self.cfg, params = spec.model.load()
        devices = jax.local_devices()[: serve.mesh.prefill_tp]
        self.mesh = make_mesh(devices, tp=serve.mesh.prefill_tp)
        self.params = shard_params(self.cfg, quantize_params(params, phase_policy(serve.quant, "prefill")), self.mesh)
        self.kv_dtype = canonical_dtype(serve.quant.kv_dtype)
        self.limits = Limits.of(self.cfg, serve, staging_pages=spec.staging_pages)
        self.worker = PrefillWorker(self.cfg, self.params, self.mesh, kv_dtype=self.kv_dtype,
                                    prefill_kv_dtype=serve.quant.prefill_kv_dtype,
                                    max_prefill_tokens=serve.max_prefill_tokens, page_size=serve.cache.page_size,
                                    num_pages=prefill_pages(self.limits, serve.max_prefill_tokens),
                                    max_pages_per_seq=self.limits.max_pages)
        self.device = devices[0]
        self.endpoint = start_endpoint(spec.bind, self.device)
        self.staging = StagingArea(self.endpoint, spec.staging_pages, serve.cache.page_size, spec.staging_ttl_s)
        self.pending: list[Request] = []
        self.delayed: list[tuple[float, TransferDescriptor]] = []
        self.stats = dict(prefill_batches=0, prefill_tokens=0, prefill_time=0.0, served=0, released=0, failed=0,
                          bad_messages=0)
        self.running = True

    # ---- messages -------------------------------------------------------------------------------------------
    def _fail(self, rid: Any, err: Exception) -> None:
        self.stats["failed"] += 1
        if isinstance(rid, str):
            self.router_q.put(("failed", rid, error_tuple(err)))

    def handle(self, msg: Any) -> None:
        """Apply one control message; one that raises is answered ``failed`` for the request it names."""
        try:
            self._handle(msg)
        except Exception as e:
            self.stats["bad_messages"] += 1
            self._fail(*bad_message(msg, e))

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "prompt":
            self.pending.append(validate(msg[1], self.limits))
        elif kind == "serve":
            self._serve(msg[1], msg[2])
        elif kind == "release":
            self.stats["released"] += int(self.staging.release(msg[1]))
        elif kind == "stats":
            self.router_q.put(("stats", "prefill", self.snapshot()))
        elif kind == "shutdown":
            self.running = False
        else:
            raise BadMessageError(f"unknown message kind {kind!r:.40}")

    def _serve(self, rid: str, desc: TransferDescriptor) -> None:
        """A pull request from the decode side for its request ``rid``: verify, arm, reply (to ``rid``)."""
        delay = self.spec.faults.get("arm_delay_s", {}).get(getattr(desc, "request_id", None))
        try:
            if delay:
                self.staging.verify(desc, rid).served = True  # granted now, armed later (a slow wire)
                self.delayed.append((time.monotonic() + delay, desc))
            else:
                self.staging.serve(desc, rid)
            self.stats["served"] += 1
            err = None
        except StaleDescriptorError as e:
            err = e
        self.router_q.put(("serve_reply", rid, getattr(desc, "uuid", None), error_tuple(err)))

    def _arm_delayed(self) -> None:
        now, keep = time.monotonic(), []
        for due, desc in self.delayed:
            entry = self.staging.entries.get(desc.uuid)
            if due > now:
                keep.append((due, desc))
            elif entry is not None:
                remaining = max(entry.expires - now, 0.1)
                self.endpoint.await_pull(desc.uuid, entry.arrays, timeout=deadline_after(remaining))
        self.delayed = keep

    def snapshot(self) -> dict:
        return dict(self.stats, staging_pages_in_use=self.staging.pages_in_use, staged=len(self.staging.entries),
                    refused=dict(self.staging.refused), expired=self.staging.expired, address=self.staging.address,
                    bytes_staged=self.staging.bytes_staged)

    # ---- prefill ------------------------------------------------------------------------------------------
    def prefill_pending(self) -> None:
        """Prefill the queued prompts in chunks (the engine's chunk step and budget, ``max_prefill_tokens`` per round,
        over this server's prefill pool), staging each one's pages as its last chunk is done."""
        reqs, self.pending = self.pending, []
        t0 = time.perf_counter()
        seqs = [s for s in map(self._admit, reqs) if s is not None]
        while seqs:
            chunks, budget = [], self.spec.serve.max_prefill_tokens
            for s in seqs:
                if budget <= 0:
                    break
                chunks.append(Chunk(s, s.computed, min(s.num_prompt - s.computed, budget)))
                budget -= chunks[-1].n
            for group in self.worker.groups(chunks):
                self._prefill_group(group)
            seqs = [s for s in seqs if s.id in self.worker.tables]  # done (staged) or failed ones have left
        self.stats["prefill_time"] += time.perf_counter() - t0

    def _admit(self, r: Request) -> Sequence | None:
        """The prompt's pages of the prefill pool, or None (queued again) while the pool is short."""
        tables = self.worker.tables
        need = -(-len(r.prompt) // self.spec.serve.cache.page_size)
        if tables.allocator.num_free < need:
            self.pending.append(r)
            return None
        try:
            tables.add(r.id)
            tables.allocate(r.id, need)
        except Exception as e:
            self._drop(r.id)
            self._fail(r.id, e)
            return None
        return Sequence(request=r, output=RequestOutput(id=r.id), tokens=list(r.prompt), num_prompt=len(r.prompt))

    def _drop(self, rid: str) -> None:
        if rid in self.worker.tables:
            self.worker.tables.release(rid)

    def _prefill_group(self, group: list[Chunk]) -> None:
        """One chunk step; if it raises, each request again alone (only the failing ones fail)."""
        try:
            first, _, _ = self.worker.run(group)  # logprobs: in-process engine only (Router refuses them)
        except Exception as e:
            if not self.worker.pool_ok():  # the donated pool is gone: every prompt in progress lost its KV
                for rid in list(self.worker.tables.slot_of):
                    self._drop(rid)
                    self._fail(rid, e)
                self.worker.reset_pool()
            elif len(group) == 1:
                self._drop(group[0].id)
                self._fail(group[0].id, e)
            else:
                for c in group:
                    self._prefill_group([c])
            return
        self.stats["prefill_batches"] += 1
        self.stats["prefill_tokens"] += sum(c.n for c in group)
        for c, tok in zip(group, first, strict=True):
            c.seq.computed += c.n
            if c.ends_prompt:
                self._stage(c.seq, int(tok))

    def _stage(self, s: Sequence, tok: int) -> None:
        """A finished prompt: its pages (decode storage dtype) staged for the decode side's pull, and the router
        told; its prefill pages are freed either way."""
        r = s.request
        try:
            if tok == NONFINITE_TOKEN:
                raise nonfinite_logits(r.id, 0)
            if stop_reason(r, tok, 1, self.cfg.eos_token_ids):
                self.router_q.put(("prefilled", r.id, tok, None))
                return
            payload = join_chunks(self.worker.export(self.worker.tables.owned(r.id)))
            leaves = [jax.device_put(x[0], self.device) for x in jax.tree.leaves(payload)]  # [T_r, ...] whole pages
            desc = self.staging.stage(r.id, leaves, len(r.prompt), self.kv_dtype)
        except Exception as e:
            self._fail(r.id, e)
            return
        finally:
            self._drop(r.id)
        if desc is None:  # staging full for now (validate() refused prompts it could never hold): retry later
            self.pending.append(r)
            return
        self.router_q.put(("prefilled", r.id, tok, desc))

    # ---- loop ---------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.router_q.put(("ready", "prefill", self.staging.address))
        while self.running:
            msgs = []
            try:
                msgs.append(self.inbox.get(timeout=0.002 if (self.pending or self.delayed) else 0.05))
                while True:
                    msgs.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
            for m in msgs:
                self.handle(m)
            if self.pending:
                self.prefill_pending()
            if self.delayed:
                self._arm_delayed()
            self.staging.expire()


def serve_prefill(spec: ServerSpec, inbox: Any, router_q: Any) -> None:
    """Process entry point (``multiprocessing`` spawn target)."""
    server = PrefillServer(spec, inbox, router_q)
    server.run()
    exit_child(router_q)
