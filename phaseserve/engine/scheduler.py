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

A concurrency cap (``max_batch``) bounds the running batch (the decode step's rows).

Prefix reuse: full prompt pages are keyed by a hash chain ``h_i = H(h_{i-1}, tokens of page i)`` seeded with the
request's tenant salt, so equal prefixes of one tenant map to the same pages and a different tenant never hits.
An entry records ``(page, tag)`` and is only honoured while the allocator still gives that page that tag with a
live reference: a freed or reissued page can never be handed out as a prefix hit. The index is a registered tag
holder of the allocator, so at tag wraparound its tags are retired with the live requests' ones and a stale entry
can never match a page reissued (to any tenant) in a later epoch.

Containment: an exception while growing or admitting one sequence removes that sequence alone (its pages released)
and reports it in ``ScheduleResult.failed``; the rest of the round goes on.
"""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from phaseserve.cache.allocator import PageTables
from phaseserve.engine.request import Request, RequestOutput, pages_ever


@dataclass(eq=False)
class Sequence:
    """Engine-side state of one request."""

    request: Request
    output: RequestOutput
    tokens: list[int]  # prompt + generated so far
    num_prompt: int  # tokens prefilled at the last admission (prompt, plus generated ones after a preemption)
    shared_pages: int = 0  # leading pages taken from the prefix cache at admission
    admitted_order: int = 0
    swap: Any = None  # preemption="swap": the pages held at preemption, then their KV on the host, until swapped in

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def next_position(self) -> int:
        """Position of the pending input token (the last one in ``tokens``) in the next decode step."""
        return len(self.tokens) - 1


def page_hashes(tokens: list[int], page_size: int, salt: str, num_pages: int) -> list[bytes]:
    """Hash chain over the first ``num_pages`` full pages of ``tokens``."""
    out, h = [], hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for i in range(num_pages):
        chunk = tokens[i * page_size:(i + 1) * page_size]
        h = hashlib.blake2b(h + b"|" + ",".join(map(str, chunk)).encode(), digest_size=16).digest()
        out.append(h)
    return out


@dataclass
class ScheduleResult:
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, Exception]] = field(default_factory=list)  # removed, pages released


class Scheduler:
    def __init__(self, tables: PageTables, page_size: int, max_batch: int, policy: str = "reserve",
                 prefix_caching: bool = True, preemption: str = "recompute"):
        if policy not in ("reserve", "on_demand"):
            raise ValueError(f"admission policy must be 'reserve' or 'on_demand', got {policy!r}")
        if preemption not in ("recompute", "swap"):
            raise ValueError(f"preemption must be 'recompute' or 'swap', got {preemption!r}")
        self.preemption = preemption
        self.tables = tables
        self.page_size = page_size
        self.max_batch = max_batch
        self.policy = policy
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix: dict[bytes, tuple[int, int]] = {}  # hash -> (page, tag)
        self.lookup_pages = 0
        self.hit_pages = 0
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

    def _lookup_prefix(self, seq: Sequence) -> list[int]:
        if not self.prefix_caching or seq.swap is not None:  # a swapped-out request brings its own KV back
            return []
        full = seq.num_prompt // self.page_size  # only full pages: decode writes start past them
        hits = []
        alloc = self.tables.allocator
        for h in page_hashes(seq.tokens, self.page_size, seq.request.tenant, full):
            entry = self.prefix.get(h)
            if entry is None or alloc.tags[entry[0]] != entry[1] or alloc.refcount[entry[0]] == 0:
                break
            hits.append(entry[0])
        self.lookup_pages += full
        self.hit_pages += len(hits)
        return hits

    def register_prefix(self, seq: Sequence) -> None:
        """Record ``seq``'s full prompt pages (after their KV has been written) for later hits."""
        if not self.prefix_caching:
            return
        full = seq.num_prompt // self.page_size
        owned = self.tables.owned(seq.id)
        alloc = self.tables.allocator
        for i, h in enumerate(page_hashes(seq.tokens, self.page_size, seq.request.tenant, full)):
            if h not in self.prefix or alloc.tags[self.prefix[h][0]] != self.prefix[h][1]:
                self.prefix[h] = (owned[i], int(alloc.tags[owned[i]]))
        if len(self.prefix) > 2 * alloc.num_pages:  # drop entries whose page was freed or reissued since
            self.prefix = {h: (p, t) for h, (p, t) in self.prefix.items() if alloc.tags[p] == t}

    # ---- queue ---------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _try_admit(self, seq: Sequence) -> bool:
        hits = self._lookup_prefix(seq)
        need = self.pages_needed(seq) - len(hits)
        if self.tables.allocator.num_free < need:
            return False
        self.tables.add(seq.id)
        try:
            if hits:
                self.tables.share(seq.id, hits)
            if need > 0 and self.tables.allocate(seq.id, need) is None:  # cannot happen after the check; be safe
                self.tables.release(seq.id)
                return False
        except Exception:
            self.tables.release(seq.id)
            raise
        seq.shared_pages = len(hits)
        seq.output.metrics.prefix_hit_tokens = len(hits) * self.page_size
        return True

    def _preempt_one(self, result: ScheduleResult) -> bool:
        if not self.running:
            return False
        victim = max(self.running, key=lambda s: s.admitted_order)
        self.running.remove(victim)
        if self.preemption == "swap":  # its KV is still in these pages until the next device write
            victim.swap = self.tables.owned(victim.id)
        self.tables.release(victim.id)
        victim.num_prompt = len(victim.tokens) - 1  # recompute: prefill all but the pending input token
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
        while self.waiting and len(self.running) < self.max_batch and not result.preempted:  # no thrashing
            seq = self.waiting[0]
            try:
                admitted = self._try_admit(seq)
            except Exception as e:
                self.waiting.popleft()
                result.failed.append((seq, e))
                continue
            if not admitted:
                break
            self.waiting.popleft()
            self._order += 1
            seq.admitted_order = self._order
            self.running.append(seq)
            result.admitted.append(seq)
        return result

    def finish(self, seq: Sequence) -> None:
        """Release a finished (or aborted/cancelled) request's pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.id in self.tables:
            self.tables.release(seq.id)

    def check_invariants(self) -> None:
        self.tables.check_invariants()
        ids = [s.id for s in self.running] + [s.id for s in self.waiting]
        assert len(ids) == len(set(ids)), "a request is queued twice"
        assert len(self.running) <= self.max_batch
        assert all(s.id in self.tables for s in self.running), "a running request holds no page table"
        assert not any(s.id in self.tables for s in self.waiting), "a waiting request holds pages"
