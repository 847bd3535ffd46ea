"""Fault injection for the paged cache and its integrity layer (tests and experiments), plus a model-free step.

:class:`FaultInjector` breaks the state the way real bugs would, going around the normal bookkeeping:

==========================  =======================================================================  ==============
fault                       what it does                                                             caught by
==========================  =======================================================================  ==============
``point_at_free_page``      a page-table entry now names a page on the free queue                    tag (free = 0)
``free_behind``             use-after-free: the allocator frees the request's page, the request      tag (free = 0)
                            keeps using it (``allocate`` may then hand it to someone else)
``point_at_other``          an entry names a page owned by another request                          tag mismatch
``point_out_of_range``      an entry names a page id outside ``[1, num_pages)``                      range check
``double_allocate``         the allocator hands a page still in use to a second request (fresh tag,  tag mismatch
                            refcount unchanged: it forgot the first holder)                          (first holder)
``seed_tag_counter``        start the tag counter next to 2**32 (wraparound)                         must flag none
``poison``                  write NaN/inf into a page's data or its FP8 scale                        finite guard
==========================  =======================================================================  ==============

Page-table faults change only the request's *page table* (what the device reads), never its owned record, so
``PageTables.release`` still frees exactly what the request owns and nothing leaks. ``free_behind`` and
``double_allocate`` change the allocator behind the request's back; release then skips the pages whose tags no
longer match (they are not the request's any more) and reports them.

:func:`toy_decode_step` runs the engine's own per-layer paged attention (:class:`~phaseserve.cache.attend.PagedAttend`:
write the new token, attend over the pages, consume the tracker's mask and guard) on given queries instead of a
model's. Tests use it to show that faults are caught in the step that would first read them while other rows stay
bit-identical, and that a step built with the :class:`~phaseserve.cache.integrity.NoopTracker` traces to the same
jaxpr as one built without a tracker.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from phaseserve.cache.allocator import PageTables
from phaseserve.cache.attend import PagedAttend
from phaseserve.cache.paged import MLAPages, PagePool, as_stored
from phaseserve.kernel_mesh import KernelDispatch


class FaultInjector:
    """Corrupts a :class:`PageTables` / :class:`PageAllocator` / :class:`PagePool` on purpose."""

    def __init__(self, tables: PageTables):
        self.tables = tables
        self.allocator = tables.allocator

    def _entry(self, rid: str, entry: int) -> tuple[int, int]:
        s = self.tables._slot(rid)
        if not 0 <= entry < self.tables.count[s]:
            raise IndexError(f"request {rid!r} has no page-table entry {entry}")
        return s, int(self.tables.page_table[s, entry])

    def point_at_free_page(self, rid: str, entry: int, page: int | None = None) -> int:
        """Entry ``entry`` of ``rid``'s page table -> a free page (default: the tail of the free queue)."""
        s, _ = self._entry(rid, entry)
        free = self.allocator.free_pages()
        page = free[-1] if page is None else page
        if page not in free:
            raise ValueError(f"page {page} is not free")
        self.tables.page_table[s, entry] = page
        return page

    def free_behind(self, rid: str, entry: int) -> int:
        """Use-after-free: free ``rid``'s page at ``entry`` in the allocator while ``rid`` keeps it in its table."""
        _, page = self._entry(rid, entry)
        if self.allocator.refcount[page] != 1:
            raise ValueError(f"page {page} is shared (refcount {self.allocator.refcount[page]}); pick another entry")
        self.allocator.free([page])
        return page

    def point_at_other(self, rid: str, entry: int, other: str, other_entry: int = 0) -> int:
        """Entry ``entry`` of ``rid``'s page table -> the page ``other`` holds at ``other_entry``."""
        s, _ = self._entry(rid, entry)
        _, page = self._entry(other, other_entry)
        self.tables.page_table[s, entry] = page
        return page

    def point_out_of_range(self, rid: str, entry: int, page: int | None = None) -> int:
        """Entry ``entry`` of ``rid``'s page table -> an id outside ``[1, num_pages)`` (default ``num_pages``)."""
        s, _ = self._entry(rid, entry)
        page = self.allocator.num_pages if page is None else page
        if 0 < page < self.allocator.num_pages:
            raise ValueError(f"page {page} is in range")
        self.tables.page_table[s, entry] = page
        return page

    def double_allocate(self, victim: str, entry: int, thief: str) -> int:
        """The page ``victim`` holds at ``entry`` is handed to ``thief`` too, as a buggy allocator would."""
        _, page = self._entry(victim, entry)
        a = self.allocator
        if a.refcount[page] != 1:
            raise ValueError(f"page {page} is shared (refcount {a.refcount[page]}); pick another entry")
        a._set_tag(page, a._fresh_tag())  # reissued as if free: new tag, the allocator forgot the victim
        self.tables._append(self.tables._slot(thief), [page])
        return page

    def seed_tag_counter(self, next_tag: int) -> None:
        """Make the allocator's next tag ``next_tag`` (e.g. ``2**32 - 3`` to cross wraparound soon)."""
        self.allocator.seed_tag_counter(next_tag)

    @staticmethod
    def poison(pool: PagePool, layer: int, page: int, slot: int, *, target: str = "data",
               value: float = float("nan")) -> PagePool:
        """Write ``value`` into element 0 of (page, slot)'s data in ``layer`` (``target="data"``; GQA: K) or its
        scale (``target="scale"``, FP8 pools only), or into a GLM-5 DSA index key (``"index"``) or its scale
        (``"index_scale"``). FP8 data has no inf: inf becomes NaN, as in the hardware cast."""
        lay = pool.layers[layer]
        mla = isinstance(lay, MLAPages)
        if target == "data":
            arr = lay.latent if mla else lay.k
            idx = (page, slot, 0) if mla else (page, slot, 0, 0)
            new = arr.at[idx].set(as_stored(jnp.asarray(value, jnp.float32), arr.dtype))  # raw bits on XLA:CPU
            lay = lay.replace(latent=new) if mla else lay.replace(k=new)
        elif target in ("index", "index_scale") and mla and getattr(lay, target) is not None:
            arr = getattr(lay, target)
            new = (arr.at[page, slot, 0].set(as_stored(jnp.asarray(value, jnp.float32), arr.dtype))
                   if target == "index" else arr.at[page, slot].set(value))
            lay = lay.replace(**{target: new})
        elif target == "scale":
            arr = lay.scale if mla else lay.k_scale
            if arr is None:
                raise ValueError(f"a {pool.kv_dtype} pool has no scales")
            new = arr.at[(page, slot) if mla else (page, slot, 0)].set(value)
            lay = lay.replace(scale=new) if mla else lay.replace(k_scale=new)
        else:
            raise ValueError(f"target must be 'data', 'scale', or 'index' / 'index_scale' on a layer with DSA index "
                             f"keys, got {target!r}")
        layers = list(pool.layers)
        layers[layer] = lay
        return pool.replace(layers=tuple(layers))


