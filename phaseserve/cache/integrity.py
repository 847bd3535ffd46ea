"""Page-tag integrity layer: a device tag per page, a separate jitted batched check, step hooks, typed errors.

Per decode step the engine does::

    pt, expected, live = tables.batch(rids)                      # host numpy (PageTables, allocator.py)
    pt_dev = jax.device_put(pt, decode_sharding)                 # once: both launches read the same copy
    ok = tracker.check(pt_dev, expected, live)                   # separate jitted launch -> bool[B] on device
    out = decode_step(..., pt_dev, ok)                           # ok consumed on device, no host round trip
    errors = tracker.failures(rids, ok, (pt, expected, live))    # host, after the step's tokens arrive

``check`` first pushes the allocator's pending tag changes to the device tag array ``u32[num_pages]`` (one small
transfer, padded to a power-of-two bucket so it compiles a handful of times), then computes for every row
``ok = all over live entries of (0 < page < N) & (tags[page] == expected)``. Expected tags are never 0 and free
pages have tag 0, so a stale entry pointing at a freed page, a page reassigned to another request (new tag), a
page given to two requests (the first holder's tag is overwritten), or an out-of-range id all fail.

Inside the jitted step the tracker's hooks consume ``ok``: :meth:`IntegrityTracker.mask_table` points failing
rows' page tables at the null page (so they read nothing of anyone's), :meth:`~IntegrityTracker.mask_rows` makes
them write nothing, and :meth:`~IntegrityTracker.guard` turns a non-finite attention output into a per-row flag.

NaN/inf containment (decision). Tags cannot see corrupted *contents*. Checking every live page's data before the
step would read the whole cache twice, and checking only the FP8 scales misses NaN bytes in the data (e4m3fn has
NaN encodings) and BF16 pages entirely. Instead the step checks what it actually computed: ``guard`` reduces each
layer's attention output ``[B, ...]`` to ``finite bool[B]`` (a few elements per row, nothing next to the KV
read) and zeroes non-finite rows so they cannot spread through batched ops (MoE dispatch). Non-finite values at
positions a row reads surface in that row's attention output in the very step they are first read; so does an
overflow of the attention scores over pages that hold finite values (a model fault: a norm weight of 1e30, say).
The two cannot be told apart from the output, so such a row is *not* an integrity failure: the decode step gives
it the sentinel token ``engine.sampling.NONFINITE_ATTENTION`` and the engine ends it with
``NonFiniteLogitsError``; its pages are scrubbed (``paged.clear_pages``) before release. A
:class:`KVIntegrityError` means one thing only: the row's page-tag or range check failed, so the signal that
counts integrity aborts never fires on a model's overflow. Attention implementations must mask positions past a
row's length with ``where`` (not by multiplying with a zero probability), since a freshly reused page may still
hold another request's stale bytes there.

:class:`NoopTracker` has the same interface and adds nothing: ``check`` returns ``None`` without a launch and
the hooks return their inputs, so a decode step built with it traces to the same jaxpr as one built without.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from phaseserve.cache.allocator import PageAllocator


class KVIntegrityError(RuntimeError):
    """A request's KV pages failed the integrity check; the request must be aborted, the batch goes on."""

    def __init__(self, request_id: str, details: str, kind: str = "tag"):
        super().__init__(f"KV integrity failure for request {request_id!r} ({kind}): {details}")
        self.request_id = request_id
        self.details = details
        self.kind = kind  # "tag" | "range"

    def __reduce__(self):  # picklable (it crosses process boundaries from a remote decode worker)
        return (KVIntegrityError, (self.request_id, self.details, self.kind))


