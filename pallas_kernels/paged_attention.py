"""GQA decode attention over a paged KV cache (BF16, F32 or FP8 e4m3 pages with per-token-per-head scales).

One query token per sequence attends over ``lengths[b]`` cached tokens whose pages are listed in
``page_table[b]``. Layout (docs/design.md, "Public API")::

    k_pages, v_pages  [num_pages, page_size, num_kv_heads, head_dim]   bf16 | f32 | float8_e4m3fn
    k_scales, v_scales [num_pages, page_size, num_kv_heads] f32        value = page * scale (None: 1)
    page_table i32[B, max_pages_per_seq]    lengths i32[B]    q [B, num_q_heads, head_dim]

    token t of row b lives at  pages[page_table[b, t // page_size], t % page_size]

Query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``. Rows with length 0 return zeros.
Page ids are clipped into ``[0, num_pages)`` (JAX does not fault on out-of-range gathers; the integrity
layer reports them) and entries past a row's length are never trusted: masked keys never reach the
softmax and masked value rows are zeroed, so stale or NaN page contents cannot leak.

Two kernels, one per backend, sharing the reference, the dequantization rule and the online-softmax
update of :mod:`pallas_kernels.common`:

* GPU: **Pallas Triton** lowering. One program per (row, KV head, split); it gathers ``pages_per_block``
  pages per step with an indexed load of the page ids, runs flash-decoding over its split of the page
  range and writes unnormalized partials that XLA merges (split-K, so short batches still fill the GPU).
  Why Triton and not Mosaic GPU: the page gather is an indexed pointer load in Triton, while Mosaic GPU
  needs one TMA copy per page, warpgroup-sized (64-row) WGMMA tiles that a decode step (1..8 query heads
  per KV head) cannot fill, and Hopper-only code; the Triton kernel runs BF16/F32 pages on Ampere and
  Hopper (FP8 pages need the FP8 conversions of sm_89+, Ada/Hopper and newer; on older GPUs ``impl="auto"``
  uses the reference for FP8 pages, ``"pallas"`` raises), lowers from a CPU
  machine, and its body is exactly what interpret mode tests on the CPU. Triton is deprecated from jax 0.11
  (this project pins 0.10.2); the body is small and isolated so a Mosaic GPU port can replace it.
  FP8: K is upcast to the query dtype for the tensor-core dot and its scale is folded into the
  logits, the V scale is folded into the probabilities. Needs power-of-two page_size and head_dim.
* TPU: **Mosaic TPU**, lengths and the page table scalar-prefetched into SMEM, grid (row, KV head, page
  block); the BlockSpec index maps read page ids from SMEM, so Pallas double-buffers the page DMAs, and
  blocks past a row's length map to its last page (no new DMA) and skip compute. Pages are viewed as
  ``[num_pages, page_size, num_kv_heads * head_dim]`` (a free reshape) so one head is a lane-aligned
  block: head_dim must be a multiple of 128 unless there is one KV head. FP8 pages are dequantized in VMEM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltr

from pallas_kernels import tuning
from pallas_kernels.common import (
    NEG_INF,
    Provenance,
    UnsupportedShapeError,
    check_gpu_fp8,
    combine_splits,
    compute_dtype,
    dequantize_pages,
    dispatch_kernel,
    dot_nt,
    finalize,
    is_fp8,
    is_pow2,
    online_softmax_step,
    token_mask_col,
    token_mask_row,
)

PAGE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e4m3fn))


def paged_decode_attention_reference(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [P, S, Hkv, D]
    v_pages: jax.Array,  # [P, S, Hkv, D]
    page_table: jax.Array,  # i32[B, max_pages]
    lengths: jax.Array,  # i32[B]
    *,
    k_scales: jax.Array | None = None,  # f32[P, S, Hkv]
    v_scales: jax.Array | None = None,  # f32[P, S, Hkv]
    sm_scale: float | None = None,
) -> jax.Array:  # [B, Hq, D] in q's dtype
    """Plain-jnp reference: gather every listed page, dequantize, mask, softmax in f32."""
    b, hq, d = q.shape
    p, s, hkv, _ = k_pages.shape
    maxp = page_table.shape[1]
    sm_scale = d**-0.5 if sm_scale is None else sm_scale
    pt = jnp.clip(page_table, 0, p - 1)
    t = maxp * s
    valid = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
    k = dequantize_pages(k_pages[pt], None if k_scales is None else k_scales[pt]).reshape(b, t, hkv, d)
    v = dequantize_pages(v_pages[pt], None if v_scales is None else v_scales[pt]).reshape(b, t, hkv, d)
    k = jnp.where(valid[:, :, None, None], k, 0.0)
    v = jnp.where(valid[:, :, None, None], v, 0.0)
    qf = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("bhgd,bthd->bhgt", qf, k, precision=hi) * sm_scale
    logits = jnp.where(valid[:, None, None, :], logits, NEG_INF)
    m = jnp.max(logits, axis=-1, keepdims=True)
    probs = jnp.exp(logits - jnp.where(m == NEG_INF, 0.0, m))
    out = finalize(jnp.einsum("bhgt,bthd->bhgd", probs, v, precision=hi), jnp.sum(probs, axis=-1, keepdims=True))
    return out.reshape(b, hq, d).astype(q.dtype)


def _check(q, k_pages, v_pages, page_table, lengths, k_scales, v_scales):
    if q.ndim != 3 or k_pages.ndim != 4:
        raise ValueError(f"q must be [B, Hq, D] and pages [P, S, Hkv, D]; got {q.shape} and {k_pages.shape}")
    b, hq, d = q.shape
    p, s, hkv, dk = k_pages.shape
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(f"k_pages {k_pages.shape} {k_pages.dtype} and v_pages {v_pages.shape} {v_pages.dtype} differ")
    if dk != d or hq % hkv:
        raise ValueError(f"q {q.shape} does not fit pages {k_pages.shape} (head_dim, or Hq % Hkv)")
    if jnp.dtype(k_pages.dtype) not in PAGE_DTYPES:
        raise ValueError(f"page dtype must be one of {[str(t) for t in PAGE_DTYPES]}, got {k_pages.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"page_table {page_table.shape} / lengths {lengths.shape} do not match batch {b}")
    if not (jnp.issubdtype(page_table.dtype, jnp.integer) and jnp.issubdtype(lengths.dtype, jnp.integer)):
        raise ValueError("page_table and lengths must be integer arrays")
    for name, sc in (("k_scales", k_scales), ("v_scales", v_scales)):
        if sc is not None and sc.shape != (p, s, hkv):
            raise ValueError(f"{name} must be [P, S, Hkv] = {(p, s, hkv)}, got {sc.shape}")
    if is_fp8(k_pages.dtype) and (k_scales is None or v_scales is None):
        raise ValueError("FP8 pages need k_scales and v_scales")


# --------------------------------------------------------------------------------------------- GPU (Triton)


def _gpu_kernel(len_ref, pt_ref, q_ref, k_ref, v_ref, *rest, has_scales, page_size, ppb, pps, sm_scale, cdt):
    if has_scales:
        ks_ref, vs_ref, o_ref, m_ref, l_ref = rest
    else:
        o_ref, m_ref, l_ref = rest
    split = pl.program_id(2)
    bt = ppb * page_size
    n_tok = jnp.clip(len_ref[0] - split * pps * page_size, 0, pps * page_size)  # this split's valid tokens
    q = q_ref[...].astype(cdt)  # [Gp, D]
    gp, d = q.shape

    def body(i, carry):
        m, den, acc = carry
        ids = pt_ref[pl.ds(i * ppb, ppb)]  # i32[ppb]
        k = k_ref[ids].reshape(bt, d)
        v = v_ref[ids].reshape(bt, d)
        row, col = token_mask_row(i * bt, bt, n_tok), token_mask_col(i * bt, bt, n_tok)
        logits = dot_nt(q, k.astype(cdt))  # f32[Gp, bt]
        p_scale = None
        if has_scales:
            logits = logits * ks_ref[ids].reshape(1, bt)
            p_scale = jnp.where(row, vs_ref[ids].reshape(1, bt), 0.0)
        logits = jnp.where(row, logits * sm_scale, NEG_INF)
        v = jnp.where(col, v.astype(cdt), jnp.zeros_like(v, cdt))
        return online_softmax_step(m, den, acc, logits, v, p_scale=p_scale, dot_dtype=cdt)

    init = (jnp.full((gp, 1), NEG_INF, jnp.float32), jnp.zeros((gp, 1), jnp.float32), jnp.zeros((gp, d), jnp.float32))
    m, den, acc = jax.lax.fori_loop(0, pl.cdiv(n_tok, bt), body, init)
    o_ref[...] = acc
    m_ref[...] = m.reshape(gp)
    l_ref[...] = den.reshape(gp)


def _gpu_forward(q, k_pages, v_pages, pt, lengths, k_scales, v_scales, sm_scale, interpret):
    b, hq, d = q.shape
    p, s, hkv, _ = k_pages.shape
    g = hq // hkv
    if not (is_pow2(s) and is_pow2(d) and d >= 16):
        raise UnsupportedShapeError(f"Triton paged attention needs power-of-two page_size and head_dim >= 16; "
                                    f"got page_size={s}, head_dim={d}")
    check_gpu_fp8("Triton paged attention", k_pages.dtype, interpret)
    blk = tuning.gqa_gpu(b, hkv, s, pt.shape[1])
    gp = max(blk.block_h, 1 << (g - 1).bit_length())
    pt = jnp.pad(pt, ((0, 0), (0, blk.num_splits * blk.pages_per_split - pt.shape[1])))
    qr = jnp.pad(q.reshape(b, hkv, g, d), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    has_scales = k_scales is not None
    kv_spec = pl.BlockSpec((p, s, None, d), lambda i, h, j: (0, 0, h, 0))
    sc_spec = pl.BlockSpec((p, s, None), lambda i, h, j: (0, 0, h))
    in_specs = [
        pl.BlockSpec((1,), lambda i, h, j: (i,)),
        pl.BlockSpec((None, blk.pages_per_split), lambda i, h, j: (i, j)),
        pl.BlockSpec((None, None, gp, d), lambda i, h, j: (i, h, 0, 0)),
        kv_spec, kv_spec, *([sc_spec, sc_spec] if has_scales else []),
    ]
    ns = blk.num_splits
    kernel = functools.partial(_gpu_kernel, has_scales=has_scales, page_size=s, ppb=blk.pages_per_block,
                               pps=blk.pages_per_split, sm_scale=sm_scale,
                               cdt=compute_dtype(q.dtype, k_pages.dtype))
    o, m, den = pl.pallas_call(
        kernel,
        grid=(b, hkv, ns),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, None, gp, d), lambda i, h, j: (i, j, h, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, h, j: (i, j, h, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, h, j: (i, j, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, ns, hkv, gp, d), jnp.float32),
            jax.ShapeDtypeStruct((b, ns, hkv, gp), jnp.float32),
            jax.ShapeDtypeStruct((b, ns, hkv, gp), jnp.float32),
        ],
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="paged_decode_attention_gpu",
    )(lengths, pt, qr, k_pages, v_pages, *([k_scales, v_scales] if has_scales else []))
    out = combine_splits(o, m, den, axis=1)  # [B, Hkv, Gp, D]
    return out[:, :, :g].reshape(b, hq, d).astype(q.dtype)


# --------------------------------------------------------------------------------------------- TPU (Mosaic)


def _tpu_kernel(len_ref, pt_ref, q_ref, *refs, has_scales, page_size, ppb, num_kv_heads, sm_scale, cdt):
    k_refs, v_refs = refs[:ppb], refs[ppb:2 * ppb]
    refs = refs[2 * ppb:]
    if has_scales:
        ks_refs, vs_refs = refs[:ppb], refs[ppb:2 * ppb]
        refs = refs[2 * ppb:]
    o_ref, m_sc, l_sc, acc_sc = refs
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = len_ref[b]

    @pl.when(i == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(i * ppb * page_size < length)
    def _step():
        q = q_ref[...].astype(cdt)  # [G, D]
        m, den, acc = m_sc[...], l_sc[...], acc_sc[...]
        head = jax.lax.broadcasted_iota(jnp.int32, (page_size, num_kv_heads), 1) == h
        for j in range(ppb):
            start = (i * ppb + j) * page_size
            col = token_mask_col(start, page_size, length)
            k = k_refs[j][...].astype(jnp.float32)  # [S, D]
            v = v_refs[j][...].astype(jnp.float32)
            if has_scales:  # this head's column of the [S, Hkv] scale block, dequantized in VMEM
                k = k * jnp.sum(jnp.where(head, ks_refs[j][...], 0.0), axis=1, keepdims=True)
                v = v * jnp.sum(jnp.where(head, vs_refs[j][...], 0.0), axis=1, keepdims=True)
            logits = jnp.where(token_mask_row(start, page_size, length), dot_nt(q, k.astype(cdt)) * sm_scale, NEG_INF)
            m, den, acc = online_softmax_step(m, den, acc, logits, jnp.where(col, v, 0.0), dot_dtype=cdt)
        m_sc[...], l_sc[...], acc_sc[...] = m, den, acc

    @pl.when(i == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = finalize(acc_sc[...], l_sc[...]).astype(o_ref.dtype)


def _tpu_forward(q, k_pages, v_pages, pt, lengths, k_scales, v_scales, sm_scale, interpret):
    b, hq, d = q.shape
    p, s, hkv, _ = k_pages.shape
    g = hq // hkv
    if hkv > 1 and d % 128:
        raise UnsupportedShapeError(f"Mosaic TPU paged attention needs head_dim % 128 == 0 with several KV heads; "
                                    f"got head_dim={d}, num_kv_heads={hkv}")
    blk = tuning.gqa_tpu(s, pt.shape[1])
    ppb, maxp = blk.pages_per_block, blk.pages_per_split
    pt = jnp.pad(pt, ((0, 0), (0, maxp - pt.shape[1]))).reshape(-1)  # SMEM: 1-D avoids 2-D padding
    has_scales = k_scales is not None

    def page(bi, i, len_ref, pt_ref, j):
        last = jnp.maximum(pl.cdiv(len_ref[bi], s) - 1, 0)  # past the length: stay on the last page (no DMA)
        return pt_ref[bi * maxp + jnp.minimum(i * ppb + j, last)]

    kv_specs = [pl.BlockSpec((None, s, d), lambda bi, h, i, lr, pr, j=j: (page(bi, i, lr, pr, j), 0, h))
                for j in range(ppb)]
    sc_specs = [pl.BlockSpec((None, s, hkv), lambda bi, h, i, lr, pr, j=j: (page(bi, i, lr, pr, j), 0, 0))
                for j in range(ppb)]
    q_spec = pl.BlockSpec((None, None, g, d), lambda bi, h, i, lr, pr: (bi, h, 0, 0))
    kf, vf = k_pages.reshape(p, s, hkv * d), v_pages.reshape(p, s, hkv * d)
    args = [q.reshape(b, hkv, g, d), *[kf] * ppb, *[vf] * ppb]
    in_specs = [q_spec, *kv_specs, *kv_specs]
    if has_scales:
        args += [*[k_scales] * ppb, *[v_scales] * ppb]
        in_specs += [*sc_specs, *sc_specs]
    kernel = functools.partial(_tpu_kernel, has_scales=has_scales, page_size=s, ppb=ppb, num_kv_heads=hkv,
                               sm_scale=sm_scale, cdt=compute_dtype(q.dtype, k_pages.dtype))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, hkv, maxp // ppb),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((g, 1), jnp.float32), pltpu.VMEM((g, 1), jnp.float32),
                            pltpu.VMEM((g, d), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((b, hkv, g, d), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=tuning.TPU_VMEM_LIMIT_BYTES),
        interpret=interpret,
        name="paged_decode_attention_tpu",
    )(lengths, pt, *args)
    return out.reshape(b, hq, d)


# --------------------------------------------------------------------------------------------- public entry


def paged_decode_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [P, S, Hkv, D]
    v_pages: jax.Array,  # [P, S, Hkv, D]
    page_table: jax.Array,  # i32[B, max_pages]
    lengths: jax.Array,  # i32[B]
    *,
    k_scales: jax.Array | None = None,  # f32[P, S, Hkv]
    v_scales: jax.Array | None = None,  # f32[P, S, Hkv]
    sm_scale: float | None = None,
    impl: str = "auto",
    interpret: bool | None = None,
    target: str | None = None,
    provenance: Provenance | None = None,  # the caller's sink (common)
) -> jax.Array:  # [B, Hq, D] in q's dtype
    """Decode attention over paged K/V; see the module docstring for layouts and the two kernels."""
    _check(q, k_pages, v_pages, page_table, lengths, k_scales, v_scales)
    sm_scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)

    def run_reference():
        return paged_decode_attention_reference(q, k_pages, v_pages, page_table, lengths, k_scales=k_scales,
                                                v_scales=v_scales, sm_scale=sm_scale)

    def build(tgt, interp):
        if (k_scales is None) != (v_scales is None):
            raise UnsupportedShapeError("the kernels take both K and V scales or neither")
        p, s = k_pages.shape[:2]
        pt = jnp.clip(page_table.astype(jnp.int32), 0, p - 1)
        lens = jnp.clip(lengths.astype(jnp.int32), 0, page_table.shape[1] * s)
        fwd = _tpu_forward if tgt == "tpu" else _gpu_forward
        return fwd(q, k_pages, v_pages, pt, lens, k_scales, v_scales, sm_scale, interp)

    return dispatch_kernel("paged_decode_attention", impl, target, interpret, build, run_reference,
                           provenance=provenance)
