"""Mixture-of-experts block: routing and expert dispatch.

Routing (``route``):

- ``softmax`` (Qwen3-MoE): softmax over expert logits, top-k, optional renormalisation;
- ``sigmoid`` (DeepSeek-V3, Kimi K2, GLM-4.5/5): sigmoid scores, ``e_score_correction_bias`` added for the
  *choice* only, group-limited top-k (keep the ``topk_group`` of ``n_group`` groups with the best
  top-2 sums), weights are the un-biased scores, optionally renormalised, times ``routed_scaling_factor``.

Dispatch (``moe``): the N*k (token, expert) assignments are sorted by expert and run through one ragged
(grouped) matmul per projection (``qarrays.grouped_dense``, i.e. ``jax.lax.ragged_dot`` or the INT4 grouped
kernel), then scattered back weighted. Shared experts run densely on every token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from phaseserve.config import ModelConfig
from phaseserve.model.layers import mlp
from phaseserve.model.params import MoEParams
from phaseserve.qarrays import grouped_dense


def route(p: MoEParams, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [N, D] -> (weights f32[N, k], expert ids i32[N, k])."""
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), p.router.astype(jnp.float32))
    k = cfg.num_experts_per_tok
    if cfg.scoring_func == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        w, idx = jax.lax.top_k(probs, k)
        if cfg.norm_topk_prob:
            w = w / jnp.sum(w, axis=-1, keepdims=True)
        return w * cfg.routed_scaling_factor, idx
    scores = jax.nn.sigmoid(logits)
    choice = scores + p.correction_bias if p.correction_bias is not None else scores
    if cfg.n_group > 1:
        n, e = choice.shape
        grouped = choice.reshape(n, cfg.n_group, e // cfg.n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
        _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
        keep = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, e // cfg.n_group, axis=-1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if cfg.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx


def experts(p: MoEParams, cfg: ModelConfig, x: jax.Array, weights: jax.Array, idx: jax.Array) -> jax.Array:
    """Sorted ragged dispatch. x [N, D], weights f32[N, k], idx i32[N, k] -> [N, D]."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)
    xs = x[token]
    h = jax.nn.silu(grouped_dense(xs, p.w_gate, group_sizes)) * grouped_dense(xs, p.w_up, group_sizes)
    ys = grouped_dense(h, p.w_down, group_sizes).astype(jnp.float32)
    ys = ys * weights.reshape(-1)[order][:, None]
    return jax.ops.segment_sum(ys, token, num_segments=n).astype(x.dtype)


def moe(p: MoEParams, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """x [..., D] -> [..., D]: routed experts plus shared experts."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    w, idx = route(p, cfg, xf)
    out = experts(p, cfg, xf, w, idx)
    if p.shared is not None:
        out = out + mlp(p.shared, xf)
    return out.reshape(shape)
