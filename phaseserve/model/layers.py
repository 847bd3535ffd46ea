"""Basic layers: RMSNorm, rotary embeddings (default, YaRN, Llama-3, linear; partial and interleaved),
the SwiGLU MLP and causal prefill attention (``pallas_kernels.flash_prefill``: memory linear in T).
Pure functions of (params, config, arrays).

Numerics follow Hugging Face transformers: norms are computed in float32 and cast back before the
weight multiply; softmax runs in float32; RoPE cos/sin are computed in float32 and cast to the
activation dtype. One departure, for overflows only: where a row's mean square overflows float32 (activations
past ~1.8e19), transformers' RMSNorm returns zeros (x / inf) and the model goes on to finite, meaningless logits;
here that row becomes NaN, so the overflow reaches the logits and the engine ends the request with
``NonFiniteLogitsError`` instead of emitting a token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from phaseserve.config import ModelConfig, RopeConfig
from phaseserve.kernel_mesh import DIRECT, KernelDispatch, flash_prefill  # shard_map'd on the step's mesh
from phaseserve.model.params import MLPParams
from phaseserve.qarrays import dense


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x [..., D], w [D] -> [..., D] (HF: normalise in f32, cast, then scale; a row whose mean square is not finite
    comes out NaN, not HF's zeros: module docstring)."""
    xf = x.astype(jnp.float32)
    ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
    xf = jnp.where(jnp.isfinite(ms), xf * jax.lax.rsqrt(ms + eps), jnp.nan)
    return w.astype(x.dtype) * xf.astype(x.dtype)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(rope: RopeConfig, dim: int, max_pos: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies f32[dim // 2] and the cos/sin scale ('attention factor') for a rotary dim."""
    base = rope.theta
    inv = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if rope.kind in ("default",):
        return inv.astype(np.float32), 1.0
    if rope.kind == "linear":
        return (inv / rope.factor).astype(np.float32), 1.0
    if rope.kind == "llama3":
        old = rope.original_max_position_embeddings or 8192
        low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
        wl = 2 * math.pi / inv
        scaled = np.where(wl > low_wl, inv / rope.factor, inv)
        smooth = (old / wl - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wl >= high_wl) & (wl <= low_wl)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    # yarn
    factor = rope.factor
    orig = rope.original_max_position_embeddings or max_pos
    if rope.attention_factor is not None:
        att = float(rope.attention_factor)
    elif rope.mscale and rope.mscale_all_dim:
        att = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        att = _yarn_mscale(factor)

    def corr_dim(n_rot: float) -> float:
        return (dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrap = 1.0 - ramp
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv.astype(np.float32), float(att)


def softmax_scale(cfg: ModelConfig) -> float:
    """Attention logit scale: head_dim^-0.5, times mscale^2 for DeepSeek-style YaRN (``mscale_all_dim``)."""
    scale = cfg.head_dim ** -0.5
    r = cfg.rope
    if r.kind == "yarn" and r.mscale_all_dim:
        m = _yarn_mscale(r.factor, r.mscale_all_dim)
        scale *= m * m
    return scale


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """positions i32[...] -> cos, sin [..., rotary_dim // 2] (already scaled by the attention factor)."""
    inv, att = rope_frequencies(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
    return (jnp.cos(freqs) * att).astype(dtype), (jnp.sin(freqs) * att).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """Rotate the first ``2 * cos.shape[-1]`` dims of x [B, T, H, hd]; cos/sin [B, T, rot/2].

    ``interleave`` rotates pairs (x0, x1), (x2, x3), ... and returns them de-interleaved (evens then odds),
    exactly as transformers does for DeepSeek; since q and k are permuted alike, scores are unchanged.
    """
    rot = 2 * cos.shape[-1]
    xr, xp = x[..., :rot], x[..., rot:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    if interleave:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return jnp.concatenate([out, xp], axis=-1) if xp.shape[-1] else out


def mlp(p: MLPParams, x: jax.Array, *, kd: KernelDispatch = DIRECT) -> jax.Array:
    """SwiGLU: x [..., D] -> [..., D]."""
    return dense(jax.nn.silu(dense(x, p.w_gate, kd)) * dense(x, p.w_up, kd), p.w_down, kd)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, lengths: jax.Array | None,
              scale: float, *, kd: KernelDispatch = DIRECT) -> jax.Array:
    """Causal attention with memory linear in T (flash prefill; the blockwise XLA reference on the CPU).

    q [B, T, H, dk], k [B, S, KV, dk], v [B, S, KV, dv], q_positions i32[B, T], lengths i32[B] | None -> [B, T, H, dv].
    Key s is visible to the query at position p when s <= p and s < lengths[b]; a query that sees no key
    (padding) gives zeros. GQA when KV < H; MLA's expanded form is KV == H with dk != dv. ``kd.attn_impl`` picks
    the implementation (``phaseserve.kernel_mesh``).
    """
    return flash_prefill(kd, q, k, v, q_positions, lengths, sm_scale=scale)
