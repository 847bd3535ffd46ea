"""Multi-head latent attention (DeepSeek-V3 / Kimi K2 / GLM-5).

Per token the cache holds one latent row ``[kv_lora_rank + qk_rope_head_dim]``: the RMS-normalised
compressed KV ``c`` followed by the roped shared key ``k_rope``.

Two equivalent forms:

- expanded (prefill): ``K_nope, V = c @ W_kv_b`` per head, then ordinary attention over
  ``[K_nope, k_rope]``;
- weight-absorbed (decode): ``q_latent = q_nope @ W_uk^T`` so scores are ``q_latent . c + q_rope . k_rope``
  and the output stays in latent space, ``o_latent = P @ c``, projected by ``W_uv`` afterwards. Decode then
  reads only the latent pages (576 values per token for Kimi K2 / GLM-5) instead of per-head K and V.

A prefill chunk over cached keys (a prefix hit's suffix, a later chunk of a long prompt) takes whichever form costs
fewer multiply-adds for its T queries over S keys (:func:`absorbed_is_cheaper`): the expanded form runs every key
through ``W_kv_b`` (S * r * H * (nope + v)), which a short chunk over a long context never earns back; the absorbed
form's cost grows with T * S only. GLM-5 prompts longer than ``index_topk`` take the weight-absorbed form over the
keys the DSA indexer selects (:mod:`phaseserve.model.indexer`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.common import finalize
from phaseserve.config import ModelConfig
from phaseserve.kernel_mesh import DIRECT, KernelDispatch
from phaseserve.model import indexer
from phaseserve.model.layers import apply_rope, attention, rms_norm, rope_cos_sin, softmax_scale
from phaseserve.model.params import MLAParams
from phaseserve.qarrays import dense, dequantize, is_quantized


def queries(p: MLAParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array, *, kd: KernelDispatch = DIRECT):
    """x [B, T, D] -> q_nope [B, T, H, nope], q_rope [B, T, H, rope] (rotary applied), and the query latent
    ``q_resid`` [B, T, q_lora] (None without q LoRA) that the DSA indexer reads."""
    b, t, _ = x.shape
    if p.wq is not None:
        q_resid, q = None, dense(x, p.wq, kd)
    else:
        q_resid = rms_norm(dense(x, p.wq_a, kd), p.q_a_norm, cfg.mla_norm_eps)
        q = dense(q_resid, p.wq_b, kd)
    q = q.reshape(b, t, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
    cos, sin = rope_cos_sin(cfg, positions, x.dtype)
    return q_nope, apply_rope(q_rope, cos, sin, cfg.rope.interleave), q_resid


def latents(p: MLAParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array, *,
            kd: KernelDispatch = DIRECT) -> jax.Array:
    """x [B, T, D] -> cacheable latent [B, T, kv_lora + rope] = [norm(c_kv), rope(k_rope)]."""
    ckv = dense(x, p.wkv_a, kd)
    c, k_rope = ckv[..., : cfg.kv_lora_rank], ckv[..., cfg.kv_lora_rank:]
    c = rms_norm(c, p.kv_a_norm, cfg.mla_norm_eps)
    cos, sin = rope_cos_sin(cfg, positions, x.dtype)
    k_rope = apply_rope(k_rope[:, :, None, :], cos, sin, cfg.rope.interleave)[:, :, 0]
    return jnp.concatenate([c, k_rope], axis=-1)


def _kv_b(p: MLAParams, cfg: ModelConfig, dtype) -> jax.Array:
    """kv_b_proj as [r, H, nope + v] (dequantized: it is small)."""
    return dequantize(p.wkv_b, dtype).reshape(cfg.kv_lora_rank, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)


def _per_head(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., H, k] times w [H, k, m] per head -> [..., H, m], as one batched matmul over [H, M, k] with the head
    axis moved to the front first. The einsum with the heads in the middle was slower on XLA:CPU: the decode step's
    dense projections 2.53 -> 1.50 ms at 8 rows of the vLLM race's MLA 512 + 64 shape, 2.82 -> 2.13 at 16
    (``benchmarks/vllm_race/decode_ops_1207d_heads_compare.md``, runs one after the other)."""
    h, k = x.shape[-2:]
    lead = x.shape[:-2]
    y = jnp.matmul(jnp.moveaxis(x, -2, 0).reshape(h, -1, k), w)  # [H, M, m]
    return jnp.moveaxis(y.reshape(h, *lead, w.shape[-1]), 0, -2)


def absorb_query(p: MLAParams, cfg: ModelConfig, q_nope: jax.Array) -> jax.Array:
    """q_nope [..., H, nope] -> q_latent [..., H, r] = q_nope @ W_uk^T per head, in q_nope's dtype. Reads the
    head-major W_uk of ``p.kv_b_heads`` where set; else slices it from wkv_b (on XLA:CPU a relayout copy of the
    weight in every call: the per-head product needs the head axis major). The product comes out in the operands'
    dtype (XLA:CPU has no float32 result for two bfloat16 operands in every layout; the accumulation is float32)."""
    if p.kv_b_heads is not None:
        q = _per_head(q_nope, p.kv_b_heads[0].astype(q_nope.dtype))
    else:
        q = jnp.einsum("...hn,rhn->...hr", q_nope, _kv_b(p, cfg, q_nope.dtype)[..., : cfg.qk_nope_head_dim])
    return q.astype(q_nope.dtype)


