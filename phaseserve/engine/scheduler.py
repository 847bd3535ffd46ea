"""Continuous-batching scheduler (plain Python + numpy, no JAX).

State::

    waiting (deque, FCFS)  ->  admitted (pages allocated, prefilled this step)  ->  running (decode rows)
         ^                                                                             |
         +------------------- preempted (pages released, recompute later) -------------+

Admission is by free KV pages under one of two policies:

- ``"reserve"``: at admission a request gets every page it can ever need, ``ceil((prompt + max_tokens - 1) /
  page_size)``; it can never run out later, so nothing is ever preempted. Capacity is what is reserved.
- ``"on_demand"``: a request gets the pages of its prompt plus the next token; before each decode step every
  running request grows by a page when its next token crosses a page boundary. When the pool is short, the most
  recently admitted request is preempted *by recompute*: its pages are released and it goes back to the front of
  the queue with its generated tokens appended to its prompt, to be prefilled again (``preemption="recompute"``),
  or, with ``preemption="swap"``, it records the pages it held (``Sequence.swap``) so the engine copies their KV
  to host memory before anything overwrites them and writes it back into fresh pages at readmission (no prefill).

A concurrency cap (``max_batch``) bounds the running batch (the decode step's rows, and the prompts in progress).

Chunked prefill: an admitted request is *prefilling* until the KV of all ``num_prompt`` tokens exists
(``Sequence.computed``). Each step :meth:`Scheduler.plan_chunks` shares a token budget (``max_prefill_tokens``) among
the prefilling requests, oldest first: one :class:`Chunk` (``start = computed``, ``n`` tokens) each while the budget
lasts, so a long prompt advances a chunk per step beside other prompts' chunks and the running decode batch.
With ``prefill_tables`` (the prefill pool's page tables), a request holds the prefill pages of its whole prompt from
its first chunk until its pages are handed to decode (:meth:`Scheduler.prefilled`); a preempted or finished request
gives them back. Preemption by recompute re-enters the same path (its prompt is then prompt + generated tokens).

Prefix reuse: full prompt pages are keyed by a hash chain ``h_i = H(h_{i-1}, tokens of page i)`` seeded with the
request's tenant salt, so equal prefixes of one tenant map to the same pages and a different tenant never hits. A
hit skips compute: the request starts prefilling at ``computed = hits * page_size`` (at least one prompt token is
always computed: it gives the first output token). A waiting request whose next page is being computed right now by
a prefilling request (same hash) is *deferred* -- left in the queue, later ones may pass it -- until that page is
registered, so requests submitted together that share a prefix compute it once.
An entry records ``(page, tag)`` and is honoured while the page still holds that KV
(:meth:`~phaseserve.cache.allocator.PageAllocator.holds`): held under that tag by a live request, or, with
``retain_prefixes``, freed with it and neither reissued nor scrubbed since (retained, as vLLM's and SGLang's prefix
caches keep finished requests' blocks: a later request with the same prompt prefix revives the page under a fresh
tag instead of recomputing it; retained pages stay in the free queue, overwritten least recently freed first;
off by default, since a detected integrity fault does not yet mark the pages it touched unfit). A reissued or
scrubbed page can never be handed out as a prefix hit. The index is a registered tag
holder of the allocator, so at tag wraparound its tags are retired with the live requests' ones and a stale entry
can never match a page reissued (to any tenant) in a later epoch.

Containment: an exception while growing or admitting one sequence removes that sequence alone (its pages released)
and reports it in ``ScheduleResult.failed``; the rest of the round goes on.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field

from phaseserve.cache.allocator import PageTables
from phaseserve.engine.request import Request, Sequence, pages_ever


def page_hashes(tokens: list[int], page_size: int, salt: str, num_pages: int) -> list[bytes]:
    """Hash chain over the first ``num_pages`` full pages of ``tokens``."""
    out, h = [], hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for i in range(num_pages):
        chunk = tokens[i * page_size:(i + 1) * page_size]
        h = hashlib.blake2b(h + b"|" + ",".join(map(str, chunk)).encode(), digest_size=16).digest()
        out.append(h)
    return out


@dataclass(eq=False)
class Chunk:
    """The next ``n`` prompt tokens of ``seq`` to prefill, from position ``start``."""

    seq: Sequence
    start: int
    n: int
    first: bool = False  # the prompt's first chunk (a prefix hit's pages are to be loaded before it runs)

    @property
    def id(self) -> str:
        return self.seq.id

    @property
    def ends_prompt(self) -> bool:
        return self.start + self.n == self.seq.num_prompt


ADMITTED, SHORT, DEFERRED = "admitted", "short", "deferred"


@dataclass
class ScheduleResult:
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # removed, pages released


class Scheduler:
    def __init__(self, tables: PageTables, page_size: int, max_batch: int, policy: str = "reserve",
                 prefix_caching: bool = True, preemption: str = "recompute",
                 prefill_tables: PageTables | None = None, retain_prefixes: bool = False):
        if policy not in ("reserve", "on_demand"):
            raise ValueError(f"admission policy must be 'reserve' or 'on_demand', got {policy!r}")
        if preemption not in ("recompute", "swap"):
            raise ValueError(f"preemption must be 'recompute' or 'swap', got {preemption!r}")
        self.preemption = preemption
        self.tables = tables
        self.prefill_tables = prefill_tables  # the prefill pool's tables (None: not accounted here)
        self.page_size = page_size
        self.max_batch = max_batch
        self.policy = policy
        self.prefix_caching = prefix_caching
        self.retain_prefixes = retain_prefixes  # honour entries of freed pages whose KV is intact
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix: dict[bytes, tuple[int, int]] = {}  # hash -> (page, tag)
        self.lookup_pages = 0
        self.hit_pages = 0
        self.deferrals = 0  # admissions put off to wait for a prefix page being computed
        self._order = 0
        tables.allocator.register_tag_holder(lambda: [t for _, t in self.prefix.values()])

    # ---- pages ---------------------------------------------------------------------------------------------
    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def pages_needed(self, seq: Sequence) -> int:
        """Pages to hold at admission under the policy (before prefix sharing)."""
        if self.policy == "reserve":
            return self.max_pages_ever(seq.request)
        return self._pages_for(seq.num_prompt + 1)  # the prefilled tokens and the first decode input

    def max_pages_ever(self, req: Request) -> int:
        """Positions 0 .. prompt + max_tokens - 2 are written (the last sampled token is never fed back)."""
        return pages_ever(len(req.prompt), req.max_tokens, self.page_size)

    def _hashes(self, seq: Sequence) -> list[bytes]:
        """The hash chain of ``seq``'s full prompt pages (cached while ``num_prompt`` is unchanged)."""
        if seq.hashes is None or seq.hashes[0] != seq.num_prompt:
            full = seq.num_prompt // self.page_size
            seq.hashes = (seq.num_prompt, page_hashes(seq.tokens, self.page_size, seq.request.tenant, full))
        return seq.hashes[1]

    def _lookup_prefix(self, seq: Sequence) -> tuple[list[int], bool]:
        """(pages of ``seq``'s prompt found in the prefix cache, whether the next page is being computed now)."""
        if not self.prefix_caching or seq.swap is not None:  # a swapped-out request brings its own KV back
            return [], False
        if seq.request.prompt_logprobs is not None and seq.output.prompt_logprobs[-1] is None:
            return [], False  # scoring the prompt: every position's logits are computed, none taken from the cache
        cap = (seq.num_prompt - 1) // self.page_size  # full pages only, and one prompt token is always computed
        hashes = self._hashes(seq)[:cap]
        hits = []
        for h in hashes:
            entry = self.prefix.get(h)
            if entry is None or not self._usable(*entry):
                break
            hits.append(entry[0])
        pending = len(hits) < len(hashes) and any(
            hashes[len(hits)] in self._hashes(s)[s.shared_pages:] for s in self.running if s.prefilling)
        return hits, pending

    def cached_page(self, seq: Sequence, i: int) -> int | None:
        """The page holding the KV of ``seq``'s ``i``-th full prompt page in the prefix cache (usable now), else None:
        a lookup past the hit's cap (a whole prompt of full pages is a hit but for its last page)."""
        hashes = self._hashes(seq) if self.prefix_caching else []
        entry = self.prefix.get(hashes[i]) if i < len(hashes) else None
        return entry[0] if entry is not None and self._usable(*entry) else None

    def _usable(self, page: int, tag: int) -> bool:
        """An index entry may serve a hit: the page holds its KV, held by a live request unless ``retain_prefixes``."""
        alloc = self.tables.allocator
        return alloc.holds(page, tag) and (self.retain_prefixes or alloc.refcount[page] > 0)

    def register_prefix(self, seq: Sequence) -> None:
        """Record ``seq``'s full prompt pages (after their KV has been written) for later hits."""
        if not self.prefix_caching:
            return
        owned = self.tables.owned(seq.id)
        alloc = self.tables.allocator
        for i, h in enumerate(self._hashes(seq)):
            if h not in self.prefix or not self._usable(*self.prefix[h]):
                self.prefix[h] = (owned[i], int(alloc.tags[owned[i]]))
        if len(self.prefix) > 2 * alloc.num_pages:  # drop entries whose page was reissued or forgotten since
            self.prefix = {h: (p, t) for h, (p, t) in self.prefix.items() if self._usable(p, t)}

    def prefilled(self, seq: Sequence) -> None:
        """``seq``'s prompt KV is in its decode pages now: give back its prefill pages."""
        seq.computed = seq.num_prompt
        if self.prefill_tables is not None and seq.id in self.prefill_tables:
            self.prefill_tables.release(seq.id)

    def plan_chunks(self, budget: int, split: bool = True, skip: set[str] | frozenset = frozenset()) -> list[Chunk]:
        """This step's prefill work: the prefilling requests' next chunks, oldest first, ``budget`` tokens in all. A
        prompt's first chunk also gives it the prefill pages of its whole prompt; while the prefill pool is short,
        it and every later prompt wait (FCFS) for the prompts in progress to be handed off. ``split`` False: a
        prompt's rest is not cut to the budget's remainder (it waits for the next plan), unless it is the first; a
        later prompt whose rest fits the remainder (a prefix hit's short suffix) still goes in.
        ``skip``: ids of requests not to plan now (a chunk of theirs is in flight)."""
        chunks = []
        for seq in sorted(self.running, key=lambda s: s.admitted_order):
            if budget <= 0:
                break
            if not seq.prefilling or seq.id in skip:
                continue
            if not split and chunks and seq.num_prompt - seq.computed > budget:
                continue  # waits for the next plan (where it is the oldest); a shorter rest behind it may fit
            pre = self.prefill_tables
            if pre is not None and seq.id not in pre:
                need = self._pages_for(seq.num_prompt)
                if pre.allocator.num_free < need:
                    break
                pre.add(seq.id)
                if pre.allocate(seq.id, need) is None:  # cannot happen after the check
                    raise RuntimeError(f"prefill pages for {seq.id!r} vanished between the check and the allocation")
            n = min(seq.num_prompt - seq.computed, budget)
            chunks.append(Chunk(seq, seq.computed, n, first=seq.computed == seq.shared_pages * self.page_size))
            budget -= n
        return chunks

    # ---- queue ---------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _try_admit(self, seq: Sequence) -> str:
        hits, pending = self._lookup_prefix(seq)
        if pending:
            return DEFERRED
        alloc = self.tables.allocator
        need = self.pages_needed(seq) - len(hits)
        fresh = seq.swap is None
        if alloc.num_free - int((alloc.refcount[hits] == 0).sum()) < need:  # revived hits leave the free queue
            return SHORT
        self.tables.add(seq.id)
        try:
            if hits:
                self.tables.share(seq.id, hits)
                for h, p in zip(self._hashes(seq), hits, strict=False):  # revived pages carry fresh tags
                    self.prefix[h] = (p, int(alloc.tags[p]))
            if need > 0 and self.tables.allocate(seq.id, need) is None:  # cannot happen after the check; be safe
                raise RuntimeError(f"decode pages for {seq.id!r} vanished between the check and the allocation")
        except Exception:
            self._release(seq)
            raise
        if self.prefix_caching and fresh:
            self.lookup_pages += (seq.num_prompt - 1) // self.page_size
            self.hit_pages += len(hits)
        seq.shared_pages = len(hits)
        seq.computed = len(hits) * self.page_size if fresh else seq.num_prompt
        seq.output.metrics.prefix_hit_tokens = len(hits) * self.page_size
        if seq.output.metrics.admitted is None:
            seq.output.metrics.admitted = time.perf_counter()
        return ADMITTED

    def _release(self, seq: Sequence) -> None:
        """Give back every page ``seq`` holds, decode and prefill."""
        if seq.id in self.tables:
            self.tables.release(seq.id)
        if self.prefill_tables is not None and seq.id in self.prefill_tables:
            self.prefill_tables.release(seq.id)

    def _preempt_one(self, result: ScheduleResult) -> bool:
        if not self.running:
            return False
        victim = max(self.running, key=lambda s: s.admitted_order)
        self.running.remove(victim)
        if self.preemption == "swap" and not victim.prefilling:  # its KV is in these pages until the next write
            victim.swap = self.tables.owned(victim.id)
        self._release(victim)
        # recompute: prefill all but the pending input token (a prompt still prefilling: the prompt again)
        victim.num_prompt = len(victim.tokens) - (1 if victim.num_generated else 0)
        victim.computed = 0
        victim.output.metrics.preemptions += 1
        self.waiting.appendleft(victim)
        result.preempted.append(victim)
        return True

    def schedule(self) -> ScheduleResult:
        """Grow running requests (on_demand, preempting if short), then admit waiting ones FCFS -- but not in a
        round that had to preempt: memory is short, and re-admitting the victim at once would only thrash."""
        result = ScheduleResult()
        if self.policy == "on_demand":
            for seq in sorted(self.running, key=lambda s: s.admitted_order):
                if seq not in self.running:
                    continue
                try:
                    while not self.tables.grow(seq.id, seq.next_position + 1, self.page_size):
                        if not self._preempt_one(result) or seq not in self.running:
                            break
                except Exception as e:
                    self.finish(seq)
                    result.failed.append((seq, e))
        for seq in list(self.waiting):
            if len(self.running) >= self.max_batch or result.preempted:  # no thrashing
                break
            try:
                state = self._try_admit(seq)
            except Exception as e:
                self.waiting.remove(seq)
                result.failed.append((seq, e))
                continue
            if state == DEFERRED:
                self.deferrals += 1
                continue
            if state == SHORT:  # FCFS: nothing passes a request that waits for memory
                break
            self.waiting.remove(seq)
            self._order += 1
            seq.admitted_order = self._order
            self.running.append(seq)
            result.admitted.append(seq)
        return result

    def requeue(self, seq: Sequence) -> None:
        """Put a running request that has emitted nothing back at the head of the queue, its pages released (its
        KV was lost with a worker): it is admitted and prefilled again from its prompt."""
        if seq.num_generated:
            raise ValueError(f"request {seq.id!r} has emitted tokens; it cannot be requeued")
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)
        seq.num_prompt, seq.computed, seq.shared_pages, seq.swap = len(seq.tokens), 0, 0, None
        if seq not in self.waiting:
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted/cancelled) request's pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def check_invariants(self) -> None:
        self.tables.check_invariants()
        ids = [s.id for s in self.running] + [s.id for s in self.waiting]
        assert len(ids) == len(set(ids)), "a request is queued twice"
        assert len(self.running) <= self.max_batch
        assert all(s.id in self.tables for s in self.running), "a running request holds no page table"
        assert not any(s.id in self.tables for s in self.waiting), "a waiting request holds pages"
        if self.prefill_tables is not None:
            self.prefill_tables.check_invariants()
            held = set(self.prefill_tables.slot_of)
            assert held <= {s.id for s in self.running if s.prefilling}, "a request not in progress holds prefill pages"