@jax.jit
def check_tags(tags: jax.Array, page_table: jax.Array, expected: jax.Array, num_live: jax.Array) -> jax.Array:
    """ok bool[B]: every live entry of the row is in range and carries its expected tag.

    tags u32[N]; page_table i32[B, P]; expected u32[B, P]; num_live i32[B] (entries checked per row, <= P).
    """
    n = tags.shape[0]
    p = page_table.shape[1]
    live = jnp.arange(p, dtype=jnp.int32)[None, :] < num_live[:, None]
    in_range = (page_table > 0) & (page_table < n)
    got = tags[jnp.clip(page_table, 0, n - 1)]
    good = in_range & (got == expected)
    return jnp.all(good | ~live, axis=1) & (num_live >= 0) & (num_live <= p)


def _set_tags(tags: jax.Array, updates: jax.Array) -> jax.Array:
    """tags u32[N]; updates u32[2, n] (row 0: page ids, N = padding; row 1: new tags)."""
    return tags.at[updates[0]].set(updates[1], mode="drop")


_set_tags_donated = jax.jit(_set_tags, donate_argnums=0)


def mask_page_table(page_table: jax.Array, ok: jax.Array) -> jax.Array:
    """page_table i32[B, P], ok bool[B] -> failing rows point at the null page only."""
    return jnp.where(ok[:, None], page_table, 0)


def guard_finite(x: jax.Array, finite: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """x [B, ...] -> (x with non-finite rows zeroed, finite bool[B] and-ed into ``finite``)."""
    f = jnp.all(jnp.isfinite(x).reshape(x.shape[0], -1), axis=1)
    x = jnp.where(f.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))
    return x, f if finite is None else finite & f


@dataclass
class CheckStats:
    checks: int = 0  # batched check launches
    rows_checked: int = 0  # rows (requests) checked, padding excluded
    entries_checked: int = 0  # page-table entries checked


