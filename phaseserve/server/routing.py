"""Which engine replica takes a new request: prefix affinity, within a load bound, else the least loaded.

Every replica keeps its own prefix cache, so a prompt whose prefix one replica has cached costs a prefill anywhere
else. :class:`Balancer` keeps an approximate map of what each replica holds, as SGLang's cache-aware router does
(never asking the engines): the chained hashes of every request's full prompt pages (salted by its tenant, as the
engines' own hash chains are), each pointing at the replica it was sent to, least recently used first out. A new
request goes to the replica of its longest page chain found there, unless that replica's load exceeds the least
loaded one's by more than ``affinity_slack`` times the request's own load, or it already runs ``capacity`` requests
(its batch is full: the request would wait there while another replica has room); otherwise, and with no chain found, to
the replica with the fewest tokens in flight (prompt + ``max_tokens`` of its requests not yet closed), ties to the
lowest index. The map can be wrong (a replica evicts pages on its own): a wrong guess costs a prefill, never a
wrong token.

``fill`` (packing at low load): while some replica runs fewer than ``fill`` requests, a new request goes to the first
such replica, or to the one holding its prefix if that one is below the mark and already running requests (or no
replica runs any: an idle server loses nothing by following the prefix); past the mark on every replica, the rule
above. Where each replica's step has a large fixed cost (XLA:CPU, where the replicas also share the cores), one
batch of 7 rows beat two of 3.5 under ``vllm bench serve`` at concurrency 8 (``benchmarks/vllm_race/profile.md``,
2026-12-07, fourth session): spreading from the first request pays that cost twice for the same tokens.

    page chain of a prompt:  h1 = hash(tenant, page 1); h2 = hash(h1, page 2); ...   (full pages only)
"""

from __future__ import annotations

import collections
from typing import Any

from phaseserve.engine.replicas import request_load
from phaseserve.engine.request import Request
from phaseserve.server.schemas import ApiError

AFFINITY_PAGES = 64  # prompt pages hashed per request (a longer shared prefix routes as its first 64 pages)
AFFINITY_ENTRIES = 65536  # page hashes remembered over all replicas (least recently used dropped first)
AFFINITY_SLACK = 2.0  # a replica holding the prefix may carry this many times the request's load more than the least


def page_chain(req: Request, page_size: int, limit: int = AFFINITY_PAGES) -> list[int]:
    """The chained hashes of ``req``'s full prompt pages (at most ``limit``), salted by its tenant."""
    out, h = [], hash(("phaseserve-route", req.tenant))
    prompt = req.prompt
    for i in range(min(len(prompt) // page_size, limit)):
        h = hash((h, tuple(prompt[i * page_size:(i + 1) * page_size])))
        out.append(h)
    return out


class Balancer:
    """Routes requests over ``loops`` (the module docstring); at most ``max_in_flight`` requests are open at once over
    all loops (the engines' waiting queues are bounded under any load): one more is a 503 ``server_overloaded``.
    ``page_size`` None: no prefix affinity (least loaded only); ``capacity``: requests one replica runs at once (its
    ``max_batch``; None: unbounded); ``fill``: pack requests on the first replicas up to this many each (None: spread
    from the first request). Used from the event-loop thread only."""

    def __init__(self, loops: list[Any], max_in_flight: int | None = None, page_size: int | None = None,
                 capacity: int | None = None, affinity_slack: float = AFFINITY_SLACK, entries: int = AFFINITY_ENTRIES,
                 fill: int | None = None):
        if fill is not None and fill < 1:
            raise ValueError(f"fill must be >= 1 or None, got {fill}")
        self.loops = loops
        self.fill = fill
        self.load = [0] * len(loops)
        self.count = [0] * len(loops)  # requests in flight per replica
        self.capacity = capacity
        self.in_flight = 0
        self.max_in_flight = max_in_flight
        self.page_size = page_size if len(loops) > 1 else None
        self.affinity_slack, self.entries = affinity_slack, entries
        self.owner: collections.OrderedDict[int, int] = collections.OrderedDict()  # page-chain hash -> replica
        self.affinity_hits = 0  # requests sent to the replica holding their prefix

    def acquire(self, req: Request) -> int:
        if self.max_in_flight is not None and self.in_flight >= self.max_in_flight:
            raise ApiError(503, f"the server has {self.in_flight} requests in flight, its limit; retry later",
                           "server_error", code="server_overloaded")
        i = min(range(len(self.loops)), key=lambda j: (self.load[j], j))
        chain = page_chain(req, self.page_size) if self.page_size else []
        held = next((self.owner[h] for h in reversed(chain) if h in self.owner), None)
        below = [] if self.fill is None else [j for j, n in enumerate(self.count) if n < self.fill]
        if below:  # packing: the prefix's replica if it runs requests below the mark (or none runs any), else the first
            i = held if held in below and (self.count[held] > 0 or self.in_flight == 0) else below[0]
        elif held is not None:
            room = self.capacity is None or self.count[held] < self.capacity
            if room and self.load[held] - self.load[i] <= self.affinity_slack * request_load(req):
                i = held
        self.affinity_hits += held is not None and i == held
        if self.page_size:
            for h in chain:
                self.owner[h] = i
                self.owner.move_to_end(h)
            while len(self.owner) > self.entries:
                self.owner.popitem(last=False)
        self.load[i] += request_load(req)
        self.count[i] += 1
        self.in_flight += 1
        return i

    def release(self, i: int, req: Request) -> None:
        self.load[i] -= request_load(req)
        self.count[i] -= 1
        self.in_flight -= 1
