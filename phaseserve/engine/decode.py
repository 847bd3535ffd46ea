"""The decode worker's step: one jitted function for the whole running batch.

For every row ``b`` it feeds ``tokens[b]`` at ``positions[b]``, writes that token's KV into the row's pages,
attends over the row's paged cache (FP8 pages dequantized inside the attention kernel), runs the decode weight
representation through the MoE layers, and samples the next token::

    step(params, pool, batch) -> (next_tokens i32[B], pool', finite bool[B] | None)

Integrity: the step takes the tracker's ``ok bool[B]`` mask (computed by the tracker's separate jitted check
just before) and consumes it on device: failing rows' page tables point at the null page, they write nothing
and attend over nothing. The hooks come from the tracker object; with :class:`NoopTracker` they are identities
and the traced step is the same jaxpr as one built with ``tracker=None`` (tested).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.mla_attention import mla_decode_attention
from pallas_kernels.paged_attention import paged_decode_attention
from phaseserve.cache.paged import GQAPages, MLAPages, PagePool, write_token_layer
from phaseserve.config import ModelConfig
from phaseserve.engine.sampling import sample
from phaseserve.model import attention_gqa, attention_mla
from phaseserve.model.layers import rms_norm, softmax_scale
from phaseserve.model.params import Params
from phaseserve.model.transformer import embed, ffn, logits_from_hidden


@struct.dataclass
class DecodeBatch:
    """Per-row inputs of one decode step (B rows, padding rows have ``active=False``)."""

    tokens: jax.Array  # i32[B] input token
    positions: jax.Array  # i32[B] its position
    page_table: jax.Array  # i32[B, P]
    active: jax.Array  # bool[B] real rows
    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    seeds: jax.Array  # u32[B]
    steps: jax.Array  # i32[B] index of the token being sampled in the request's output


def _attend_gqa(layer_p, cfg: ModelConfig, pages: GQAPages, h, batch: DecodeBatch, pt, write, lengths, impl):
    q, k, v = attention_gqa.decode_queries(layer_p, cfg, h, batch.positions)
    pages = write_token_layer(pages, (k, v), pt, batch.positions, write)
    o = paged_decode_attention(q, pages.k, pages.v, pt, lengths, k_scales=pages.k_scale, v_scales=pages.v_scale,
                               sm_scale=softmax_scale(cfg), impl=impl)
    return pages, o


def _attend_mla(layer_p, cfg: ModelConfig, pages: MLAPages, h, batch: DecodeBatch, pt, write, lengths, impl):
    q_lat, q_rope, lat = attention_mla.absorbed_queries(layer_p, cfg, h, batch.positions)
    pages = write_token_layer(pages, lat, pt, batch.positions, write)
    o = mla_decode_attention(q_lat, q_rope, pages.latent, pt, lengths, scales=pages.scale,
                             sm_scale=softmax_scale(cfg), impl=impl)
    return pages, o


def decode_step(params: Params, cfg: ModelConfig, pool: PagePool, batch: DecodeBatch, ok: Any, *,
                tracker: Any = None, attn_impl: str = "auto") -> tuple[jax.Array, PagePool, Any]:
    """One decode step for the batch. ``ok`` bool[B] from the tracker's check (None when disabled)."""
    pt, write = batch.page_table, batch.active
    if tracker is not None:
        pt = tracker.mask_table(pt, ok)
        write = tracker.mask_rows(write, ok)
    lengths = jnp.where(write, batch.positions + 1, 0)
    finite = None
    x = embed(params, batch.tokens)
    new_layers = []
    for layer_p, pages in zip(params.layers, pool.layers, strict=True):
        h = rms_norm(x, layer_p.attn_norm, cfg.rms_norm_eps)
        if cfg.is_mla:
            pages, o = _attend_mla(layer_p.attn, cfg, pages, h, batch, pt, write, lengths, attn_impl)
        else:
            pages, o = _attend_gqa(layer_p.attn, cfg, pages, h, batch, pt, write, lengths, attn_impl)
        if tracker is not None:
            o, finite = tracker.guard(o, finite)
        if cfg.is_mla:
            out = attention_mla.absorbed_output(layer_p.attn, cfg, o)
        else:
            out = attention_gqa.output(layer_p.attn, o[:, None])[:, 0]
        x = ffn(layer_p, cfg, x + out)
        new_layers.append(pages)
    logits = logits_from_hidden(params, cfg, x)
    nxt = sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.seeds, batch.steps)
    return nxt, pool.replace(layers=tuple(new_layers)), finite
