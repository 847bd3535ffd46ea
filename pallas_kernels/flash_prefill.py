"""Causal prefill attention with memory linear in the sequence length (flash attention, forward only).

Every query row sees the keys at indices ``s <= q_positions[b, t]`` and ``s < lengths[b]`` (exactly the mask
of dense causal attention over right-padded rows; a row that sees no key returns zeros). GQA maps query head
``h`` to KV head ``h // (H // KV)``; MLA's prefill (expanded) form is the case KV == H with ``dk != dv``
(192 / 128 on Kimi K2)::

    q [B, T, H, dk]    k [B, S, KV, dk]    v [B, S, KV, dv]    q_positions i32[B, T]    lengths i32[B] | None
    -> out [B, T, H, dv] (q's dtype)

Nothing of size ``T x S`` is ever materialized: keys are visited in blocks with an online softmax (running
max, denominator and unnormalized output per query row), and a key block that no query of a query block can
see (it starts past the block's largest position, or past every row's length) is skipped, not computed.

* :func:`flash_prefill_reference`: plain JAX (``lax.map`` over query blocks, ``lax.scan`` over key blocks with a
  ``lax.cond`` that skips fully masked blocks). Differentiable (training runs through it) and the CPU path; the
  kernels' gradients are the reference's VJP (a ``custom_vjp``: the kernels are forward only).
* GPU: **Pallas Triton**, one program per (row, query head, query block); it loops over exactly the key blocks
  it needs (a dynamic trip count computed in XLA), so skipped blocks cost nothing. Head dims are zero-padded to
  powers of two (Triton tiles); padding changes no dot product.
* TPU: **Mosaic TPU**, grid (row, query head, query block, key block) with the per-query-block key-block
  count scalar-prefetched into SMEM; the K/V index maps clamp to the last needed block (no new DMA) and
  ``pl.when`` skips the compute, the running statistics live in VMEM scratch.

Block sizes come from :mod:`pallas_kernels.tuning` (``prefill_blocks``). The body is chosen per lowering platform
(``common.dispatch_kernel``: ``jax.export`` for ``tpu`` from a CPU process builds the Mosaic body) and recorded in
the kernel provenance as ``flash_prefill``.
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
    cdiv,
    compute_dtype,
    dispatch_kernel,
    dot_nt,
    finalize,
    next_pow2,
    online_softmax_step,
)


def _lengths(lengths, b: int, s: int) -> jax.Array:
    """Valid keys per row, clipped to S (None: all S)."""
    return jnp.full((b,), s, jnp.int32) if lengths is None else jnp.minimum(lengths.astype(jnp.int32), s)


def _pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def flash_prefill_reference(
    q: jax.Array,  # [B, T, H, dk]
    k: jax.Array,  # [B, S, KV, dk]
    v: jax.Array,  # [B, S, KV, dv]
    q_positions: jax.Array,  # i32[B, T]
    lengths: jax.Array | None,  # i32[B] valid keys per row (None: S)
    *,
    sm_scale: float,
    block_q: int | None = None,
    block_k: int | None = None,
) -> jax.Array:  # [B, T, H, dv]
    """Blockwise online-softmax attention in plain JAX; temporaries O(block_q x block_k x H), not O(T x S x H)."""
    b, t, h, dk = q.shape
    s, kvh, dv = k.shape[1], k.shape[2], v.shape[-1]
    g = h // kvh
    blk = tuning.prefill_blocks("reference", t, s)
    bq, bk = block_q or blk.block_q, block_k or blk.block_k
    nq, nk = cdiv(t, bq), cdiv(s, bk)
    lens = _lengths(lengths, b, s)
    limit = jnp.max(lens)  # no row has a valid key at or past this index
    # pad: padded queries have position -1 (they see nothing); padded keys sit at index >= S >= length (masked)
    pos = _pad_axis(q_positions.astype(jnp.int32), 1, nq * bq, -1).reshape(b, nq, bq).transpose(1, 0, 2)
    qb = _pad_axis(q, 1, nq * bq).reshape(b, nq, bq, kvh, g, dk).transpose(1, 0, 3, 4, 2, 5)  # [nq,B,KV,G,bq,dk]
    kb = _pad_axis(k, 1, nk * bk).reshape(b, nk, bk, kvh, dk).transpose(1, 0, 3, 2, 4)  # [nk, B, KV, bk, dk]
    vb = _pad_axis(v, 1, nk * bk).reshape(b, nk, bk, kvh, dv).transpose(1, 0, 3, 2, 4)  # [nk, B, KV, bk, dv]

    def q_block(args):
        qi, pi = args  # [B, KV, G, bq, dk], i32[B, bq]
        end = jnp.minimum(jnp.max(pi) + 1, limit)  # keys [0, end) are the only ones this block can see

        def k_step(carry, xs):
            j, kj, vj = xs

            def compute(carry):
                m, den, acc = carry  # f32[B, KV, G, bq, 1] x2, f32[B, KV, G, bq, dv]
                logits = jnp.einsum("bgrqd,bgkd->bgrqk", qi, kj, preferred_element_type=jnp.float32) * sm_scale
                key = j * bk + jnp.arange(bk)
                mask = (key[None, None, :] <= pi[:, :, None]) & (key[None, None, :] < lens[:, None, None])
                logits = jnp.where(mask[:, None, None], logits, NEG_INF)
                m_new = jnp.maximum(m, jnp.max(logits, axis=-1, keepdims=True))
                m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # nothing seen yet: avoid (-inf) - (-inf)
                alpha = jnp.exp(m - m_safe)
                p = jnp.exp(logits - m_safe)
                pv = jnp.einsum("bgrqk,bgkd->bgrqd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
                return m_new, alpha * den + jnp.sum(p, axis=-1, keepdims=True), alpha * acc + pv

            return jax.lax.cond(j * bk < end, compute, lambda c: c, carry), None

        init = (jnp.full((b, kvh, g, bq, 1), NEG_INF, jnp.float32), jnp.zeros((b, kvh, g, bq, 1), jnp.float32),
                jnp.zeros((b, kvh, g, bq, dv), jnp.float32))
        (_, den, acc), _ = jax.lax.scan(k_step, init, (jnp.arange(nk), kb, vb))
        return finalize(acc, den).astype(q.dtype)

    out = jax.lax.map(q_block, (qb, pos))  # [nq, B, KV, G, bq, dv]
    return out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, h, dv)[:, :t]


def _kv_blocks(q_positions, lens, bq: int, bk: int, nq: int) -> jax.Array:
    """i32[B, nq]: key blocks each query block must visit (0 for a block that sees no key)."""
    b = q_positions.shape[0]
    pmax = jnp.max(q_positions.reshape(b, nq, bq), axis=-1)  # padded queries carry -1
    end = jnp.clip(jnp.minimum(pmax + 1, lens[:, None]), 0, None)
    return ((end + bk - 1) // bk).astype(jnp.int32)


# --------------------------------------------------------------------------------------------- GPU (Triton)


def _gpu_kernel(nb_ref, len_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, *, bk, sm_scale, cdt):
    q = q_ref[...].astype(cdt)  # [bq, dkp]
    pos = pos_ref[...]  # i32[bq]
    length = len_ref[0]
    bq, dvp = q.shape[0], o_ref.shape[-1]

    def body(j, carry):
        m, den, acc = carry
        kj = k_ref[pl.ds(j * bk, bk), :].astype(cdt)  # [bk, dkp]
        vj = v_ref[pl.ds(j * bk, bk), :].astype(cdt)  # [bk, dvp]
        key = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        mask = (key <= pos[:, None]) & (key < length)
        logits = jnp.where(mask, dot_nt(q, kj) * sm_scale, NEG_INF)
        return online_softmax_step(m, den, acc, logits, vj, dot_dtype=cdt)

    init = (jnp.full((bq, 1), NEG_INF, jnp.float32), jnp.zeros((bq, 1), jnp.float32), jnp.zeros((bq, dvp), jnp.float32))
    _, den, acc = jax.lax.fori_loop(0, nb_ref[0], body, init)
    o_ref[...] = finalize(acc, den).astype(o_ref.dtype)


def _blocked(target: str, q, k, v, pos, lens, dk_pad: int, dv_pad: int):
    """Whole blocks: T and S padded to block multiples (head dims to dk_pad / dv_pad), head-major layout, and the
    key blocks each query block visits. -> (blocks, q [B, H, Tp, dk_pad], k [B, KV, Sp, dk_pad],
    v [B, KV, Sp, dv_pad], positions i32[B, Tp] (padding: -1), key blocks i32[B, nq])."""
    blk = tuning.prefill_blocks(target, q.shape[1], k.shape[1])
    nq, nk = cdiv(q.shape[1], blk.block_q), cdiv(k.shape[1], blk.block_k)
    qt = _pad_axis(_pad_axis(q, 3, dk_pad), 1, nq * blk.block_q).transpose(0, 2, 1, 3)
    kt = _pad_axis(_pad_axis(k, 3, dk_pad), 1, nk * blk.block_k).transpose(0, 2, 1, 3)
    vt = _pad_axis(_pad_axis(v, 3, dv_pad), 1, nk * blk.block_k).transpose(0, 2, 1, 3)
    posp = _pad_axis(pos, 1, nq * blk.block_q, -1)
    return blk, qt, kt, vt, posp, _kv_blocks(posp, lens, blk.block_q, blk.block_k, nq)


def _gpu_forward(q, k, v, pos, lens, *, sm_scale, interpret):
    b, t, h, dk = q.shape
    g, dv = h // k.shape[2], v.shape[-1]
    dkp, dvp = max(16, next_pow2(dk)), max(16, next_pow2(dv))  # Triton tiles: powers of two
    blk, qt, kt, vt, posp, nb = _blocked("gpu", q, k, v, pos, lens, dkp, dvp)
    bq, bk = blk.block_q, blk.block_k
    nq, sp = qt.shape[2] // bq, kt.shape[2]
    kernel = functools.partial(_gpu_kernel, bk=bk, sm_scale=sm_scale, cdt=compute_dtype(q.dtype, k.dtype))
    out = pl.pallas_call(
        kernel,
        grid=(b, h, nq),
        in_specs=[
            pl.BlockSpec((None, 1), lambda bi, hi, i: (bi, i)),
            pl.BlockSpec((1,), lambda bi, hi, i: (bi,)),
            pl.BlockSpec((None, bq), lambda bi, hi, i: (bi, i)),
            pl.BlockSpec((None, None, bq, dkp), lambda bi, hi, i: (bi, hi, i, 0)),
            pl.BlockSpec((None, None, sp, dkp), lambda bi, hi, i: (bi, hi // g, 0, 0)),
            pl.BlockSpec((None, None, sp, dvp), lambda bi, hi, i: (bi, hi // g, 0, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, bq, dvp), lambda bi, hi, i: (bi, hi, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, h, nq * bq, dvp), q.dtype),
        compiler_params=pltr.CompilerParams(num_warps=blk.num_warps, num_stages=2),
        interpret=interpret,
        name="flash_prefill_gpu",
    )(nb, lens, posp, qt, kt, vt)
    return out.transpose(0, 2, 1, 3)[:, :t, :, :dv]


# --------------------------------------------------------------------------------------------- TPU (Mosaic)


def _tpu_kernel(nb_ref, len_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, m_sc, l_sc, acc_sc, *, nq, bk, sm_scale, cdt):
    bi, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG_INF, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(j < nb_ref[bi * nq + i])
    def _step():
        q = q_ref[...].astype(cdt)  # [bq, dk]
        pos = pos_ref[...]  # i32[bq, 1]
        key = j * bk + jax.lax.broadcasted_iota(jnp.int32, (q.shape[0], bk), 1)
        mask = (key <= pos) & (key < len_ref[bi])
        logits = jnp.where(mask, dot_nt(q, k_ref[...].astype(cdt)) * sm_scale, NEG_INF)
        m, den, acc = online_softmax_step(m_sc[...], l_sc[...], acc_sc[...], logits, v_ref[...], dot_dtype=cdt)
        m_sc[...], l_sc[...], acc_sc[...] = m, den, acc

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...] = finalize(acc_sc[...], l_sc[...]).astype(o_ref.dtype)


def _tpu_forward(q, k, v, pos, lens, *, sm_scale, interpret):
    b, t, h, dk = q.shape
    g, dv = h // k.shape[2], v.shape[-1]
    blk, qt, kt, vt, posp, nb = _blocked("tpu", q, k, v, pos, lens, dk, dv)
    bq, bk = blk.block_q, blk.block_k
    nq, nk = qt.shape[2] // bq, kt.shape[2] // bk
    nb = nb.reshape(-1)  # SMEM: 1-D avoids 2-D padding

    def kv_map(bi, hi, i, j, nb_ref, len_ref):
        last = jnp.maximum(nb_ref[bi * nq + i] - 1, 0)  # past the needed blocks: stay on the last one (no DMA)
        return bi, jax.lax.div(hi, g), jnp.minimum(j, last), 0  # lax.div: no sign op (Mosaic)

    kernel = functools.partial(_tpu_kernel, nq=nq, bk=bk, sm_scale=sm_scale, cdt=compute_dtype(q.dtype, k.dtype))
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, h, nq, nk),
            in_specs=[
                pl.BlockSpec((None, bq, 1), lambda bi, hi, i, j, nr, lr: (bi, i, 0)),
                pl.BlockSpec((None, None, bq, dk), lambda bi, hi, i, j, nr, lr: (bi, hi, i, 0)),
                pl.BlockSpec((None, None, bk, dk), kv_map),
                pl.BlockSpec((None, None, bk, dv), kv_map),
            ],
            out_specs=pl.BlockSpec((None, None, bq, dv), lambda bi, hi, i, j, nr, lr: (bi, hi, i, 0)),
            scratch_shapes=[pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32),
                            pltpu.VMEM((bq, dv), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((b, h, nq * bq, dv), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
                                             vmem_limit_bytes=tuning.TPU_VMEM_LIMIT_BYTES),
        interpret=interpret,
        name="flash_prefill_tpu",
    )(nb, lens, posp[..., None], qt, kt, vt)
    return out.transpose(0, 2, 1, 3)[:, :t]


# --------------------------------------------------------------------------------------------- public entry


def flash_prefill(
    q: jax.Array,  # [B, T, H, dk]
    k: jax.Array,  # [B, S, KV, dk]
    v: jax.Array,  # [B, S, KV, dv]
    q_positions: jax.Array,  # i32[B, T]
    lengths: jax.Array | None = None,  # i32[B] (None: all S keys valid)
    *,
    sm_scale: float,
    impl: str = "auto",
    interpret: bool | None = None,
    target: str | None = None,
    provenance: Provenance | None = None,  # the caller's sink (common)
) -> jax.Array:  # [B, T, H, dv]
    """Causal prefill attention (see the module docstring); ``impl`` / ``interpret`` / ``target`` as in common."""
    b, t, h, dk = q.shape
    if k.ndim != 4 or k.shape[:2] != v.shape[:2] or k.shape[0] != b or k.shape[3] != dk or v.shape[2] != k.shape[2]:
        raise ValueError(f"shapes q {q.shape}, k {k.shape}, v {v.shape} do not form attention")
    if h % k.shape[2]:
        raise ValueError(f"{h} query heads are not a multiple of {k.shape[2]} KV heads")
    if q_positions.shape != (b, t):
        raise ValueError(f"q_positions {q_positions.shape} != {(b, t)}")

    reference = functools.partial(flash_prefill_reference, sm_scale=sm_scale)

    def build(tgt, interp):
        fwd = _tpu_forward if tgt == "tpu" else _gpu_forward
        kernel = functools.partial(fwd, sm_scale=sm_scale, interpret=interp)
        pos = q_positions.astype(jnp.int32)
        return _kernel_with_reference_grad(kernel, reference, q, k, v, pos, _lengths(lengths, b, k.shape[1]))

    return dispatch_kernel("flash_prefill", impl, target, interpret, build,
                           lambda: reference(q, k, v, q_positions, lengths),
                           provenance=provenance)


def _kernel_with_reference_grad(kernel, reference, q, k, v, pos, lens):
    """The kernel forward; gradients (training) through the reference's VJP, recomputed blockwise."""
    @jax.custom_vjp
    def f(q, k, v, pos, lens):
        return kernel(q, k, v, pos, lens)

    def bwd(res, g):
        _, vjp = jax.vjp(lambda q, k, v: reference(q, k, v, res[3], res[4]), *res[:3])
        return (*vjp(g), None, None)

    f.defvjp(lambda *a: (f(*a), a), bwd)
    return f(q, k, v, pos, lens)
