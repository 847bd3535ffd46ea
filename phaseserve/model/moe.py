"""Mixture-of-experts block: routing and expert dispatch.

Routing (``route``):

- ``softmax`` (Qwen3-MoE): softmax over expert logits, top-k, optional renormalisation;
- ``sigmoid`` (DeepSeek-V3, Kimi K2, GLM-4.5/5): sigmoid scores, ``e_score_correction_bias`` added for the
  *choice* only, group-limited top-k (keep the ``topk_group`` of ``n_group`` groups with the best
  top-2 sums), weights are the un-biased scores, optionally renormalised, times ``routed_scaling_factor``.

Dispatch (how the routed tokens reach their experts), one function per strategy, each
``(p, cfg, x [N, D], weights f32[N, k], idx i32[N, k]) -> (out [N, D], dropped fraction f32[])``; by default
(serving) :func:`moe` picks one of the exact ones by backend and the step's kernel dispatch
(:func:`choose_dispatch`):

- :func:`ragged_experts` (accelerators): the N*k (token, expert) assignments are sorted by expert and run through
  one ragged (grouped) matmul per projection (``qarrays.grouped_dense``, i.e. ``jax.lax.ragged_dot`` or the INT4
  grouped kernel), then scattered back weighted; exact.
- :func:`blocked_experts` (the CPU, every token count): the sorted assignments, from prefill sizes on first each
  expert's share up to a capacity in one batched FFN over all experts, the rest (all of them at decode sizes) in
  fixed-size blocks of one expert each, a loop over the used blocks running one dense FFN per block; exact.
- :func:`dense_experts`: every expert on every token, combined with the routing weights; exact (training).
- :func:`capacity_experts` (training): each expert takes at most ``ceil(factor * N * k / E)`` assignments into a
  fixed [E, C, D] buffer for one batched matmul; the overflow is dropped.

Shared experts run densely on every token. :func:`moe` also returns the layer's expert load (fractions of the
assignments) and the dropped fraction, which training uses for auxiliary-loss-free balancing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from phaseserve.config import ModelConfig
from phaseserve.kernel_mesh import DIRECT, KernelDispatch
from phaseserve.model.layers import mlp
from phaseserve.model.params import MoEParams
from phaseserve.qarrays import dequantize, grouped_dense, is_quantized


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


def ragged_experts(p: MoEParams, cfg: ModelConfig, x: jax.Array, weights: jax.Array, idx: jax.Array, *,
                   kd: KernelDispatch = DIRECT) -> tuple[jax.Array, jax.Array]:
    """Sorted ragged dispatch. x [N, D], weights f32[N, k], idx i32[N, k] -> (out [N, D], 0.0); the grouped matmuls
    run per ``kd`` (``phaseserve.kernel_mesh``)."""
    n, k = idx.shape
    order, _, counts, _, _ = _sorted(idx, cfg.num_experts)
    token = order // k
    group_sizes = counts.astype(jnp.int32)
    xs = x[token]
    h = jax.nn.silu(grouped_dense(xs, p.w_gate, group_sizes, kd)) * grouped_dense(xs, p.w_up, group_sizes, kd)
    ys = grouped_dense(h, p.w_down, group_sizes, kd).astype(jnp.float32)
    ys = ys * weights.reshape(-1)[order][:, None]
    return jax.ops.segment_sum(ys, token, num_segments=n).astype(x.dtype), jnp.float32(0)


def block_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per block of :func:`blocked_experts`: twice the mean assignments per expert, as a power of two in
    [4, 128] (small blocks waste little padding at decode; 128 rows keep prefill's matmuls efficient)."""
    mean = max(1.0, num_assignments / num_experts)
    return int(min(128, max(4, 2 * 2 ** int(np.ceil(np.log2(mean))))))


