"""The one matmul dispatch point of the model.

Every projection in the model calls :func:`dense` and every routed-expert matmul calls
:func:`grouped_dense`. A weight is either a plain array (float32/bfloat16) or a quantized weight pytree
(see the other modules of this package); the dispatch picks the matching implementation, so the model
runs unchanged on any representation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def is_quantized(w: Any) -> bool:
    """True for quantized weight pytrees (anything with a ``dequantize`` method)."""
    return hasattr(w, "dequantize")


def dequantize(w: Any, dtype=None) -> jax.Array:
    """A plain array of the weight's values (identity for plain arrays)."""
    out = w.dequantize() if is_quantized(w) else w
    return out if dtype is None else out.astype(dtype)


def dense(x: jax.Array, w: Any) -> jax.Array:
    """``x @ w``: x [..., K], w [K, N] (plain or quantized) -> [..., N] in x's dtype."""
    if is_quantized(w):
        return w.matmul(x)
    return jnp.einsum("...k,kn->...n", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


def grouped_dense(x: jax.Array, w: Any, group_sizes: jax.Array) -> jax.Array:
    """Ragged expert matmul: x [M, K] sorted by expert, w [E, K, N], group_sizes i32[E] -> [M, N]."""
    if is_quantized(w):
        return w.grouped_matmul(x, group_sizes)
    out = jax.lax.ragged_dot(x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)
