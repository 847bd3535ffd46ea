"""Grouped-query attention (Llama, Qwen3 with q/k norm, GLM-4.5 with partial rotary and q/k/v biases).

The cacheable per-token state is K and V: ``k, v [B, T, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import jax

from phaseserve.config import ModelConfig
from phaseserve.kernel_mesh import DIRECT, KernelDispatch
from phaseserve.model.layers import apply_rope, attention, rms_norm, rope_cos_sin, softmax_scale
from phaseserve.model.params import GQAParams
from phaseserve.qarrays import dense


def project_qkv(p: GQAParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array, *, kd: KernelDispatch = DIRECT):
    """x [B, T, D], positions i32[B, T] -> q [B, T, H, hd], k, v [B, T, KV, hd] (rotary applied)."""
    b, t, _ = x.shape
    q, k, v = dense(x, p.wq, kd), dense(x, p.wk, kd), dense(x, p.wv, kd)
    if p.bq is not None:
        q, k, v = q + p.bq.astype(x.dtype), k + p.bk.astype(x.dtype), v + p.bv.astype(x.dtype)
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if p.q_norm is not None:
        q, k = rms_norm(q, p.q_norm, cfg.rms_norm_eps), rms_norm(k, p.k_norm, cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(cfg, positions, x.dtype)
    return apply_rope(q, cos, sin, cfg.rope.interleave), apply_rope(k, cos, sin, cfg.rope.interleave), v


def output(p: GQAParams, x: jax.Array, *, kd: KernelDispatch = DIRECT) -> jax.Array:
    """attn [B, T, H, hd] -> [B, T, D]."""
    b, t = x.shape[:2]
    return dense(x.reshape(b, t, -1), p.wo, kd)


def forward(p: GQAParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array, lengths: jax.Array | None,
            context=None, *, kd: KernelDispatch = DIRECT):
    """Causal self-attention. Returns (out [B, T, D], (k, v) to cache). ``context((k, v)) -> (k, v)`` [B, S, KV, hd]
    (None: the tokens themselves) gives the keys to attend over, key s at position s (a prefill chunk: the request's
    cached KV with the chunk's own written in); ``lengths`` then counts the valid keys."""
    q, k, v = project_qkv(p, cfg, x, positions, kd=kd)
    kc, vc = (k, v) if context is None else context((k, v))
    with jax.named_scope("attention"):
        out = attention(q, kc, vc, positions, lengths, softmax_scale(cfg), kd=kd)
    return output(p, out, kd=kd), (k, v)


def decode_queries(p: GQAParams, cfg: ModelConfig, x: jax.Array, positions: jax.Array, *,
                   kd: KernelDispatch = DIRECT):
    """One token per row: x [B, D], positions i32[B] -> q [B, H, hd], k, v [B, KV, hd]."""
    q, k, v = project_qkv(p, cfg, x[:, None], positions[:, None], kd=kd)
    return q[:, 0], k[:, 0], v[:, 0]

