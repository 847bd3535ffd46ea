"""Calibrated INT4: GPTQ on input-activation statistics collected with a plain reference forward.

**Collecting.** :func:`collect_calibration` runs the unmodified model (``transformer.forward``, jitted) on a
small calibration set of token sequences, with every matmul weight wrapped in a recording tap. The model
sends each projection through ``qarrays.dense`` / ``qarrays.grouped_dense``, which dispatch on registered weight
types; the tap is registered there like a quantized weight type. It computes the Gram matrix of its input
rows, hands it to the host with ``jax.debug.callback`` and returns the plain product. So the statistics come
from the real model code, not a copy of it. Per weight it keeps
``H = sum_x x x^T`` (float64 on the host, ``[K, K]``; ``[E, K, K]`` for routed experts, split by the ragged
``group_sizes``) and the number of rows seen. Weights the model dequantizes instead of multiplying (MLA's
``wkv_b``) get no statistics.

**GPTQ** (Frantar et al., 2022) quantizes the input rows of ``w [K, N]`` one after another and pushes each
row's rounding error onto the rows not yet quantized, weighted by the inverse Hessian, which minimises
``||X w - X q||`` rather than ``||w - q||``. Group scales (symmetric, ``amax / 7`` over the group's rows,
rounded to the scale dtype) are fixed when the sweep reaches a group's first row, so the result is an
ordinary :class:`Int4Weight` (same kernels, same checkpoint format as RTN). Damping: ``0.01 * mean(diag H)``;
dead inputs get a unit diagonal. An expert with no calibration rows gets ``H = I``, which is exactly RTN.
The sweep is a jitted ``fori_loop`` over rows (f32, like the reference implementation), vmapped over experts,
updating all later rows each step (``O(K^2 N)``): fine for the small models of the quality evaluation, not
meant for calibrating a 1T-parameter checkpoint. With independent input channels (diagonal ``H``) GPTQ can
only match RTN; its gain comes from correlated activations, which real models have.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.int4_matmul import Int4Weight, pack_int4
from phaseserve.config import ModelConfig, to_dtype
from phaseserve.model.loader import leaf_path as path_str
from phaseserve.qarrays import QuantOps, dense, grouped_dense, register

DAMP = 0.01


@dataclass
class Calibration:
    """Per-weight input statistics: ``hessians[path]`` f64[K, K] (or [E, K, K]) and ``rows[path]``."""

    hessians: dict[str, np.ndarray] = field(default_factory=dict)
    rows: dict[str, np.ndarray] = field(default_factory=dict)

    def hessian(self, path: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(H, rows)`` for a weight path, or None if the weight was never multiplied."""
        if path not in self.hessians:
            return None
        return self.hessians[path], self.rows[path]

    def _add(self, path: str, h: np.ndarray, n: np.ndarray) -> None:
        if path in self.hessians:
            self.hessians[path] += h
            self.rows[path] += n
        else:
            self.hessians[path], self.rows[path] = h, n


_SINK: list[Calibration] = []  # the collection in progress (host callbacks write into it)


def _record(path: str, h, n) -> None:
    _SINK[-1]._add(path, np.asarray(h, np.float64), np.asarray(n, np.int64))


