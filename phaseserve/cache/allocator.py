"""Host-side page allocator and per-request page tables for the paged decode cache (numpy only, no JAX).

Two classes:

- :class:`PageAllocator` owns the physical pages: a reference count and a tag per page, and the free queue.
  Page 0 is the reserved **null page**: never allocated, never freed, tag 0 forever. Padding rows of a page
  table point at it, and tag 0 is never issued, so no live expectation can ever match it.
- :class:`PageTables` owns the per-request view: for each request the pages it holds and the tag each page had
  when it was given to the request (its *ownership token*), laid out as rows of host arrays so that building
  the batch's page table and expected tags for a decode step is one numpy fancy-index, not a Python loop.

Page layout (one page id addresses the same slot range in every layer's pool, see ``paged.py``)::

    physical pages            0 (null)   1      2      3      4      5      6   ...  N-1
    refcount                  0          1      2      0      1      1      0
    tag (u32, 0 = not owned)  0          17     9      0      21     22     0
    free queue (head->tail)   3 -> 6 -> ...        (allocate pops the head, free appends at the tail)

    request "a": pages [1, 2]      tags [17, 9]        page-table row  [1, 2, 0, 0]   (0 = null padding)
    request "b": pages [2, 4, 5]   tags [9, 21, 22]    page-table row  [2, 4, 5, 0]   (page 2 is a shared prefix)

    token t of a request lives at  page = row[t // page_size],  slot = t % page_size

Tags. Every allocation gives the page a fresh tag from a counter that only
increases. The counter is 32 bits (the device tag array is ``u32[num_pages]``) and skips 0. **Wraparound**: when
the counter passes ``2**32 - 1`` the allocator retires the epoch -- it snapshots every tag still held (by a page,
or recorded by any registered holder: the live requests of a :class:`PageTables`, the scheduler's prefix index),
restarts at 1, and skips every snapshot tag
for the whole new epoch. Tags issued within an epoch are strictly increasing, so a tag is never reissued while any
page or any live request record holds it; ``epoch`` counts the wraps. (A hard error at wraparound was rejected:
at ~10^2 allocations/s a long-running server would hit it within a year.)

Shared prefixes: :meth:`PageAllocator.share` adds a reference *without* changing the tag, so every holder of a
shared page records the same tag and one device tag covers all of them. A page's tag is cleared to 0 only when its
last reference is dropped, which makes any stale reference to a free page fail the integrity check.

Retained prefixes: a freed page keeps its KV in the pool until it is allocated again, so the scheduler's prefix index
may still point at it. The allocator remembers the tag a page had when its last reference was dropped
(``retired``) until the page is allocated again (its KV about to be overwritten) or :meth:`PageAllocator.forget`
says its KV is gone (scrubbed); :meth:`PageAllocator.holds` answers "does page p still hold what it held under tag
t". A prefix hit on such a page takes it back out of the free queue with :meth:`PageAllocator.revive`, under a
*fresh* tag (a stale record of its old owner still fails the check). Free pages with retained KV stay in the free
queue, so they count as free and are overwritten in LRU order when nothing older is left: the prefix cache lives in
the pool's otherwise idle pages and never makes an allocation fail.

Device tag updates are not pushed one by one: the allocator keeps a small dict of pending ``page -> tag`` changes
(last write wins, bounded by ``num_pages``) that the integrity tracker drains once per decode step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import numpy as np

NULL_PAGE = 0
TAG_MAX = 2**32 - 1  # largest u32 tag; tag 0 means "not owned" and is never issued


class AllocatorError(RuntimeError):
    """Base class for misuse of the page allocator; the allocator state is unchanged when one is raised."""


class InvalidPageError(AllocatorError):
    """A page id that is out of range or the reserved null page."""


class DoubleFreeError(AllocatorError):
    """Freeing (or sharing) a page that is not allocated: a double free, or a page nobody owns."""


class UnknownRequestError(AllocatorError):
    """A request id the page tables do not know (or one added twice)."""


class PageAllocator:
    """Reference-counted, tagged physical pages with an LRU free queue.

    Free queue: an insertion-ordered dict used as a queue with O(1) removal from the middle; allocation pops the
    head, free appends at the tail, so the least recently freed pages are the ones overwritten first, and a prefix
    hit on a freed page (:meth:`revive`) takes it out wherever it is. :class:`PageTables` frees a request's pages
    tail-first so the end of a sequence (least likely to be a shared prefix) is reused before its start.
    ``_in_queue bool[num_pages]`` answers "is this page free" in O(1).
    """

    def __init__(self, num_pages: int, *, first_tag: int = 1):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is the reserved null page)")
        self.num_pages = num_pages
        self.refcount = np.zeros(num_pages, np.int32)  # i32[num_pages]
        self.tags = np.zeros(num_pages, np.uint32)  # u32[num_pages]; 0 = free / null
        self.retired = np.zeros(num_pages, np.uint32)  # u32[num_pages] a free page's last tag while its KV is intact
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))  # 1..N-1; never the null page
        self._in_queue = np.ones(num_pages, bool)  # bool[num_pages]
        self._in_queue[NULL_PAGE] = False
        self._next_tag = 1
        self.seed_tag_counter(first_tag)
        self.epoch = 0
        self._skip_tags: set[int] = set()
        self._tag_holders: list[Callable[[], Iterable[int]]] = []
        self._pending: dict[int, int] = {}  # page -> tag not yet pushed to the device

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def free_pages(self) -> list[int]:
        """The free queue, head (next to be allocated) first."""
        return list(self._free)

    # ---- tags ----------------------------------------------------------------------------------------------
    def seed_tag_counter(self, next_tag: int) -> None:
        """Set the next tag to issue (tests and fault injection use this to start next to wraparound)."""
        if not 1 <= next_tag <= TAG_MAX:
            raise ValueError(f"next_tag={next_tag} must be in [1, 2**32 - 1]")
        self._next_tag = next_tag

    def register_tag_holder(self, fn: Callable[[], Iterable[int]]) -> None:
        """Add a source of tags that must survive wraparound (e.g. tags recorded by live requests)."""
        self._tag_holders.append(fn)

    def _fresh_tag(self) -> int:
        while True:
            t = self._next_tag
            if t > TAG_MAX:  # wraparound: retire the epoch, never reissue a tag that is still held
                held = set(self.tags[self.refcount > 0].tolist())
                for fn in self._tag_holders:
                    held.update(int(x) for x in fn())
                held.discard(0)
                self._skip_tags, self.epoch, t = held, self.epoch + 1, 1
            self._next_tag = t + 1
            if t not in self._skip_tags:
                return t

    def _set_tag(self, page: int, tag: int) -> None:
        self.tags[page] = tag
        self._pending[page] = tag

    def pending_touch(self, pages: np.ndarray) -> bool:
        """Whether a tag change not yet drained (:meth:`drain_tag_updates`) is on any of ``pages`` (int array)."""
        return bool(self._pending) and bool(np.isin(pages, np.fromiter(self._pending, np.int64)).any())

    def drain_tag_updates(self) -> tuple[np.ndarray, np.ndarray]:
        """Pending device tag changes since the last drain: (pages i32[n], tags u32[n]); clears them."""
        if not self._pending:
            return np.zeros(0, np.int32), np.zeros(0, np.uint32)
        pages = np.fromiter(self._pending.keys(), np.int32, len(self._pending))
        tags = np.fromiter(self._pending.values(), np.uint32, len(self._pending))
        self._pending.clear()
        return pages, tags

    # ---- allocation ----------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` pages from the head of the free queue, each with refcount 1 and a fresh tag.

        Returns ``None`` (allocating nothing) when fewer than ``n`` pages are free, so the scheduler can preempt.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            p, _ = self._free.popitem(last=False)
            self._in_queue[p] = False
            self.retired[p] = 0  # its KV is about to be overwritten
            self.refcount[p] = 1
            self._set_tag(p, self._fresh_tag())
            out.append(p)
        return out

    def holds(self, page: int, tag: int) -> bool:
        """Whether ``page`` still holds the KV it held under ``tag``: allocated with that tag, or freed with it and
        neither allocated again nor forgotten since."""
        if tag == 0:
            return False
        return bool(self.tags[page] == tag if self.refcount[page] > 0 else self.retired[page] == tag)

    def revive(self, pages: list[int]) -> None:
        """Take free pages whose KV is intact (a prefix hit, :meth:`holds`) back out of the free queue, each with
        refcount 1 and a fresh tag. Raises (changing nothing) for a page that is allocated or whose KV is gone."""
        self._validate(pages)
        for p in pages:
            if self.refcount[p] > 0 or self.retired[p] == 0:
                raise DoubleFreeError(f"cannot revive page {p}: it is allocated or holds no retained KV")
        for p in pages:
            del self._free[p]
            self._in_queue[p] = False
            self.retired[p] = 0
            self.refcount[p] = 1
            self._set_tag(p, self._fresh_tag())

    def forget(self, pages: list[int]) -> None:
        """The KV of these pages is gone (scrubbed, or the pool rebuilt): no prefix hit may revive them once free."""
        self._validate(pages)
        self.retired[pages] = 0

    def share(self, pages: list[int]) -> None:
        """One more reference to each (allocated) page, for a request that shares a prompt prefix; tags unchanged."""
        self._validate(pages)
        for p in pages:
            if self.refcount[p] <= 0:
                raise DoubleFreeError(f"cannot share page {p}: it is not allocated")
        for p in pages:
            self.refcount[p] += 1

    def free(self, pages: list[int]) -> list[int]:
        """Drop one reference per listed page (a page may be listed as often as it is referenced).

        Pages whose count reaches 0 get tag 0 and go to the tail of the free queue, in the given order; they are
        returned. Freeing a page that is not allocated (double free, never allocated), the null page or an
        out-of-range id raises and changes nothing.
        """
        self._validate(pages)
        counts: dict[int, int] = {}
        for p in pages:
            counts[p] = counts.get(p, 0) + 1
        for p, c in counts.items():
            if c > self.refcount[p]:
                raise DoubleFreeError(f"page {p} freed {c} time(s) but has refcount {int(self.refcount[p])}")
        released = []
        for p in pages:
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self.retired[p] = self.tags[p]
                self._set_tag(p, 0)
                self._free[p] = None
                self._in_queue[p] = True
                released.append(p)
        return released

    def _validate(self, pages: list[int]) -> None:
        for p in pages:
            if not isinstance(p, int | np.integer) or not 0 < p < self.num_pages:
                raise InvalidPageError(f"page {p!r} is not an allocatable page id in [1, {self.num_pages})")

    # ---- invariants ----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every page is free xor owned; the free queue is a consistent list without duplicates; tags are sane."""
        free = self.free_pages()
        assert len(set(free)) == len(free), "free queue holds duplicates"
        assert NULL_PAGE not in free, "null page is in the free queue"
        assert self._in_queue.sum() == len(free) and self._in_queue[free].all(), "free-queue membership disagrees"
        rc = self.refcount
        assert rc[NULL_PAGE] == 0 and self.tags[NULL_PAGE] == 0, "null page is owned or tagged"
        assert (rc >= 0).all(), "negative refcount"
        is_free = np.zeros(self.num_pages, bool)
        is_free[free] = True
        owned = rc > 0
        assert not (is_free & owned).any(), f"pages free and owned at once: {np.nonzero(is_free & owned)[0]}"
        orphan = ~is_free & ~owned
        orphan[NULL_PAGE] = False
        assert not orphan.any(), f"pages neither free nor owned (leaked): {np.nonzero(orphan)[0]}"
        assert (self.tags[~owned] == 0).all(), "a free page has a nonzero tag"
        assert (self.retired[owned] == 0).all(), "an allocated page has a retired tag"
        held = self.tags[owned]
        assert (held != 0).all(), "an owned page has tag 0"
        assert len(np.unique(held)) == len(held), "two owned pages share a tag"


