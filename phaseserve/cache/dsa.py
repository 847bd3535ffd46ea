"""GLM-5 DeepSeek Sparse Attention decode over the paged cache: index scores over the row's cached index keys,
top-k, and sparse MLA attention over the selected tokens' latents.

:class:`~phaseserve.cache.attend.PagedAttend` hands a layer here when its query is an
:class:`~phaseserve.model.indexer.DSAQuery` (the new token's latent and index key are already written)::

    layer with its own indexer:  keys = row's index pages (dequantized)         [B, P*S, d]   linear in context
                                 selection = top-k visible index scores         i32[B, min(index_topk, P*S)]
    "shared" layer:              selection = the previous layer's, kept on the attend object
    both:                        o = sparse_mla_decode_attention(selected latents)   O(index_topk) per row

The index keys live in :class:`~phaseserve.cache.paged.MLAPages` ``index`` / ``index_scale`` under the same page ids
as the latent, so a row whose integrity check failed (its table masked to the null page, its length 0) selects
nothing and reads zeros here too; a non-finite index score over a visible token makes the row's output NaN, so the
integrity layer's finite guard catches a poisoned index key like a poisoned latent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from phaseserve.cache.paged import MLAPages, dequantize_kv, take_pages
from phaseserve.kernel_mesh import KernelDispatch, sparse_mla_decode_attention  # shard_map'd on kd's mesh
from phaseserve.model import indexer
from phaseserve.model.indexer import DSAQuery


def cached_index_keys(pages: MLAPages, page_table: jax.Array) -> jax.Array:
    """The rows' index keys, dequantized: page_table i32[B, P] -> f32[B, P*S, d] (token t at index t)."""
    b, p = page_table.shape
    keys = take_pages(pages.index, page_table)  # [B, P, S, d]
    scale = None if pages.index_scale is None else take_pages(pages.index_scale, page_table)  # f32[B, P, S]
    return dequantize_kv(keys, scale).reshape(b, -1, keys.shape[-1])


def select_cached(pages: MLAPages, page_table: jax.Array, lengths: jax.Array, q: DSAQuery,
                  ) -> tuple[jax.Array, jax.Array]:
    """Top-k of the new token's index scores over the row's cached keys: -> (i32[B, min(topk, P*S)] positions, best
    first, positions at or past ``lengths`` only where fewer keys are visible; bool[B] every visible score finite)."""
    keys = cached_index_keys(pages, page_table)
    scores = indexer.index_scores(q.index_q[:, None], q.index_w[:, None], keys)[:, 0]  # f32[B, P*S]
    pos = jnp.arange(scores.shape[-1], dtype=jnp.int32)[None, :]
    finite = jnp.all(jnp.isfinite(scores) | (pos >= lengths[:, None]), axis=-1)
    return indexer.select(scores[:, None], (lengths - 1)[:, None], lengths, q.topk)[:, 0], finite


def sparse_attend(pages: MLAPages, page_table: jax.Array, lengths: jax.Array, q: DSAQuery,
                  selection: jax.Array | None, *, sm_scale: float, kd: KernelDispatch) -> tuple[jax.Array, jax.Array]:
    """One DSA layer of a decode step: -> (o_latent [B, H, r], the selection a following "shared" layer reuses)."""
    finite = None
    if q.index_q is not None:
        with jax.named_scope("dsa_index"):
            selection, finite = select_cached(pages, page_table, lengths, q)
    elif selection is None:
        raise ValueError("a DSA layer without an indexer ('shared') needs the previous layer's selection")
    with jax.named_scope("dsa_attention"):
        o = sparse_mla_decode_attention(kd, q.q_latent, q.q_rope, pages.latent, page_table, selection, lengths,
                                        scales=pages.scale, sm_scale=sm_scale)
    if finite is not None:  # a non-finite index key makes the output non-finite: the integrity guard sees it
        o = jnp.where(finite[:, None, None], o, jnp.nan)
    return o, selection
