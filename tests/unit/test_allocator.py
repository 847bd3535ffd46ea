"""Host page allocator and per-request page tables: exact ids, refcounts, tags and free-queue order; typed errors
that change nothing; tag wraparound; a Hypothesis state machine with invariants after every step; a drain test."""

from __future__ import annotations

import ast
import pathlib

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from phaseserve.cache.allocator import (
    TAG_MAX,
    DoubleFreeError,
    InvalidPageError,
    PageAllocator,
    PageTables,
    UnknownRequestError,
)


def snapshot(a: PageAllocator):
    return (a.refcount.copy(), a.tags.copy(), a.free_pages(), a.num_free, a._next_tag, dict(a._pending), a.epoch,
            a.retired.copy())


def same(s1, s2) -> bool:
    return all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(s1, s2, strict=True))


def test_allocator_imports_no_jax():
    src = pathlib.Path(__file__).parents[2] / "phaseserve" / "cache" / "allocator.py"
    names = {a.name.split(".")[0] for n in ast.walk(ast.parse(src.read_text()))
             if isinstance(n, ast.Import | ast.ImportFrom) for a in (n.names if isinstance(n, ast.Import)
                                                                     else [ast.alias(n.module or "")])}
    assert "jax" not in names and "numpy" in names


def test_exact_ids_tags_and_lru_order():
    a = PageAllocator(6)
    assert a.free_pages() == [1, 2, 3, 4, 5] and a.num_free == 5
    assert a.allocate(2) == [1, 2]
    assert a.allocate(2) == [3, 4]
    assert a.tags.tolist() == [0, 1, 2, 3, 4, 0] and a.refcount.tolist() == [0, 1, 1, 1, 1, 0]
    assert a.free([4, 2]) == [4, 2]  # freed to the tail in the given order
    assert a.free_pages() == [5, 4, 2] and a.tags.tolist() == [0, 1, 0, 3, 0, 0]
    assert a.allocate(2) == [5, 4] and a.tags[[5, 4]].tolist() == [5, 6]  # fresh tags, never reused
    a.check_invariants()
    before = snapshot(a)
    assert a.allocate(2) is None  # only page 2 is free: nothing allocated
    assert same(before, snapshot(a))
    assert a.allocate(1) == [2] and a.tags[2] == 7 and a.num_free == 0
    assert a.allocate(1) is None
    a.check_invariants()


def test_null_page_is_never_allocated():
    a = PageAllocator(4)
    pages = a.allocate(3)
    assert 0 not in pages and a.allocate(1) is None
    assert a.refcount[0] == 0 and a.tags[0] == 0


def test_share_keeps_tag_and_last_free_clears_it():
    a = PageAllocator(5)
    p = a.allocate(2)
    t = a.tags[p].copy()
    a.share(p[:1])
    assert a.refcount[p].tolist() == [2, 1] and (a.tags[p] == t).all()
    assert a.free([p[0]]) == []  # still referenced
    assert a.tags[p[0]] == t[0] and p[0] not in a.free_pages()
    assert a.free([p[0]]) == [p[0]] and a.tags[p[0]] == 0
    a.check_invariants()


@pytest.mark.parametrize("bad", [
    lambda a, p: a.free([p[0], p[0]]),  # refcount 1, freed twice in one call
    lambda a, p: a.free([p[1], 3]),  # page 3 was never allocated (valid p[1] must not be freed either)
    lambda a, p: a.share([p[0], 4]),
])
def test_double_free_and_unowned_raise_and_change_nothing(bad):
    a = PageAllocator(6)
    p = a.allocate(2)
    before = snapshot(a)
    with pytest.raises(DoubleFreeError):
        bad(a, p)
    assert same(before, snapshot(a))
    a.free(p)
    before = snapshot(a)
    with pytest.raises(DoubleFreeError):
        a.free([p[0]])  # double free after a real free
    assert same(before, snapshot(a))
    a.check_invariants()


@pytest.mark.parametrize("page", [0, 6, -1, 100])
def test_invalid_page_ids_raise_and_change_nothing(page):
    a = PageAllocator(6)
    p = a.allocate(3)
    before = snapshot(a)
    for op in (a.free, a.share):
        with pytest.raises(InvalidPageError):
            op([p[0], page])
        assert same(before, snapshot(a))


