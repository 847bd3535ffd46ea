"""Sparse MLA decode attention over a gathered token list (GLM-5 DeepSeek Sparse Attention decode).

Each row attends, in the weight-absorbed MLA form (see :mod:`pallas_kernels.mla_attention`), only to the ``K``
tokens its DSA indexer selected -- ``indices i32[B, K]``, token positions in the row's paged sequence -- so the
per-step attention cost is ``O(K)``, whatever the context length::

    scores[b, h, k] = (q_latent[b, h] . c[t_bk] + q_rope[b, h] . k_rope[t_bk]) * sm_scale,  t_bk = indices[b, k]
    out[b, h]       = softmax_k(scores[b, h]) @ c[t_b]                  -> [B, H, kv_lora_rank]

An index is valid when ``0 <= t < lengths[b]``; invalid entries (a row with fewer than K tokens, padding rows with
length 0) are masked, and a row without a valid index gives zeros. Pages: ``latent_pages [P, S, r + rope]``
(bf16, f32 or float8_e4m3fn, or their raw uint16 / uint8 bits), ``scales f32[P, S]`` (FP8),
``page_table i32[B, max_pages]``.

:func:`gather_selected` reads the K selected rows from the pages (an XLA gather on the storage bits: K rows, never
the pool) and the kernels attend over them in blocks of ``block_k`` tokens with the online softmax of
:mod:`pallas_kernels.common`, the FP8 token scale folded into the logits and the probabilities:

* GPU, Pallas Triton: one program per (row, block of heads), a loop over the K blocks. Needs power-of-two
  kv_lora_rank and rope_dim (512 and 64 in GLM-5).
* TPU, Mosaic: grid (row, K block) with the running max / sum / output in VMEM scratch; all heads of a row share
  each block. Needs kv_lora_rank % 128 == 0.
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
    compute_dtype,
    dequantize_pages,
    dispatch_kernel,
    dot_nt,
    finalize,
    is_fp8,
    is_pow2,
    next_pow2,
    online_softmax_step,
)
from pallas_kernels.paged_attention import PAGE_DTYPES

MAX_BLOCK_K = 128  # tokens per kernel step


# pools held as raw bits (phaseserve's XLA:CPU storage, ``cache.paged.storage_dtype``) -> the values they hold
RAW_BITS = {jnp.dtype(jnp.uint8): jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint16): jnp.dtype(jnp.bfloat16)}


def _take_rows(flat: jax.Array, rows: jax.Array) -> jax.Array:
    """flat [M, F] -> flat[rows] [..., F] as values: a raw-bit pool is gathered, then the K rows reinterpreted; a
    sub-32-bit pool on the CPU is gathered on its bits (XLA:CPU would convert the whole pool)."""
    if flat.dtype in RAW_BITS:
        return jax.lax.bitcast_convert_type(flat[rows], RAW_BITS[flat.dtype])
    if flat.dtype.itemsize >= 4:
        return flat[rows]
    bits = jnp.dtype(f"uint{8 * flat.dtype.itemsize}")
    # chosen per lowering platform, not by jax.default_backend(): a CPU process compiling for TPU (deviceless,
    # lab.kernels.tpu_compile) got the CPU branch, a pool-sized bitcast copy per layer on the TPU
    return jax.lax.platform_dependent(
        cpu=lambda: jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(flat, bits)[rows], flat.dtype),
        default=lambda: flat[rows])


def gather_selected(latent_pages: jax.Array, scales: jax.Array | None, page_table: jax.Array, indices: jax.Array,
                    lengths: jax.Array) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """The selected tokens' rows: latent_pages [P, S, W], scales f32[P, S] | None, page_table i32[B, MP],
    indices i32[B, K], lengths i32[B] -> (rows [B, K, W] in the storage dtype, zeros where invalid; scales
    f32[B, K] | None; valid bool[B, K])."""
    p, s, w = latent_pages.shape
    mp = page_table.shape[1]
    indices = jnp.sort(indices, axis=-1)  # position order: page by page reads (the softmax ignores the order)
    valid = (indices >= 0) & (indices < lengths[:, None]) & (indices < mp * s)
    page = jnp.take_along_axis(jnp.clip(page_table, 0, p - 1), jnp.clip(indices // s, 0, mp - 1), axis=1)
    flat = jnp.where(valid, page * s + indices % s, 0)  # invalid: slot 0 of the null page
    rows = _take_rows(latent_pages.reshape(p * s, w), flat)
    rows = jnp.where(valid[..., None], rows, jnp.zeros((), rows.dtype))
    sc = None if scales is None else jnp.where(valid, scales.reshape(p * s)[flat], 1.0)
    return rows, sc, valid


def sparse_mla_reference(q_latent: jax.Array, q_rope: jax.Array, rows: jax.Array, scales: jax.Array | None,
                         valid: jax.Array, *, sm_scale: float) -> jax.Array:
    """Plain-jnp attention over gathered rows: q_latent [B, H, r], q_rope [B, H, rope], rows [B, K, r + rope],
    scales f32[B, K] | None, valid bool[B, K] -> [B, H, r] in q_latent's dtype (f32 softmax)."""
    r = q_latent.shape[-1]
    x = dequantize_pages(rows, scales)
    c, k_rope = x[..., :r], x[..., r:]
    hi = jax.lax.Precision.HIGHEST
    logits = (jnp.einsum("bhr,bkr->bhk", q_latent.astype(jnp.float32), c, precision=hi)
              + jnp.einsum("bhe,bke->bhk", q_rope.astype(jnp.float32), k_rope, precision=hi)) * sm_scale
    logits = jnp.where(valid[:, None, :], logits, NEG_INF)
    m = jnp.max(logits, axis=-1, keepdims=True)
    probs = jnp.exp(logits - jnp.where(m == NEG_INF, 0.0, m))
    out = finalize(jnp.einsum("bhk,bkr->bhr", probs, c, precision=hi), jnp.sum(probs, axis=-1, keepdims=True))
    return out.astype(q_latent.dtype)


