"""W4A16: symmetric INT4 weights in groups along K, 16-bit activations, f32 accumulation.

Packing (chosen so a kernel unpacks with two shifts and no interleave): for a weight ``w [..., K, N]``
and group size ``G``, group ``g`` covers rows ``[g*G, (g+1)*G)``. Its packed rows
``packed[g*G/2 + j]`` (``j < G/2``) hold ``w[g*G + j]`` in the low nibble and ``w[g*G + G/2 + j]`` in the
high nibble, each stored as ``q + 8`` (unsigned, ``q`` in ``[-8, 7]``). Unpacking a group therefore gives
its first and second halves as two contiguous blocks: ``x_g @ w_g = x_lo @ lo + x_hi @ hi``.

::

    w rows of one group:  [ r0 r1 ... r(G/2-1) | r(G/2) ... r(G-1) ]
    packed row j:          low nibble = r(j),    high nibble = r(G/2 + j)

Scales are ``[..., K/G, N]`` (f32 or bf16); ``w ~= (nibble - 8) * scale[group]``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Int4Weight:
    packed: jax.Array  # u8[..., K/2, N]
    scale: jax.Array  # f32|bf16[..., K/G, N]
    group_size: int = struct.field(pytree_node=False, default=128)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-2], self.packed.shape[-2] * 2, self.packed.shape[-1])

    @property
    def nbytes(self) -> int:
        return self.packed.size * self.packed.dtype.itemsize + self.scale.size * self.scale.dtype.itemsize

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize_int4(self, dtype)

    def matmul(self, x: jax.Array, **kw: Any) -> jax.Array:
        return int4_matmul(x, self, **kw)

    def grouped_matmul(self, x: jax.Array, group_sizes: jax.Array, **kw: Any) -> jax.Array:
        return int4_grouped_matmul(x, self, group_sizes, **kw)


def quantize_int4(w: jax.Array, group_size: int = 128, scale_dtype=jnp.float32) -> Int4Weight:
    """Round-to-nearest symmetric INT4. w [..., K, N] with K a multiple of group_size."""
    *lead, k, n = w.shape
    if k % group_size or group_size % 2:
        raise ValueError(f"K={k} must be a multiple of the (even) group size {group_size}")
    wg = w.astype(jnp.float32).reshape(*lead, k // group_size, group_size, n)
    amax = jnp.max(jnp.abs(wg), axis=-2, keepdims=True)
    scale = jnp.where(amax > 0, amax / 7.0, 1.0).astype(scale_dtype)
    q = jnp.clip(jnp.round(wg / scale.astype(jnp.float32)), -8, 7).astype(jnp.int32) + 8
    return pack_int4(q.reshape(*lead, k, n).astype(jnp.uint8), scale[..., 0, :], group_size)


def pack_int4(nibbles: jax.Array, scale: jax.Array, group_size: int) -> Int4Weight:
    """nibbles u8[..., K, N] in [0, 15] (value + 8) -> Int4Weight in the layout of the module docstring."""
    *lead, k, n = nibbles.shape
    g = nibbles.reshape(*lead, k // group_size, 2, group_size // 2, n).astype(jnp.uint8)
    packed = g[..., 0, :, :] | (g[..., 1, :, :] << 4)
    return Int4Weight(packed.reshape(*lead, k // 2, n), scale, group_size)


def unpack_int4(w: Int4Weight) -> jax.Array:
    """-> signed int8 values [..., K, N] in [-8, 7]."""
    *lead, kh, n = w.packed.shape
    g = w.packed.reshape(*lead, kh * 2 // w.group_size, w.group_size // 2, n)
    lo = (g & 0xF).astype(jnp.int8) - 8
    hi = (g >> 4).astype(jnp.int8) - 8
    return jnp.stack([lo, hi], axis=-3).reshape(*lead, kh * 2, n)


def dequantize_int4(w: Int4Weight, dtype=jnp.float32) -> jax.Array:
    q = unpack_int4(w).astype(jnp.float32)
    *lead, k, n = q.shape
    s = jnp.repeat(w.scale.astype(jnp.float32), w.group_size, axis=-2)
    return (q * s).astype(dtype)


def int4_matmul_reference(x: jax.Array, w: Int4Weight) -> jax.Array:
    """x [..., K] @ dequant(w) [K, N] -> [..., N] in x's dtype, f32 accumulation."""
    return jnp.einsum("...k,kn->...n", x, dequantize_int4(w, x.dtype), preferred_element_type=jnp.float32
                      ).astype(x.dtype)


def int4_grouped_matmul_reference(x: jax.Array, w: Int4Weight, group_sizes: jax.Array) -> jax.Array:
    """Ragged: x [M, K] sorted by expert, w [E, K, N], group_sizes i32[E] -> [M, N]."""
    out = jax.lax.ragged_dot(x, dequantize_int4(w, x.dtype), group_sizes, preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def int4_matmul(x: jax.Array, w: Int4Weight, *, impl: str = "auto", interpret: bool | None = None) -> jax.Array:
    """Dense W4A16 matmul. The Pallas kernel is added by the kernels work; until then: the reference."""
    return int4_matmul_reference(x, w)


def int4_grouped_matmul(x: jax.Array, w: Int4Weight, group_sizes: jax.Array, *, impl: str = "auto",
                        interpret: bool | None = None) -> jax.Array:
    """Grouped (MoE) W4A16 matmul."""
    return int4_grouped_matmul_reference(x, w, group_sizes)
