"""Scheduler (no JAX): admission by free pages under both policies, the concurrency cap, growth and preemption by
recompute, tenant-salted prefix reuse, stale prefix entries, a drain that frees every page, chunked prefill under a
token budget with the prefill pool's pages, and requests sharing a prefix computing it once."""

from __future__ import annotations

import numpy as np
import pytest

from phaseserve.cache.allocator import PageAllocator, PageTables
from phaseserve.engine.request import Request, RequestOutput, Sequence
from phaseserve.engine.scheduler import Scheduler, page_hashes


def make(num_pages=17, page_size=4, max_batch=8, policy="reserve", prefix=True, prefill_pages=None, retain=False):
    tables = PageTables(PageAllocator(num_pages), max_pages_per_seq=16)
    pre = None if prefill_pages is None else PageTables(PageAllocator(prefill_pages), max_pages_per_seq=16)
    return Scheduler(tables, page_size, max_batch, policy, prefix, prefill_tables=pre, retain_prefixes=retain)


def run_chunks(s, budget):
    """One step's prefill as the engine does it: plan, compute, hand off (prefilled + registered) the done ones."""
    chunks = s.plan_chunks(budget)
    for c in chunks:
        c.seq.computed += c.n
        if c.ends_prompt:
            s.prefilled(c.seq)
            s.register_prefix(c.seq)
    s.check_invariants()
    return [(c.id, c.start, c.n) for c in chunks]


def seq(rid, prompt, max_tokens=4, tenant=""):
    r = Request(id=rid, prompt=list(prompt), max_tokens=max_tokens, tenant=tenant)
    return Sequence(request=r, output=RequestOutput(id=rid), tokens=list(prompt), num_prompt=len(prompt))


def test_reserve_admits_by_whole_request_pages_and_respects_the_cap():
    s = make(num_pages=17, max_batch=3)  # 16 usable pages
    seqs = [seq(f"r{i}", range(10 * i, 10 * i + 7), max_tokens=6) for i in range(5)]  # 7 + 6 - 1 -> 3 pages each
    for q in seqs:
        s.add(q)
    res = s.schedule()
    assert [q.id for q in res.admitted] == ["r0", "r1", "r2"]  # capped by max_batch, not pages
    assert s.tables.allocator.num_free == 16 - 9
    s.check_invariants()
    s.max_batch = 8
    res = s.schedule()
    assert [q.id for q in res.admitted] == ["r3", "r4"] and s.tables.allocator.num_free == 1
    for q in list(s.running):
        s.finish(q)
        s.check_invariants()
    assert s.tables.allocator.num_free == 16


def test_reserve_stops_at_the_head_of_the_queue_when_short():
    s = make(num_pages=8)  # 7 usable
    s.add(seq("big", range(20), max_tokens=9))  # 28 tokens -> 7 pages
    s.add(seq("small", range(3), max_tokens=2))
    assert [q.id for q in s.schedule().admitted] == ["big"]
    assert s.schedule().admitted == [] and s.tables.allocator.num_free == 0  # FCFS: small waits behind nothing
    s.finish(s.running[0])
    assert [q.id for q in s.schedule().admitted] == ["small"]


def test_on_demand_grows_and_preempts_the_newest_by_recompute():
    s = make(num_pages=7, policy="on_demand")  # 6 usable pages of 4 tokens
    a, b = seq("a", range(7), max_tokens=20), seq("b", range(10, 17), max_tokens=20)
    s.add(a)
    s.add(b)
    assert [q.id for q in s.schedule().admitted] == ["a", "b"]  # 2 pages each (7 prompt + 1 pending)
    for step in range(12):
        for q in s.running:
            q.tokens.append(step)  # one decoded token each
        res = s.schedule()
        s.check_invariants()
        if res.preempted:
            break
    assert [q.id for q in res.preempted] == ["b"] and [q.id for q in s.running] == ["a"]
    assert list(s.waiting) == [b] and b.id not in s.tables and b.output.metrics.preemptions == 1
    assert b.num_prompt == len(b.tokens) - 1  # it will be prefilled again up to its pending token
    assert len(s.tables.owned("a")) * 4 >= a.next_position + 1


