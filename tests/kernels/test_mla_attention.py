"""MLA (weight-absorbed) paged decode attention: the reference against a dense numpy computation, and both
Pallas kernel bodies (Triton GPU, Mosaic TPU; interpret mode) against the reference for BF16, F32 and FP8
latent pages, page sizes 16 and 64, ragged lengths with 0, 1, page boundaries and capacity, poisoned pools."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import tuning
from pallas_kernels.common import UnsupportedShapeError
from pallas_kernels.mla_attention import mla_decode_attention
from tests.kernels.kernel_checks import TOL, assert_close, build_pool, gather_dense, softmax

R, ROPE = 128, 32  # kv_lora_rank (TPU needs a multiple of 128), rope_dim
F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn


def make_case(seed, dtype, qdtype, page_size, heads, lengths, max_pages):
    rng = np.random.default_rng(seed)
    pool = build_pool(rng, lengths, page_size, max_pages, (R + ROPE,), dtype)
    ql = jnp.asarray(rng.standard_normal((len(lengths), heads, R)), qdtype)
    qr = jnp.asarray(rng.standard_normal((len(lengths), heads, ROPE)), qdtype)
    return ql, qr, pool


def call(ql, qr, pool, sm_scale=0.08, **kw):
    fn = jax.jit(functools.partial(mla_decode_attention, sm_scale=sm_scale, **kw))
    return fn(ql, qr, pool.pages[0], pool.page_table, pool.lengths, scales=pool.scales[0])


def dense_mla(ql, qr, pool, sm_scale) -> np.ndarray:
    qln = np.asarray(ql.astype(jnp.float32), np.float64)
    qrn = np.asarray(qr.astype(jnp.float32), np.float64)
    out = np.zeros_like(qln)
    for b in range(qln.shape[0]):
        x = gather_dense(pool, b)  # [L, R + ROPE]
        for h in range(qln.shape[1] if len(x) else 0):
            p = softmax((x[:, :R] @ qln[b, h] + x[:, R:] @ qrn[b, h]) * sm_scale)
            out[b, h] = p @ x[:, :R]
    return out


@pytest.mark.parametrize("dtype", [F32, FP8])
def test_reference_matches_dense(dtype):
    ql, qr, pool = make_case(0, dtype, F32, 16, 4, [1, 16, 0, 40, 64], 4)
    ref = call(ql, qr, pool, sm_scale=0.11, impl="reference")
    assert_close(ref, dense_mla(ql, qr, pool, 0.11), 1e-5)
    assert (np.asarray(ref[2]) == 0).all()


# (page dtype, query dtype, page_size, heads, lengths, max_pages)
CASES = [
    (F32, F32, 16, 5, [1, 16, 0, 33, 112, 15], 7),  # GPU: heads padded 5 -> 16, split-K; TPU: one block of 7 pages
    (BF16, BF16, 64, 16, [64, 1, 0, 130], 3),
    (FP8, BF16, 16, 8, [1, 32, 17, 0, 48], 3),
    (FP8, F32, 64, 3, [200, 1, 0, 64, 256], 4),
]


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype,qdtype,page_size,heads,lengths,max_pages", CASES)
def test_kernel_matches_reference(target, dtype, qdtype, page_size, heads, lengths, max_pages):
    ql, qr, pool = make_case(sum(lengths) + heads, dtype, qdtype, page_size, heads, lengths, max_pages)
    ref = call(ql, qr, pool, impl="reference")
    out = call(ql, qr, pool, impl="pallas", interpret=True, target=target)
    assert out.shape == ql.shape and out.dtype == ql.dtype
    assert_close(out, ref, TOL[jnp.dtype(qdtype).name])
    for b, n in enumerate(lengths):
        if n == 0:
            assert (np.asarray(out[b]) == 0).all()


def test_split_k_is_exercised():
    assert tuning.mla_gpu(6, 5, 16, 7).num_splits > 1


def test_typed_errors():
    ql, qr, pool = make_case(1, FP8, BF16, 16, 4, [3, 17], 2)
    x, pt, lens = pool.pages[0], pool.page_table, pool.lengths
    with pytest.raises(ValueError, match="FP8 latent pages need scales"):
        mla_decode_attention(ql, qr, x, pt, lens, sm_scale=0.1)
    with pytest.raises(ValueError, match="do not fit"):
        mla_decode_attention(ql, qr[..., :16], x, pt, lens, scales=pool.scales[0], sm_scale=0.1)
    with pytest.raises(ValueError, match="scales must be"):
        mla_decode_attention(ql, qr, x, pt, lens, scales=pool.scales[0][:, :8], sm_scale=0.1)
    # kv_lora_rank 96 + rope 64: not a power of two (Triton) and not a multiple of 128 (TPU)
    ql96, qr64, pool96 = ql[..., :96], jnp.concatenate([qr, qr], axis=-1), pool.pages[0][..., :160]
    for target in ("gpu", "tpu"):
        with pytest.raises(UnsupportedShapeError):
            mla_decode_attention(ql96, qr64, pool96, pt, lens, scales=pool.scales[0], sm_scale=0.1, impl="pallas",
                                 interpret=True, target=target)