def test_pending_tag_updates_last_write_wins():
    a = PageAllocator(5)
    p = a.allocate(2)
    a.free([p[0]])
    pages, tags = a.drain_tag_updates()
    assert dict(zip(pages.tolist(), tags.tolist(), strict=True)) == {p[0]: 0, p[1]: 2}
    assert len(a.drain_tag_updates()[0]) == 0


def test_tag_wraparound_retires_the_epoch_and_skips_held_tags():
    a = PageAllocator(8)
    t = PageTables(a, max_pages_per_seq=4)
    t.add("old")
    t.allocate("old", 3)  # tags 1, 2, 3 held by pages
    t.add("stale")
    t.allocate("stale", 1)  # tag 4 ...
    a.free(t.owned("stale"))  # ... freed behind the request's back: only its record still holds tag 4
    a.seed_tag_counter(TAG_MAX - 1)
    t.add("new")
    got = t.allocate("new", 4)
    tags = a.tags[got].tolist()
    assert tags == [TAG_MAX - 1, TAG_MAX, 5, 6], tags  # skips 0 and the held 1, 2, 3 and the recorded 4
    assert a.epoch == 1
    a.check_invariants()
    t.release("old")
    p = a.allocate(3)
    assert a.tags[p].tolist() == [7, 8, 9]  # 1..3 were held at the wrap: skipped for the whole epoch


def test_page_tables_batch_is_exact_and_padding_points_at_null():
    a = PageAllocator(10)
    t = PageTables(a, max_pages_per_seq=4, initial_slots=1)  # forces slot growth
    t.add("a")
    t.allocate("a", 2)
    t.add("b")
    t.share("b", t.owned("a")[:1])
    t.allocate("b", 2)
    pt, exp, live = t.batch(["b", None, "a"], pad_to=4)
    assert pt.tolist() == [[1, 3, 4, 0], [0] * 4, [1, 2, 0, 0], [0] * 4]
    assert exp.tolist() == [[1, 3, 4, 0], [0] * 4, [1, 2, 0, 0], [0] * 4]
    assert live.tolist() == [3, 0, 2, 0] and pt.dtype == np.int32 and exp.dtype == np.uint32
    assert t.grow("a", 9, page_size=4) and t.owned("a") == [1, 2, 5]
    with pytest.raises(ValueError, match="max_pages_per_seq"):
        t.grow("a", 17, page_size=4)  # 5 pages > 4
    assert t.owned("a") == [1, 2, 5]
    t.check_invariants()
    with pytest.raises(UnknownRequestError):
        t.add("a")
    with pytest.raises(UnknownRequestError):
        t.release("zz")
    assert t.release("a") == [] and t.release("b") == []
    assert a.num_free == 9
    t.check_invariants()


