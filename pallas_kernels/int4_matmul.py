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

Kernels (``int4_matmul`` dense, ``int4_grouped_matmul`` ragged MoE; ``impl="auto" | "pallas" | "reference"``):
the wrapper splits the activations once into ``x_lo [M, K/2]`` (the columns that meet low nibbles) and
``x_hi [M, K/2]``, so a kernel step loads a ``[bk, bn]`` tile of packed bytes, unpacks it with a mask and a
shift into two tiles, scales them by their group's scale row and runs two 16-bit dots into an f32
accumulator: ``acc += x_lo[:, kb] @ lo + x_hi[:, kb] @ hi``. Weight bytes are read once per output tile,
which is what makes W4A16 decode (small M) fast. The same kernel body lowers with Pallas Triton (GPU) and
Mosaic TPU. Dense grid (M tiles, N tiles, K splits): on a GPU, K is split (split-K, as Marlin/Machete do at
small M) until the grid fills ~2 waves of the SMs (:func:`pallas_kernels.tuning.split_k`; N=2,048 at M<=16
gives 16 (M, N) programs, x8 splits = 128), and the f32 partials are summed in XLA; TPU uses one split.

Grouped form: rows are first gathered into expert-aligned tiles (:mod:`pallas_kernels.moe_tiles`), so each
program computes one tile of one expert, reading only that expert's weight tile and no other expert's rows.
GPU grid (tiles, N tiles), the expert id read from a small array; TPU grid (N tiles, tiles) with the expert
ids scalar-prefetched into the weight BlockSpec's index map (unused tiles repeat the last block: no DMA).

Shapes the Pallas path refuses (:class:`~pallas_kernels.common.UnsupportedShapeError`; ``impl="auto"``
falls back to the reference): GPU needs a power-of-two group size and N divisible by 16; TPU needs N
divisible by 128 (or N <= 512) and K/2 divisible by 8 * G/2 (a K step covers 8 scale rows; bf16 scales are
converted to f32 in VMEM first), i.e. K % 256 == 0 for G=32 and K % 1024 == 0 for G=128. M is padded
internally, so any M works.
"""

from __future__ import annotations

import functools

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
    compute_dtype,
    dispatch_kernel,
    dot_nn,
    dot_precision,
)


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
    return jnp.einsum("...k,kn->...n", x, dequantize_int4(w, x.dtype), preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


def int4_grouped_matmul_reference(x: jax.Array, w: Int4Weight, group_sizes: jax.Array) -> jax.Array:
    """Ragged: x [M, K] sorted by expert, w [E, K, N], group_sizes i32[E] -> [M, N]. HIGHEST precision only for
    float32 operands: XLA:TPU's ragged dot (a Mosaic kernel) refuses BF16 operands at fp32 contract precision."""
    wd = dequantize_int4(w, x.dtype)
    out = jax.lax.ragged_dot(x, wd, group_sizes, preferred_element_type=jnp.float32, precision=dot_precision(x, wd))
    return out.astype(x.dtype)


# --------------------------------------------------------------------------------------------- kernels