# ---- a model-free decode step ------------------------------------------------------------------------------
def toy_decode_step(pool: PagePool, q: list[Any], new_kv: list[Any], page_table: jax.Array, lengths: jax.Array,
                    row_mask: jax.Array, ok: jax.Array | None, *, tracker=None):
    """The engine's per-layer paged attention (:class:`~phaseserve.cache.attend.PagedAttend`, reference kernels)
    applied to given queries and new KV instead of a model's: per layer, write the new token at position
    ``lengths`` and attend over the row's pages.

    q: per layer [B, H, hd] (GQA) or ``(q_latent [B, H, r], q_rope [B, H, rope])`` (MLA); new_kv: per layer
    ``(k, v)`` [B, KV, hd] or latent [B, r + rope]; page_table i32[B, P]; lengths i32[B] (tokens already cached);
    row_mask bool[B] (False: padding row); ok bool[B] from the tracker's check (None without a tracker or with
    the NoopTracker). ``tracker=None`` builds the step with no integrity code at all.
    Returns (pool, out [B, L, H, hd or r], finite bool[B] | None).
    """
    d = (q[0][0] if isinstance(q[0], tuple) else q[0]).shape[-1]
    attend = PagedAttend(page_table, lengths, row_mask, ok, tracker=tracker, sm_scale=d**-0.5,
                         kd=KernelDispatch(attn_impl="reference"))
    layers, outs = zip(*(attend(layer, ql, kvl) for layer, ql, kvl in zip(pool.layers, q, new_kv, strict=True)),
                       strict=True)
    return pool.replace(layers=tuple(layers)), jnp.stack(outs, axis=1), attend.finite