class _Tap:
    """Stands in for a weight during calibration: sends the Gram matrix of its inputs to the host (a
    ``jax.debug.callback`` inside the jitted forward) and returns the plain product. A pytree (the weight is
    its child, the path its static data), so the tapped params pass through ``jax.jit`` like any params."""

    def __init__(self, w: jax.Array, path: str):
        self.w, self.path = w, path

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    def dequantize(self, dtype) -> jax.Array:
        return self.w.astype(dtype)

    def matmul(self, x: jax.Array) -> jax.Array:
        xs = x.astype(jnp.float32).reshape(-1, x.shape[-1])  # [M, K]
        h = jnp.einsum("mk,mj->kj", xs, xs, precision=jax.lax.Precision.HIGHEST)
        jax.debug.callback(partial(_record, self.path), h, xs.shape[0])
        return dense(x, self.w)

    def grouped_matmul(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        xs = x.astype(jnp.float32)  # [M, K], sorted by expert
        e = group_sizes.shape[0]
        ends = jnp.cumsum(group_sizes)
        expert = jnp.searchsorted(ends, jnp.arange(xs.shape[0]), side="right")  # i32[M]; == E for padding rows
        onehot = jax.nn.one_hot(expert, e, dtype=jnp.float32)  # [M, E]
        h = jnp.einsum("me,mk,mj->ekj", onehot, xs, xs, precision=jax.lax.Precision.HIGHEST)
        jax.debug.callback(partial(_record, self.path), h, group_sizes)
        return grouped_dense(x, self.w, group_sizes)


jax.tree_util.register_pytree_node(_Tap, lambda t: ((t.w,), t.path), lambda path, ch: _Tap(ch[0], path))
register(_Tap, QuantOps(dense=lambda x, t, **_: t.matmul(x),  # calibration runs the plain product (kernel_mesh.DIRECT)
                        grouped_dense=lambda x, t, gs, **_: t.grouped_matmul(x, gs),
                        dequantize=lambda t, dtype: t.dequantize(dtype)))


def collect_calibration(params: Any, cfg: ModelConfig, tokens: Any, batch_size: int = 8) -> Calibration:
    """Input statistics of every matmul weight over ``tokens`` i32[S, T] (a small calibration set), from the
    real forward (jitted once per batch shape). The MoE layers run the ragged dispatch, whatever the backend's
    default: it is the one that multiplies every routed token by its expert's weight (``grouped_dense``), so each
    expert's statistics are recorded; the gathered and dense CPU dispatches dequantize the weights instead."""
    from phaseserve.model.moe import ragged_experts
    from phaseserve.model.transformer import forward_with_moe_stats

    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[0] == 0:
        raise ValueError(f"calibration tokens must be i32[S, T] with S > 0, got shape {tokens.shape}")

    def tap(kp, x):
        path = path_str(kp)
        if getattr(x, "ndim", 0) >= 2 and path != "embed" and not path.endswith("mlp.router"):
            return _Tap(x, path)
        return x

    tapped = jax.tree_util.tree_map_with_path(tap, params)
    run = jax.jit(lambda p, t: forward_with_moe_stats(p, cfg, t, ragged_experts)[0])
    cal = Calibration()
    _SINK.append(cal)
    try:
        for i in range(0, tokens.shape[0], batch_size):
            jax.block_until_ready(run(tapped, jnp.asarray(tokens[i:i + batch_size])))
        jax.effects_barrier()
    finally:
        _SINK.pop()
    return cal


def _prepare_hessian(h: np.ndarray) -> np.ndarray:
    """Dead inputs get a unit diagonal, then damping ``DAMP * mean(diag)`` (elementwise, host)."""
    h = np.array(h, np.float64)
    k = h.shape[-1]
    idx = np.arange(k)
    dead = h[idx, idx] == 0
    h[idx[dead], idx[dead]] = 1.0
    h[idx, idx] += DAMP * np.mean(h[idx, idx])
    return h


def _gptq_matrix(w: jax.Array, h: jax.Array, group_size: int, scale_dtype, qmax) -> tuple[jax.Array, jax.Array]:
    """GPTQ of one matrix: w f32[K, N], damped h f32[K, K] -> (nibbles u8[K, N] = q + 8, scale f32[K/G, N]).

    Row ``r`` is rounded with its group's scale (fixed from the updated rows when ``r`` opens the group);
    its error, divided by ``U[r, r]``, is subtracted from every later row ``j`` times ``U[r, j]``, where
    ``H^-1 = U^T U`` (upper Cholesky factor of the inverse Hessian).
    """
    k, n = w.shape
    u = jnp.linalg.cholesky(jnp.linalg.inv(h)).T  # upper
    rows = jnp.arange(k)

    def step(r, carry):
        w, q, scales = carry
        g = r // group_size
        block = jax.lax.dynamic_slice_in_dim(w, g * group_size, group_size, axis=0)
        amax = jnp.max(jnp.abs(block), axis=0)
        fresh = jnp.where(amax > 0, amax / qmax, 1.0).astype(scale_dtype).astype(jnp.float32)
        s = jnp.where(r % group_size == 0, fresh, scales[g])
        scales = scales.at[g].set(s)
        qr = jnp.clip(jnp.round(w[r] / s), -8, 7)
        err = (w[r] - qr * s) / u[r, r]
        w = w - jnp.where((rows > r)[:, None], u[r][:, None] * err[None, :], 0.0)
        return w, q.at[r].set(qr), scales

    init = (w.astype(jnp.float32), jnp.zeros((k, n), jnp.float32), jnp.zeros((k // group_size, n), jnp.float32))
    _, q, scales = jax.lax.fori_loop(0, k, step, init)
    return (q + 8).astype(jnp.uint8), scales


@partial(jax.jit, static_argnames=("group_size", "scale_dtype"))
def _gptq_stack(w: jax.Array, h: jax.Array, group_size: int, scale_dtype, qmax: jax.Array) -> Int4Weight:
    """w f32[E, K, N], h f32[E, K, K] -> Int4Weight [E, K, N] (one compile per shape). ``qmax`` f32[E, N] of 7s
    is an array so that ``amax / qmax`` stays an IEEE division (as RTN's, see ``quantize.py``)."""
    nib, scales = jax.vmap(lambda a, b, m: _gptq_matrix(a, b, group_size, scale_dtype, m))(w, h, qmax)
    return pack_int4(nib, scales.astype(scale_dtype), group_size)


def gptq_int4(w: jax.Array, hessian: tuple[np.ndarray, np.ndarray], group_size: int,
              scale_dtype: str = "float32") -> Int4Weight:
    """GPTQ INT4 of w [K, N] or [E, K, N] given ``(H, rows)`` from :class:`Calibration`.

    An expert no calibration row reached gets ``H = I``: no error is propagated, which is exactly RTN.
    """
    h, rows = hessian
    h3, rows = np.asarray(h, np.float64), np.asarray(rows).reshape(-1)
    w3 = jnp.asarray(w, jnp.float32)
    if w3.ndim == 2:
        w3, h3 = w3[None], h3[None]
    eye = np.eye(h3.shape[-1])
    hp = np.stack([_prepare_hessian(h3[e]) if rows[e] and np.any(np.diagonal(h3[e])) else eye
                   for e in range(h3.shape[0])])
    qmax = np.full((w3.shape[0], w3.shape[-1]), 7.0, np.float32)
    out = _gptq_stack(w3, jnp.asarray(hp, jnp.float32), group_size, to_dtype(scale_dtype).type, qmax)
    if w.ndim == 2:
        return Int4Weight(out.packed[0], out.scale[0], group_size)
    return out