def _check(q_latent, q_rope, latent_pages, page_table, indices, lengths, scales):
    if q_latent.ndim != 3 or q_rope.ndim != 3 or latent_pages.ndim != 3 or indices.ndim != 2:
        raise ValueError(f"q_latent [B, H, r], q_rope [B, H, rope], latent_pages [P, S, r + rope], indices [B, K] "
                         f"expected; got {q_latent.shape}, {q_rope.shape}, {latent_pages.shape}, {indices.shape}")
    b, h, r = q_latent.shape
    p, s, f = latent_pages.shape
    if q_rope.shape[:2] != (b, h) or f != r + q_rope.shape[2]:
        raise ValueError(f"q_rope {q_rope.shape} / latent_pages {latent_pages.shape} do not fit "
                         f"q_latent {q_latent.shape}")
    if jnp.dtype(latent_pages.dtype) not in PAGE_DTYPES and jnp.dtype(latent_pages.dtype) not in RAW_BITS:
        raise ValueError(f"page dtype must be one of {[str(t) for t in PAGE_DTYPES]}, got {latent_pages.dtype}")
    if page_table.shape[0] != b or indices.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"page_table {page_table.shape} / indices {indices.shape} / lengths {lengths.shape} do not "
                         f"match batch {b}")
    if scales is not None and scales.shape != (p, s):
        raise ValueError(f"scales must be [P, S] = {(p, s)}, got {scales.shape}")
    if (is_fp8(latent_pages.dtype) or jnp.dtype(latent_pages.dtype) == jnp.uint8) and scales is None:
        raise ValueError("FP8 latent pages need scales")


def _block(c, k_rope, valid, sc, ql, qr, *, sm_scale, cdt):
    """Logits f32[H, bk], values [bk, r] and the probability scale of one block of gathered tokens
    (c [bk, r], k_rope [bk, rope], valid bool[1, bk], sc f32[1, bk] | None)."""
    c = c.astype(cdt)
    logits = dot_nt(ql, c) + dot_nt(qr, k_rope.astype(cdt))
    p_scale = None
    if sc is not None:
        logits = logits * sc
        p_scale = jnp.where(valid, sc, 0.0)
    return jnp.where(valid, logits * sm_scale, NEG_INF), c, p_scale


# --------------------------------------------------------------------------------------------- GPU (Triton)


