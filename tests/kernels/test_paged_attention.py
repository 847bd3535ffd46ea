"""GQA paged decode attention: the reference against a dense numpy computation, and both Pallas kernel bodies
(Triton GPU and Mosaic TPU, in interpret mode on the CPU) against the reference: BF16, F32 and FP8 pages,
page sizes 16 and 64, GQA groups 1/4/8, ragged lengths with 0, 1, exact page boundaries and full capacity,
split-K, poisoned pools; plus typed errors and the impl/target dispatch."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import tuning
from pallas_kernels.common import UnsupportedShapeError
from pallas_kernels.paged_attention import paged_decode_attention
from tests.kernels.kernel_checks import TOL, assert_close, build_pool, gather_dense, softmax

D = 128
HKV = 2


def dense_gqa(q, pool, sm_scale) -> np.ndarray:
    qn = np.asarray(q.astype(jnp.float32), np.float64)
    b, hq, d = qn.shape
    g = hq // HKV
    out = np.zeros_like(qn)
    for i in range(b):
        k, v = gather_dense(pool, i, 0), gather_dense(pool, i, 1)  # [L, Hkv, D]
        for h in range(hq if len(k) else 0):
            out[i, h] = softmax(k[:, h // g] @ qn[i, h] * sm_scale) @ v[:, h // g]
    return out


def make_case(seed, dtype, page_size, group, lengths, max_pages):
    rng = np.random.default_rng(seed)
    pool = build_pool(rng, lengths, page_size, max_pages, (HKV, D), dtype, count=2)
    qdt = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
    return jnp.asarray(rng.standard_normal((len(lengths), HKV * group, D)), qdt), pool


def call(q, pool, **kw):
    """Jitted: one compile per case instead of one per eager op (interpret mode is compile-bound)."""
    (k, v), (ks, vs) = pool.pages, pool.scales
    fn = jax.jit(functools.partial(paged_decode_attention, **kw))
    return fn(q, k, v, pool.page_table, pool.lengths, k_scales=ks, v_scales=vs)


def test_interpret_mode_poisons_unwritten_outputs():
    def half_writer(x_ref, o_ref):
        o_ref[:4] = x_ref[:4]

    out = pl.pallas_call(half_writer, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), interpret=True)(
        jnp.ones((8, 128), jnp.float32))
    assert np.isnan(np.asarray(out[4:])).all() and (np.asarray(out[:4]) == 1).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float8_e4m3fn])
def test_reference_matches_dense(dtype):
    q, pool = make_case(0, dtype, 16, 4, [1, 16, 0, 37, 64], 4)
    q = q.astype(jnp.float32)
    ref = call(q, pool, impl="reference", sm_scale=0.3)
    dense = dense_gqa(q, pool, 0.3)
    assert_close(ref, dense, 1e-5)
    assert (np.asarray(ref[2]) == 0).all()


# (page dtype, query dtype, page_size, GQA group, lengths, max_pages): each mixes 0, 1, page boundaries, capacity
F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn
CASES = [
    (F32, F32, 16, 1, [1, 16, 0, 33, 112, 15], 7),  # GPU: 2 splits over a padded page range
    (BF16, BF16, 16, 4, [16, 1, 48, 0, 5], 3),
    (FP8, BF16, 16, 8, [1, 32, 17, 0], 2),
    (FP8, F32, 64, 1, [64, 1, 0, 200, 384, 63], 6),  # TPU: 2 page blocks; FP8 dequantization exact in f32
    (BF16, BF16, 64, 8, [65, 128, 1], 2),
    (FP8, BF16, 64, 4, [0, 1, 127], 2),
]


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("dtype,qdtype,page_size,group,lengths,max_pages", CASES)
def test_kernel_matches_reference(target, dtype, qdtype, page_size, group, lengths, max_pages):
    q, pool = make_case(sum(lengths) + group, dtype, page_size, group, lengths, max_pages)
    q = q.astype(qdtype)
    ref = call(q, pool, impl="reference")
    out = call(q, pool, impl="pallas", interpret=True, target=target)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, TOL[jnp.dtype(qdtype).name])
    for b, n in enumerate(lengths):
        if n == 0:
            assert (np.asarray(out[b]) == 0).all()


@pytest.mark.parametrize("impl,target", [("reference", None), ("pallas", "gpu"), ("pallas", "tpu")])
def test_nan_inside_a_length_propagates_to_that_row_only(impl, target):
    """A corrupted page (NaN inside a row's length) must show up as NaN in that row -- the integrity layer's
    finite guard relies on it -- while NaN past a length (poisoned pools everywhere else) never leaks."""
    q, pool = make_case(11, BF16, 16, 4, [16, 1, 48, 0, 5], 3)
    table = np.asarray(pool.page_table)
    k = pool.pages[0].at[table[2, 1], 3, 1].set(jnp.nan)  # row 2, token 19, KV head 1
    pool.pages = [k, pool.pages[1]]
    out = np.asarray(call(q, pool, impl=impl, interpret=True, target=target), np.float32)
    g = q.shape[1] // HKV
    assert np.isnan(out[2, g:]).all() and np.isfinite(out[2, :g]).all()
    assert np.isfinite(np.delete(out, 2, axis=0)).all()


def test_split_k_is_exercised():
    blk = tuning.gqa_gpu(6, HKV, 16, 7)
    assert blk.num_splits > 1 and blk.num_splits * blk.pages_per_split >= 7


def test_auto_is_the_reference_on_cpu():
    q, pool = make_case(3, jnp.bfloat16, 16, 4, [5, 20], 2)
    np.testing.assert_array_equal(np.asarray(call(q, pool), np.float32),
                                  np.asarray(call(q, pool, impl="reference"), np.float32))


def test_typed_errors():
    q, pool = make_case(4, jnp.float8_e4m3fn, 16, 4, [5, 20], 2)
    with pytest.raises(ValueError, match="FP8 pages need"):
        paged_decode_attention(q, *pool.pages, pool.page_table, pool.lengths)
    with pytest.raises(ValueError, match="impl must be"):
        call(q, pool, impl="triton")
    with pytest.raises(ValueError, match="does not fit"):
        call(q[:, :3], pool)
    q64, p64 = make_case(5, jnp.bfloat16, 16, 2, [5, 20], 2)
    p64.pages = [x[..., :64] for x in p64.pages]
    args = (q64[..., :64], *p64.pages, p64.page_table, p64.lengths)
    with pytest.raises(UnsupportedShapeError, match="head_dim % 128"):
        paged_decode_attention(*args, impl="pallas", interpret=True, target="tpu")
