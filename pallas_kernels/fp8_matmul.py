"""FP8 e4m3 weights with block scales (128x128 as DeepSeek-V3/GLM FP8 checkpoints) or per-channel scales.

``w [..., K, N] ~= q * scale`` where ``q`` is float8_e4m3fn and ``scale`` f32 ``[..., ceil(K/bk), ceil(N/bn)]``
with ``block = (bk, bn)``. Per-channel scales are the block ``(K, 1)``: ``scale [..., 1, N]``. The
scale of a block is ``amax / 448`` (e4m3's largest finite value); DeepSeek's ``weight_scale_inv`` is exactly
this scale, stored transposed for the ``[N, K]`` layout.

Kernel (``fp8_matmul``, ``impl="auto" | "pallas" | "reference"``): grid (M tiles, N tiles), a loop over K
in steps that never straddle a scale block; each step is one dot with f32 accumulation, multiplied by the
block's weight scale (a scalar: an N tile never straddles a scale column), and per-channel scales are
applied once at the end. Two numerics, chosen by ``act_quant``:

* ``act_quant=False`` (W8A16): weights are upcast in VMEM/registers to the activation dtype (bf16, or
  f32 for exact-parity runs). The XLA reference computes the same thing.
* ``act_quant=True`` (W8A8, prefill on Hopper): activations are quantized dynamically per token and per
  128 columns (DeepSeek-V3's 1x128 scheme) and both operands feed FP8 tensor cores; the partial product
  of each 128-column step is rescaled by the token's activation scale. The reference with
  ``act_quant=True`` simulates exactly this quantization.

``act_quant=None`` (default) means True exactly when the Triton kernel runs on a GPU for 16-bit
activations, False otherwise (CPU reference, TPU, float32 inputs), so CPU runs keep W8A16 numerics.
GPU lowering is Pallas Triton (see :mod:`pallas_kernels.paged_attention` for why); TPU is Mosaic with the
block scales in SMEM; the TPU kernel does not take FP8 activations. Shapes the Pallas path refuses
(:class:`~pallas_kernels.common.UnsupportedShapeError`; ``impl="auto"`` then uses the reference): scale
blocks whose N size is not a multiple of 16 (GPU) / 128 (TPU) unless per-channel, N not divisible by the
tile, K not divisible by the K step (16 on GPU, 128 on TPU), and ``act_quant`` with K % 128 != 0.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

from pallas_kernels import tuning
from pallas_kernels.common import (
    UnsupportedShapeError,
    backend,
    cdiv,
    compute_dtype,
    dispatch,
    dot_nn,
    resolve_impl,
    resolve_interpret,
    resolve_target,
)

E4M3_MAX = 448.0
ACT_BLOCK = 128  # columns per dynamic activation scale (1 x 128 per token)


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


def quantize_activations_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Dynamic 1x128 quantization: x [M, K] -> (f8e4m3[M, K], f32[M, K/128] scales), value = q * scale."""
    m, k = x.shape
    if k % ACT_BLOCK:
        raise UnsupportedShapeError(f"FP8 activations need K % {ACT_BLOCK} == 0, got K={k}")
    xb = x.astype(jnp.float32).reshape(m, k // ACT_BLOCK, ACT_BLOCK)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = (xb / scale[..., None]).astype(jnp.float8_e4m3fn).reshape(m, k)
    return q, scale


def fp8_matmul_reference(x: jax.Array, w: Fp8Weight, *, act_quant: bool = False) -> jax.Array:
    """x [..., K] @ dequant(w) [K, N] -> [..., N] in x's dtype, f32 accumulation.

    ``act_quant=True`` first rounds x through :func:`quantize_activations_fp8` (what the W8A8 kernel sees).
    """
    if act_quant:
        x2 = x.reshape(-1, x.shape[-1])
        q, s = quantize_activations_fp8(x2)
        xf = (q.astype(jnp.float32) * jnp.repeat(s, ACT_BLOCK, axis=-1)).reshape(x.shape)
        out = jnp.einsum("...k,kn->...n", xf, dequantize_fp8(w), precision=jax.lax.Precision.HIGHEST)
        return out.astype(x.dtype)
    return jnp.einsum("...k,kn->...n", x, dequantize_fp8(w, x.dtype), preferred_element_type=jnp.float32
                      ).astype(x.dtype)


def _kernel(*refs, bk, bks, bn_per_scale, per_channel, act_quant, cdt):
    if act_quant:
        x_ref, xs_ref, w_ref, s_ref, o_ref = refs
    else:
        (x_ref, w_ref, s_ref, o_ref), xs_ref = refs, None
    col = jax.lax.div(pl.program_id(1), bn_per_scale)  # this N tile's scale column (block scales)
    steps_per_act = ACT_BLOCK // bk if act_quant else 1

    def body(kk, acc):
        k0 = pl.multiple_of(kk * bk, bk)
        xk, wk = x_ref[:, pl.ds(k0, bk)], w_ref[pl.ds(k0, bk), :]
        if act_quant:  # FP8 x FP8 on tensor cores, rescaled by the token's 1x128 activation scale
            part = dot_nn(xk, wk) * xs_ref[:, pl.ds(jax.lax.div(kk, steps_per_act), 1)]
        else:
            part = dot_nn(xk.astype(cdt), wk.astype(cdt))
        if not per_channel:
            part = part * s_ref[jax.lax.div(kk * bk, bks), col]  # lax.div: non-negative, no sign fix-up
        return acc + part

    acc = jax.lax.fori_loop(0, x_ref.shape[1] // bk, body, jnp.zeros(o_ref.shape, jnp.float32))
    if per_channel:
        acc = acc * s_ref[...].astype(jnp.float32)  # [1, bn]
    o_ref[...] = acc.astype(o_ref.dtype)


def _forward(x2, w: Fp8Weight, act_quant: bool, target: str, interpret: bool):
    m, k = x2.shape
    n = w.q.shape[-1]
    bks, bns = w.block
    per_channel = (bks, bns) == (k, 1)
    if act_quant and target == "tpu":
        raise UnsupportedShapeError("the TPU FP8 kernel takes 16/32-bit activations (act_quant=False)")
    blk = tuning.fp8_blocks(target, m, k, n, w.block)
    if blk is None:
        raise UnsupportedShapeError(f"FP8 Pallas ({target}) cannot tile M={m} K={k} N={n} scale block {w.block}")
    vmem = tuning.fp8_vmem_bytes(blk, k, jnp.dtype(x2.dtype).itemsize)
    if target == "tpu" and vmem > tuning.TPU_VMEM_LIMIT_BYTES:
        raise UnsupportedShapeError(f"FP8 TPU kernel would need {vmem >> 20} MiB of VMEM for K={k}")
    bm, bn, bk = blk.bm, blk.bn, math.gcd(blk.bk, ACT_BLOCK) if act_quant else blk.bk
    mp = cdiv(m, bm) * bm
    xp = jnp.pad(x2, ((0, mp - m), (0, 0)))
    args, in_specs = [], []
    if act_quant:
        xq, xs = quantize_activations_fp8(xp)
        args += [xq, xs]
        in_specs += [pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                     pl.BlockSpec((bm, k // ACT_BLOCK), lambda i, j: (i, 0))]
    else:
        args.append(xp)
        in_specs.append(pl.BlockSpec((bm, k), lambda i, j: (i, 0)))
    args += [w.q, w.scale.astype(jnp.float32)]
    in_specs.append(pl.BlockSpec((k, bn), lambda i, j: (0, j)))
    if per_channel:
        in_specs.append(pl.BlockSpec((1, bn), lambda i, j: (0, j)))
    elif target == "tpu":
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    else:
        in_specs.append(pl.BlockSpec(w.scale.shape, lambda i, j: (0, 0)))
    if target == "gpu":
        params = pltr.CompilerParams(num_warps=4, num_stages=3)
    else:
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                      vmem_limit_bytes=tuning.TPU_VMEM_LIMIT_BYTES)
    kernel = functools.partial(_kernel, bk=bk, bks=bks, bn_per_scale=max(bns // bn, 1), per_channel=per_channel,
                               act_quant=act_quant, cdt=compute_dtype(x2.dtype))
    out = pl.pallas_call(
        kernel,
        grid=(mp // bm, n // bn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, n), x2.dtype),
        compiler_params=params,
        interpret=interpret,
        name=f"fp8_matmul_{target}",
    )(*args)
    return out[:m]


def fp8_matmul(
    x: jax.Array,  # [..., K]
    w: Fp8Weight,  # f8e4m3[K, N] with scales
    *,
    act_quant: bool | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
    target: str | None = None,
) -> jax.Array:  # [..., N] in x's dtype
    """FP8-weight matmul (W8A16, or W8A8 with dynamic activation scales); see the module docstring."""
    if w.q.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_matmul needs x [..., K] and a 2-D weight [K, N]; got x {x.shape}, w {w.shape}")
    tgt = resolve_target(target)
    if act_quant is None:
        act_quant = (resolve_impl(impl) == "pallas" and tgt == "gpu" and backend() == "gpu"
                     and jnp.dtype(x.dtype).itemsize == 2 and x.shape[-1] % ACT_BLOCK == 0)

    def run_pallas():
        out = _forward(x.reshape(-1, x.shape[-1]), w, act_quant, tgt, resolve_interpret(interpret))
        return out.reshape(*x.shape[:-1], w.shape[-1])

    return dispatch(impl, run_pallas, lambda: fp8_matmul_reference(x, w, act_quant=act_quant))