def absorb_output(p: MLAParams, cfg: ModelConfig, o_latent: jax.Array) -> jax.Array:
    """o_latent [..., H, r] -> per-head values [..., H, v] = o_latent @ W_uv per head, in o_latent's dtype (W_uv
    head-major from ``p.kv_b_heads`` where set, as :func:`absorb_query`)."""
    if p.kv_b_heads is not None:
        v = _per_head(o_latent, p.kv_b_heads[1].astype(o_latent.dtype))
    else:
        v = jnp.einsum("...hr,rhv->...hv", o_latent, _kv_b(p, cfg, o_latent.dtype)[..., cfg.qk_nope_head_dim:])
    return v.astype(o_latent.dtype)


def with_head_major_kv_b(cfg: ModelConfig, params: Any) -> Any:
    """``params`` with ``kv_b_heads`` set on every MLA layer whose wkv_b is a plain float array: W_uk [H, nope, r]
    and W_uv [H, r, v], computed once (on wkv_b's devices) so the absorbed products read them in place. Quantized
    wkv_b (dequantized in every step anyway), layers already set and other attention kinds are left as they are."""
    def one(layer: Any) -> Any:
        a = layer.attn
        if not isinstance(a, MLAParams) or a.kv_b_heads is not None or is_quantized(a.wkv_b):
            return layer
        w = _kv_b(a, cfg, a.wkv_b.dtype)  # [r, H, nope + v]
        uk = jnp.transpose(w[..., : cfg.qk_nope_head_dim], (1, 2, 0))
        uv = jnp.transpose(w[..., cfg.qk_nope_head_dim:], (1, 0, 2))
        return layer.replace(attn=a.replace(kv_b_heads=(uk, uv)))

    return params.replace(layers=[one(layer) for layer in params.layers])


def absorbed_is_cheaper(cfg: ModelConfig, t: int, s: int) -> bool:
    """Whether T queries attending over S keys cost fewer multiply-adds per row and layer in the weight-absorbed form
    (queries lifted to the latent, T * H * r * (nope + v); scores and values at latent width, T * S * H * (2r + rope))
    than in the expanded one (every key through W_kv_b, S * r * H * (nope + v); attention at head width,
    T * S * H * (nope + rope + v))."""
    r, h, dn, dr, dv = cfg.kv_lora_rank, cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    expanded = s * r * h * (dn + dv) + t * s * h * (dn + dr + dv)
    absorbed = t * h * r * (dn + dv) + t * s * h * (2 * r + dr)
    return absorbed < expanded