class AllocatorMachine(RuleBasedStateMachine):
    """allocate / grow / share-prefix / finish / preempt and deliberate misuse, against a plain model."""

    @initialize(num_pages=st.integers(2, 24), max_pages=st.integers(1, 6))
    def setup(self, num_pages, max_pages):
        self.a = PageAllocator(num_pages)
        self.t = PageTables(self.a, max_pages, initial_slots=2)
        self.model: dict[str, list[int]] = {}
        self.n = 0
        self.preempted: list[str] = []

    def _new_id(self):
        self.n += 1
        return f"r{self.n}"

    @rule(n=st.integers(0, 6))
    def admit(self, n):
        rid = self._new_id()
        self.t.add(rid)
        n = min(n, self.t.max_pages)
        free = self.a.num_free
        got = self.t.allocate(rid, n)
        if n > free:
            assert got is None and self.a.num_free == free
            self.t.release(rid)
        else:
            assert len(got) == n and len(set(got)) == n and 0 not in got
            self.model[rid] = list(got)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 3))
    def grow(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        n = min(n, self.t.max_pages - len(self.model[rid]))
        free = self.a.num_free
        got = self.t.allocate(rid, n)
        if n > free:
            assert got is None and self.a.num_free == free
        else:
            self.model[rid] += got

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def share_prefix(self, data):
        src = data.draw(st.sampled_from(sorted(self.model)))
        k = data.draw(st.integers(0, len(self.model[src])))
        rid = self._new_id()
        self.t.add(rid)
        self.t.share(rid, self.model[src][:k])
        self.model[rid] = self.model[src][:k]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), preempt=st.booleans())
    def finish_or_preempt(self, data, preempt):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        assert self.t.release(rid) == []
        del self.model[rid]
        if preempt:
            self.preempted.append(rid)

    @precondition(lambda self: self.preempted)
    @rule()
    def readmit_preempted(self):
        self.preempted.pop()
        self.admit(1)  # recompute: a fresh id, fresh pages

    @precondition(lambda self: (self.a.retired != 0).any())
    @rule(data=st.data())
    def revive_retained(self, data):
        """A prefix hit on freed pages whose KV is intact: out of the free queue under fresh tags."""
        kept = np.nonzero(self.a.retired)[0].tolist()
        pages = data.draw(st.lists(st.sampled_from(kept), min_size=1, max_size=min(3, self.t.max_pages), unique=True))
        old, free = self.a.retired[pages].copy(), self.a.num_free
        rid = self._new_id()
        self.t.add(rid)
        self.t.share(rid, pages)
        self.model[rid] = list(pages)
        assert self.a.num_free == free - len(pages) and not set(pages) & set(self.a.free_pages())
        assert (self.a.tags[pages] > old).all() and (self.a.retired[pages] == 0).all()

    @rule(data=st.data())
    def forget_or_misrevive(self, data):
        """Forgotten pages are never revived; reviving an allocated page or one without retained KV raises and
        changes nothing."""
        free = self.a.free_pages()
        if free and data.draw(st.booleans()):
            p = data.draw(st.sampled_from(free))
            self.a.forget([p])
            assert not self.a.holds(p, int(self.a.retired[p]))
        before = snapshot(self.a)
        bad = [p for p in range(1, self.a.num_pages) if self.a.retired[p] == 0]
        if bad:
            with pytest.raises(DoubleFreeError):
                self.a.revive([data.draw(st.sampled_from(bad))])
            assert same(before, snapshot(self.a))

    @rule(data=st.data())
    def misuse(self, data):
        before = snapshot(self.a)
        free = self.a.free_pages()
        if free and data.draw(st.booleans()):
            with pytest.raises(DoubleFreeError):
                self.a.free([data.draw(st.sampled_from(free))])
        else:
            with pytest.raises(InvalidPageError):
                self.a.free([data.draw(st.sampled_from([0, -1, self.a.num_pages]))])
        assert same(before, snapshot(self.a))

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "t"):
            return
        self.t.check_invariants()
        counts = np.zeros(self.a.num_pages, np.int64)
        for pages in self.model.values():
            np.add.at(counts, pages, 1)
        assert (counts == self.a.refcount).all()
        assert self.a.num_free == self.a.num_pages - 1 - int((counts > 0).sum())
        for rid, pages in self.model.items():
            assert self.t.owned(rid) == pages

    def teardown(self):
        if not hasattr(self, "t"):
            return
        for rid in list(self.model):  # drain
            assert self.t.release(rid) == []
        self.t.check_invariants()
        assert self.a.num_free == self.a.num_pages - 1
        assert (self.a.refcount == 0).all() and (self.a.tags == 0).all()


AllocatorMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestAllocatorMachine = AllocatorMachine.TestCase


def test_drain_after_random_workload_frees_everything():
    rng = np.random.default_rng(7)
    a = PageAllocator(40)
    t = PageTables(a, max_pages_per_seq=8)
    live: list[str] = []
    for i in range(400):
        op = rng.integers(4)
        if op == 0 or not live:
            rid = f"q{i}"
            t.add(rid)
            if t.allocate(rid, int(rng.integers(1, 4))) is None:
                t.release(rid)
            else:
                live.append(rid)
        elif op == 1:
            rid = live[rng.integers(len(live))]
            t.grow(rid, int(rng.integers(1, 8 * 4)), page_size=4)
        elif op == 2:
            src = live[rng.integers(len(live))]
            rid = f"s{i}"
            t.add(rid)
            t.share(rid, t.owned(src)[: int(rng.integers(0, len(t.owned(src)) + 1))])
            live.append(rid)
        else:
            assert t.release(live.pop(rng.integers(len(live)))) == []
        t.check_invariants()
    assert a.num_used > 0 or not live
    for rid in live:
        t.release(rid)
    a.check_invariants()
    assert a.num_free == 39 and sorted(a.free_pages()) == list(range(1, 40))
    assert (a.refcount == 0).all() and (a.tags == 0).all() and not t.slot_of