def test_prefix_hits_need_the_same_tenant_and_intact_kv():
    live = make(num_pages=33)  # the default: only pages a live request holds serve hits
    first = seq("q0", list(range(100, 112)) + [1])
    live.add(first)
    live.schedule()
    live.register_prefix(first)
    live.finish(first)
    late = seq("q1", list(range(100, 112)) + [1])
    live.add(late)
    live.schedule()
    assert late.shared_pages == 0
    s = make(num_pages=33, retain=True)
    alloc = s.tables.allocator
    prefix = list(range(100, 112))  # three full pages
    first = seq("p0", prefix + [1, 2])
    s.add(first)
    s.schedule()
    s.register_prefix(first)
    same, other = seq("p1", prefix + [3]), seq("p2", prefix + [3], tenant="acme")
    s.add(same)
    s.add(other)
    s.schedule()
    assert same.shared_pages == 3 and other.shared_pages == 0
    pages = s.tables.owned("p0")[:3]
    assert s.tables.owned("p1")[:3] == pages
    assert alloc.refcount[pages[0]] == 2
    s.check_invariants()
    old_tags = alloc.tags[pages].copy()
    for q in list(s.running):
        s.finish(q)
    assert alloc.num_free == 32  # retained pages count as free
    late = seq("p3", prefix + [4])
    s.add(late)
    s.schedule()
    assert late.shared_pages == 3 and s.tables.owned("p3")[:3] == pages  # freed, KV intact: revived
    assert (alloc.refcount[pages] == 1).all() and not np.isin(alloc.tags[pages], old_tags).any()  # fresh tags
    s.check_invariants()
    s.finish(late)
    alloc.forget(pages[2:])  # the last page's KV is gone (scrubbed)
    part = seq("p4", prefix + [5])
    s.add(part)
    s.schedule()
    assert part.shared_pages == 2
    s.finish(part)
    grabbed = alloc.allocate(alloc.num_free)  # every free page reissued: their KV is overwritten
    alloc.free(grabbed)
    gone = seq("p5", prefix + [6])
    s.add(gone)
    s.schedule()
    assert gone.shared_pages == 0  # reissued pages are never honoured
    s.finish(gone)
    assert alloc.num_free == 32
    s.check_invariants()


def test_without_prefix_caching_nothing_is_registered_or_hit():
    s = make(num_pages=33, prefix=False)
    prefix = list(range(100, 112))
    first = seq("p0", prefix + [1])
    s.add(first)
    s.schedule()
    s.register_prefix(first)
    again = seq("p1", prefix + [1])
    s.add(again)
    s.schedule()
    assert not s.prefix and again.shared_pages == 0 and first.shared_pages == 0
    s.check_invariants()


def test_retained_prefix_pages_are_overwritten_last_and_never_block_an_allocation():
    s = make(num_pages=9, retain=True)  # 8 usable pages
    alloc = s.tables.allocator
    a = seq("a", list(range(100, 108)) + [1], max_tokens=1)  # two full prompt pages + one
    s.add(a)
    s.schedule()
    s.register_prefix(a)
    kept = s.tables.owned("a")[:2]
    s.finish(a)
    assert set(alloc.free_pages()[-3:]) >= set(kept)  # freed last: overwritten last
    fill = alloc.allocate(alloc.num_free - 3)  # all but three pages: the retained ones are spared
    assert not set(fill) & set(kept)
    b = seq("b", list(range(100, 108)) + [2], max_tokens=1)
    s.add(b)
    s.schedule()
    assert b.shared_pages == 2 and alloc.num_free == 0  # two revived, its third page the last free one
    s.finish(b)
    alloc.free(fill)
    every = alloc.allocate(alloc.num_free)  # retained pages never make an allocation fail
    assert every is not None and set(kept) <= set(every)
    alloc.free(every)
    c = seq("c", list(range(100, 108)) + [3], max_tokens=1)
    s.add(c)
    s.schedule()
    assert c.shared_pages == 0  # reissued since: no hit
    s.finish(c)
    s.check_invariants()


def test_hash_chain_depends_on_every_earlier_token_and_the_salt():
    toks = list(range(12))
    h = page_hashes(toks, 4, "", 3)
    changed = page_hashes([99] + toks[1:], 4, "", 3)
    assert all(x != y for x, y in zip(h, changed, strict=True))  # a change in page 0 changes every later hash
    assert page_hashes(toks, 4, "t", 3)[0] != h[0]
    assert page_hashes(toks + [5], 4, "", 3) == h


def test_random_workload_drains_without_leaks():
    rng = np.random.default_rng(0)
    for policy in ("reserve", "on_demand"):
        s = make(num_pages=25, max_batch=6, policy=policy)
        pending = [seq(f"{policy}{i}", rng.integers(0, 5, rng.integers(1, 12)).tolist(),
                       max_tokens=int(rng.integers(1, 10))) for i in range(30)]
        for q in pending:
            s.add(q)
        for _ in range(400):
            res = s.schedule()
            for q in res.admitted:
                s.register_prefix(q)
            for q in res.preempted:
                assert q.num_prompt == len(q.tokens) - 1
            for q in list(s.running):
                q.tokens.append(int(rng.integers(0, 5)))
                if q.num_generated >= q.request.max_tokens:
                    s.finish(q)
            s.check_invariants()
            if not s.running and not s.waiting:
                break
        assert not s.running and not s.waiting, policy
        assert s.tables.allocator.num_free == 24 and (s.tables.allocator.refcount == 0).all()


def test_unknown_policy():
    with pytest.raises(ValueError, match="admission policy"):
        make(policy="greedy")


