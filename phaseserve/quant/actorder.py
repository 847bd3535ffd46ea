"""Act-order INT4 (GPTQ ``actorder: group``): INT4 groups over a permutation of the input columns.

An act-order checkpoint's ``weight_g_idx`` maps input column ``c`` to its scale group ``g_idx[c]``; the columns
of one group are scattered. :class:`Int4Weight` needs each group's rows contiguous, so the loader permutes the
weight's rows into group order (``perm = argsort(g_idx)``, stable) and keeps the permutation: the nibbles and the
scales are the checkpoint's own, nothing is dequantized. The matmul gathers the activations the same way,
``x @ W = x[..., perm] @ W[perm]``, as vLLM's GPTQ-Marlin path does. ::

    checkpoint (HF [out, in])       loaded ([in, out], rows in group order)
    column c, group g_idx[c]   ->   row j = column perm[j]; rows [g*G, (g+1)*G) are group g

:class:`ActOrderInt4Weight` is registered with :mod:`phaseserve.qarrays`, so ``dense`` / ``grouped_dense`` /
``dequantize`` (and with them ``ps.forward``) take it like any weight; a policy conversion (the engine's per-phase
copies) starts from its exact dequantization.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallas_kernels.int4_matmul import Int4Weight, dequantize_int4, int4_grouped_matmul, int4_matmul, pack_int4
from phaseserve.qarrays import QuantOps, register


@struct.dataclass
class ActOrderInt4Weight:
    w: Int4Weight  # [..., K, N] with row j = input column perm[j]
    perm: jax.Array  # i32[..., K]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return _dequantize(self, dtype)


def _dequantize(a: ActOrderInt4Weight, dtype) -> jax.Array:
    """Rows back in input-column order: [..., K, N]."""
    inverse = jnp.argsort(a.perm, axis=-1)
    return jnp.take_along_axis(dequantize_int4(a.w, dtype), inverse[..., None], axis=-2)


def _dense(x: jax.Array, a: ActOrderInt4Weight, **kernel_kw) -> jax.Array:
    """x [..., K], perm [K]; ``kernel_kw`` (impl, provenance) go to the INT4 kernel."""
    return int4_matmul(jnp.take(x, a.perm, axis=-1), a.w, **kernel_kw)


def _grouped(x: jax.Array, a: ActOrderInt4Weight, group_sizes: jax.Array, **kernel_kw) -> jax.Array:
    """x [M, K] sorted by expert, perm [E, K]: each row gathered by its own expert's permutation."""
    expert = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=x.shape[0])
    return int4_grouped_matmul(jnp.take_along_axis(x, a.perm[expert], axis=-1), a.w, group_sizes, **kernel_kw)


register(ActOrderInt4Weight, QuantOps(dense=_dense, grouped_dense=_grouped, dequantize=_dequantize))


def act_order_int4(nibbles: np.ndarray, scale: np.ndarray, g_idx: np.ndarray, group: int) -> ActOrderInt4Weight | None:
    """nibbles u8[out, in] (q + 8), scale [out, in/G], g_idx [in] -> the weight [in, out] in group order, or None
    when some group does not hold exactly ``group`` columns (then no permutation makes the groups contiguous)."""
    perm = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[perm], np.arange(g_idx.shape[0]) // group):
        return None
    w = pack_int4(jnp.asarray(np.ascontiguousarray(nibbles[:, perm].T)), jnp.asarray(np.ascontiguousarray(scale.T)),
                  group)
    return ActOrderInt4Weight(w, jnp.asarray(perm.astype(np.int32)))


def identity(w: Int4Weight) -> ActOrderInt4Weight:
    """An ordinary INT4 weight [K, N] as act-order with the identity permutation (to stack with act-order ones)."""
    return ActOrderInt4Weight(w, jnp.arange(w.shape[-2], dtype=jnp.int32))


def stack(parts: list[ActOrderInt4Weight]) -> ActOrderInt4Weight:
    """Per-expert weights -> one [E, K, N] weight with perm [E, K]."""
    w = Int4Weight(jnp.stack([p.w.packed for p in parts]), jnp.stack([p.w.scale for p in parts]),
                   parts[0].w.group_size)
    return ActOrderInt4Weight(w, jnp.stack([p.perm for p in parts]))
