"""The serving engine: continuous batching over a prefill worker and a decode worker.

``mode="disaggregated"``: prefill and decode run on disjoint device meshes, each holding its own copy of the
weights in its own representation (``QuantConfig.prefill_weights`` / ``decode_weights``); the prompt's KV is
quantized on the prefill mesh and handed to the decode mesh's paged cache. ``mode="colocated"``: the baseline a
user would run without this design -- one mesh, one weight copy and representation (``decode_weights``) for
both phases.

One :meth:`Engine.step`::

    schedule (grow / preempt / admit)  ->  collect each prefill launch of earlier steps that has finished, in launch
        order (first tokens; prompts whose last chunk ran: their pages handed to decode, whole pages, decode storage
        dtype)  ->  if fewer than ``prefill_in_flight`` are in flight: plan the next chunks of the prompts in
        progress that have none in flight (``max_prefill_tokens``, or ``decoding_prefill_tokens`` while requests
        decode), prefix hits starting: cached pages into the prefill pool, launch the chunks on the prefill mesh
        (not waited for)  ->  integrity check (separate jitted launch)  ->  decode step for the prefilled requests,
        on the decode mesh while the prefill computes  ->  bookkeeping

Decode lookahead (``ServeConfig.decode_lookahead``, the default): the decode worker launches the next decode step for
the same rows before it reads this step's tokens (fed on the device), so the host's work between two steps overlaps
the device's; the next step uses it only if its inputs turn out exactly the same (``workers.Ahead.matches``), else
drops it. Rows new to the batch (a prompt handed off, a request swapped back in, a prefix hit's last token below)
wait one step while a step launched ahead is pending, so it is used, not dropped: the launch ahead goes on while a
prefill computes, and each arrival costs one step not overlapped, not a prefill's worth of them.

A prefix hit's last token as a decode row (``ServeConfig.decode_hit_suffix``, the default): a fresh prompt whose
cached pages leave one token to compute, or a prompt of whole pages cached to its last page (a hit stops a page short,
so that one prompt token is computed; the cached last page is copied into the request's own page on the decode mesh),
joins the decode rows at once; the decode step writes that token's KV and samples the first output token, with no
prefill launch, no copy of the cached pages into the prefill pool and no handoff (with quantized weights, that first
token comes from the decode weights).

Overlap (``ServeConfig.overlap_prefill``, the default): prefill and decode run on disjoint meshes, so a step does
not wait for the prefill it launched; the decode rows keep stepping and a later step collects each launch once it
has finished (up to ``ServeConfig.prefill_in_flight`` launches queued on the prefill mesh, 1 by default: one
profile of the race at 2 measured lower tok/s and higher TTFT at concurrency 8 and 32). A step waits for them when
it has nothing to decode, and every step does with ``overlap_prefill=False`` (the prefill is then collected in the
step that launched it, before its decode). A request cancelled or preempted while its chunk computes is dropped from the
result when it is collected (its pages were already released).

Where a prompt's KV lives while it is prefilled: in the prefill mesh's own page pool, in the prefill KV dtype
(``QuantConfig.prefill_kv_dtype``, BF16 in the design), each chunk attending over what the earlier chunks wrote.
Only when its last chunk is done do its pages cross to the decode mesh, quantized there to the decode storage dtype
(FP8), and the prefill pages are freed. A prefix hit copies the cached pages (decode pool, dequantized) into the
request's first prefill pages and computes only the suffix.

A bad request ends alone with ``finish_reason="error"`` and a typed error, before anything is allocated; a
request whose pages fail the integrity check ends ``"aborted"`` with a ``KVIntegrityError`` while every other
row of the batch goes on unaffected.

Fault containment: an exception raised while serving a request -- scheduling it, prefilling it, handing its KV
over, decoding it -- ends that request with ``finish_reason="error"`` and the exception, releases its pages, and
the engine keeps serving. A failing prefill batch or decode step is retried in halves until the failure is
narrowed to single requests; if a device call lost the page pool (a donated buffer), every request whose KV was
in it ends with the error and the pool is rebuilt empty.

Preemption (``CacheConfig.admission="on_demand"``): ``CacheConfig.preemption="recompute"`` re-prefills a victim's
prompt and generated tokens at readmission, in chunks like any prompt (with FP8 KV the generated tokens' KV is
then rebuilt with prefill attention, so outputs can depend on load); ``"swap"`` copies the victim's pages (values
and scales, exactly) to host memory and writes them back into fresh pages at readmission, so outputs do not depend
on load.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax

from phaseserve.cache.paged import kv_bytes_per_token
from phaseserve.config import ConfigError, ModelConfig, ServeConfig, canonical_dtype
from phaseserve.engine.compiled import MAP_USE_STOP, memory_map_use
from phaseserve.engine.handoff import InProcessHandoff
from phaseserve.engine.metrics import RunMetrics, kernel_provenance, oversized_pool
from phaseserve.engine.request import (
    CancelledError,
    Limits,
    Logprob,
    NonFiniteLogitsError,
    Request,
    RequestOutput,
    Sequence,
    logprob_at,
    nonfinite_logits,
    open_request,
    stop_reason,
)
from phaseserve.engine.sampling import NONFINITE_ATTENTION, is_nonfinite
from phaseserve.engine.scheduler import Chunk, Scheduler
from phaseserve.engine.shapes import bucket
from phaseserve.engine.workers import Launched, PhaseWorkers, local_workers
from phaseserve.model.params import Params

KEEP_FINISHED = 1 << 16  # default Engine.keep_finished: finished outputs kept for summary() and lookups by id


class InFlight(NamedTuple):
    """A prefill group dispatched to the prefill mesh and not collected yet."""

    group: list[Chunk]
    admitted: list[int]  # each chunk's request's admitted_order at launch (a readmitted request is not current)
    launched: Launched


class EngineBusyError(RuntimeError):
    """``generate()`` / ``stream()`` called while another of this engine's drivers is still running (e.g. a
    ``generate()`` inside a ``stream()`` loop): it would take the other driver's tokens."""