def _gpu_kernel(ql_ref, qr_ref, x_ref, v_ref, *rest, has_scales, bk, nk, r, rope, sm_scale, cdt):
    o_ref = rest[-1]
    s_ref = rest[0] if has_scales else None
    ql, qr = ql_ref[...].astype(cdt), qr_ref[...].astype(cdt)
    bh = ql.shape[0]

    def body(i, carry):
        sl = pl.ds(i * bk, bk)
        valid = v_ref[sl].reshape(1, bk) > 0
        sc = s_ref[sl].reshape(1, bk) if has_scales else None
        logits, c, p_scale = _block(x_ref[sl, pl.ds(0, r)], x_ref[sl, pl.ds(r, rope)], valid, sc, ql, qr,
                                    sm_scale=sm_scale, cdt=cdt)
        return online_softmax_step(*carry, logits, c, p_scale=p_scale, dot_dtype=cdt)

    init = (jnp.full((bh, 1), NEG_INF, jnp.float32), jnp.zeros((bh, 1), jnp.float32), jnp.zeros((bh, r), jnp.float32))
    m, den, acc = jax.lax.fori_loop(0, nk, body, init)
    o_ref[...] = finalize(acc, den).astype(o_ref.dtype)


def _gpu_forward(q_latent, q_rope, rows, sc, valid, bk, sm_scale, interpret):
    b, h, r = q_latent.shape
    rope = q_rope.shape[2]
    kp, f = rows.shape[1:]
    if not (is_pow2(r) and is_pow2(rope) and min(r, rope) >= 16):
        raise UnsupportedShapeError(f"Triton sparse MLA needs power-of-two kv_lora_rank and rope_dim (>= 16); "
                                    f"got {r}, {rope}")
    check_gpu_fp8("Triton sparse MLA", rows.dtype, interpret)
    bh = min(max(16, next_pow2(h)), 64)
    hp = -(-h // bh) * bh
    ql = jnp.pad(q_latent, ((0, 0), (0, hp - h), (0, 0)))
    qr = jnp.pad(q_rope, ((0, 0), (0, hp - h), (0, 0)))
    has_scales = sc is not None
    in_specs = [pl.BlockSpec((None, bh, r), lambda i, hb: (i, hb, 0)),
                pl.BlockSpec((None, bh, rope), lambda i, hb: (i, hb, 0)),
                pl.BlockSpec((None, kp, f), lambda i, hb: (i, 0, 0)),
                pl.BlockSpec((None, kp), lambda i, hb: (i, 0)),
                *([pl.BlockSpec((None, kp), lambda i, hb: (i, 0))] if has_scales else [])]
    kernel = functools.partial(_gpu_kernel, has_scales=has_scales, bk=bk, nk=kp // bk, r=r, rope=rope,
                               sm_scale=sm_scale,
                               cdt=compute_dtype(q_latent.dtype, rows.dtype))
    out = pl.pallas_call(
        kernel,
        grid=(b, hp // bh),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bh, r), lambda i, hb: (i, hb, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hp, r), q_latent.dtype),
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="sparse_mla_decode_gpu",
    )(ql, qr, rows, valid.astype(jnp.int32), *([sc] if has_scales else []))
    return out[:, :h]


# --------------------------------------------------------------------------------------------- TPU (Mosaic)


def _tpu_kernel(ql_ref, qr_ref, x_ref, v_ref, *rest, has_scales, r, sm_scale, cdt):
    s_ref = rest[0] if has_scales else None
    o_ref, m_sc, l_sc, acc_sc = rest[-4:]
    i = pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    ql, qr = ql_ref[...].astype(cdt), qr_ref[...].astype(cdt)
    valid = v_ref[...] > 0  # [1, bk]
    sc = s_ref[...] if has_scales else None
    x = x_ref[...]
    logits, c, p_scale = _block(x[:, :r], x[:, r:], valid, sc, ql, qr, sm_scale=sm_scale, cdt=cdt)
    m, den, acc = online_softmax_step(m_sc[...], l_sc[...], acc_sc[...], logits, c, p_scale=p_scale, dot_dtype=cdt)
    m_sc[...], l_sc[...], acc_sc[...] = m, den, acc

    @pl.when(i == pl.num_programs(1) - 1)
    def _finish():
        o_ref[...] = finalize(acc_sc[...], l_sc[...]).astype(o_ref.dtype)


def _tpu_forward(q_latent, q_rope, rows, sc, valid, bk, sm_scale, interpret):
    b, h, r = q_latent.shape
    rope = q_rope.shape[2]
    kp, f = rows.shape[1:]
    if r % 128:
        raise UnsupportedShapeError(f"Mosaic TPU sparse MLA needs kv_lora_rank % 128 == 0, got {r}")
    has_scales = sc is not None
    in_specs = [pl.BlockSpec((None, h, r), lambda bi, i: (bi, 0, 0)),
                pl.BlockSpec((None, h, rope), lambda bi, i: (bi, 0, 0)),
                pl.BlockSpec((None, bk, f), lambda bi, i: (bi, i, 0)),
                pl.BlockSpec((None, 1, bk), lambda bi, i: (bi, 0, i)),
                *([pl.BlockSpec((None, 1, bk), lambda bi, i: (bi, 0, i))] if has_scales else [])]
    args = [q_latent, q_rope, rows, valid.astype(jnp.int32).reshape(b, 1, kp)]
    args += [sc.reshape(b, 1, kp)] if has_scales else []
    kernel = functools.partial(_tpu_kernel, has_scales=has_scales, r=r, sm_scale=sm_scale,
                               cdt=compute_dtype(q_latent.dtype, rows.dtype))
    return pl.pallas_call(
        kernel,
        grid=(b, kp // bk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, h, r), lambda bi, i: (bi, 0, 0)),
        scratch_shapes=[pltpu.VMEM((h, 1), jnp.float32), pltpu.VMEM((h, 1), jnp.float32),
                        pltpu.VMEM((h, r), jnp.float32)],
        out_shape=jax.ShapeDtypeStruct((b, h, r), q_latent.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=tuning.TPU_VMEM_LIMIT_BYTES),
        interpret=interpret,
        name="sparse_mla_decode_tpu",
    )(*args)


# --------------------------------------------------------------------------------------------- public entry


def sparse_mla_decode_attention(
    q_latent: jax.Array,  # [B, H, r]
    q_rope: jax.Array,  # [B, H, rope]
    latent_pages: jax.Array,  # [P, S, r + rope]
    page_table: jax.Array,  # i32[B, max_pages]
    indices: jax.Array,  # i32[B, K] selected token positions
    lengths: jax.Array,  # i32[B]
    *,
    scales: jax.Array | None = None,  # f32[P, S]
    sm_scale: float,
    impl: str = "auto",
    interpret: bool | None = None,
    target: str | None = None,
    provenance: Provenance | None = None,  # the caller's sink (common)
) -> jax.Array:  # [B, H, r] in q_latent's dtype
    """Weight-absorbed MLA decode attention over the selected tokens of each row; see the module docstring."""
    _check(q_latent, q_rope, latent_pages, page_table, indices, lengths, scales)
    sm_scale = float(sm_scale)
    rows, sc, valid = gather_selected(latent_pages, scales, page_table.astype(jnp.int32), indices.astype(jnp.int32),
                                      lengths.astype(jnp.int32))

    def run_reference():
        return sparse_mla_reference(q_latent, q_rope, rows, sc, valid, sm_scale=sm_scale)

    def build(tgt, interp):
        k = rows.shape[1]
        bk = MAX_BLOCK_K if k > MAX_BLOCK_K else max(32, next_pow2(k))
        if tgt == "gpu" and rows.dtype.itemsize >= 4:  # f32 rows: 128 x 576 x 4 B overflow an H100's 227 KiB of
            bk = min(bk, 64)  # shared memory (a deviceless compile for H100 refused it; docs/tpu_compile.md)
        kp = -(-k // bk) * bk
        pad = ((0, 0), (0, kp - k))
        x = jnp.pad(rows, pad + ((0, 0),))
        s = None if sc is None else jnp.pad(sc, pad, constant_values=1.0)
        fwd = _tpu_forward if tgt == "tpu" else _gpu_forward
        return fwd(q_latent, q_rope, x, s, jnp.pad(valid, pad), bk, sm_scale, interp)

    return dispatch_kernel("sparse_mla_decode_attention", impl, target, interpret, build, run_reference,
                           provenance=provenance)
