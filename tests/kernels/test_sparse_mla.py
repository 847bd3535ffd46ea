"""Sparse MLA decode attention over a gathered token list (GLM-5 DSA decode): the reference against a dense numpy
computation over the selected tokens and against the paged MLA reference when every token is selected, and both
Pallas kernel bodies (Triton GPU, Mosaic TPU; interpret mode) against the reference for F32, BF16 and FP8 latent
pages, on poisoned pools with ragged lengths (0, 1, page boundaries), selections shorter than K (invalid entries
in random places) and K from under one block to several blocks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import UnsupportedShapeError
from pallas_kernels.mla_attention import mla_decode_attention
from pallas_kernels.sparse_mla import sparse_mla_decode_attention
from tests.kernels.kernel_checks import TOL, assert_close, build_pool, gather_dense, softmax

R, ROPE = 128, 32
F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn


def make_case(seed, dtype, qdtype, page_size, heads, lengths, max_pages, k):
    """Pool, queries and per row k indices: distinct visible positions, then invalid ones (-1 or >= length),
    shuffled so that invalid entries sit anywhere in the list."""
    rng = np.random.default_rng(seed)
    pool = build_pool(rng, lengths, page_size, max_pages, (R + ROPE,), dtype)
    ql = jnp.asarray(rng.standard_normal((len(lengths), heads, R)), qdtype)
    qr = jnp.asarray(rng.standard_normal((len(lengths), heads, ROPE)), qdtype)
    idx = np.empty((len(lengths), k), np.int64)
    for b, n in enumerate(lengths):
        chosen = rng.permutation(n)[:k]
        pad = rng.choice([-1, n, n + 5, max_pages * page_size + 3], size=k - len(chosen))
        idx[b] = rng.permutation(np.concatenate([chosen, pad]))
    return ql, qr, pool, jnp.asarray(idx, jnp.int32)


def call(ql, qr, pool, idx, sm_scale=0.08, **kw):
    fn = jax.jit(functools.partial(sparse_mla_decode_attention, sm_scale=sm_scale, **kw))
    return fn(ql, qr, pool.pages[0], pool.page_table, idx, pool.lengths, scales=pool.scales[0])


def dense_selected(ql, qr, pool, idx, sm_scale) -> np.ndarray:
    qln, qrn = (np.asarray(a.astype(jnp.float32), np.float64) for a in (ql, qr))
    out = np.zeros_like(qln)
    for b in range(qln.shape[0]):
        x = gather_dense(pool, b)
        sel = [int(t) for t in np.asarray(idx[b]) if 0 <= t < len(x)]
        if not sel:
            continue
        x = x[sel]
        for h in range(qln.shape[1]):
            p = softmax((x[:, :R] @ qln[b, h] + x[:, R:] @ qrn[b, h]) * sm_scale)
            out[b, h] = p @ x[:, :R]
    return out


@pytest.mark.parametrize("dtype", [F32, FP8])
def test_reference_matches_dense(dtype):
    ql, qr, pool, idx = make_case(0, dtype, F32, 16, 4, [1, 16, 0, 40, 64], 4, 24)
    ref = call(ql, qr, pool, idx, sm_scale=0.11, impl="reference")
    assert_close(ref, dense_selected(ql, qr, pool, idx, 0.11), 1e-5)
    assert (np.asarray(ref[2]) == 0).all()


def test_selecting_every_token_is_dense_mla():
    lengths = [1, 16, 0, 37]
    ql, qr, pool, _ = make_case(1, F32, F32, 16, 4, lengths, 3, 48)
    idx = jnp.broadcast_to(jnp.arange(48, dtype=jnp.int32)[::-1], (4, 48))  # every position, reversed
    dense = mla_decode_attention(ql, qr, pool.pages[0], pool.page_table, pool.lengths, sm_scale=0.08,
                                 impl="reference")
    assert_close(call(ql, qr, pool, idx, impl="reference"), dense, 1e-6)


# (page dtype, query dtype, page_size, heads, lengths, max_pages, k)
CASES = [
    (F32, F32, 16, 5, [1, 16, 0, 33, 112, 15], 7, 20),  # k under one 32-token block
    (BF16, BF16, 64, 16, [64, 1, 0, 130], 3, 100),  # one 128 block, padded
    (FP8, BF16, 16, 8, [1, 32, 17, 0, 300], 20, 200),  # two 128 blocks
    (FP8, F32, 64, 3, [200, 1, 0, 64, 256], 4, 256),  # exactly two blocks
]


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype,qdtype,page_size,heads,lengths,max_pages,k", CASES)
def test_kernel_matches_reference(target, dtype, qdtype, page_size, heads, lengths, max_pages, k):
    ql, qr, pool, idx = make_case(sum(lengths) + heads, dtype, qdtype, page_size, heads, lengths, max_pages, k)
    ref = call(ql, qr, pool, idx, impl="reference")
    out = call(ql, qr, pool, idx, impl="pallas", interpret=True, target=target)
    assert out.shape == ql.shape and out.dtype == ql.dtype
    assert_close(out, ref, TOL[jnp.dtype(qdtype).name])
    for b, n in enumerate(lengths):
        if n == 0:
            assert (np.asarray(out[b]) == 0).all()


def test_typed_errors():
    ql, qr, pool, idx = make_case(2, FP8, BF16, 16, 4, [3, 17], 2, 8)
    x, pt, lens = pool.pages[0], pool.page_table, pool.lengths
    with pytest.raises(ValueError, match="FP8 latent pages need scales"):
        sparse_mla_decode_attention(ql, qr, x, pt, idx, lens, sm_scale=0.1)
    with pytest.raises(ValueError, match="do not match batch"):
        sparse_mla_decode_attention(ql, qr, x, pt, idx[:1], lens, scales=pool.scales[0], sm_scale=0.1)
    ql96, qr64, pool96 = ql[..., :96], jnp.concatenate([qr, qr], axis=-1), x[..., :160]
    for target in ("gpu", "tpu"):
        with pytest.raises(UnsupportedShapeError):
            sparse_mla_decode_attention(ql96, qr64, pool96, pt, idx, lens, scales=pool.scales[0], sm_scale=0.1,
                                        impl="pallas", interpret=True, target=target)
