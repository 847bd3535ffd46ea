"""The serving engine: continuous batching over a prefill worker and a decode worker.

``mode="disaggregated"``: prefill and decode run on disjoint device meshes, each holding its own copy of the
weights in its own representation (``QuantConfig.prefill_weights`` / ``decode_weights``); the prompt's KV is
quantized on the prefill mesh and handed to the decode mesh's paged cache. ``mode="colocated"``: the baseline a
user would run without this design -- one mesh, one weight copy and representation (``decode_weights``) for
both phases.

One :meth:`Engine.step`::

    schedule (grow / preempt / admit)  ->  prefill admitted  ->  handoff KV into their pages
        ->  integrity check (separate jitted launch)  ->  decode step for the running batch  ->  host bookkeeping

A bad request ends alone with ``finish_reason="error"`` and a typed error, before anything is allocated; a
request whose pages fail the integrity check ends ``"aborted"`` with a ``KVIntegrityError`` while every other
row of the batch goes on unaffected.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from phaseserve.cache.paged import pages_for_budget
from phaseserve.config import ModelConfig, ServeConfig, canonical_dtype
from phaseserve.engine.handoff import InProcessHandoff
from phaseserve.engine.metrics import RunMetrics
from phaseserve.engine.request import (
    CancelledError,
    DuplicateRequestError,
    InvalidParameterError,
    Request,
    RequestError,
    RequestOutput,
    validate,
)
from phaseserve.engine.scheduler import Scheduler, Sequence
from phaseserve.engine.workers import DecodeWorker, PrefillWorker, stop_reason
from phaseserve.model.params import Params
from phaseserve.quant.policy import phase_policy
from phaseserve.quant.quantize import quantize_params
from phaseserve.sharding import make_mesh, replicated, shard_params, split_devices


class Engine:
    def __init__(self, cfg: ModelConfig, params: Params, serve: ServeConfig | None = None, *,
                 attn_impl: str = "auto", handoff: Any = None):
        self.cfg = cfg
        self.serve = serve = serve or ServeConfig()
        if serve.mode not in ("disaggregated", "colocated"):
            raise ValueError(f"mode must be 'disaggregated' or 'colocated', got {serve.mode!r}")
        m, q, c = serve.mesh, serve.quant, serve.cache
        devices = jax.devices()
        n_dec = m.decode_tp * m.decode_ep
        if serve.mode == "disaggregated":
            pre_devs, dec_devs = split_devices(devices, m.prefill_devices, m.decode_devices, m.prefill_tp, n_dec)
        else:
            dec_devs = [devices[i] for i in m.decode_devices] if m.decode_devices else devices[:n_dec]
            pre_devs = dec_devs
        self.decode_mesh = make_mesh(dec_devs, tp=m.decode_tp, ep=m.decode_ep)
        self.prefill_mesh = self.decode_mesh if serve.mode == "colocated" else make_mesh(pre_devs, tp=m.prefill_tp)

        # weights: one copy per phase, each in its own representation
        decode_params = shard_params(cfg, quantize_params(params, phase_policy(q, "decode")), self.decode_mesh)
        prefill_params = decode_params if serve.mode == "colocated" else shard_params(
            cfg, quantize_params(params, phase_policy(q, "prefill")), self.prefill_mesh)

        # decode cache
        self.kv_dtype = canonical_dtype(q.kv_dtype)
        if c.num_pages is not None:
            num_pages = c.num_pages
        elif c.kv_budget_bytes is not None:
            num_pages = pages_for_budget(cfg, self.kv_dtype, c.page_size, c.kv_budget_bytes)
        else:
            raise ValueError("CacheConfig needs num_pages or kv_budget_bytes")
        self.prefill = PrefillWorker(cfg, prefill_params, kv_dtype=self.kv_dtype, prefill_kv_dtype=q.prefill_kv_dtype,
                                     max_prefill_tokens=serve.max_prefill_tokens)
        self.decode = DecodeWorker(cfg, decode_params, self.decode_mesh, kv_dtype=self.kv_dtype, num_pages=num_pages,
                                   page_size=c.page_size, max_pages_per_seq=c.max_pages_per_seq,
                                   integrity=c.integrity, attn_impl=attn_impl)
        self.num_pages = num_pages
        self.allocator, self.tables, self.tracker = self.decode.allocator, self.decode.tables, self.decode.tracker
        self.scheduler = Scheduler(self.tables, c.page_size, serve.max_batch, c.admission)
        self.max_context = min(serve.max_context or cfg.max_position_embeddings, c.max_pages_per_seq * c.page_size)
        self.handoff = handoff or InProcessHandoff()
        self.metrics = RunMetrics()
        self.outputs: dict[str, RequestOutput] = {}  # this run's outputs by id (an id may be reused once finished)
        self._seqs: dict[str, Sequence] = {}
        self.fault_hooks: list[Any] = []  # callables(engine, rows) run before each integrity check (fault injection)

    @classmethod
    def from_hydra(cls, hydra_cfg: Any) -> Engine:
        """An engine from a composed ``configs/config.yaml`` tree (model, quant, cache, mesh groups)."""
        from phaseserve.config_hydra import serve_config_from_hydra

        cfg, params, serve = serve_config_from_hydra(hydra_cfg)
        engine_cfg = hydra_cfg.get("engine") or {}
        return cls(cfg, params, serve, attn_impl=engine_cfg.get("attn_impl", "auto"))

    @property
    def pool(self):
        """The decode page pool (device pytree)."""
        return self.decode.pool

    @pool.setter
    def pool(self, value) -> None:
        self.decode.pool = value

    @property
    def prefill_params(self):
        return self.prefill.params

    @property
    def decode_params(self):
        return self.decode.params

    # ---- requests ------------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> RequestOutput:
        """Queue a request; a malformed one is finished with ``finish_reason="error"`` right away."""
        out = RequestOutput(id=req.id)
        out.metrics.arrival = time.perf_counter()
        out.metrics.num_prompt_tokens = len(req.prompt) if isinstance(req.prompt, (list, tuple)) else 0
        try:
            if req.id in self._seqs:
                raise DuplicateRequestError(f"request id {req.id!r} is already in flight")
            validate(req, self.cfg.vocab_size, self.max_context)
            if self.scheduler.max_pages_ever(req) > self.num_pages - 1:
                raise InvalidParameterError(f"request {req.id!r} needs {self.scheduler.max_pages_ever(req)} pages; "
                                            f"the cache has {self.num_pages - 1}")
        except RequestError as e:
            out.finish_reason, out.error = "error", e
            out.metrics.finished = time.perf_counter()
            self.metrics.errors += 1
            return out
        seq = Sequence(request=req, output=out, tokens=list(req.prompt), num_prompt=len(req.prompt))
        self.outputs[req.id] = out
        self._seqs[req.id] = seq
        self.scheduler.add(seq)
        return out

    def cancel(self, request_id: str) -> bool:
        """Stop a queued or running request; its pages are released. False if unknown or already finished."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._finish(seq, "aborted", CancelledError(f"request {request_id!r} was cancelled"))
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def _finish(self, seq: Sequence, reason: str, error: Exception | None = None) -> None:
        seq.output.finish_reason, seq.output.error = reason, error
        seq.output.metrics.finished = time.perf_counter()
        self.scheduler.finish(seq)
        del self._seqs[seq.id]
        if reason == "aborted" and error is not None and not isinstance(error, CancelledError):
            self.metrics.aborts += 1

    def _emit(self, seq: Sequence, token: int, events: list) -> None:
        """Append a generated token, record timing, finish on stop / length."""
        seq.tokens.append(token)
        out = seq.output
        out.tokens.append(token)
        now = time.perf_counter()
        if out.metrics.first_token is None:
            out.metrics.first_token = now
        out.metrics.num_output_tokens = len(out.tokens)
        events.append((seq.id, token))
        reason = stop_reason(seq.request, token, len(out.tokens), self.cfg.eos_token_ids)
        if reason:
            self._finish(seq, reason)

    # ---- one engine step -----------------------------------------------------------------------------------
    def step(self) -> list[tuple[str, int]]:
        """Run one scheduling round; returns the ``(request_id, token)`` pairs produced."""
        events: list[tuple[str, int]] = []
        res = self.scheduler.schedule()
        self.metrics.preemptions += len(res.preempted)
        if res.admitted:
            self._run_prefill(res.admitted, events)
        if self.scheduler.running:
            self._run_decode(events)
        self.metrics.observe(len(self.scheduler.running), self.allocator.num_used)
        return events

    def _run_prefill(self, admitted: list[Sequence], events: list) -> None:
        t0 = time.perf_counter()
        for group in self.prefill.groups(admitted):
            first, kvq, lengths = self.prefill.run(group)
            kvq = self.handoff.transfer(kvq, replicated(self.decode_mesh))
            start = np.zeros(len(lengths), np.int32)
            start[: len(group)] = [s.shared_pages * self.serve.cache.page_size for s in group]
            self.decode.land([s.id for s in group], kvq, lengths, start)
            self.metrics.prefill_batches += 1
            self.metrics.prefill_tokens += int(lengths.sum())
            for i, s in enumerate(group):
                self.scheduler.register_prefix(s)
                if s.num_prompt == len(s.tokens):  # fresh prompt: its first output token comes from prefill
                    self._emit(s, int(first[i]), events)
        self.metrics.prefill_time += time.perf_counter() - t0

    def _run_decode(self, events: list) -> None:
        t0 = time.perf_counter()
        rows = list(self.scheduler.running)
        for hook in self.fault_hooks:
            hook(self, rows)
        nxt, failures, device_s = self.decode.step(rows)
        if self.tracker.enabled:
            self.metrics.integrity_checks += len(rows)
        for i, s in enumerate(rows):
            err = failures.get(s.id)
            if err is not None:
                self._finish(s, "aborted", err)
            else:
                self._emit(s, int(nxt[i]), events)
        self.metrics.decode_steps += 1
        self.metrics.decode_tokens += len(rows) - len(failures)
        self.metrics.decode_time += device_s
        self.metrics.host_time += time.perf_counter() - t0 - device_s

    # ---- drivers -------------------------------------------------------------------------------------------
    def stream(self, requests: list[Request]) -> Iterator[tuple[str, int]]:
        """Submit ``requests`` and yield ``(request_id, token)`` as tokens are produced, until all finish."""
        for r in requests:
            self.add_request(r)
        self.metrics.begin()
        while self.has_work:
            yield from self.step()
        self.metrics.finish()

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        """Run ``requests`` to completion; outputs in input order (a duplicate id gets its own error output)."""
        outs = [self.add_request(r) for r in requests]
        self.metrics.begin()
        while self.has_work:
            self.step()
        self.metrics.finish()
        return outs

    def reset_metrics(self) -> None:
        """Start a new measurement run: clear the run counters and the finished outputs (nothing in flight)."""
        self.metrics = RunMetrics()
        self.outputs = {k: v for k, v in self.outputs.items() if k in self._seqs}
        self.scheduler.lookup_pages = self.scheduler.hit_pages = 0

    def summary(self) -> dict:
        return self.metrics.summary(list(self.outputs.values()), self.scheduler.lookup_pages,
                                    self.scheduler.hit_pages)

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()
