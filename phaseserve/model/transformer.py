"""The decoder stack: ``forward`` (full causal pass, no cache) and ``prefill`` (also returns the per-layer
KV the decode cache stores). Decode over the paged cache lives in ``phaseserve.engine.decode``, which
reuses the per-layer pieces exposed here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from phaseserve.config import ModelConfig
from phaseserve.model import attention_gqa, attention_mla
from phaseserve.model.layers import mlp, rms_norm
from phaseserve.model.moe import moe
from phaseserve.model.params import LayerParams, MLPParams, Params
from phaseserve.qarrays import dense


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """tokens i32[...] -> [..., D]."""
    return jnp.take(params.embed, tokens, axis=0)


def ffn(layer: LayerParams, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The MLP half of a layer (dense SwiGLU or MoE), residual included. x [..., D]."""
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    return x + (mlp(layer.mlp, h) if isinstance(layer.mlp, MLPParams) else moe(layer.mlp, cfg, h))


def logits_from_hidden(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final norm and lm head: x [..., D] -> f32[..., V]."""
    h = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:
        return jnp.einsum("...d,vd->...v", h, params.embed.astype(h.dtype), preferred_element_type=jnp.float32)
    return dense(h, params.lm_head).astype(jnp.float32)


def _layer_attention(layer: LayerParams, cfg: ModelConfig, x, positions, lengths):
    h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    mod = attention_mla if cfg.is_mla else attention_gqa
    out, kv = mod.forward(layer.attn, cfg, h, positions, lengths)
    return x + out, kv


def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array | None = None,
            positions: jax.Array | None = None, logits_at: jax.Array | None = None) -> tuple[jax.Array, list[Any]]:
    """Causal pass returning (logits, per-layer KV).

    tokens i32[B, T] (right-padded), lengths i32[B] (valid tokens per row; None: all), positions i32[B, T],
    logits_at i32[B] (None: logits f32[B, T, V] for every position; else f32[B, V] at that index per row, so the
    lm head runs once per row). Per-layer KV: ``(k, v)`` each [B, T, KV, hd] for GQA, or the latent
    [B, T, kv_lora + rope] for MLA.
    """
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = embed(params, tokens)
    kvs = []
    for layer in params.layers:
        x, kv = _layer_attention(layer, cfg, x, positions, lengths)
        x = ffn(layer, cfg, x)
        kvs.append(kv)
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)[:, 0]
    return logits_from_hidden(params, cfg, x), kvs


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """tokens i32[B, T] -> logits f32[B, T, V]; causal, no cache."""
    return prefill(params, cfg, tokens)[0]
