"""MLA decode attention in the weight-absorbed form over paged latent KV (Kimi K2 / DeepSeek-V3 / GLM-5 decode).

The cache holds one latent row per token: ``kv_lora_rank`` compressed KV values ``c`` followed by the
``rope_dim`` rotary key ``k_rope``, shared by every head. With the up-projections absorbed into the
query (``q_latent = q_nope @ W_uk``) and into the output (``out @ W_uv`` later, outside this kernel)::

    scores[b, h, t] = (q_latent[b, h] . c[t] + q_rope[b, h] . k_rope[t]) * sm_scale
    out[b, h]       = softmax_t(scores[b, h]) @ c          -> [B, H, kv_lora_rank]

Layout: ``latent_pages [num_pages, page_size, kv_lora_rank + rope_dim]`` (bf16, f32 or float8_e4m3fn),
``scales [num_pages, page_size]`` f32 (one per token; value = page * scale), ``page_table i32[B, max_pages]``,
``lengths i32[B]``. Length-0 rows give zeros; page ids are clipped into range and rows past a length are
masked before they reach the softmax or the value product (see :mod:`pallas_kernels.paged_attention`).

Kernels (same backend choices and reasons as :mod:`pallas_kernels.paged_attention`):

* GPU, Pallas Triton: one program per (row, block of up to 64 heads, split); each step gathers a block of
  pages once and uses it for both the score dot (``c`` and ``k_rope``) and the value dot (``c``), with the
  FP8 token scale folded into the logits and into the probabilities. With H <= 64 (Kimi K2: 64 heads) every
  head is in one block, so each latent page is read once per row, as FlashMLA does; split-K over the pages
  supplies the parallelism. Needs power-of-two page_size, kv_lora_rank and rope_dim (512 and 64 in every
  Kimi/DeepSeek/GLM config). FP8 latents are converted to the compute dtype in registers, which needs the
  FP8 conversions of sm_89+ (Ada, Hopper and newer); on older GPUs ``impl="auto"`` uses the reference for FP8
  pages and ``"pallas"`` raises :class:`~pallas_kernels.common.UnsupportedShapeError`.
* TPU, Mosaic: grid (row, page block) with scalar-prefetched lengths and page table; all heads of a row
  share each page DMA, and each page of a row is fetched once (blocks past the length repeat a fetched page; a row
  shorter than ``pages_per_block`` pages re-reads its last page per unused operand).
  Needs kv_lora_rank % 128 == 0 (the rope columns start on a lane-tile boundary).
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
from pallas_kernels.paged_attention import PAGE_DTYPES


def mla_decode_attention_reference(
    q_latent: jax.Array,  # [B, H, r]
    q_rope: jax.Array,  # [B, H, rope]
    latent_pages: jax.Array,  # [P, S, r + rope]
    page_table: jax.Array,  # i32[B, max_pages]
    lengths: jax.Array,  # i32[B]
    *,
    scales: jax.Array | None = None,  # f32[P, S]
    sm_scale: float,
) -> jax.Array:  # [B, H, r] in q_latent's dtype
    """Plain-jnp reference: gather the listed latent pages, dequantize, mask, softmax in f32.

    Laid out for XLA:CPU, where it is the decode path: pages are gathered as whole rows of a 2-D view, the
    scores are ``x [T, r + rope] @ q^T [r + rope, H]`` per row (the transpose falls on the small query, one dot
    over the whole latent row instead of one for ``c`` and one for ``k_rope``), and the values
    ``p^T [H, T] @ x [T, r + rope]`` with the rope columns dropped from the result (``x`` is never sliced): the
    same arithmetic as the textbook form, 0.39 vs 0.47 ms a layer at 32 rows x 192 tokens in a 6-layer chain."""
    b, h, r = q_latent.shape
    p, s, f = latent_pages.shape
    t = page_table.shape[1] * s
    pt = jnp.clip(page_table, 0, p - 1).reshape(-1)  # i32[B * max_pages]
    valid = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
    rows = jnp.take(latent_pages.reshape(p, s * f), pt, axis=0).reshape(b, t, f)
    x = dequantize_pages(rows, None if scales is None else jnp.take(scales, pt, axis=0).reshape(b, t))
    x = jnp.where(valid[:, :, None], x, 0.0)  # f32[B, T, r + rope]
    q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(jnp.float32).transpose(0, 2, 1)  # [B, r + rope, H]
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("btf,bfh->bth", x, q, precision=hi) * sm_scale  # [B, T, H]
    logits = jnp.where(valid[:, :, None], logits, NEG_INF)
    m = jnp.max(logits, axis=1, keepdims=True)
    probs = jnp.exp(logits - jnp.where(m == NEG_INF, 0.0, m)).transpose(0, 2, 1)  # [B, H, T]
    out = jnp.einsum("bht,btf->bhf", probs, x, precision=hi)[..., :r]
    return finalize(out, jnp.sum(probs, axis=-1, keepdims=True)).astype(q_latent.dtype)


def _check(q_latent, q_rope, latent_pages, page_table, lengths, scales):
    if q_latent.ndim != 3 or q_rope.ndim != 3 or latent_pages.ndim != 3:
        raise ValueError(f"q_latent [B, H, r], q_rope [B, H, rope], latent_pages [P, S, r + rope] expected; got "
                         f"{q_latent.shape}, {q_rope.shape}, {latent_pages.shape}")
    b, h, r = q_latent.shape
    p, s, f = latent_pages.shape
    if q_rope.shape[:2] != (b, h) or f != r + q_rope.shape[2]:
        raise ValueError(f"q_rope {q_rope.shape} / latent_pages {latent_pages.shape} do not fit "
                         f"q_latent {q_latent.shape}")
    if jnp.dtype(latent_pages.dtype) not in PAGE_DTYPES:
        raise ValueError(f"page dtype must be one of {[str(t) for t in PAGE_DTYPES]}, got {latent_pages.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"page_table {page_table.shape} / lengths {lengths.shape} do not match batch {b}")
    if scales is not None and scales.shape != (p, s):
        raise ValueError(f"scales must be [P, S] = {(p, s)}, got {scales.shape}")
    if is_fp8(latent_pages.dtype) and scales is None:
        raise ValueError("FP8 latent pages need scales")


# --------------------------------------------------------------------------------------------- GPU (Triton)


def _gpu_kernel(len_ref, pt_ref, ql_ref, qr_ref, x_ref, *rest, has_scales, page_size, ppb, pps, sm_scale, cdt):
    if has_scales:
        s_ref, o_ref, m_ref, l_ref = rest
    else:
        o_ref, m_ref, l_ref = rest
    split = pl.program_id(2)
    bt = ppb * page_size
    n_tok = jnp.clip(len_ref[0] - split * pps * page_size, 0, pps * page_size)
    ql, qr = ql_ref[...].astype(cdt), qr_ref[...].astype(cdt)  # [bh, r], [bh, rope]
    bh, r = ql.shape
    rope = qr.shape[1]

    def body(i, carry):
        m, den, acc = carry
        ids = pt_ref[pl.ds(i * ppb, ppb)]  # i32[ppb]
        c = x_ref[ids, :, pl.ds(0, r)].reshape(bt, r)
        k_rope = x_ref[ids, :, pl.ds(r, rope)].reshape(bt, rope)
        row, col = token_mask_row(i * bt, bt, n_tok), token_mask_col(i * bt, bt, n_tok)
        logits = dot_nt(ql, c.astype(cdt)) + dot_nt(qr, k_rope.astype(cdt))  # f32[bh, bt]
        p_scale = None
        if has_scales:
            tok_scale = s_ref[ids].reshape(1, bt)
            logits = logits * tok_scale
            p_scale = jnp.where(row, tok_scale, 0.0)
        logits = jnp.where(row, logits * sm_scale, NEG_INF)
        c = jnp.where(col, c.astype(cdt), jnp.zeros_like(c, cdt))
        return online_softmax_step(m, den, acc, logits, c, p_scale=p_scale, dot_dtype=cdt)

    init = (jnp.full((bh, 1), NEG_INF, jnp.float32), jnp.zeros((bh, 1), jnp.float32), jnp.zeros((bh, r), jnp.float32))
    m, den, acc = jax.lax.fori_loop(0, pl.cdiv(n_tok, bt), body, init)
    o_ref[...] = acc
    m_ref[...] = m.reshape(bh)
    l_ref[...] = den.reshape(bh)


def _gpu_forward(q_latent, q_rope, pages, pt, lengths, scales, sm_scale, interpret):
    b, h, r = q_latent.shape
    rope = q_rope.shape[2]
    p, s, f = pages.shape
    if not (is_pow2(s) and is_pow2(r) and is_pow2(rope) and min(r, rope) >= 16):
        raise UnsupportedShapeError(f"Triton MLA needs power-of-two page_size, kv_lora_rank, rope_dim (>= 16); "
                                    f"got {s}, {r}, {rope}")
    check_gpu_fp8("Triton MLA", pages.dtype, interpret)
    cdt = compute_dtype(q_latent.dtype, pages.dtype)
    blk = tuning.mla_gpu(b, h, s, pt.shape[1], jnp.dtype(cdt).itemsize)
    bh = blk.block_h
    hp = max(bh, 1 << (h - 1).bit_length())
    ns = blk.num_splits
    pt = jnp.pad(pt, ((0, 0), (0, ns * blk.pages_per_split - pt.shape[1])))
    ql = jnp.pad(q_latent, ((0, 0), (0, hp - h), (0, 0)))
    qr = jnp.pad(q_rope, ((0, 0), (0, hp - h), (0, 0)))
    has_scales = scales is not None
    in_specs = [
        pl.BlockSpec((1,), lambda i, hb, j: (i,)),
        pl.BlockSpec((None, blk.pages_per_split), lambda i, hb, j: (i, j)),
        pl.BlockSpec((None, bh, r), lambda i, hb, j: (i, hb, 0)),
        pl.BlockSpec((None, bh, rope), lambda i, hb, j: (i, hb, 0)),
        pl.BlockSpec((p, s, f), lambda i, hb, j: (0, 0, 0)),
        *([pl.BlockSpec((p, s), lambda i, hb, j: (0, 0))] if has_scales else []),
    ]
    kernel = functools.partial(_gpu_kernel, has_scales=has_scales, page_size=s, ppb=blk.pages_per_block,
                               pps=blk.pages_per_split, sm_scale=sm_scale, cdt=cdt)
    o, m, den = pl.pallas_call(
        kernel,
        grid=(b, hp // bh, ns),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, bh, r), lambda i, hb, j: (i, j, hb, 0)),
            pl.BlockSpec((None, None, bh), lambda i, hb, j: (i, j, hb)),
            pl.BlockSpec((None, None, bh), lambda i, hb, j: (i, j, hb)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, ns, hp, r), jnp.float32),
            jax.ShapeDtypeStruct((b, ns, hp), jnp.float32),
            jax.ShapeDtypeStruct((b, ns, hp), jnp.float32),
        ],
        compiler_params=pltr.CompilerParams(num_warps=8 if bh >= 64 else 4, num_stages=2),
        interpret=interpret,
        name="mla_decode_attention_gpu",
    )(lengths, pt, ql, qr, pages, *([scales] if has_scales else []))
    return combine_splits(o, m, den, axis=1)[:, :h].astype(q_latent.dtype)


# --------------------------------------------------------------------------------------------- TPU (Mosaic)


def _tpu_kernel(len_ref, pt_ref, ql_ref, qr_ref, *refs, has_scales, page_size, ppb, r, sm_scale, cdt):
    x_refs = refs[:ppb]
    s_refs = refs[ppb:2 * ppb] if has_scales else None
    o_ref, m_sc, l_sc, acc_sc = refs[-4:]
    b, i = pl.program_id(0), pl.program_id(1)
    length = len_ref[b]

    @pl.when(i == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(i * ppb * page_size < length)
    def _step():
        ql, qr = ql_ref[...].astype(cdt), qr_ref[...].astype(cdt)  # [H, r], [H, rope]
        m, den, acc = m_sc[...], l_sc[...], acc_sc[...]
        for j in range(ppb):
            start = (i * ppb + j) * page_size
            row, col = token_mask_row(start, page_size, length), token_mask_col(start, page_size, length)
            c = x_refs[j][:, :r].astype(cdt)  # [S, r]
            logits = dot_nt(ql, c) + dot_nt(qr, x_refs[j][:, r:].astype(cdt))  # f32[H, S]
            p_scale = None
            if has_scales:
                tok_scale = s_refs[j][...]  # f32[1, S]
                logits = logits * tok_scale
                p_scale = jnp.where(row, tok_scale, 0.0)
            logits = jnp.where(row, logits * sm_scale, NEG_INF)
            c = jnp.where(col, c, jnp.zeros_like(c))
            m, den, acc = online_softmax_step(m, den, acc, logits, c, p_scale=p_scale, dot_dtype=cdt)
        m_sc[...], l_sc[...], acc_sc[...] = m, den, acc

    @pl.when(i == pl.num_programs(1) - 1)
    def _finish():
        o_ref[...] = finalize(acc_sc[...], l_sc[...]).astype(o_ref.dtype)


def _tpu_forward(q_latent, q_rope, pages, pt, lengths, scales, sm_scale, interpret):
    b, h, r = q_latent.shape
    rope = q_rope.shape[2]
    p, s, f = pages.shape
    if r % 128:
        raise UnsupportedShapeError(f"Mosaic TPU MLA needs kv_lora_rank % 128 == 0, got {r}")
    blk = tuning.mla_tpu(s, pt.shape[1])
    ppb, maxp = blk.pages_per_block, blk.pages_per_split
    pt = jnp.pad(pt, ((0, 0), (0, maxp - pt.shape[1]))).reshape(-1)
    has_scales = scales is not None

    def page(bi, i, len_ref, pt_ref, j):
        # past the row's last page, operand j keeps its last in-range page (the same block: no new DMA); an
        # operand with no in-range page (rows shorter than ppb pages) reads the last page (masked anyway)
        last = jnp.maximum(pl.cdiv(len_ref[bi], s) - 1, 0)
        idx = i * ppb + j
        kept = jnp.where(j <= last, j + jax.lax.div(last - j, ppb) * ppb, last)
        return pt_ref[bi * maxp + jnp.where(idx <= last, idx, kept)]

    in_specs = [pl.BlockSpec((None, h, r), lambda bi, i, lr, pr: (bi, 0, 0)),
                pl.BlockSpec((None, h, rope), lambda bi, i, lr, pr: (bi, 0, 0)),
                *[pl.BlockSpec((None, s, f), lambda bi, i, lr, pr, j=j: (page(bi, i, lr, pr, j), 0, 0))
                  for j in range(ppb)]]
    args = [q_latent, q_rope, *[pages] * ppb]
    if has_scales:  # [P, 1, S]: a token's scale is a lane of a full-width row
        in_specs += [pl.BlockSpec((None, 1, s), lambda bi, i, lr, pr, j=j: (page(bi, i, lr, pr, j), 0, 0))
                     for j in range(ppb)]
        args += [scales.reshape(p, 1, s)] * ppb
    kernel = functools.partial(_tpu_kernel, has_scales=has_scales, page_size=s, ppb=ppb, r=r, sm_scale=sm_scale,
                               cdt=compute_dtype(q_latent.dtype, pages.dtype))
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, maxp // ppb),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, h, r), lambda bi, i, lr, pr: (bi, 0, 0)),
            scratch_shapes=[pltpu.VMEM((h, 1), jnp.float32), pltpu.VMEM((h, 1), jnp.float32),
                            pltpu.VMEM((h, r), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((b, h, r), q_latent.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=tuning.TPU_VMEM_LIMIT_BYTES),
        interpret=interpret,
        name="mla_decode_attention_tpu",
    )(lengths, pt, *args)


# --------------------------------------------------------------------------------------------- public entry


def mla_decode_attention(
    q_latent: jax.Array,  # [B, H, r]
    q_rope: jax.Array,  # [B, H, rope]
    latent_pages: jax.Array,  # [P, S, r + rope]
    page_table: jax.Array,  # i32[B, max_pages]
    lengths: jax.Array,  # i32[B]
    *,
    scales: jax.Array | None = None,  # f32[P, S]
    sm_scale: float,
    impl: str = "auto",
    interpret: bool | None = None,
    target: str | None = None,
    provenance: Provenance | None = None,  # the caller's sink (common)
) -> jax.Array:  # [B, H, r] in q_latent's dtype
    """Weight-absorbed MLA decode attention over paged latents; see the module docstring."""
    _check(q_latent, q_rope, latent_pages, page_table, lengths, scales)
    sm_scale = float(sm_scale)

    def run_reference():
        return mla_decode_attention_reference(q_latent, q_rope, latent_pages, page_table, lengths, scales=scales,
                                              sm_scale=sm_scale)

    def build(tgt, interp):
        p, s, _ = latent_pages.shape
        pt = jnp.clip(page_table.astype(jnp.int32), 0, p - 1)
        lens = jnp.clip(lengths.astype(jnp.int32), 0, page_table.shape[1] * s)
        fwd = _tpu_forward if tgt == "tpu" else _gpu_forward
        return fwd(q_latent, q_rope, latent_pages, pt, lens, scales, sm_scale, interp)

    return dispatch_kernel("mla_decode_attention", impl, target, interpret, build, run_reference,
                           provenance=provenance)
