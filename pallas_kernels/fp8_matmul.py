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

``act_quant=None`` (default) means True exactly when the compiled Triton body is built (GPU, not interpret
mode) for 16-bit activations with K % 128 == 0, False otherwise (CPU reference, interpret mode, TPU, float32
inputs), so CPU runs keep W8A16 numerics. W8A8 uses FP8 tensor cores: Hopper (sm_90) and newer; on older
GPUs pass ``act_quant=False``. The Triton bodies convert FP8 weights in registers, which needs sm_89+ (Ada,
Hopper and newer): on older GPUs ``impl="auto"`` uses the reference, ``"pallas"`` raises.

Grouped (MoE) kernel ``fp8_grouped_matmul``: the same tile body on expert-aligned row tiles
(:mod:`pallas_kernels.moe_tiles`): each program reads one expert's ``[K, bn]`` FP8 tile and its scales and
dequantizes in registers (GPU) / VMEM (TPU); the expert stack is never expanded to 16 bits in HBM.
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

from pallas_kernels import moe_tiles, tuning
from pallas_kernels.common import (
    Provenance,
    UnsupportedShapeError,
    cdiv,
    check_gpu_fp8,
    compute_dtype,
    dispatch_kernel,
    dot_nn,
    dot_precision,
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


def _fake_quant_activations(x: jax.Array) -> jax.Array:
    """x [M, K] -> f32 values of its 1x128 e4m3 quantization. The barrier keeps the e4m3 values: XLA:GPU (jax
    0.11.2, H200) otherwise drops a jitted f32 -> e4m3 -> f32 round trip as excess precision, and the reference
    then saw unquantized activations (rel. err 2.6e-2 against the W8A8 kernel, the size of the rounding itself)."""
    q, s = jax.lax.optimization_barrier(quantize_activations_fp8(x))
    return q.astype(jnp.float32) * jnp.repeat(s, ACT_BLOCK, axis=-1)


def fp8_matmul_reference(x: jax.Array, w: Fp8Weight, *, act_quant: bool = False) -> jax.Array:
    """x [..., K] @ dequant(w) [K, N] -> [..., N] in x's dtype, f32 accumulation.

    ``act_quant=True`` first rounds x through :func:`quantize_activations_fp8` (what the W8A8 kernel sees).
    """
    if act_quant:
        xf = _fake_quant_activations(x.reshape(-1, x.shape[-1])).reshape(x.shape)
        out = jnp.einsum("...k,kn->...n", xf, dequantize_fp8(w), precision=jax.lax.Precision.HIGHEST)
        return out.astype(x.dtype)
    return jnp.einsum("...k,kn->...n", x, dequantize_fp8(w, x.dtype), preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


def _k_loop(x_ref, xs_ref, w_at, s_at, acc, *, bk, bks, col, per_channel, cdt):
    """acc f32[bm, bn] += x @ dequant(w) over all of K in steps of bk; ``w_at(slice)`` -> [bk, bn] weight rows,
    ``s_at(row, col)`` -> the block scale; xs_ref (W8A8) holds the 1x128 activation scales, else None."""
    steps_per_act = ACT_BLOCK // bk if xs_ref is not None else 1

    def body(kk, acc):
        k0 = pl.multiple_of(kk * bk, bk)
        xk, wk = x_ref[:, pl.ds(k0, bk)], w_at(pl.ds(k0, bk))
        if xs_ref is not None:  # FP8 x FP8 on tensor cores, rescaled by the token's 1x128 activation scale
            part = dot_nn(xk, wk) * xs_ref[:, pl.ds(jax.lax.div(kk, steps_per_act), 1)]
        else:
            part = dot_nn(xk.astype(cdt), wk.astype(cdt))
        if not per_channel:
            part = part * s_at(jax.lax.div(kk * bk, bks), col)  # lax.div: non-negative, no sign fix-up
        return acc + part

    return jax.lax.fori_loop(0, x_ref.shape[1] // bk, body, acc)


def _kernel(*refs, bk, bks, bn_per_scale, per_channel, act_quant, cdt):
    if act_quant:
        x_ref, xs_ref, w_ref, s_ref, o_ref = refs
    else:
        (x_ref, w_ref, s_ref, o_ref), xs_ref = refs, None
    col = jax.lax.div(pl.program_id(1), bn_per_scale)  # this N tile's scale column (block scales)
    acc = _k_loop(x_ref, xs_ref, lambda sl: w_ref[sl, :], lambda r, c: s_ref[r, c], jnp.zeros(o_ref.shape, jnp.float32),
                  bk=bk, bks=bks, col=col, per_channel=per_channel, cdt=cdt)
    if per_channel:
        acc = acc * s_ref[...].astype(jnp.float32)  # [1, bn]
    o_ref[...] = acc.astype(o_ref.dtype)


def _grouped_kernel(te_ref, tv_ref, *refs, tile_axis, bk, bks, bn_per_scale, per_channel, act_quant, cdt):
    """One expert-aligned tile (rows of one expert, :mod:`pallas_kernels.moe_tiles`), dequantized in the tile.

    GPU (tile_axis 0): w/s refs hold every expert's N tile and are indexed by the tile's expert. TPU (tile_axis
    1): the pipeline fetched this tile's expert block through the scalar-prefetched expert ids."""
    if act_quant:
        x_ref, xs_ref, w_ref, s_ref, o_ref = refs
    else:
        (x_ref, w_ref, s_ref, o_ref), xs_ref = refs, None
    t = pl.program_id(tile_axis)
    col = jax.lax.div(pl.program_id(1), bn_per_scale) if tile_axis == 0 else 0  # GPU: this N tile's scale column
    if tile_axis == 0:
        e = te_ref[t]
        w_at, s_at, s_row = (lambda sl: w_ref[e, sl, :]), (lambda r, c: s_ref[e, r, c]), (lambda: s_ref[e, :, :])
    else:
        # TPU block scales: the tile's own column [1, nk] of the expert's transposed scales; per-channel: [1, bn]
        w_at, s_at, s_row = (lambda sl: w_ref[sl, :]), (lambda r, c: s_ref[0, r]), (lambda: s_ref[...])

    @pl.when(tv_ref[t] == 1)
    def _compute():
        acc = _k_loop(x_ref, xs_ref, w_at, s_at, jnp.zeros(o_ref.shape, jnp.float32), bk=bk, bks=bks, col=col,
                      per_channel=per_channel, cdt=cdt)
        if per_channel:
            acc = acc * s_row().astype(jnp.float32)  # [1, bn]
        o_ref[...] = acc.astype(o_ref.dtype)

    @pl.when(tv_ref[t] == 0)
    def _unused():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _plan(m, k, n, w: Fp8Weight, x_dtype, act_quant: bool, target: str, interpret: bool):
    """-> (bm, bn, bk, kernel kwargs) after the shape checks shared by the dense and grouped kernels."""
    bks, bns = w.block
    per_channel = (bks, bns) == (k, 1)
    if act_quant and target == "tpu":
        raise UnsupportedShapeError("the TPU FP8 kernel takes 16/32-bit activations (act_quant=False)")
    blk = tuning.fp8_blocks(target, m, k, n, w.block)
    if blk is None:
        raise UnsupportedShapeError(f"FP8 Pallas ({target}) cannot tile M={m} K={k} N={n} scale block {w.block}")
    vmem = tuning.fp8_vmem_bytes(blk, k, jnp.dtype(x_dtype).itemsize)
    if target == "tpu" and vmem > tuning.TPU_VMEM_LIMIT_BYTES:
        raise UnsupportedShapeError(f"FP8 TPU kernel would need {vmem >> 20} MiB of VMEM for K={k}")
    if target == "gpu":
        check_gpu_fp8("Triton FP8 matmul", w.q.dtype, interpret)
    if act_quant and k % ACT_BLOCK:
        raise UnsupportedShapeError(f"FP8 activations need K % {ACT_BLOCK} == 0, got K={k}")
    bk = math.gcd(blk.bk, ACT_BLOCK) if act_quant else blk.bk
    kw = dict(bk=bk, bks=bks, bn_per_scale=max(bns // blk.bn, 1), per_channel=per_channel, act_quant=act_quant,
              cdt=compute_dtype(x_dtype))
    return blk.bm, blk.bn, kw


def _x_args(xp, act_quant: bool, spec_of):
    """Activation operands and specs: x, or (x as e4m3, its 1x128 scales) for W8A8."""
    m, k = xp.shape
    if not act_quant:
        return [xp], [spec_of(k)]
    xq, xs = quantize_activations_fp8(xp)
    return [xq, xs], [spec_of(k), spec_of(k // ACT_BLOCK)]


def _gpu_params(bm: int):
    warps, stages = tuning.matmul_gpu_launch(bm)
    return pltr.CompilerParams(num_warps=warps, num_stages=stages)


def _forward(x2, w: Fp8Weight, act_quant: bool, target: str, interpret: bool):
    m, k = x2.shape
    n = w.q.shape[-1]
    bm, bn, kw = _plan(m, k, n, w, x2.dtype, act_quant, target, interpret)
    mp = cdiv(m, bm) * bm
    args, in_specs = _x_args(jnp.pad(x2, ((0, mp - m), (0, 0))), act_quant,
                             lambda cols: pl.BlockSpec((bm, cols), lambda i, j: (i, 0)))
    args += [w.q, w.scale.astype(jnp.float32)]
    in_specs.append(pl.BlockSpec((k, bn), lambda i, j: (0, j)))
    if kw["per_channel"]:
        in_specs.append(pl.BlockSpec((1, bn), lambda i, j: (0, j)))
    elif target == "tpu":
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
    else:
        in_specs.append(pl.BlockSpec(w.scale.shape, lambda i, j: (0, 0)))
    if target == "gpu":
        params = _gpu_params(bm)
    else:
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                      vmem_limit_bytes=tuning.TPU_VMEM_LIMIT_BYTES)
    out = pl.pallas_call(
        functools.partial(_kernel, **kw),
        grid=(mp // bm, n // bn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((mp, n), x2.dtype),
        compiler_params=params,
        interpret=interpret,
        name=f"fp8_matmul_{target}",
    )(*args)
    return out[:m]


def _grouped_forward(x, w: Fp8Weight, group_sizes, act_quant: bool, target: str, interpret: bool):
    m, k = x.shape
    num_groups, _, n = w.q.shape
    bm, bn, kw = _plan(cdiv(m, num_groups), k, n, w, x.dtype, act_quant, target, interpret)  # bm: rows per expert
    tile_expert, tile_valid, src, dest = moe_tiles.align_rows(group_sizes, m, bm)
    t = tile_expert.shape[0]
    scale = w.scale.astype(jnp.float32)  # [E, nk, nn]
    out_shape = jax.ShapeDtypeStruct((t * bm, n), x.dtype)
    kernel = functools.partial(_grouped_kernel, tile_axis=0 if target == "gpu" else 1, **kw)
    if target == "gpu":
        args, in_specs = _x_args(moe_tiles.gather_tiles(x, src), act_quant,
                                 lambda cols: pl.BlockSpec((bm, cols), lambda i, j: (i, 0)))
        meta = pl.BlockSpec((t,), lambda i, j: (0,))
        s_spec = (pl.BlockSpec((num_groups, 1, bn), lambda i, j: (0, 0, j)) if kw["per_channel"]
                  else pl.BlockSpec(scale.shape, lambda i, j: (0, 0, 0)))
        out = pl.pallas_call(
            kernel, grid=(t, n // bn),
            in_specs=[meta, meta, *in_specs, pl.BlockSpec((num_groups, k, bn), lambda i, j: (0, 0, j)), s_spec],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)), out_shape=out_shape,
            compiler_params=_gpu_params(bm), interpret=interpret, name="fp8_grouped_matmul_gpu",
        )(tile_expert, tile_valid, *args, w.q, scale)
        return moe_tiles.scatter_back(out, dest)
    args, in_specs = _x_args(moe_tiles.gather_tiles(x, src), act_quant,
                             lambda cols: pl.BlockSpec((bm, cols), lambda j, v, te, tv: (v, 0)))
    nk, nn, bps = scale.shape[1], scale.shape[2], kw["bn_per_scale"]
    if not kw["per_channel"]:  # [E * nn, 1, nk]: one N tile's scale column is a whole (1, nk) block (SMEM)
        scale = scale.transpose(0, 2, 1).reshape(num_groups * nn, 1, nk)
    s_spec = (pl.BlockSpec((None, 1, bn), lambda j, v, te, tv: (te[v], 0, j)) if kw["per_channel"]
              else pl.BlockSpec((None, 1, nk), lambda j, v, te, tv: (te[v] * nn + jax.lax.div(j, bps), 0, 0),
                                memory_space=pltpu.SMEM))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(n // bn, t),  # tiles innermost: consecutive tiles of one expert reuse its fetched weight block
            in_specs=[*in_specs, pl.BlockSpec((None, k, bn), lambda j, v, te, tv: (te[v], 0, j)), s_spec],
            out_specs=pl.BlockSpec((bm, bn), lambda j, v, te, tv: (v, j)),
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=tuning.TPU_VMEM_LIMIT_BYTES),
        interpret=interpret,
        name="fp8_grouped_matmul_tpu",
    )(tile_expert, tile_valid, *args, w.q, scale)
    return moe_tiles.scatter_back(out, dest)


def _default_act_quant(act_quant: bool | None, x: jax.Array, target: str, interpret: bool) -> bool:
    """``None`` -> W8A8 exactly for the compiled Triton body with 16-bit activations and K % 128 == 0."""
    if act_quant is not None:
        return act_quant
    return target == "gpu" and not interpret and jnp.dtype(x.dtype).itemsize == 2 and x.shape[-1] % ACT_BLOCK == 0


def fp8_matmul(
    x: jax.Array,  # [..., K]
    w: Fp8Weight,  # f8e4m3[K, N] with scales
    *,
    act_quant: bool | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
    target: str | None = None,
    provenance: Provenance | None = None,  # the caller's sink (common)
) -> jax.Array:  # [..., N] in x's dtype
    """FP8-weight matmul (W8A16, or W8A8 with dynamic activation scales); see the module docstring."""
    if w.q.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_matmul needs x [..., K] and a 2-D weight [K, N]; got x {x.shape}, w {w.shape}")

    def build(tgt, interp):
        aq = _default_act_quant(act_quant, x, tgt, interp)
        out = _forward(x.reshape(-1, x.shape[-1]), w, aq, tgt, interp)
        return out.reshape(*x.shape[:-1], w.shape[-1])

    return dispatch_kernel("fp8_matmul", impl, target, interpret, build,
                           lambda: fp8_matmul_reference(x, w, act_quant=bool(act_quant)),
                           provenance=provenance)


def fp8_grouped_matmul_reference(x: jax.Array, w: Fp8Weight, group_sizes: jax.Array, *,
                                 act_quant: bool = False) -> jax.Array:
    """Ragged: x [M, K] sorted by expert, w [E, K, N], group_sizes i32[E] -> [M, N] (dequantizes every expert:
    a reference, not a serving path)."""
    if act_quant:
        x = _fake_quant_activations(x).astype(x.dtype)
    wd = dequantize_fp8(w, x.dtype)  # HIGHEST for float32 only: XLA:TPU's ragged dot refuses BF16 at fp32 precision
    out = jax.lax.ragged_dot(x, wd, group_sizes, preferred_element_type=jnp.float32, precision=dot_precision(x, wd))
    return out.astype(x.dtype)


def fp8_grouped_matmul(
    x: jax.Array,  # [M, K], rows sorted by expert
    w: Fp8Weight,  # f8e4m3[E, K, N], scales [E, ceil(K/bk), ceil(N/bn)]
    group_sizes: jax.Array,  # i32[E]
    *,
    act_quant: bool | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
    target: str | None = None,
    provenance: Provenance | None = None,  # the caller's sink (common)
) -> jax.Array:  # [M, N] in x's dtype; rows past sum(group_sizes) are zero (as lax.ragged_dot)
    """Grouped (MoE) FP8 matmul: rows ``[start_e, end_e)`` use expert ``e``; each tile dequantizes its own
    expert's weight tile in registers/VMEM (never the expert stack). See the module docstring."""
    if x.ndim != 2 or w.q.ndim != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != (w.shape[0],):
        raise ValueError(f"fp8_grouped_matmul needs x [M, K], w [E, K, N], group_sizes [E]; got x {x.shape}, "
                         f"w {w.shape}, group_sizes {group_sizes.shape}")

    def build(tgt, interp):
        return _grouped_forward(x, w, group_sizes, _default_act_quant(act_quant, x, tgt, interp), tgt, interp)

    return dispatch_kernel("fp8_grouped_matmul", impl, target, interpret, build,
                           lambda: fp8_grouped_matmul_reference(x, w, group_sizes, act_quant=bool(act_quant)),
                           provenance=provenance)