def split_activations(x: jax.Array, group_size: int) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (x_lo, x_hi), each [M, K/2]: the columns that multiply low / high nibbles of packed rows."""
    m, k = x.shape
    xg = x.reshape(m, k // group_size, 2, group_size // 2)
    return xg[:, :, 0, :].reshape(m, k // 2), xg[:, :, 1, :].reshape(m, k // 2)


def _unpack_scaled(packed, scale, half: int, cdt):
    """packed u8[bk, bn], scale [bk/half, bn] -> (lo, hi) [bk, bn] in cdt: (nibble - 8) * scale of its group."""
    bk, bn = packed.shape
    nsg = bk // half
    srep = jnp.broadcast_to(scale.astype(jnp.float32)[:, None, :], (nsg, half, bn)).reshape(bk, bn)
    p = packed.astype(jnp.int32)
    lo = ((p & 15) - 8).astype(jnp.float32) * srep
    hi = ((p >> 4) - 8).astype(jnp.float32) * srep
    return lo.astype(cdt), hi.astype(cdt)


def _k_loop(xlo_ref, xhi_ref, w_ref, s_ref, acc, *, bk: int, half: int, cdt, row_mask=None, expert=None):
    """acc f32[bm, bn] += x[:, all K] @ dequant(w) over K/2 packed rows in steps of bk (dynamic ref slices)."""
    nsg = bk // half
    w_at = (lambda sl: w_ref[expert, sl, :]) if expert is not None else (lambda sl: w_ref[sl, :])
    s_at = (lambda sl: s_ref[expert, sl, :]) if expert is not None else (lambda sl: s_ref[sl, :])

    def body(kk, acc):
        k0 = pl.multiple_of(kk * bk, bk)
        lo, hi = _unpack_scaled(w_at(pl.ds(k0, bk)), s_at(pl.ds(pl.multiple_of(kk * nsg, nsg), nsg)), half, cdt)
        xlo = xlo_ref[:, pl.ds(k0, bk)].astype(cdt)
        xhi = xhi_ref[:, pl.ds(k0, bk)].astype(cdt)
        if row_mask is not None:
            xlo = jnp.where(row_mask, xlo, jnp.zeros_like(xlo))
            xhi = jnp.where(row_mask, xhi, jnp.zeros_like(xhi))
        return acc + dot_nn(xlo, lo) + dot_nn(xhi, hi)

    return jax.lax.fori_loop(0, xlo_ref.shape[1] // bk, body, acc)


def _f32_scales(s_ref, scratch):
    """TPU: bf16 scales are copied to an f32 VMEM scratch so that dynamic 8-row slices stay tile-aligned."""
    if not scratch:
        return s_ref
    scratch[0][...] = s_ref[...].astype(jnp.float32)
    return scratch[0]


def _dense_kernel(xlo_ref, xhi_ref, w_ref, s_ref, o_ref, *scratch, bk, half, cdt):
    s_ref = _f32_scales(s_ref, scratch)
    acc = jnp.zeros(o_ref.shape, jnp.float32)
    o_ref[...] = _k_loop(xlo_ref, xhi_ref, w_ref, s_ref, acc, bk=bk, half=half, cdt=cdt).astype(o_ref.dtype)


def _blocks(target: str, m: int, k: int, n: int, group_size: int, x_dtype) -> tuning.MatmulBlocks:
    blk = tuning.int4_blocks(target, m, k, n, group_size)
    if blk is None:
        raise UnsupportedShapeError(f"INT4 Pallas ({target}) cannot tile M={m} K={k} N={n} group={group_size}; "
                                    "see the module docstring for the supported shapes")
    vmem = tuning.int4_vmem_bytes(blk, k, group_size, jnp.dtype(x_dtype).itemsize)
    if target == "tpu" and vmem > tuning.TPU_VMEM_LIMIT_BYTES:
        raise UnsupportedShapeError(f"INT4 TPU kernel would need {vmem >> 20} MiB of VMEM for K={k}")
    return blk


def _compiler_params(target: str, semantics: tuple[str, ...], m: int = 64):
    if target == "gpu":
        warps, stages = tuning.matmul_gpu_launch(m)
        return pltr.CompilerParams(num_warps=warps, num_stages=stages)
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=tuning.TPU_VMEM_LIMIT_BYTES)


def _scale_scratch(target: str, scale_dtype, shape) -> list:
    return [pltpu.VMEM(shape, jnp.float32)] if target == "tpu" and scale_dtype != jnp.float32 else []


def _dense_forward(x2, w: Int4Weight, target: str, interpret: bool):
    """Grid (M tiles, N tiles, K splits). GPU split-K: at decode M one (M, N) tile grid has too few programs
    (N=2,048 -> 16 on 132 SMs), so K is split until ~2 waves; f32 partials [splits, M, N] are summed in XLA."""
    m, k = x2.shape
    n = w.packed.shape[-1]
    blk = _blocks(target, m, k, n, w.group_size, x2.dtype)
    mp = cdiv(m, blk.bm) * blk.bm
    xlo, xhi = (jnp.pad(a, ((0, mp - m), (0, 0))) for a in split_activations(x2, w.group_size))
    kh, ng = k // 2, k // w.group_size
    tm, tn = mp // blk.bm, n // blk.bn
    ns = tuning.split_k(tm * tn, kh // blk.bk) if target == "gpu" else 1
    khs, ngs = kh // ns, ng // ns
    x_spec = pl.BlockSpec((blk.bm, khs), lambda i, j, s: (i, s))
    out_dtype = jnp.float32 if ns > 1 else x2.dtype
    out = pl.pallas_call(
        functools.partial(_dense_kernel, bk=blk.bk, half=w.group_size // 2, cdt=compute_dtype(x2.dtype)),
        grid=(tm, tn, ns),
        in_specs=[x_spec, x_spec, pl.BlockSpec((khs, blk.bn), lambda i, j, s: (s, j)),
                  pl.BlockSpec((ngs, blk.bn), lambda i, j, s: (s, j))],
        out_specs=pl.BlockSpec((None, blk.bm, blk.bn), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((ns, mp, n), out_dtype),
        scratch_shapes=_scale_scratch(target, w.scale.dtype, (ngs, blk.bn)),
        compiler_params=_compiler_params(target, ("parallel", "parallel", "parallel"), m),
        interpret=interpret,
        name=f"int4_matmul_{target}",
    )(xlo, xhi, w.packed, w.scale)
    return (out[0] if ns == 1 else jnp.sum(out, axis=0)).astype(x2.dtype)[:m]


def _grouped_kernel(te_ref, tv_ref, xlo_ref, xhi_ref, w_ref, s_ref, o_ref, *scratch, tile_axis, bk, half, cdt):
    """One expert-aligned tile: rows of one expert only (see :mod:`pallas_kernels.moe_tiles`). GPU (tile_axis 0):
    w/s refs hold every expert's N tile, indexed by the tile's expert; TPU (tile_axis 1): the pipeline already
    fetched the tile's expert block (scalar-prefetched expert ids in the index map)."""
    t = pl.program_id(tile_axis)
    expert = te_ref[t] if tile_axis == 0 else None

    @pl.when(tv_ref[t] == 1)
    def _compute():
        acc = jnp.zeros(o_ref.shape, jnp.float32)
        o_ref[...] = _k_loop(xlo_ref, xhi_ref, w_ref, _f32_scales(s_ref, scratch), acc, bk=bk, half=half, cdt=cdt,
                             expert=expert).astype(o_ref.dtype)

    @pl.when(tv_ref[t] == 0)
    def _unused():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _grouped_forward(x, w: Int4Weight, group_sizes, target: str, interpret: bool):
    m, k = x.shape
    num_groups, kh, n = w.packed.shape
    ng = k // w.group_size
    blk = _blocks(target, cdiv(m, num_groups), k, n, w.group_size, x.dtype)  # bm from rows per expert
    bm, bn = blk.bm, blk.bn
    tile_expert, tile_valid, src, dest = moe_tiles.align_rows(group_sizes, m, bm)
    t = tile_expert.shape[0]
    xlo, xhi = (moe_tiles.gather_tiles(a, src) for a in split_activations(x, w.group_size))
    kw = dict(bk=blk.bk, half=w.group_size // 2, cdt=compute_dtype(x.dtype))
    if target == "gpu":
        x_spec = pl.BlockSpec((bm, kh), lambda i, j: (i, 0))
        meta = pl.BlockSpec((t,), lambda i, j: (0,))
        out = pl.pallas_call(
            functools.partial(_grouped_kernel, tile_axis=0, **kw),
            grid=(t, n // bn),
            in_specs=[meta, meta, x_spec, x_spec, pl.BlockSpec((num_groups, kh, bn), lambda i, j: (0, 0, j)),
                      pl.BlockSpec((num_groups, ng, bn), lambda i, j: (0, 0, j))],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
            out_shape=jax.ShapeDtypeStruct((t * bm, n), x.dtype),
            compiler_params=_compiler_params(target, (), bm),
            interpret=interpret,
            name="int4_grouped_matmul_gpu",
        )(tile_expert, tile_valid, xlo, xhi, w.packed, w.scale)
        return moe_tiles.scatter_back(out, dest)
    x_spec = pl.BlockSpec((bm, kh), lambda j, v, te, tv: (v, 0))
    out = pl.pallas_call(
        functools.partial(_grouped_kernel, tile_axis=1, **kw),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(n // bn, t),  # tiles innermost: consecutive tiles of one expert reuse its fetched weight block
            in_specs=[x_spec, x_spec,
                      pl.BlockSpec((None, kh, bn), lambda j, v, te, tv: (te[v], 0, j)),
                      pl.BlockSpec((None, ng, bn), lambda j, v, te, tv: (te[v], 0, j))],
            out_specs=pl.BlockSpec((bm, bn), lambda j, v, te, tv: (v, j)),
            scratch_shapes=_scale_scratch(target, w.scale.dtype, (ng, bn)),
        ),
        out_shape=jax.ShapeDtypeStruct((t * bm, n), x.dtype),
        compiler_params=_compiler_params(target, ("parallel", "arbitrary")),
        interpret=interpret,
        name="int4_grouped_matmul_tpu",
    )(tile_expert, tile_valid, xlo, xhi, w.packed, w.scale)
    return moe_tiles.scatter_back(out, dest)


# --------------------------------------------------------------------------------------------- public entry


def int4_matmul(
    x: jax.Array,  # [..., K]
    w: Int4Weight,  # packed u8[K/2, N]
    *,
    impl: str = "auto",
    interpret: bool | None = None,
    target: str | None = None,
    provenance: Provenance | None = None,  # the caller's sink (common)
) -> jax.Array:  # [..., N] in x's dtype
    """Dense W4A16 matmul ``x @ dequant(w)`` with f32 accumulation."""
    if w.packed.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"int4_matmul needs x [..., K] and a 2-D weight [K, N]; got x {x.shape}, w {w.shape}")

    def build(tgt, interp):
        out = _dense_forward(x.reshape(-1, x.shape[-1]), w, tgt, interp)
        return out.reshape(*x.shape[:-1], w.shape[-1])

    return dispatch_kernel("int4_matmul", impl, target, interpret, build, lambda: int4_matmul_reference(x, w),
                           provenance=provenance)


def int4_grouped_matmul(
    x: jax.Array,  # [M, K], rows sorted by expert
    w: Int4Weight,  # packed u8[E, K/2, N]
    group_sizes: jax.Array,  # i32[E]
    *,
    impl: str = "auto",
    interpret: bool | None = None,
    target: str | None = None,
    provenance: Provenance | None = None,  # the caller's sink (common)
) -> jax.Array:  # [M, N] in x's dtype; rows past sum(group_sizes) are zero (as lax.ragged_dot)
    """Grouped (MoE) W4A16 matmul: rows ``[start_e, end_e)`` of x use expert ``e``'s weight."""
    if x.ndim != 2 or w.packed.ndim != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != (w.shape[0],):
        raise ValueError(f"int4_grouped_matmul needs x [M, K], w [E, K, N], group_sizes [E]; got x {x.shape}, "
                         f"w {w.shape}, group_sizes {group_sizes.shape}")

    def build(tgt, interp):
        return _grouped_forward(x, w, group_sizes, tgt, interp)

    return dispatch_kernel("int4_grouped_matmul", impl, target, interpret, build,
                           lambda: int4_grouped_matmul_reference(x, w, group_sizes),
                           provenance=provenance)
