"""Quantized weight arrays and the model's one matmul dispatch point (a leaf: imports no model code).

A weight is either a plain array (float32 / bfloat16) or one of the quantized pytrees registered here:

==================  ===========================================  =============================================
type                leaves                                       kernels (``pallas_kernels``)
==================  ===========================================  =============================================
:class:`Int4Weight`  packed u8[..., K/2, N], scale [..., K/G, N]   ``int4_matmul``, ``int4_grouped_matmul``
:class:`Fp8Weight`   q f8e4m3[..., K, N], scale [..., K/bk, N/bn]  ``fp8_matmul``, ``fp8_grouped_matmul``
==================  ===========================================  =============================================

The types are defined beside their kernels (``pallas_kernels.int4_matmul.quantize_int4`` returns an
:class:`Int4Weight`), which know nothing of phaseserve; this module is where phaseserve names them and picks the
implementation by *registered type* (:func:`register`), never by duck typing. Every projection of the model calls
:func:`dense`, every routed-expert matmul :func:`grouped_dense`, so the model runs unchanged on any representation.
Calibration registers its recording tap the same way (``phaseserve.quant.calibrate``).

Both take the step's :class:`~phaseserve.kernel_mesh.KernelDispatch` as ``kd`` (default ``kernel_mesh.DIRECT``: the
kernels called directly): quantized-weight kernels run with its ``matmul_impl`` and, on a mesh, under ``shard_map``
with the weight's partition spec (``kernel_mesh.dense`` / ``kernel_mesh.grouped_dense``); every call is recorded in
its provenance log (the engine's workers' ``kernels`` tables).

Layering: ``config`` -> this module -> ``model`` -> ``quant`` (policies, quantization, calibration, formats).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_matmul import Fp8Weight, dequantize_fp8, fp8_grouped_matmul, fp8_matmul
from pallas_kernels.int4_matmul import Int4Weight, dequantize_int4, int4_grouped_matmul, int4_matmul
from phaseserve import kernel_mesh
from phaseserve.kernel_mesh import DIRECT, KernelDispatch

__all__ = ["Fp8Weight", "Int4Weight", "QuantOps", "dense", "dequantize", "grouped_dense", "is_quantized",
           "register", "stored_arrays"]


@dataclass(frozen=True)
class QuantOps:
    """How one quantized weight type multiplies and expands."""

    # (x [..., K], w [K, N], *, impl, provenance) -> [..., N] in x's dtype; impl / provenance as pallas_kernels'
    dense: Callable[..., jax.Array]
    grouped_dense: Callable[..., jax.Array]  # (x [M, K], w [E, K, N], sizes i32[E], *, impl, provenance) -> [M, N]
    dequantize: Callable[[Any, Any], jax.Array]  # (w, dtype) -> plain array of w's shape


_OPS: dict[type, QuantOps] = {}


def register(cls: type, ops: QuantOps) -> None:
    """Make ``cls`` (a pytree) a quantized weight type that :func:`dense` and friends dispatch on."""
    _OPS[cls] = ops


def is_quantized(w: Any) -> bool:
    """True for instances of a registered quantized weight type."""
    return type(w) in _OPS


def dequantize(w: Any, dtype=None) -> jax.Array:
    """A plain array of the weight's values (plain arrays as they are, or cast to ``dtype``)."""
    ops = _OPS.get(type(w))
    if ops is not None:
        return ops.dequantize(w, jnp.float32 if dtype is None else dtype)
    return w if dtype is None else w.astype(dtype)


def stored_arrays(w: Any) -> list[Any]:
    """The arrays a weight stores: a quantized weight's data and scales (its pytree children), else the array.
    Works on abstract weights too (children that are ``ShapeDtypeStruct`` or ``ArrayInfo``)."""
    if not is_quantized(w):
        return [w]
    return jax.tree_util.tree_flatten(w, is_leaf=lambda v: v is not w)[0]


def dense(x: jax.Array, w: Any, kd: KernelDispatch = DIRECT) -> jax.Array:
    """``x @ w``: x [..., K], w [K, N] (plain or quantized) -> [..., N] in x's dtype, f32 accumulation."""
    ops = _OPS.get(type(w))
    if ops is not None:
        return kernel_mesh.dense(kd, x, w, ops.dense)
    return kernel_mesh.plain(kd, "dense:plain", lambda: jnp.einsum(
        "...k,kn->...n", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype))


def grouped_dense(x: jax.Array, w: Any, group_sizes: jax.Array, kd: KernelDispatch = DIRECT) -> jax.Array:
    """Ragged expert matmul: x [M, K] sorted by expert, w [E, K, N], group_sizes i32[E] -> [M, N]."""
    ops = _OPS.get(type(w))
    if ops is not None:
        return kernel_mesh.grouped_dense(kd, x, w, group_sizes, ops.grouped_dense)
    return kernel_mesh.plain(kd, "grouped:plain", lambda: _ragged(x, w, group_sizes))


def _ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    out = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


register(Int4Weight, QuantOps(dense=int4_matmul, grouped_dense=int4_grouped_matmul, dequantize=dequantize_int4))
register(Fp8Weight, QuantOps(dense=fp8_matmul, grouped_dense=fp8_grouped_matmul, dequantize=dequantize_fp8))