class PageTables:
    """Per-request page lists and expected tags, stored as rows of host arrays for cheap batch assembly.

    Each request gets a row (slot) in ``pages i32[slots, max_pages]`` / ``tags u32[slots, max_pages]`` holding what it
    owns, and a separate ``page_table`` row that is what the device is given. The two are identical unless a bug
    (or the fault injector) corrupts the page table; releasing a request uses the owned record and its tags, never
    the page table. A decode step's inputs are one fancy-index: :meth:`batch`.
    """

    def __init__(self, allocator: PageAllocator, max_pages_per_seq: int, initial_slots: int = 64):
        self.allocator = allocator
        self.max_pages = max_pages_per_seq
        n = max(initial_slots, 1)
        self.pages = np.zeros((n, max_pages_per_seq), np.int32)  # i32[slots, P] owned record
        self.tags = np.zeros((n, max_pages_per_seq), np.uint32)  # u32[slots, P] tag at the time of acquisition
        self.page_table = np.zeros((n, max_pages_per_seq), np.int32)  # i32[slots, P] what the device reads
        self.count = np.zeros(n, np.int32)  # i32[slots] pages held
        self.slot_of: dict[str, int] = {}
        self._free_slots = list(range(n - 1, -1, -1))
        allocator.register_tag_holder(lambda: self.tags[list(self.slot_of.values())].ravel())

    def __contains__(self, rid: str) -> bool:
        return rid in self.slot_of

    def _slot(self, rid: str) -> int:
        try:
            return self.slot_of[rid]
        except KeyError:
            raise UnknownRequestError(f"unknown request {rid!r}") from None

    def add(self, rid: str) -> None:
        if rid in self.slot_of:
            raise UnknownRequestError(f"request {rid!r} already has a page table")
        if not self._free_slots:
            n = len(self.count)
            for name in ("pages", "tags", "page_table"):
                a = getattr(self, name)
                setattr(self, name, np.concatenate([a, np.zeros_like(a)]))
            self.count = np.concatenate([self.count, np.zeros(n, np.int32)])
            self._free_slots = list(range(2 * n - 1, n - 1, -1))
        self.slot_of[rid] = self._free_slots.pop()

    def owned(self, rid: str) -> list[int]:
        s = self._slot(rid)
        return self.pages[s, : self.count[s]].tolist()

    def _append(self, s: int, pages: list[int]) -> None:
        c, n = int(self.count[s]), len(pages)
        self.pages[s, c : c + n] = pages
        self.page_table[s, c : c + n] = pages
        self.tags[s, c : c + n] = self.allocator.tags[pages]
        self.count[s] = c + n

    def allocate(self, rid: str, n: int) -> list[int] | None:
        """Give ``rid`` ``n`` more fresh pages; ``None`` (nothing allocated) when short of pages."""
        s = self._slot(rid)
        if self.count[s] + n > self.max_pages:
            raise ValueError(f"request {rid!r} would hold {self.count[s] + n} > max_pages_per_seq={self.max_pages}")
        pages = self.allocator.allocate(n)
        if pages is not None:
            self._append(s, pages)
        return pages

    def grow(self, rid: str, num_tokens: int, page_size: int) -> bool:
        """Make ``rid`` hold enough pages for ``num_tokens`` tokens; False (nothing allocated) when short."""
        need = -(-num_tokens // page_size) - int(self.count[self._slot(rid)])
        return need <= 0 or self.allocate(rid, need) is not None

    def share(self, rid: str, pages: list[int]) -> None:
        """Append prefix pages to ``rid``, recording their current tags: pages another request holds get one more
        reference; free pages whose KV is retained (:meth:`PageAllocator.holds`) are revived under fresh tags."""
        s = self._slot(rid)
        if self.count[s] + len(pages) > self.max_pages:
            raise ValueError(f"request {rid!r} would exceed max_pages_per_seq={self.max_pages}")
        a = self.allocator
        a._validate(pages)
        held = [p for p in pages if a.refcount[p] > 0]
        a.revive([p for p in pages if a.refcount[p] == 0])  # checks every page before it changes any
        a.share(held)
        self._append(s, pages)

    def release(self, rid: str) -> list[int]:
        """Drop every page ``rid`` still owns (tail first) and forget the request.

        A page is dropped only if its current tag is still the one recorded for ``rid``: after an integrity fault
        (the page was freed or handed to someone else behind the request's back) the page is no longer the
        request's to free. Returns the pages skipped that way (always empty in fault-free operation).
        """
        s = self._slot(rid)
        c = int(self.count[s])
        pages, tags = self.pages[s, :c][::-1], self.tags[s, :c][::-1]
        a = self.allocator
        still = (a.tags[pages] == tags) & (a.refcount[pages] > 0)
        a.free(pages[still].tolist())
        self.pages[s], self.tags[s], self.page_table[s], self.count[s] = 0, 0, 0, 0
        del self.slot_of[rid]
        self._free_slots.append(s)
        return pages[~still].tolist()

    def batch(self, rids: list[str | None], pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decode-step inputs for these rows (``None`` = padding row, pointing at the null page).

        Returns ``page_table i32[B, P]``, ``expected_tags u32[B, P]``, ``num_live i32[B]``; ``B = pad_to or len(rids)``.
        """
        slots = [self.slot_of[r] if r is not None else -1 for r in rids]
        b = pad_to or len(slots)
        idx = np.full(b, -1, np.int64)
        idx[: len(slots)] = slots
        pad = idx < 0
        idx[pad] = 0
        pt, tags, live = self.page_table[idx], self.tags[idx], self.count[idx]
        pt[pad], tags[pad], live[pad] = 0, 0, 0
        return pt, tags, live

    def check_invariants(self) -> None:
        """The allocator's invariants, plus: reference counts add up to the requests' records."""
        a = self.allocator
        a.check_invariants()
        live = list(self.slot_of.values())
        held = np.zeros(a.num_pages, np.int64)
        for s in live:
            c = int(self.count[s])
            ps = self.pages[s, :c]
            assert len(set(ps.tolist())) == c, f"slot {s} holds a page twice"
            assert (ps > 0).all(), f"slot {s} holds the null page"
            assert (a.tags[ps] == self.tags[s, :c]).all(), f"slot {s} records a stale tag"
            assert (self.pages[s, c:] == 0).all(), f"slot {s} has entries past its count"
            np.add.at(held, ps, 1)
        assert (held == a.refcount).all(), "reference counts do not add up to the requests' pages"
        assert len(set(live)) == len(live) and not set(live) & set(self._free_slots), "slot bookkeeping broken"