class IntegrityTracker:
    """Device tag mirror of a :class:`PageAllocator`, the batched check, the step hooks, and error reporting."""

    enabled = True

    def __init__(self, allocator: PageAllocator, *, device: jax.Device | jax.sharding.Sharding | None = None):
        self.allocator = allocator
        self.num_pages = allocator.num_pages
        allocator.drain_tag_updates()  # the full copy below supersedes anything pending
        self.tags = jax.device_put(np.array(allocator.tags, np.uint32), device)  # u32[N]
        self.stats = CheckStats()

    # ---- host -> device ------------------------------------------------------------------------------------
    def sync(self) -> int:
        """Push pending tag changes in one transfer; returns how many pages changed."""
        return self.push(*self.allocator.drain_tag_updates())

    def push(self, pages: np.ndarray, tags: np.ndarray) -> int:
        """Set these pages' device tags (pages i32[n], tags u32[n]): the allocator's changes when it lives in
        another process (a remote decode worker gets them with each step)."""
        n = len(pages)
        if n:
            bucket = max(8, 1 << (n - 1).bit_length())
            upd = np.empty((2, bucket), np.uint32)
            upd[0], upd[1] = self.num_pages, 0
            upd[0, :n], upd[1, :n] = pages, tags
            self.tags = _set_tags_donated(self.tags, upd)
        return n

    def warm(self) -> int:
        """Compile :meth:`sync`'s tag update at every padded size it can use (8 .. the pages' bucket; each update
        here addresses no page, so nothing changes). Returns the number of sizes."""
        sizes = [8 << i for i in range(max(1, (max(self.num_pages, 8) - 1).bit_length() - 2))]
        for size in sizes:
            upd = np.zeros((2, size), np.uint32)
            upd[0] = self.num_pages  # out of range: dropped
            self.tags = _set_tags_donated(self.tags, upd)
        return len(sizes)

    def check(self, page_table, expected_tags, num_live) -> jax.Array:
        """ok bool[B] (device) for page_table i32[B, P], expected_tags u32[B, P], num_live i32[B]."""
        self.sync()
        self.stats.checks += 1
        live = np.asarray(num_live) if isinstance(num_live, np.ndarray) else None
        if live is not None:
            self.stats.rows_checked += int((live > 0).sum())
            self.stats.entries_checked += int(live.sum())
        return check_tags(self.tags, page_table, expected_tags, num_live)

    # ---- hooks used inside the jitted decode step ----------------------------------------------------------
    @staticmethod
    def mask_table(page_table: jax.Array, ok: jax.Array) -> jax.Array:
        """page_table i32[B, P] the step reads through: failing rows see only the null page."""
        return mask_page_table(page_table, ok)

    @staticmethod
    def mask_rows(mask: jax.Array, ok: jax.Array) -> jax.Array:
        """Write mask bool[B]: failing rows write nothing."""
        return mask & ok

    @staticmethod
    def guard(x: jax.Array, finite: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """Per-layer attention output x [B, ...]: flag and zero rows that read NaN/inf."""
        return guard_finite(x, finite)

    @staticmethod
    def computed(kv: Any, finite: jax.Array | None) -> jax.Array:
        """A layer's new KV (a pytree of [B, ...] arrays, one token per row) -> bool[B] all finite, and-ed into
        ``finite``: False where the model itself produced NaN/inf this step."""
        f = functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(x).reshape(x.shape[0], -1), axis=1)
                                               for x in jax.tree.leaves(kv)])
        return f if finite is None else finite & f

    # ---- device -> host ------------------------------------------------------------------------------------
    def failures(self, request_ids: list[str | None], ok,
                 batch: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> dict[str, KVIntegrityError]:
        """Typed errors for the rows whose page-tag check failed (``None`` ids are padding and ignored). ``batch`` =
        the check's inputs, used only to explain a failure (which entry, which page, which tags)."""
        ok = np.asarray(ok)
        bad = [i for i, r in enumerate(request_ids) if r is not None and not ok[i]]
        if not bad:
            return {}
        dev = np.asarray(self.tags)
        out = {}
        for i in bad:
            kind, details = self._explain(i, dev, batch)
            out[request_ids[i]] = KVIntegrityError(request_ids[i], details, kind)
        return out

    def _explain(self, row: int, dev: np.ndarray, batch) -> tuple[str, str]:
        if batch is None:
            return "tag", "page tag check failed"
        pt, exp, live = (np.asarray(a)[row] for a in batch)
        msgs, kind = [], "tag"
        for j in range(min(int(live), len(pt))):
            p = int(pt[j])
            if not 0 < p < self.num_pages:
                kind = "range"
                msgs.append(f"entry {j}: page {p} out of range [1, {self.num_pages})")
            elif dev[p] != exp[j]:
                state = "free" if dev[p] == 0 else f"tag {int(dev[p])}"
                msgs.append(f"entry {j}: page {p} is {state}, expected tag {int(exp[j])}")
        return kind, "; ".join(msgs) or "page tag check failed"


class NoopTracker:
    """Integrity disabled: same interface, no device state, no launch, identity hooks."""

    enabled = False

    def __init__(self, allocator: PageAllocator | None = None, **_):
        self.allocator = allocator
        self.stats = CheckStats()

    def sync(self) -> int:
        if self.allocator is not None:
            self.allocator.drain_tag_updates()  # nothing to mirror; keep the pending dict empty
        return 0

    def push(self, pages, tags) -> int:
        return 0

    def check(self, page_table, expected_tags, num_live) -> None:
        self.sync()
        return None

    def warm(self) -> int:
        return 0

    @staticmethod
    def mask_table(page_table: jax.Array, ok: None) -> jax.Array:
        return page_table

    @staticmethod
    def mask_rows(mask: jax.Array, ok: None) -> jax.Array:
        return mask

    @staticmethod
    def guard(x: jax.Array, finite: None) -> tuple[jax.Array, None]:
        return x, finite

    @staticmethod
    def computed(kv: Any, finite: None) -> None:
        return finite

    def failures(self, request_ids, ok, batch=None) -> dict[str, KVIntegrityError]:
        return {}
