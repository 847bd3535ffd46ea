"""Decode attention over the paged cache, one layer at a time: the ``attend`` of ``transformer.decode_step``.

For every row ``b`` of the batch, :class:`PagedAttend` writes the new token's KV at ``positions[b]`` into the
row's pages, then attends over the row's first ``positions[b] + 1`` tokens with the paged kernels
(``pallas_kernels.paged_attention`` for GQA, ``pallas_kernels.mla_attention`` for MLA latents; FP8 pages are
dequantized inside the kernel), called per the step's :class:`~phaseserve.kernel_mesh.KernelDispatch` (``kd``: its
``attn_impl``, mesh and provenance log)::

    pages, o = attend(pages, q, kv)     # GQA: q [B, H, hd], kv (k, v) [B, KV, hd] -> o [B, H, hd]
                                        # MLA: q (q_latent [B, H, r], q_rope [B, H, rope]), kv [B, r+rope]
                                        #      -> o [B, H, r]

Integrity hooks come from the tracker object and are consumed on device: rows whose ``ok`` is False get the null
page in their table and write nothing (``mask_table`` / ``mask_rows``); their length is 0, so they attend over
nothing and read zeros. ``guard`` flags rows whose attention output is not finite, accumulated over the layers in
:attr:`PagedAttend.finite`, and ``computed`` rows whose own new KV (this step's, before it is written) is not
(:attr:`PagedAttend.computed`): such a row overflowed before attention (its logits are made NaN). Neither is a
cache fault: the decode step ends both with a non-finite sentinel token, never a KV integrity failure.
With ``tracker=None`` none of this code is traced; the :class:`NoopTracker`'s hooks are
identities, so it traces to the same jaxpr (tested).

One object serves one traced step (it accumulates ``finite`` across the layers of that step).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.common import resolve_impl
from phaseserve.cache import dsa
from phaseserve.cache.paged import GQAPages, MLAPages, as_values, take_pages, write_token_layer
from phaseserve.kernel_mesh import DIRECT, KernelDispatch, mla_decode_attention, paged_decode_attention
from phaseserve.model.indexer import DSAQuery


class PagedAttend:
    """``attend(pages, q, kv) -> (pages, o)`` for one decode step over a paged cache (see module docstring)."""

    def __init__(
        self,
        page_table: jax.Array,  # i32[B, P]
        positions: jax.Array,  # i32[B] position of the new token (= tokens already cached)
        active: jax.Array,  # bool[B] real rows (False: padding)
        ok: jax.Array | None,  # bool[B] from the tracker's check (None without a tracker / with the NoopTracker)
        *,
        tracker: Any = None,
        sm_scale: float,
        kd: KernelDispatch = DIRECT,  # the step's kernel dispatch: attn_impl, mesh (shard_map), provenance log
    ):
        if tracker is not None:
            with jax.named_scope("integrity"):
                page_table = tracker.mask_table(page_table, ok)
                active = tracker.mask_rows(active, ok)
        self.page_table, self.positions, self.write = page_table, positions, active
        self.lengths = jnp.where(active, positions + 1, 0)  # i32[B]
        self.tracker, self.sm_scale, self.kd = tracker, sm_scale, kd
        self.finite: jax.Array | None = None  # bool[B] after the first layer when the tracker guards
        self.computed: jax.Array | None = None  # bool[B] every layer's new KV of the row finite (when it guards)
        self.selection: jax.Array | None = None  # i32[B, K] the last GLM-5 DSA selection (cache.dsa)

    def __call__(self, pages: GQAPages | MLAPages, q: Any, kv: Any) -> tuple[GQAPages | MLAPages, jax.Array]:
        pt, lengths = self.page_table, self.lengths
        if self.tracker is not None:
            with jax.named_scope("integrity"):
                self.computed = self.tracker.computed(kv, self.computed)
        with jax.named_scope("page_write"):
            pages = write_token_layer(pages, kv, pt, self.positions, self.write)
        with jax.named_scope("attention"):
            read = pages
            narrow = any(a.dtype.itemsize < 4 for a in jax.tree.leaves(pages))
            if narrow and resolve_impl(self.kd.attn_impl) == "reference":  # see rows_view
                read, pt = rows_view(pages, pt)
            else:  # raw-bit pages (XLA:CPU, paged.storage_dtype) as values for the kernels
                read = jax.tree.map(as_values, pages)
            if isinstance(q, DSAQuery):
                o, self.selection = dsa.sparse_attend(read, pt, lengths, q, self.selection, sm_scale=self.sm_scale,
                                                      kd=self.kd)
            elif isinstance(pages, MLAPages):
                q_latent, q_rope = q
                o = mla_decode_attention(self.kd, q_latent, q_rope, read.latent, pt, lengths, scales=read.scale,
                                         sm_scale=self.sm_scale)
            else:
                o = paged_decode_attention(self.kd, q, read.k, read.v, pt, lengths, k_scales=read.k_scale,
                                           v_scales=read.v_scale, sm_scale=self.sm_scale)
        if self.tracker is not None:
            with jax.named_scope("integrity"):
                o, self.finite = self.tracker.guard(o, self.finite)
        return pages, o


def rows_view(pages: GQAPages | MLAPages, page_table: jax.Array) -> tuple[GQAPages | MLAPages, jax.Array]:
    """The batch's own pages, gathered on their raw bits, and the identity table over them: ``[B*P, S, ...]`` per
    array and i32[B, P]. The reference attention gathers ``pages[page_table]`` from value arrays, and a raw-bit
    pool (``paged.storage_dtype``) seen as values is a pool-sized copy on XLA:CPU; gathering the rows' raw pages
    here keeps the step's cost in the pages the batch reads, not in the pool's size. page_table i32[B, P] (entries
    clipped into range, as the kernels do)."""
    b, p = page_table.shape
    view = jax.tree.map(lambda a: take_pages(a, page_table).reshape(b * p, *a.shape[1:]), pages)
    return view, jnp.arange(b * p, dtype=jnp.int32).reshape(b, p)
