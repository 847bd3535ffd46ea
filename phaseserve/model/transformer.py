"""The decoder stack, written once:

- :func:`prefill` / :func:`forward`: the full causal pass (``forward`` = logits only; ``prefill`` also returns the
  per-layer KV the decode cache stores); :func:`forward_with_moe_stats` is the same pass with a chosen expert
  dispatch (training) returning each MoE layer's expert load;
- :func:`decode_step`: one new token per row through every layer, with the KV storage left to the caller: an
  ``attend(cache, q, kv) -> (cache, o)`` callback writes the token's KV into that layer's cache and attends over it.
  The engine's paged step (``engine.decode_step``), the fault-injection harness and the cached reference generator
  (``eval.cached_decode``) all run this one function with the paged attention of ``phaseserve.cache.attend``.

Each takes ``kd``, the :class:`~phaseserve.kernel_mesh.KernelDispatch` its kernel calls (matmuls, attention) run
and are recorded with; the default, ``kernel_mesh.DIRECT``, calls the kernels directly (the engine's workers pass
their phase's: mesh, implementations, provenance log).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from phaseserve.config import ModelConfig
from phaseserve.kernel_mesh import DIRECT, KernelDispatch
from phaseserve.model import attention_gqa, attention_mla
from phaseserve.model.layers import mlp, rms_norm
from phaseserve.model.moe import Dispatch, moe
from phaseserve.model.params import LayerParams, MLPParams, Params
from phaseserve.qarrays import dense

Context = Callable[[int, Any], Any]  # (layer index, the chunk's KV) -> the KV the chunk attends over


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """tokens i32[...] -> [..., D]."""
    return jnp.take(params.embed, tokens, axis=0)


def ffn(layer: LayerParams, cfg: ModelConfig, x: jax.Array, dispatch: Dispatch | None = None, *,
        kd: KernelDispatch = DIRECT) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """The MLP half of a layer (dense SwiGLU or MoE), residual included: x [..., D] -> (x', MoE stats or None);
    ``dispatch`` None: the MoE layer picks (``moe.choose_dispatch``)."""
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    if isinstance(layer.mlp, MLPParams):
        return x + mlp(layer.mlp, h, kd=kd), None
    out, stats = moe(layer.mlp, cfg, h, dispatch, kd=kd)
    return x + out, stats


def logits_from_hidden(params: Params, cfg: ModelConfig, x: jax.Array, *, kd: KernelDispatch = DIRECT) -> jax.Array:
    """Final norm and lm head: x [..., D] -> f32[..., V]."""
    h = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if params.lm_head is None:
        return jnp.einsum("...d,vd->...v", h, params.embed.astype(h.dtype), preferred_element_type=jnp.float32)
    return dense(h, params.lm_head, kd).astype(jnp.float32)


def _layer_attention(layer: LayerParams, cfg: ModelConfig, x, positions, lengths, selection=None, context=None,
                     kd: KernelDispatch = DIRECT):
    """-> (x + attention, the layer's KV to cache, GLM-5's DSA key selection for a following "shared" layer)."""
    h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    if cfg.is_mla:
        out, kv, selection = attention_mla.forward(layer.attn, cfg, h, positions, lengths, selection, context, kd=kd)
    else:
        out, kv = attention_gqa.forward(layer.attn, cfg, h, positions, lengths, context, kd=kd)
    return x + out, kv, selection


def _stack(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths, positions, dispatch: Dispatch | None,
           context: Context | None, kd: KernelDispatch):
    """The causal pass: (hidden f32[B, T, D], per-layer KV, per-MoE-layer stats)."""
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = embed(params, tokens)
    kvs, stats, selection = [], [], None
    for i, layer in enumerate(params.layers):
        ctx = None if context is None else functools.partial(context, i)
        x, kv, selection = _layer_attention(layer, cfg, x, positions, lengths, selection, ctx, kd)
        x, st = ffn(layer, cfg, x, dispatch, kd=kd)
        kvs.append(kv)
        if st is not None:
            stats.append(st)
    return x, kvs, stats


def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array | None = None,
            positions: jax.Array | None = None, logits_at: jax.Array | None = None,
            context: Context | None = None, *, kd: KernelDispatch = DIRECT) -> tuple[jax.Array, list[Any]]:
    """Causal pass returning (logits, per-layer KV).

    tokens i32[B, T] (right-padded), lengths i32[B] (valid tokens per row; None: all), positions i32[B, T],
    logits_at i32[B] (None: logits f32[B, T, V] for every position; else f32[B, V] at that index per row, so the
    lm head runs once per row). Per-layer KV: ``(k, v)`` each [B, T, KV, hd] for GQA, or the latent
    [B, T, kv_lora + rope] for MLA.

    A prefill *chunk* (tokens at positions past what the request already holds) passes ``context(layer, kv) ->
    kv over [B, S, ...]``: it stores the chunk's KV with the request's and returns every key the chunk may attend to
    (key s at position s); ``lengths`` then counts those keys (cached + this chunk's valid tokens).
    """
    x, kvs = prefill_hidden(params, cfg, tokens, lengths, positions, context, kd=kd)
    if logits_at is not None:
        x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)[:, 0]
    return logits_from_hidden(params, cfg, x, kd=kd), kvs


def prefill_hidden(params: Params, cfg: ModelConfig, tokens: jax.Array, lengths: jax.Array | None = None,
                   positions: jax.Array | None = None, context: Context | None = None, *,
                   kd: KernelDispatch = DIRECT) -> tuple[jax.Array, list[Any]]:
    """:func:`prefill` before the lm head: (final hidden states [B, T, D], per-layer KV); the logits of any position
    are ``logits_from_hidden`` of its row (the engine's chunk step takes the last token's, and every position's
    only when a request asks for its prompt's logprobs)."""
    x, kvs, _ = _stack(params, cfg, tokens, lengths, positions, None, context, kd)
    return x, kvs


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, *, kd: KernelDispatch = DIRECT) -> jax.Array:
    """tokens i32[B, T] -> logits f32[B, T, V]; causal, no cache."""
    return prefill(params, cfg, tokens, kd=kd)[0]


def forward_with_moe_stats(params: Params, cfg: ModelConfig, tokens: jax.Array, dispatch: Dispatch | None = None, *,
                           kd: KernelDispatch = DIRECT) -> tuple[jax.Array, dict[str, jax.Array]]:
    """:func:`forward` with the MoE layers dispatching through ``dispatch`` (see ``model.moe``; None: the MoE layer
    picks): tokens i32[B, T] -> (logits f32[B, T, V], {"load": f32[num_moe_layers, E], "dropped":
    f32[num_moe_layers]})."""
    x, _, stats = _stack(params, cfg, tokens, None, None, dispatch, None, kd)
    return logits_from_hidden(params, cfg, x, kd=kd), {k: jnp.stack([s[k] for s in stats]) for k in ("load", "dropped")}


Attend = Callable[[Any, Any, Any], tuple[Any, jax.Array]]


def decode_step(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array, caches: Any,
                attend: Attend, *, kd: KernelDispatch = DIRECT) -> tuple[jax.Array, list[Any]]:
    """One new token per row: tokens i32[B] at positions i32[B] -> (logits f32[B, V], per-layer caches).

    ``caches`` holds one entry per layer, in whatever form ``attend(cache, q, kv) -> (cache, o)`` stores it; attend
    writes the new token's KV and attends over the row's cached tokens (this one included):

    - GQA: q [B, H, hd], kv ``(k, v)`` each [B, KV, hd] -> o [B, H, hd];
    - MLA (weight-absorbed): q ``(q_latent [B, H, r], q_rope [B, H, rope])``, kv latent [B, r + rope]
      -> o [B, H, r]; GLM-5 (DSA): q an ``indexer.DSAQuery``, kv ``(latent, index key)`` on layers with an indexer.
    """
    x = embed(params, tokens)
    new = []
    for layer, cache in zip(params.layers, caches, strict=True):
        h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        if cfg.is_mla:
            q, kv = attention_mla.absorbed_queries(layer.attn, cfg, h, positions, kd=kd)
            cache, o = attend(cache, q, kv)
            out = attention_mla.absorbed_output(layer.attn, cfg, o, kd=kd)
        else:
            q, k, v = attention_gqa.decode_queries(layer.attn, cfg, h, positions, kd=kd)
            cache, o = attend(cache, q, (k, v))
            out = attention_gqa.output(layer.attn, o[:, None], kd=kd)[:, 0]
        x, _ = ffn(layer, cfg, x + out, kd=kd)
        new.append(cache)
    return logits_from_hidden(params, cfg, x, kd=kd), new
