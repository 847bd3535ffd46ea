"""Multi-head latent attention (DeepSeek-V3 / Kimi K2 / GLM-5).

Per token the cache holds one latent row ``[kv_lora_rank + qk_rope_head_dim]``: the RMS-normalised
compressed KV ``c`` followed by the roped shared key ``k_rope``.

Two equivalent forms:

- expanded (prefill): ``K_nope, V = c @ W_kv_b`` per head, then ordinary attention over
  ``[K_nope, k_rope]``;
- weight-absorbed (decode): ``q_latent = q_nope @ W_uk^T`` so scores are ``q_latent . c + q_rope . k_rope``
  and the output stays in latent space, ``o_latent = P @ c``, projected by ``W_uv`` afterwards. Decode then
  reads only the latent pages (576 values per token for Kimi K2 / GLM-5) instead of per-head K and V.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from phaseserve.config import ModelConfig, SequenceTooLongError
from phaseserve.model.layers import apply_rope, attention, rms_norm, rope_cos_sin, softmax_scale
from phaseserve.model.params import MLAParams
from phaseserve.qarrays import dense, dequantize


def check_length(cfg: ModelConfig, seq_len: int) -> None:
    """GLM-5's DSA indexer is exact dense attention only up to ``index_topk`` keys (see config.py)."""
    if cfg.index_topk is not None and seq_len > cfg.index_topk:
        raise SequenceTooLongError(
            f"sequence of {seq_len} tokens exceeds index_topk={cfg.index_topk}: the DSA indexer is not "
            "implemented, so attention is only exact (dense) up to index_topk keys"
        )


def queries(p: MLAParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array):
    """x [B, T, D] -> q_nope [B, T, H, nope], q_rope [B, T, H, rope] (rotary applied)."""
    b, t, _ = x.shape
    if p.wq is not None:
        q = dense(x, p.wq)
    else:
        q = dense(rms_norm(dense(x, p.wq_a), p.q_a_norm, cfg.mla_norm_eps), p.wq_b)
    q = q.reshape(b, t, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
    cos, sin = rope_cos_sin(cfg, positions, x.dtype)
    return q_nope, apply_rope(q_rope, cos, sin, cfg.rope.interleave)


def latents(p: MLAParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, T, D] -> cacheable latent [B, T, kv_lora + rope] = [norm(c_kv), rope(k_rope)]."""
    ckv = dense(x, p.wkv_a)
    c, k_rope = ckv[..., : cfg.kv_lora_rank], ckv[..., cfg.kv_lora_rank:]
    c = rms_norm(c, p.kv_a_norm, cfg.mla_norm_eps)
    cos, sin = rope_cos_sin(cfg, positions, x.dtype)
    k_rope = apply_rope(k_rope[:, :, None, :], cos, sin, cfg.rope.interleave)[:, :, 0]
    return jnp.concatenate([c, k_rope], axis=-1)


def _kv_b(p: MLAParams, cfg: ModelConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """W_uk [r, H, nope] and W_uv [r, H, v] from kv_b_proj (dequantized: it is small)."""
    w = dequantize(p.wkv_b, dtype).reshape(cfg.kv_lora_rank, cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
    return w[..., : cfg.qk_nope_head_dim], w[..., cfg.qk_nope_head_dim:]


def output(p: MLAParams, x: jax.Array) -> jax.Array:
    """per-head values [B, T, H, v] -> [B, T, D]."""
    b, t = x.shape[:2]
    return dense(x.reshape(b, t, -1), p.wo)


def forward(p: MLAParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array, lengths: jax.Array | None):
    """Expanded-form causal attention. Returns (out [B, T, D], latent [B, T, kv_lora + rope] to cache)."""
    check_length(cfg, x.shape[1])
    q_nope, q_rope = queries(p, cfg, x, positions)
    lat = latents(p, cfg, x, positions)
    c, k_rope = lat[..., : cfg.kv_lora_rank], lat[..., cfg.kv_lora_rank:]
    w_uk, w_uv = _kv_b(p, cfg, x.dtype)
    k_nope = jnp.einsum("btr,rhn->bthn", c, w_uk, preferred_element_type=jnp.float32).astype(x.dtype)
    v = jnp.einsum("btr,rhv->bthv", c, w_uv, preferred_element_type=jnp.float32).astype(x.dtype)
    k_rope_h = jnp.broadcast_to(k_rope[:, :, None, :], (*k_rope.shape[:2], cfg.num_heads, k_rope.shape[-1]))
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    k = jnp.concatenate([k_nope, k_rope_h], axis=-1)
    out = attention(q, k, v, positions, lengths, softmax_scale(cfg))
    return output(p, out), lat


def absorbed_queries(p: MLAParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array):
    """One token per row: x [B, D], positions i32[B] -> q_latent [B, H, r], q_rope [B, H, rope], latent [B, r+rope]."""
    q_nope, q_rope = queries(p, cfg, x[:, None], positions[:, None])
    w_uk, _ = _kv_b(p, cfg, x.dtype)
    q_lat = jnp.einsum("bhn,rhn->bhr", q_nope[:, 0], w_uk, preferred_element_type=jnp.float32).astype(x.dtype)
    return q_lat, q_rope[:, 0], latents(p, cfg, x[:, None], positions[:, None])[:, 0]


def absorbed_output(p: MLAParams, cfg: ModelConfig, o_latent: jax.Array) -> jax.Array:
    """o_latent [B, H, r] -> [B, D] through W_uv and the output projection."""
    _, w_uv = _kv_b(p, cfg, o_latent.dtype)
    v = jnp.einsum("bhr,rhv->bhv", o_latent, w_uv, preferred_element_type=jnp.float32).astype(o_latent.dtype)
    return dense(v.reshape(v.shape[0], -1), p.wo)