def _sorted(idx: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The N*k assignments sorted by expert (stable: token order within an expert). idx i32[N, k] ->
    (order [m]: sorted position -> assignment, expert [m] of each sorted position, counts [E], start [E]: each
    expert's first sorted position, rank [m]: position within its expert), m = N*k."""
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    expert = flat[order]
    counts = jnp.bincount(flat, length=num_experts)
    start = jnp.cumsum(counts) - counts
    return order, expert, counts, start, jnp.arange(flat.shape[0]) - start[expert]


def _capacity_slots(expert: jax.Array, rank: jax.Array, cap: int, num_experts: int) -> jax.Array:
    """Each sorted position's row in an [E * cap] capacity buffer; ``E * cap`` (one past the end) where the
    position is past its expert's capacity. expert, rank i32[m] -> i32[m]."""
    return jnp.where(rank < cap, expert * cap + rank, num_experts * cap)


def _batched_ffn(p: MoEParams, xb: jax.Array, **dot_kw: Any) -> jax.Array:
    """Every expert's FFN on its own rows in one batched matmul per projection, the weights read as laid out
    (quantized ones expanded whole to xb's dtype). xb [E, C, D] -> [E, C, D] (``dot_kw`` passed to the einsums)."""
    w_gate, w_up, w_down = (dequantize(w, xb.dtype) for w in (p.w_gate, p.w_up, p.w_down))
    h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", xb, w_gate, **dot_kw)) * jnp.einsum("ecd,edf->ecf", xb, w_up, **dot_kw)
    return jnp.einsum("ecf,efd->ecd", h.astype(xb.dtype), w_down, **dot_kw)


CAPACITY_MIN_MEAN = 16  # mean assignments per expert from which the CPU dispatch adds the capacity part
CAPACITY_FACTOR = 1.25  # capacity rows per expert over the mean (rounded up to a multiple of 8)
CAPACITY_MAX_BYTES = 256 << 20  # the most expert-weight bytes the capacity part may materialize (dequantized)
# rows per block past the capacity: few assignments overflow, so small blocks waste less; 0.75x-0.88x of the same
# dispatch with blocks of block_rows at 160 and 640 tokens on three shapes (benchmarks/engine/moe_dispatch/epyc_decode)
OVERFLOW_BLOCK_ROWS = 16


def capacity_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per expert of :func:`blocked_experts`' batched capacity part: 0 (blocks only) below
    ``CAPACITY_MIN_MEAN`` mean assignments per expert, else ``CAPACITY_FACTOR`` times the mean, rounded up to a
    multiple of 8. Side by side on XLA:CPU (``python -m lab.bench.moe_dispatch``, ``benchmarks/engine/moe_dispatch``)
    the capacity part took 0.71x-0.82x of the blocks' time from 512 to 4,096 tokens on the ~15M shape (E=16, k=2)
    (``xeon_260mb``), and 0.84x-0.95x (medians) at the means of 16 and 32 assignments per expert that the threshold
    of 16 newly sends to it (64 and 128 tokens of the default model, 128 and 256 of the ~15M shape; ``epyc_small``,
    where 32-token batches, a mean of 8, stay on the blocks)."""
    mean = num_assignments / num_experts
    return 0 if mean < CAPACITY_MIN_MEAN else int(8 * np.ceil(CAPACITY_FACTOR * mean / 8))


def _stack_bytes(p: MoEParams, cfg: ModelConfig, d: int, dtype: Any) -> int:
    """Bytes the capacity part materializes to read all experts' weights in ``dtype``: 0 when the three stacks
    already are plain arrays of it, else their dequantized size."""
    if all(not is_quantized(w) and w.dtype == dtype for w in (p.w_gate, p.w_up, p.w_down)):
        return 0
    return 3 * cfg.num_experts * d * cfg.moe_intermediate_size * jnp.dtype(dtype).itemsize


def default_cap(p: MoEParams, cfg: ModelConfig, num_tokens: int, d: int, dtype: Any) -> int:
    """The capacity :func:`blocked_experts` uses by default for ``num_tokens`` tokens of width ``d`` in ``dtype``:
    :func:`capacity_rows`, or 0 (blocks only) where the expert stacks it would expand exceed ``CAPACITY_MAX_BYTES``.
    (A small capacity part at decode sizes was tried and measured 0.89x-1.71x of the blocks alone from 4 to 32
    tokens, slower on the ~15M shape: ``benchmarks/engine/moe_dispatch/epyc_decode_small_cap.md``.)"""
    if _stack_bytes(p, cfg, d, dtype) > CAPACITY_MAX_BYTES:
        return 0
    return capacity_rows(num_tokens * cfg.num_experts_per_tok, cfg.num_experts)


def blocked_experts(p: MoEParams, cfg: ModelConfig, x: jax.Array, weights: jax.Array, idx: jax.Array,
                    cap: int | None = None, bt: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Capacity plus sorted blocks (the CPU's dispatch at every token count); exact.

    The N*k assignments are sorted by expert. Each expert's first ``cap`` assignments (:func:`default_cap` by default: 0
    at decode sizes, and when the dequantized expert stacks would exceed ``CAPACITY_MAX_BYTES``) go
    into an [E, cap, D] buffer run through one batched FFN that reads every expert's weights in place (float weights of
    the activations' dtype; quantized ones expanded whole). The rest (all of them when ``cap`` is 0) are laid out in
    blocks of ``bt`` rows (:func:`block_rows`, at most ``OVERFLOW_BLOCK_ROWS`` past a capacity), each block holding one
    expert's assignments (zero rows pad an expert's last block); a loop over the *used* blocks only (a dynamic trip
    count, zero when no expert overflows its capacity) runs one dense ``[bt, D] x [D, F]`` FFN per block with that
    expert's weights (quantized leaves indexed, then expanded). No expert's weights are copied for every assignment, and
    no expert runs on tokens that did not choose it.

    x [N, D], weights f32[N, k], idx i32[N, k] -> (out [N, D], 0.0).

        assignments sorted by expert:  e0 e0 e0 | e1 | e3 e3 e3 e3 e3      (cap = 0, bt = 4)
        blocks:                        [e0 e0 e0 0] [e1 0 0 0] [e3 e3 e3 e3] [e3 0 0 0] [unused ...]
    """
    n, k = idx.shape
    e, m, d = cfg.num_experts, n * k, x.shape[1]
    cap = default_cap(p, cfg, n, d, x.dtype) if cap is None else cap
    if bt is None:
        bt = block_rows(m, e) if cap == 0 else min(block_rows(m, e), OVERFLOW_BLOCK_ROWS)
    # static bound on the blocks used: the o_e = max(c_e - cap, 0) overflowing assignments sum to at most m - cap
    # (all when cap is 0), and at most m // (cap + 1) experts overflow, so sum_e ceil(o_e / bt) <= that (one block
    # at least, for the loop body to trace)
    nb = max(1, max(m - cap, 0) // bt + min(e, m // (cap + 1)))
    mm = dict(preferred_element_type=jnp.float32)
    order, expert, counts, start, rank = _sorted(idx, e)
    token = jnp.concatenate([order // k, jnp.array([n], order.dtype)])  # [m + 1] token per sorted position; n: pad
    xz = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])  # row n: zeros
    inv = jnp.argsort(order)  # assignment -> sorted position
    over = jnp.maximum(counts - cap, 0)  # [E] assignments past the capacity
    blocks = (over + bt - 1) // bt
    blk_end = jnp.cumsum(blocks)
    blk_start = blk_end - blocks  # first block of each expert
    blk_expert = jnp.minimum(jnp.searchsorted(blk_end, jnp.arange(nb), side="right"), e - 1)  # i32[nb]
    row_expert = jnp.repeat(blk_expert, bt)  # [nb * bt]
    within = jnp.arange(nb * bt) - blk_start[row_expert] * bt
    src = jnp.where(within < over[row_expert], start[row_expert] + cap + within, m)  # sorted position, m: padding
    buf = xz[token[src]]  # [nb * bt, D]

    def block(j, out):
        w_gate, w_up, w_down = (dequantize(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(
            a, blk_expert[j], keepdims=False), w), x.dtype) for w in (p.w_gate, p.w_up, p.w_down))
        xb = jax.lax.dynamic_slice_in_dim(buf, j * bt, bt)  # [bt, D]
        h = jax.nn.silu(jnp.dot(xb, w_gate, **mm)) * jnp.dot(xb, w_up, **mm)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.dot(h.astype(x.dtype), w_down, **mm), j * bt, 0)

    y = jax.lax.fori_loop(0, blk_end[-1], block, jnp.zeros((nb * bt, d), jnp.float32))
    rows = (blk_start[expert] * bt + rank - cap)[inv]  # each overflowing assignment's row in the blocks
    ys = y[jnp.clip(rows, 0, nb * bt - 1)]  # [m, D] by assignment (rows of the capacity's assignments replaced next)
    if cap:
        slot = _capacity_slots(expert, rank, cap, e)  # sorted position -> capacity row; e * cap: none
        cap_src = jnp.full((e * cap + 1,), m, jnp.int32).at[slot].set(jnp.arange(m, dtype=jnp.int32))[:-1]
        y_cap = _batched_ffn(p, xz[token[cap_src]].reshape(e, cap, d), **mm).reshape(e * cap, d)
        ys = jnp.where((rank < cap)[inv][:, None], y_cap[jnp.minimum(slot, e * cap - 1)[inv]], ys)
    return jnp.einsum("nkd,nk->nd", ys.reshape(n, k, d), weights).astype(x.dtype), jnp.float32(0)


def dense_experts(p: MoEParams, cfg: ModelConfig, x: jax.Array, weights: jax.Array, idx: jax.Array,
                  ) -> tuple[jax.Array, jax.Array]:
    """All experts on all tokens, combined with the routing weights. x [N, D], weights f32[N, k], idx i32[N, k]
    -> (out [N, D], 0.0)."""
    n = x.shape[0]
    gates = jnp.zeros((n, cfg.num_experts), jnp.float32).at[jnp.arange(n)[:, None], idx].add(weights)  # [N, E]
    y = _batched_ffn(p, jnp.broadcast_to(x, (cfg.num_experts, *x.shape)))  # [E, N, D]
    return jnp.einsum("end,ne->nd", y, gates).astype(x.dtype), jnp.float32(0)


def capacity_experts(p: MoEParams, cfg: ModelConfig, x: jax.Array, weights: jax.Array, idx: jax.Array,
                     factor: float) -> tuple[jax.Array, jax.Array]:
    """Capacity-limited dispatch: each expert takes at most ``C = ceil(factor * N * k / E)`` assignments (in
    token order) into an [E, C, D] buffer for one batched matmul; the rest are dropped (the token keeps its
    shared expert and residual). Exact whenever no expert overflows (always when ``factor >= E / k``).

    x [N, D], weights f32[N, k], idx i32[N, k] -> (out [N, D], dropped fraction of assignments f32[])."""
    n, k = idx.shape
    e = cfg.num_experts
    cap = int(np.ceil(factor * n * k / e))
    order, expert, _, _, rank = _sorted(idx, e)
    keep = rank < cap
    slot = _capacity_slots(expert, rank, cap, e)  # overflow goes to a discarded extra row
    token = order // k
    buf = jnp.zeros((e * cap + 1, x.shape[1]), x.dtype).at[slot].set(x[token])[:-1].reshape(e, cap, -1)
    y = _batched_ffn(p, buf).reshape(e * cap, -1)
    y = jnp.concatenate([y, jnp.zeros((1, y.shape[1]), y.dtype)])[slot]
    y = y * (weights.reshape(-1)[order] * keep)[:, None]
    return jax.ops.segment_sum(y, token, num_segments=n).astype(x.dtype), jnp.sum(~keep) / keep.size


Dispatch = Callable[[MoEParams, ModelConfig, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def choose_dispatch(num_tokens: int, cfg: ModelConfig, backend: str | None = None, *,
                    kd: KernelDispatch = DIRECT) -> Dispatch:
    """The exact dispatch for ``num_tokens`` routed tokens on ``backend`` (default: JAX's), in a step whose kernel
    calls run per ``kd``.

    Accelerators (or ``kd.matmul_impl`` resolving to the Pallas kernels): :func:`ragged_experts` (the grouped
    kernels: ``ragged_dot``, the INT4 grouped kernel), its matmuls run per ``kd``. XLA:CPU, where ``ragged_dot``
    copies every expert's weights and runs ~10x slower than :func:`blocked_experts` at prefill and decode shapes:
    :func:`blocked_experts` (MoE layer ms on the ~15M shape in ``benchmarks/engine/profile``)."""
    if (backend or jax.default_backend()) != "cpu" or kd.matmul_kernels:  # matmul_impl="pallas": the kernels
        return functools.partial(ragged_experts, kd=kd)
    return blocked_experts


def auto_experts(p: MoEParams, cfg: ModelConfig, x: jax.Array, weights: jax.Array, idx: jax.Array,
                 ) -> tuple[jax.Array, jax.Array]:
    """The dispatch :func:`choose_dispatch` picks for x's token count (static at trace time), the kernels called
    directly (``kernel_mesh.DIRECT``). x [N, D], weights f32[N, k], idx i32[N, k] -> (out [N, D], 0.0)."""
    return choose_dispatch(x.shape[0], cfg)(p, cfg, x, weights, idx)


def moe(p: MoEParams, cfg: ModelConfig, x: jax.Array, dispatch: Dispatch | None = None, *,
        kd: KernelDispatch = DIRECT) -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [..., D] -> (routed plus shared experts [..., D], {"load": f32[E] (fractions of the assignments),
    "dropped": f32[] (fraction of assignments the dispatch dropped)}). ``dispatch`` None (serving):
    :func:`choose_dispatch`'s; the shared experts' matmuls run per ``kd``."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    dispatch = choose_dispatch(xf.shape[0], cfg, kd=kd) if dispatch is None else dispatch
    with jax.named_scope("moe_dispatch"):
        w, idx = route(p, cfg, xf)
        out, dropped = dispatch(p, cfg, xf, w, idx)
    if p.shared is not None:
        out = out + mlp(p.shared, xf, kd=kd)
    load = jnp.bincount(idx.reshape(-1), length=cfg.num_experts) / idx.size
    return out.reshape(shape), {"load": load, "dropped": dropped}