def test_chunks_share_the_token_budget_and_hold_prefill_pages_until_handed_off():
    s = make(num_pages=33, prefill_pages=9)  # 8 prefill pages: 32 tokens in progress at most
    a, b, c = seq("a", range(100, 118)), seq("b", range(200, 205)), seq("c", range(300, 320))
    for q in (a, b, c):
        s.add(q)
    assert [q.id for q in s.schedule().admitted] == ["a", "b", "c"]  # decode pages; prefill pages at the 1st chunk
    pre = s.prefill_tables.allocator
    assert run_chunks(s, 8) == [("a", 0, 8)] and pre.num_free == 3  # a holds its 5 prefill pages
    assert run_chunks(s, 8) == [("a", 8, 8)]
    # the tail of a and all of b share one step; c (5 pages) cannot start while a and b hold 7 of the 8
    assert run_chunks(s, 8) == [("a", 16, 2), ("b", 0, 5)]
    assert not a.prefilling and not b.prefilling and c.prefilling and pre.num_free == 8
    assert run_chunks(s, 8) == [("c", 0, 8)]
    assert run_chunks(s, 64) == [("c", 8, 12)] and pre.num_free == 8
    assert s.plan_chunks(8) == []
    for q in list(s.running):
        s.finish(q)
    s.check_invariants()
    assert s.tables.allocator.num_free == 32 and pre.num_free == 8


def test_requests_sharing_a_prefix_compute_it_once():
    s = make(num_pages=65, prefill_pages=33, max_batch=8)
    prefix = list(range(500, 512))  # three full pages
    same = [seq(f"s{i}", prefix + [i, i + 1]) for i in range(3)]
    other = seq("o", range(600, 614))
    for q in same + [other]:
        s.add(q)
    res = s.schedule()
    assert [q.id for q in res.admitted] == ["s0", "o"]  # s1, s2 wait for s0's prefix; o passes them
    assert list(s.waiting) == same[1:] and s.deferrals == 2
    assert run_chunks(s, 4) == [("s0", 0, 4)]
    assert s.schedule().admitted == []  # s0's pages are still being computed
    run_chunks(s, 64)
    res = s.schedule()
    assert [q.id for q in res.admitted] == ["s1", "s2"]
    assert [(q.shared_pages, q.computed) for q in res.admitted] == [(3, 12), (3, 12)]
    assert s.tables.owned("s1")[:3] == s.tables.owned("s0")[:3] == s.tables.owned("s2")[:3]
    assert run_chunks(s, 64) == [("s1", 12, 2), ("s2", 12, 2)]  # only the suffixes are computed
    assert s.hit_pages == 6
    whole = seq("w", prefix)  # a prompt that is all cached pages still computes its last token
    s.add(whole)
    s.schedule()
    assert (whole.shared_pages, whole.computed) == (2, 8) and run_chunks(s, 64) == [("w", 8, 4)]


def test_preempting_a_prompt_in_progress_restarts_it_and_frees_its_prefill_pages():
    s = make(num_pages=9, policy="on_demand", prefill_pages=17)  # 8 decode pages of 4 tokens
    a, b = seq("a", range(7), max_tokens=30), seq("b", range(50, 69), max_tokens=4)
    s.add(a)
    s.add(b)
    s.schedule()
    assert run_chunks(s, 10) == [("a", 0, 7), ("b", 0, 3)]  # a done; b in progress
    assert b.prefilling and "b" in s.prefill_tables and s.prefill_tables.allocator.num_free == 11
    preempted = []
    for step in range(12):
        a.tokens.append(step)
        preempted += s.schedule().preempted
        s.check_invariants()
        if preempted:
            break
    assert preempted == [b] and b.num_prompt == 19 and b.computed == 0  # the prompt again, not prompt - 1
    assert "b" not in s.prefill_tables and s.prefill_tables.allocator.num_free == 16


def test_plan_chunks_without_split_keeps_whole_prompts_within_the_budget():
    """``split=False`` (the engine's launches while requests decode): whole prompts while they fit, the first prompt
    cut to the budget when it alone is longer; the default cuts the last prompt to the budget's remainder."""
    s = make(num_pages=64, prefill_pages=64)
    for i, n in enumerate((5, 6, 7)):
        s.add(seq(f"r{i}", range(10 * i, 10 * i + n)))
    s.schedule()
    assert [(c.id, c.n) for c in s.plan_chunks(12, split=False)] == [("r0", 5), ("r1", 6)]
    assert [(c.id, c.n) for c in s.plan_chunks(12)] == [("r0", 5), ("r1", 6), ("r2", 1)]
    assert [(c.id, c.n) for c in s.plan_chunks(3, split=False)] == [("r0", 3)]
    assert [(c.id, c.n) for c in s.plan_chunks(12, skip={"r0"})] == [("r1", 6), ("r2", 6)]  # r0's chunk in flight
