"""FP8 e4m3 weights with block scales (128x128 as DeepSeek-V3/GLM FP8 checkpoints) or per-channel scales.

``w [..., K, N] ~= q * scale`` where ``q`` is float8_e4m3fn and ``scale`` f32 ``[..., ceil(K/bk), ceil(N/bn)]``
with ``block = (bk, bn)``. Per-channel scales are the block ``(K, 1)``: ``scale [..., 1, N]``. The
scale of a block is ``amax / 448`` (e4m3's largest finite value); DeepSeek's ``weight_scale_inv`` is exactly
this scale, stored transposed for the ``[N, K]`` layout.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

E4M3_MAX = 448.0


@struct.dataclass
class Fp8Weight:
    q: jax.Array  # f8e4m3[..., K, N]
    scale: jax.Array  # f32[..., ceil(K/bk), ceil(N/bn)]
    block: tuple[int, int] = struct.field(pytree_node=False, default=(128, 128))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        return self.q.size + self.scale.size * self.scale.dtype.itemsize

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize_fp8(self, dtype)

    def matmul(self, x: jax.Array, **kw: Any) -> jax.Array:
        return fp8_matmul(x, self, **kw)

    def grouped_matmul(self, x: jax.Array, group_sizes: jax.Array, **kw: Any) -> jax.Array:
        out = jax.lax.ragged_dot(x, self.dequantize(x.dtype), group_sizes, preferred_element_type=jnp.float32)
        return out.astype(x.dtype)


def _expand(scale: jax.Array, k: int, n: int, block: tuple[int, int]) -> jax.Array:
    s = jnp.repeat(jnp.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return s[..., :k, :n]


def quantize_fp8(w: jax.Array, block: tuple[int, int] | None = (128, 128)) -> Fp8Weight:
    """Scaled e4m3 quantization. ``block=None`` means per-output-channel scales."""
    *lead, k, n = w.shape
    bk, bn = (k, 1) if block is None else block
    kp, np_ = math.ceil(k / bk) * bk, math.ceil(n / bn) * bn
    wf = jnp.pad(w.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, kp - k), (0, np_ - n)])
    blocks = wf.reshape(*lead, kp // bk, bk, np_ // bn, bn)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)
    q = (w.astype(jnp.float32) / _expand(scale, k, n, (bk, bn))).astype(jnp.float8_e4m3fn)
    return Fp8Weight(q, scale, (bk, bn))


def dequantize_fp8(w: Fp8Weight, dtype=jnp.float32) -> jax.Array:
    k, n = w.q.shape[-2:]
    return (w.q.astype(jnp.float32) * _expand(w.scale, k, n, w.block)).astype(dtype)


def fp8_matmul_reference(x: jax.Array, w: Fp8Weight) -> jax.Array:
    """x [..., K] @ dequant(w) [K, N] -> [..., N] in x's dtype, f32 accumulation."""
    return jnp.einsum("...k,kn->...n", x, dequantize_fp8(w, x.dtype), preferred_element_type=jnp.float32
                      ).astype(x.dtype)


def fp8_matmul(x: jax.Array, w: Fp8Weight, *, impl: str = "auto", interpret: bool | None = None) -> jax.Array:
    """FP8-weight matmul. The Pallas kernel is added by the kernels work; until then: the reference."""
    return fp8_matmul_reference(x, w)