def hydra_engine_args(hydra_cfg: Any) -> tuple[ModelConfig, Params, ServeConfig, str, str]:
    """``(cfg, params, serve, attn_impl, matmul_impl)`` from a composed ``configs/config.yaml`` tree: the
    positional arguments of :class:`Engine` and :class:`~phaseserve.engine.replicas.ReplicatedEngine`."""
    from phaseserve.config_hydra import serve_config_from_hydra

    cfg, params, serve = serve_config_from_hydra(hydra_cfg)
    engine_cfg = hydra_cfg.get("engine") or {}
    return cfg, params, serve, engine_cfg.get("attn_impl", "auto"), engine_cfg.get("matmul_impl", "auto")


class Engine:
    def __init__(self, cfg: ModelConfig, params: Params | None, serve: ServeConfig | None = None,
                 attn_impl: str = "auto", matmul_impl: str = "auto", *, handoff: Any = None,
                 devices: list | None = None, workers: PhaseWorkers | None = None):
        """``devices``: the devices this engine lays its meshes out over (``MeshConfig`` indices refer to this
        list); default ``jax.devices()``. Data-parallel replicas (``MeshConfig.replicas > 1``) are
        :class:`~phaseserve.engine.replicas.ReplicatedEngine`'s, which builds one engine per block of devices.

        ``workers``: the prefill and decode workers to drive (default :func:`~phaseserve.engine.workers.
        local_workers`, both in this process, built from ``params``); ``phaseserve.distributed.RayEngine`` passes
        proxies to Ray actors (``params`` None: each actor loads its own copy). The scheduler, admission, chunk
        planning, prefix reuse, preemption and the finish rule are this engine's either way."""
        self.cfg = cfg
        self.serve = serve = serve or ServeConfig()
        m, c = serve.mesh, serve.cache
        if m.replicas != 1:
            raise ConfigError(f"MeshConfig.replicas={m.replicas}: build a ReplicatedEngine (phaseserve.engine), "
                              f"which runs one Engine per replica")
        if workers is None:
            if params is None:
                raise ConfigError("Engine needs params (or workers that hold their own weights)")
            workers = local_workers(cfg, params, serve, attn_impl, matmul_impl, devices)
        self.prefill, self.decode = workers
        self.kv_dtype = canonical_dtype(serve.quant.kv_dtype)
        num_pages = self.decode.num_pages
        too_big = oversized_pool(num_pages, serve.max_batch, c.max_pages_per_seq,
                                 c.page_size * kv_bytes_per_token(cfg, self.kv_dtype))
        if too_big:
            warnings.warn(too_big, stacklevel=2)
        self.num_pages = num_pages
        self.limits = Limits.of(cfg, serve, num_pages)
        self.allocator, self.tables, self.tracker = self.decode.allocator, self.decode.tables, self.decode.tracker
        self.scheduler = Scheduler(self.tables, c.page_size, serve.max_batch, c.admission, preemption=c.preemption,
                                   prefix_caching=c.prefix_caching, retain_prefixes=c.retain_prefixes,
                                   prefill_tables=self.prefill.tables)
        self.max_context = self.limits.max_context
        self.handoff = handoff or InProcessHandoff()
        self.metrics = RunMetrics()
        self.outputs: dict[str, RequestOutput] = {}  # this run's outputs by id (an id may be reused once finished)
        self.keep_finished = KEEP_FINISHED  # finished outputs kept in ``outputs`` (the oldest are dropped beyond)
        self._submit_lock = threading.Lock()  # add_request's id check and insert are one step
        self._seqs: dict[str, Sequence] = {}
        self._driving = False  # a generate()/stream() is running
        self._yielded: dict[str, int] | None = None  # tokens handed out per request by the running stream()
        self.swap_stats = dict(swap_outs=0, swap_ins=0, bytes=0, seconds=0.0)  # preemption="swap" traffic
        self.fault_hooks: list[Any] = []  # callables(engine, rows) run before each integrity check (fault injection)
        self._inflight: list[InFlight] = []  # prefill groups launched and not yet collected (overlap_prefill)
        self._joining: set[str] = set()  # rows new to the decode batch (handed off, swapped in, a hit's last token)

    @classmethod
    def from_hydra(cls, hydra_cfg: Any) -> Engine:
        """An engine from a composed ``configs/config.yaml`` tree (model, quant, cache, mesh groups)."""
        return cls(*hydra_engine_args(hydra_cfg))

    @property
    def max_batch(self) -> int:
        """The concurrency cap (decode rows) the scheduler admits up to; settable between runs."""
        return self.scheduler.max_batch

    @max_batch.setter
    def max_batch(self, value: int) -> None:
        self.scheduler.max_batch = value

    @property
    def pool(self):
        """The decode page pool (device pytree)."""
        return self.decode.pool

    @pool.setter
    def pool(self, value) -> None:
        self.decode.pool = value

    @property
    def decode_mesh(self):
        """The decode worker's mesh (None when the worker is remote)."""
        return getattr(self.decode, "mesh", None)

    @property
    def prefill_mesh(self):
        return getattr(self.prefill, "mesh", None)

    @property
    def prefill_params(self):
        return self.prefill.params

    @property
    def decode_params(self):
        return self.decode.params

    # ---- requests ------------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> RequestOutput:
        """Queue a request; a malformed one is finished with ``finish_reason="error"`` right away, and so is one whose
        id is in flight (``DuplicateRequestError``). Safe to call from several threads at once: the id check and
        the insert happen under one lock, so one id is accepted once."""
        with self._submit_lock:
            req, out = open_request(req, self.limits, self._seqs)
            if req is None:
                self.metrics.errors += 1
                return out
            seq = Sequence(request=req, output=out, tokens=list(req.prompt), num_prompt=len(req.prompt))
            self.outputs[req.id] = out
            self._seqs[req.id] = seq
            self.scheduler.add(seq)
            self._trim_outputs()
        return out

    def _trim_outputs(self) -> None:
        """Drop the oldest finished outputs beyond :attr:`keep_finished` (a server that is never idle would otherwise
        keep every output it ever made); those in flight are always kept."""
        excess = len(self.outputs) - len(self._seqs) - self.keep_finished
        if excess <= 0:
            return
        for rid in [k for k, o in self.outputs.items() if o.finish_reason is not None][:excess]:
            del self.outputs[rid]

    def cancel(self, request_id: str) -> bool:
        """Stop a queued or running request; its pages are released at once and no token of it is produced (or
        yielded by a running :meth:`stream`) after this returns True. False if unknown or already finished."""
        seq = self._seqs.get(request_id) if isinstance(request_id, str) else None
        if seq is None:
            return False
        if self._yielded is not None:  # streaming: the output holds exactly the tokens handed out so far
            n = self._yielded.get(request_id, 0)
            del seq.output.tokens[n:]
            seq.output.metrics.num_output_tokens = n
        self._finish(seq, "aborted", CancelledError(f"request {request_id!r} was cancelled"))
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def _finish(self, seq: Sequence, reason: str, error: Exception | None = None) -> None:
        seq.output.finish_reason, seq.output.error = reason, error
        seq.output.metrics.finished = time.perf_counter()
        seq.swap = None
        self._joining.discard(seq.id)
        self.scheduler.finish(seq)
        self._seqs.pop(seq.id, None)
        if reason == "aborted" and error is not None and not isinstance(error, CancelledError):
            self.metrics.aborts += 1
        elif reason == "error":
            self.metrics.errors += 1
            self.metrics.nonfinite += isinstance(error, NonFiniteLogitsError)

    def _fail(self, seqs: list[Sequence], err: Exception) -> None:
        """End ``seqs`` (those still in flight) with ``finish_reason="error"`` and ``err``; their pages go back."""
        for s in seqs:
            if self._seqs.get(s.id) is s:
                self._finish(s, "error", err)

    def _emit(self, seq: Sequence, token: int, events: list, logprob: Logprob | None = None) -> None:
        """Append a generated token (and its logprob, when the request asked), record timing, finish on stop /
        length (on non-finite logits: an error, and nothing appended)."""
        out = seq.output
        if is_nonfinite(token):
            where = "attention" if token == NONFINITE_ATTENTION else "logits"
            self._finish(seq, "error", nonfinite_logits(seq.id, len(out.tokens), where))
            return
        seq.tokens.append(token)
        if out.logprobs is not None:
            out.logprobs.append(logprob)
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
    def step(self, after_prefill: Callable[[], None] | None = None) -> list[tuple[str, int]]:
        """Run one scheduling round; returns the ``(request_id, token)`` pairs produced.

        ``after_prefill`` (optional) is called once the round's prefill has emitted its first tokens and before its
        decode step runs (only in a round that prefilled and has rows to decode): a server hands each new request's
        first token to its client then, not a decode step later."""
        events: list[tuple[str, int]] = []
        try:
            res = self.scheduler.schedule()
        except Exception as e:  # not narrowed to one request by the scheduler: end this step's requests
            self._fail(list(self.scheduler.running) + list(self.scheduler.waiting), e)
            return events
        for seq, err in res.failed:
            self._fail([seq], err)
        self.metrics.preemptions += len(res.preempted)
        swapped = [s for s in res.preempted if s.swap is not None]
        if swapped:
            self._swap(swapped, out=True)
        if res.admitted:
            self._swap([s for s in res.admitted if s.swap is not None and s in self.scheduler.running], out=False)
        if self.serve.decode_hit_suffix:
            self._join_hit_suffixes()
        collected = self._collect_prefill(events, wait=False)
        chunks: list[Chunk] = []
        if len(self._inflight) < self.serve.prefill_in_flight:  # a request's next chunk waits for its chunk in flight
            budget, small = self.serve.max_prefill_tokens, self.serve.decoding_prefill_tokens
            decoding = small is not None and any(not s.prefilling for s in self.scheduler.running)
            busy = {c.id for f in self._inflight for c in f.group}
            try:
                chunks = self.scheduler.plan_chunks(min(budget, small) if decoding else budget, split=not decoding,
                                                    skip=busy)
            except Exception as e:  # not narrowed to one request: end the prompts in progress
                self._fail([s for s in self.scheduler.running if s.prefilling], e)
        if chunks:
            self._load_prefixes([c.seq for c in chunks if c.first and c.seq.shared_pages])
            self._launch_prefill(chunks, events)
        rows = [s for s in self.scheduler.running if not s.prefilling]
        if self._inflight and (not rows or not self.serve.overlap_prefill):  # nothing to decode meanwhile
            collected |= self._collect_prefill(events, wait=True)
            rows = [s for s in self.scheduler.running if not s.prefilling]
        if rows and collected and after_prefill is not None:
            after_prefill()
        if rows:
            self._run_decode(rows, events)
        self.metrics.observe(len(self.scheduler.running), self.allocator.num_used)
        return events

    def _device_failure(self, seqs: list[Sequence], err: Exception) -> bool:
        """After a device call raised: end ``seqs`` if it cannot be retried in parts; True if it was narrowed."""
        if not self.decode.pool_ok():  # a donated pool was consumed (or its worker died): every page's KV is gone
            self._pool_lost(self.decode, list(self.scheduler.running) + seqs, err)
            self.scheduler.prefix.clear()
            return False
        if not self.prefill.pool_ok():  # the prefill pool was consumed: every prompt in progress lost its KV
            self._pool_lost(self.prefill, [s for s in self.scheduler.running if s.prefilling] + seqs, err)
            return False
        if len(seqs) == 1:
            self._fail(seqs, err)
            return False
        return True

    def _pool_lost(self, worker: Any, seqs: list[Sequence], err: Exception) -> None:
        """``worker``'s pool is gone: end ``seqs`` with ``err``; where the worker restarts (``requeue_lost``, a
        remote worker), a request that has emitted nothing yet goes back to the queue instead (its pages released,
        prefilled again from its prompt) and only those already streaming end, ``"aborted"`` with ``err``."""
        for s in dict.fromkeys(seqs):
            if self._seqs.get(s.id) is not s:
                continue
            if worker.requeue_lost and not s.output.tokens:
                self.scheduler.requeue(s)
            elif worker.requeue_lost:
                self._finish(s, "aborted", err)
            else:
                self._fail([s], err)
        worker.reset_pool()

    def _carry(self, payload: Any, worker: Any) -> Any:
        """A payload onto ``worker``'s devices (a remote worker's payload is a staged descriptor: left as is)."""
        return payload if worker.sharding is None else jax.device_put(payload, worker.sharding)

    def _load_prefixes(self, seqs: list[Sequence]) -> None:
        """Prefix hits: the cached pages' KV (decode pool) into each request's first prefill pages, so its suffix
        chunks attend over it; one copy for all of this step's hits. If it raises, each request is copied alone and
        a request whose own copy raises fails alone."""
        if not seqs:
            return
        try:
            src = [p for s in seqs for p in self.tables.owned(s.id)[:s.shared_pages]]
            dst = [p for s in seqs for p in self.prefill.tables.owned(s.id)[:s.shared_pages]]
            payload = self._carry(self.decode.export(src, self.prefill.pool_dtype), self.prefill)
            self.prefill.land(dst, payload)
        except Exception as e:
            if self._device_failure(seqs, e) and len(seqs) > 1:
                for s in seqs:
                    self._load_prefixes([s])

    def _join_hit_suffixes(self) -> None:
        """Fresh prompts whose prefix hit leaves one token to compute become decode rows (``ServeConfig.
        decode_hit_suffix``): the decode step feeds that token at its position, writes its KV into the request's
        own page and samples the first output token. That is a hit leaving one token, or a prompt of whole pages
        cached to its last page (the hit stops a page short, so one prompt token is computed): that page is copied
        into the request's own page, bit for bit, and its last token recomputed there, so no shared page is
        written. Requests asking for prompt logprobs or for no output, and a chunk already in flight, keep the
        prefill path."""
        page = self.serve.cache.page_size
        found = [s for s in self.scheduler.running
                 if s.shared_pages and s.computed == s.shared_pages * page and s.num_prompt - s.computed in (1, page)
                 and s.num_prompt == len(s.tokens) and s.output.prompt_logprobs is None and s.request.max_tokens > 0]
        if not found:  # the common step: no prompt waits on its first chunk after a hit
            return
        busy = {c.id for f in self._inflight for c in f.group}
        join, copies = [], []  # copies: (request, cached page, its own page)
        for s in found:
            if s.id in busy:
                continue
            if s.num_prompt - s.computed == 1:
                join.append(s)
                continue
            cached = self.scheduler.cached_page(s, s.shared_pages)  # else this request prefills its last page
            if cached is not None:
                copies.append((s, cached, self.tables.owned(s.id)[s.shared_pages]))
        if copies:
            try:
                self.decode.copy_pages([c for _, c, _ in copies], [d for _, _, d in copies])
                join += [s for s, _, _ in copies]
            except Exception as e:  # they prefill their last page instead (unless the pool itself was lost)
                self._device_failure([], e)
        for s in join:
            self.scheduler.prefilled(s)
            self._joining.add(s.id)

    def _launch_prefill(self, chunks: list[Chunk], events: list) -> None:
        """Dispatch this step's chunk groups to the prefill mesh (:meth:`_collect_prefill` takes their results)."""
        t0 = time.perf_counter()
        for group in self.prefill.groups(chunks):
            try:
                self._inflight.append(self._launch(group))
            except Exception as e:
                self._retry_prefill(group, e, events)
        self.metrics.prefill_time += time.perf_counter() - t0

    def _collect_prefill(self, events: list, wait: bool) -> bool:
        """The launched prefill groups' results, in launch order, each once it is done (every one, waiting for
        them, with ``wait``): first tokens, handoffs. True if it collected any."""
        t0, got = time.perf_counter(), False
        while self._inflight and (wait or self._inflight[0].launched.ready()):
            self._finish_prefill(self._inflight.pop(0), events)
            got = True
        if got:
            self.metrics.prefill_time += time.perf_counter() - t0
        return got

    def _current(self, c: Chunk, admitted_order: int) -> bool:
        """The chunk's request is still where the launch left it: not ended, preempted or readmitted meanwhile."""
        s = c.seq
        return (self._seqs.get(c.id) is s and s.admitted_order == admitted_order and s.computed == c.start
                and s in self.scheduler.running)

    def _retry_prefill(self, group: list[Chunk], err: Exception, events: list) -> None:
        """A prefill group raised: narrowed, in halves run at once, to the one request it fails."""
        if self._device_failure([c.seq for c in group], err):
            half = len(group) // 2
            for part in (group[:half], group[half:]):
                part = [c for c in part if self._seqs.get(c.id) is c.seq]
                if part:
                    self._launch_now(part, events)

    def _launch(self, group: list[Chunk]) -> InFlight:
        return InFlight(group, [c.seq.admitted_order for c in group], self.prefill.launch(group))

    def _launch_now(self, group: list[Chunk], events: list) -> None:
        try:
            f = self._launch(group)
        except Exception as e:
            self._retry_prefill(group, e, events)
            return
        self._finish_prefill(f, events)

    def _finish_prefill(self, f: InFlight, events: list) -> None:
        """One launched group's results: each current row's chunk counted, its prompt logprobs recorded, finished
        prompts handed off (rows whose request ended or was preempted since the launch are dropped)."""
        live = [i for i, (c, order) in enumerate(zip(f.group, f.admitted, strict=True)) if self._current(c, order)]
        try:
            first, gen, prompt = f.launched.result()
        except Exception as e:
            if live:
                self._retry_prefill([f.group[i] for i in live], e, events)
            return
        self.metrics.prefill_batches += 1
        self.metrics.prefill_tokens += sum(c.n for c in f.group)
        done = []
        for i in live:
            c, tok = f.group[i], first[i]
            c.seq.computed += c.n
            if prompt is not None and c.seq.output.prompt_logprobs is not None:
                self._record_prompt_logprobs(c, prompt, i)
            if c.ends_prompt and c.seq.request.max_tokens == 0:  # scoring only: nothing is generated
                self._finish(c.seq, "length")
            elif c.ends_prompt:
                done.append((c.seq, int(tok), logprob_at(gen, (i,), int(tok), c.seq.request.logprobs)))
        if done:
            self._hand_off(done, events)

    @staticmethod
    def _record_prompt_logprobs(c: Chunk, arrays: tuple, row: int) -> None:
        """The logprobs of the prompt tokens this chunk's positions predict (position p predicts token p + 1),
        each recorded once (a prompt re-prefilled after a preemption keeps its first values)."""
        out, n_top = c.seq.output.prompt_logprobs, c.seq.request.prompt_logprobs
        for j in range(c.n):
            t = c.start + j + 1
            if t < len(out) and out[t] is None:
                out[t] = logprob_at(arrays, (row, j), c.seq.tokens[t], n_top)

    def _hand_off(self, done: list[tuple[Sequence, int, Logprob | None]], events: list) -> None:
        """The finished prompts' pages (past any shared prefix) to decode, in one payload of whole pages; then their
        prefill pages are freed, their prompt pages registered for prefix hits and their first tokens emitted. If the
        handoff raises, it is retried per request."""
        seqs = [s for s, _, _ in done]
        try:
            src = [p for s in seqs for p in self.prefill.tables.owned(s.id)[s.shared_pages: self._prompt_pages(s)]]
            dst = [p for s in seqs for p in self.tables.owned(s.id)[s.shared_pages: self._prompt_pages(s)]]
            payload = self.handoff.transfer(self.prefill.export(src), self.decode.sharding)
            self.decode.land(dst, payload)
        except Exception as e:
            if self._device_failure(seqs, e) and len(done) > 1:
                for d in done:
                    self._hand_off([d], events)
            return
        for s, tok, lp in done:
            if is_nonfinite(tok):  # the KV it computed may hold NaN: its private pages in both pools (not a
                # shared prefix it reused) are zeroed before they are freed, and never offered as prefix hits
                self.prefill.scrub(self.prefill.tables.owned(s.id))
                private = self.tables.owned(s.id)[s.shared_pages:]
                self.allocator.forget(private)
                self.decode.scrub(private)
            self.scheduler.prefilled(s)
            self._joining.add(s.id)  # a new decode row: joins the step after a pending step ahead
            if not is_nonfinite(tok):
                self.scheduler.register_prefix(s)
            if s.num_prompt == len(s.tokens):  # fresh prompt: its first output token comes from prefill
                self._emit(s, tok, events, lp)

    def _prompt_pages(self, seq: Sequence) -> int:
        return -(-seq.num_prompt // self.serve.cache.page_size)

    def _swap(self, seqs: list[Sequence], out: bool) -> None:
        """preemption="swap": copy preempted requests' pages to host (``out``), or back into the fresh pages of
        readmitted ones. Each request fails alone if its copy raises."""
        t0 = time.perf_counter()
        for s in seqs:
            try:
                if out:
                    s.swap = self.decode.swap_out(s.swap)
                else:
                    self.decode.swap_in(self.tables.owned(s.id), s.swap)
                    s.swap = None
                    self._joining.add(s.id)
            except Exception as e:
                if self._device_failure([s], e):
                    self._fail([s], e)
                continue
            self.swap_stats["swap_outs" if out else "swap_ins"] += 1
        self.swap_stats["bytes"] += sum(self.decode.swap_nbytes(s.swap) for s in seqs if s.swap is not None)
        self.swap_stats["seconds"] += time.perf_counter() - t0

    def _run_decode(self, rows: list[Sequence], events: list) -> None:
        t0 = time.perf_counter()
        # launch the next step before reading this one's tokens
        lookahead = self.serve.decode_lookahead
        if self._joining:
            old = [s for s in rows if s.id not in self._joining]
            if len(old) < len(rows) and old and self.decode.ahead_ids == tuple(s.id for s in old):
                # the step launched ahead for the other rows runs (not dropped: its compute is done or under way);
                # the new rows join the next step, launched with nothing ahead of it
                rows, lookahead = old, False
            else:
                self._joining.difference_update(s.id for s in rows)
        device_s = self._decode_rows(rows, events, lookahead=lookahead)
        self.metrics.decode_steps += 1
        self.metrics.decode_time += device_s
        self.metrics.host_time += time.perf_counter() - t0 - device_s

    def _decode_rows(self, rows: list[Sequence], events: list, lookahead: bool = False) -> float:
        """One decode step for ``rows`` (retried in halves if it raises); returns the device seconds. ``lookahead``:
        the decode worker launches the next step for these rows before reading this one's tokens."""
        try:
            for hook in self.fault_hooks:
                hook(self, rows)
            nxt, failures, device_s, lps = self.decode.step(rows, lookahead=lookahead)
        except Exception as e:
            if not self._device_failure(rows, e):
                return 0.0
            half = len(rows) // 2
            return self._decode_rows(rows[:half], events) + self._decode_rows(rows[half:], events)
        if self.tracker.enabled:
            self.metrics.integrity_checks += len(rows)
        for i, s in enumerate(rows):
            err = failures.get(s.id)
            if err is not None:
                self._finish(s, "aborted", err)
            else:
                self._emit(s, int(nxt[i]), events, logprob_at(lps, (i,), int(nxt[i]), s.request.logprobs))
        self.metrics.decode_tokens += len(rows) - len(failures)
        return device_s

    # ---- drivers -------------------------------------------------------------------------------------------
    def _enter(self) -> None:
        if self._driving:
            raise EngineBusyError("this engine is already running a generate()/stream(); finish or close it first")
        self._driving = True

    def stream(self, requests: list[Request]) -> Iterator[tuple[str, int]]:
        """Submit ``requests`` and yield ``(request_id, token)`` as tokens are produced, until all finish.

        No token of a request is yielded after :meth:`cancel` returned True for it; closing the generator early
        cancels this call's unfinished requests, releasing their pages at once."""
        self._enter()
        outs: list[RequestOutput] = []
        timed = False
        try:
            self._yielded = {}
            outs = [self.add_request(r) for r in requests]
            self.metrics.begin()
            timed = True
            while self.has_work:
                for rid, tok in self.step():
                    if not isinstance(getattr(self.outputs.get(rid), "error", None), CancelledError):  # not cancelled
                        self._yielded[rid] = self._yielded.get(rid, 0) + 1
                        yield rid, tok
        finally:
            if timed:  # a stream closed early still adds its window (its tokens count in summary())
                self.metrics.finish()
            self._yielded = None
            for o in outs:
                if o.finish_reason is None:
                    self.cancel(o.id)
            self._driving = False

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        """Run ``requests`` to completion; outputs in input order (a duplicate id gets its own error output).

        Interrupted by an exception (a ``KeyboardInterrupt`` in the caller included), it cancels this call's
        unfinished requests -- their pages are released -- before re-raising, as a closed :meth:`stream` does."""
        self._enter()
        outs: list[RequestOutput] = []
        try:
            for r in requests:
                outs.append(self.add_request(r))
            self.metrics.begin()
            while self.has_work:
                self.step()
            self.metrics.finish()
        except BaseException:
            for o in outs:
                if o.finish_reason is None:
                    self.cancel(o.id)
            raise
        finally:
            self._driving = False
        return outs

    def warm_handoff(self) -> int:
        """Compile the handoff's export and import (both ways: prompt pages to decode, prefix hits to prefill) at
        every power-of-two chunk size they can use, and the decode pool's page copy (a whole cached prompt's last
        page, ``decode_hit_suffix``) at every power of two up to one page per row, so serving never compiles them
        (page id 0 reads the null page's zeros and writes nothing). Returns the number of chunk sizes."""
        sizes = [1 << i for i in range((self.prefill.num_pages - 1).bit_length())]  # 1, 2, 4, .. <= pages held
        for size in sizes:
            null = [0] * size
            self.decode.land(null, self._carry(self.prefill.export(null), self.decode))
            if size <= self.limits.max_pages:  # a prefix hit is at most one request's pages
                self.prefill.land(null, self._carry(self.decode.export(null, self.prefill.pool_dtype), self.prefill))
        if self.serve.decode_hit_suffix:
            for size in (1 << i for i in range(bucket(self.max_batch).bit_length())):  # 1, 2, .. bucket(max_batch)
                self.decode.copy_pages([0] * size, [0] * size)
        self.prefill.block()
        self.decode.block()
        return len(sizes)

    def warm_up(self, on_shape: Callable[[str, tuple, float], None] | None = None) -> dict[str, int]:
        """Compile every shape serving can run before any request arrives, so none compiles while requests wait:
        the handoff's chunk sizes (:meth:`warm_handoff`), every padded prefill group (rows x chunk x page-table
        width, :meth:`PrefillWorker.shapes`) and every padded decode batch (rows x width, with its integrity
        check). The shapes are the engine's buckets (powers of two, widths of :func:`width_bucket`), so their
        number grows with the log of ``max_batch``, ``max_prefill_tokens`` and the context. Returns the counts.

        Decode shapes first (every step runs one), then prefill's. It stops compiling once the process holds
        :data:`MAP_USE_STOP` of the kernel's memory-map limit (:func:`memory_map_use`): a CPU process past it
        segfaults in the next compile (a shape whose step is compiled already, as replicas sharing their steps find it,
        is still run). ``shapes_left`` counts the shapes it left to compile on first use.
        ``on_shape(phase, shape, seconds)`` is called after each shape compiles (``lab.bench.warmup_maps``)."""
        rows, chunk = self.max_batch, min(self.serve.max_prefill_tokens, self.limits.max_context)
        pages = min(self.limits.max_pages, -(-self.limits.max_context // self.serve.cache.page_size))
        todo = [("decode_shapes", s) for s in self.decode.shapes(rows, pages)]
        todo += [("prefill_shapes", s) for s in self.prefill.shapes(rows, chunk, pages)]
        done = {"prefill_shapes": 0, "decode_shapes": 0}
        for phase, shape in todo:
            worker = self.decode if phase == "decode_shapes" else self.prefill
            steps = getattr(worker, "steps", None)  # a remote worker's compiled steps are not in this process
            shared = steps is not None and steps.ready(shape)  # compiled already (replicas sharing their steps)
            if not shared and (use := memory_map_use()) is not None and use >= MAP_USE_STOP:
                break
            t0 = time.perf_counter()
            worker.warm(*shape)
            done[phase] += 1
            if on_shape is not None:
                on_shape(phase, shape, time.perf_counter() - t0)
        handoff = self.warm_handoff()
        return {**done, "handoff_sizes": handoff, "tag_sync_sizes": self.decode.warm_tags(),
                "shapes_left": len(todo) - sum(done.values())}

    def reset_metrics(self) -> None:
        """Start a new measurement run: clear the run counters and the finished outputs (nothing in flight)."""
        self.metrics = RunMetrics()
        self.outputs = {k: v for k, v in self.outputs.items() if k in self._seqs}
        self.scheduler.lookup_pages = self.scheduler.hit_pages = self.scheduler.deferrals = 0

    def summary(self) -> dict:
        """Run metrics (``engine.metrics``), plus prefix reuse: ``prefix_hit_rate`` (full prompt pages found cached /
        looked up), ``prefill_tokens_saved`` (prompt tokens not computed thanks to a hit) and ``prefix_deferrals``
        (admissions put off to wait for a shared prefix being computed); ``kernels``: which implementation each op
        of the prefill and decode steps built, and its layout on the phase's mesh (``engine.metrics``)."""
        out = self.metrics.summary(list(self.outputs.values()), self.scheduler.lookup_pages, self.scheduler.hit_pages)
        out["prefill_tokens_saved"] = self.scheduler.hit_pages * self.serve.cache.page_size
        out["prefix_deferrals"] = self.scheduler.deferrals
        out["kernels"] = kernel_provenance(self.prefill.kernels, self.decode.kernels)
        return out

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()

    def health(self) -> str | None:
        """None while the engine can serve, else why not (in process: always None; a remote engine reports a
        worker that is down)."""
        return None

    def close(self) -> None:
        """Release what the engine holds outside this process (nothing, in process)."""