def latent_attention(q_latent: jax.Array, q_rope: jax.Array, latents: jax.Array, q_positions: jax.Array,
                     lengths: jax.Array | None, scale: float) -> jax.Array:
    """Weight-absorbed causal attention of a chunk over its row's keys, in float32.

    q_latent [B, T, H, r], q_rope [B, T, H, rope], latents [B, S, r + rope] (key s at position s), q_positions
    i32[B, T], lengths i32[B] | None -> o_latent [B, T, H, r] in q_latent's dtype. Key s is visible to the query at
    position p when s <= p and s < lengths[b]; a query that sees no key (padding) gives zeros."""
    r = q_latent.shape[-1]
    q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(jnp.float32)
    x = latents.astype(jnp.float32)
    keys = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), (*q_positions.shape, x.shape[1]))
    ok = indexer.visible(keys, q_positions, lengths)[:, :, None, :]  # [B, T, 1, S]
    hi = jax.lax.Precision.HIGHEST
    s = jnp.where(ok, jnp.einsum("bthf,bsf->bths", q, x, precision=hi) * scale, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    o = jnp.einsum("bths,bsr->bthr", e, x[..., :r], precision=hi)
    return finalize(o, jnp.sum(e, axis=-1, keepdims=True)).astype(q_latent.dtype)


def output(p: MLAParams, x: jax.Array, *, kd: KernelDispatch = DIRECT) -> jax.Array:
    """per-head values [B, T, H, v] -> [B, T, D]."""
    b, t = x.shape[:2]
    return dense(x.reshape(b, t, -1), p.wo, kd)


def forward(p: MLAParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array, lengths: jax.Array | None,
            selection: jax.Array | None = None, context=None, *, kd: KernelDispatch = DIRECT):
    """Causal attention: x [B, T, D], positions i32[B, T], lengths i32[B] | None -> (out [B, T, D], KV to cache,
    DSA selection i32[B, T, index_topk] or None).

    The KV to cache is the latent [B, T, kv_lora + rope], or on a GLM-5 layer with its own DSA indexer the pair
    ``(latent, index keys [B, T, index_head_dim])``. Without a DSA indexer, or while there are no more than
    index_topk keys (every causal key is selected: exactly dense attention), the expanded form with flash prefill;
    past index_topk the sparse form of :mod:`phaseserve.model.indexer`, where a layer without indexer weights
    (``indexer_types`` "shared") reuses ``selection`` from the layer before. ``context(kv) -> kv over [B, S, ...]``
    (None: the tokens themselves) gives the keys to attend over, key s at position s (a prefill chunk over the
    request's cached KV); ``lengths`` then counts valid keys, and a chunk short enough for its keys
    (:func:`absorbed_is_cheaper`) attends in the weight-absorbed form."""
    q_nope, q_rope, q_resid = queries(p, cfg, x, positions, kd=kd)
    kv = lat = latents(p, cfg, x, positions, kd=kd)
    if p.indexer is not None:
        kv = (lat, indexer.index_keys(p.indexer, cfg, x, positions, kd=kd))
    ctx = kv if context is None else context(kv)
    ctx_lat, ctx_index = ctx if isinstance(ctx, tuple) else (ctx, None)
    c, k_rope = ctx_lat[..., : cfg.kv_lora_rank], ctx_lat[..., cfg.kv_lora_rank:]
    if cfg.index_topk is not None and ctx_lat.shape[1] > cfg.index_topk:
        index = None
        if p.indexer is not None:
            q_idx, w = indexer.index_queries(p.indexer, cfg, q_resid, x, positions, kd=kd)
            index = (q_idx, w, ctx_index)
        elif selection is None:
            raise ValueError("a DSA layer without indexer weights ('shared') needs the previous layer's selection")
        q_lat = absorb_query(p, cfg, q_nope)
        with jax.named_scope("attention"):
            o_lat, selection = indexer.sparse_prefill(cfg, q_lat, q_rope, ctx_lat, positions, lengths,
                                                      softmax_scale(cfg), index=index, selection=selection)
        return output(p, absorb_output(p, cfg, o_lat), kd=kd), kv, selection
    if context is not None and absorbed_is_cheaper(cfg, x.shape[1], ctx_lat.shape[1]):
        q_lat = absorb_query(p, cfg, q_nope)
        with jax.named_scope("attention"):
            o_lat = latent_attention(q_lat, q_rope, ctx_lat, positions, lengths, softmax_scale(cfg))
        return output(p, absorb_output(p, cfg, o_lat), kd=kd), kv, None
    # every key through the whole W_kv_b in one product, split after: slicing the weight's halves first would copy
    # them in every call on XLA:CPU (the product in the operands' dtype, as absorb_query)
    kv_h = jnp.einsum("btr,rhk->bthk", c, _kv_b(p, cfg, x.dtype)).astype(x.dtype)
    k_nope, v = kv_h[..., : cfg.qk_nope_head_dim], kv_h[..., cfg.qk_nope_head_dim:]
    k_rope_h = jnp.broadcast_to(k_rope[:, :, None, :], (*k_rope.shape[:2], cfg.num_heads, k_rope.shape[-1]))
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    k = jnp.concatenate([k_nope, k_rope_h], axis=-1)
    with jax.named_scope("attention"):
        out = attention(q, k, v, positions, lengths, softmax_scale(cfg), kd=kd)
    return output(p, out, kd=kd), kv, None


def absorbed_queries(p: MLAParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array, *,
                     kd: KernelDispatch = DIRECT):
    """One token per row: x [B, D], positions i32[B] -> (q, kv) for the decode step's ``attend``.

    q is ``(q_latent [B, H, r], q_rope [B, H, rope])`` and kv the latent [B, r + rope]; on GLM-5 (DSA) q is an
    :class:`phaseserve.model.indexer.DSAQuery` and, on a layer with its own indexer, kv is ``(latent, index key
    [B, index_head_dim])``."""
    q_nope, q_rope, q_resid = queries(p, cfg, x[:, None], positions[:, None], kd=kd)
    q_lat = absorb_query(p, cfg, q_nope[:, 0])
    lat = latents(p, cfg, x[:, None], positions[:, None], kd=kd)[:, 0]
    if cfg.index_topk is None:
        return (q_lat, q_rope[:, 0]), lat
    if p.indexer is None:  # "shared": reuses the previous layer's selection
        return indexer.DSAQuery(q_lat, q_rope[:, 0], None, None, cfg.index_topk), lat
    q_idx, w = indexer.index_queries(p.indexer, cfg, q_resid, x[:, None], positions[:, None], kd=kd)
    k_idx = indexer.index_keys(p.indexer, cfg, x[:, None], positions[:, None], kd=kd)[:, 0]
    return indexer.DSAQuery(q_lat, q_rope[:, 0], q_idx[:, 0], w[:, 0], cfg.index_topk), (lat, k_idx)


def absorbed_output(p: MLAParams, cfg: ModelConfig, o_latent: jax.Array, *, kd: KernelDispatch = DIRECT) -> jax.Array:
    """o_latent [B, H, r] -> [B, D] through W_uv and the output projection."""
    v = absorb_output(p, cfg, o_latent)
    return dense(v.reshape(v.shape[0], -1), p.wo, kd)
