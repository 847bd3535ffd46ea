"""Flash prefill attention: the blockwise reference against the dense attention the model used before (float32,
1e-5 relative), and both Pallas kernel bodies (Triton GPU, Mosaic TPU; interpret mode) against the reference, on
fresh random inputs: GQA group sizes 1, 4 and 8, MLA's prefill form (dk 192 != dv 128), ragged lengths with 0 and
1, lengths and T at and one past block boundaries, offset positions; skipped blocks are really skipped."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import flash_prefill as fp
from phaseserve.model.layers import attention
from tests.kernels.kernel_checks import TOL, assert_close

F32, BF16 = jnp.float32, jnp.bfloat16


def dense_attention(q, k, v, q_positions, lengths, scale):
    """The model's attention before flash prefill: full f32 logits [B, KV, G, T, S] and a masked softmax."""
    b, t, h, dk = q.shape
    kv = k.shape[2]
    s = jnp.arange(k.shape[1])
    mask = s[None, None, :] <= q_positions[:, :, None]
    if lengths is not None:
        mask = mask & (s[None, None, :] < lengths[:, None, None])
    qg = q.reshape(b, t, kv, h // kv, dk)
    logits = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32) * scale
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    probs = jnp.where(mask[:, None, None], jax.nn.softmax(logits, axis=-1), 0.0)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, v.shape[-1]).astype(q.dtype)


def make(seed, b, t, h, kv, dk, dv, dtype=F32, lengths=None, offset=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, h, dk)), dtype)
    k = jnp.asarray(rng.standard_normal((b, t, kv, dk)), dtype)
    v = jnp.asarray(rng.standard_normal((b, t, kv, dv)), dtype)
    pos = jnp.broadcast_to(jnp.arange(offset, offset + t, dtype=jnp.int32), (b, t))
    lens = None if lengths is None else jnp.asarray(lengths, jnp.int32)
    return q, k, v, pos, lens


def assert_matches_dense(out, q, k, v, pos, lens, scale):
    ref = dense_attention(q, k, v, pos, lens, scale)
    if lens is None:
        assert_close(out, ref, TOL["float32"])
        return
    for row, n in enumerate(np.asarray(lens)):  # rows with length 0 (all-zero output) are checked exactly
        if n == 0:
            np.testing.assert_array_equal(np.asarray(out[row]), 0.0)
        else:
            assert_close(out[row], ref[row], TOL["float32"])


@pytest.mark.parametrize("t,lengths,block,kv,g", [
    (64, None, 16, 2, 4),  # T a multiple of the block
    (65, [65, 1, 0, 16], 16, 1, 8),  # one past a block; length 1, 0, exactly one block
    (37, [17, 32, 33, 37], 16, 4, 1),  # ragged, lengths one past / at block boundaries
])
def test_reference_equals_dense_float32(t, lengths, block, kv, g):
    b = 4 if lengths else 2
    q, k, v, pos, lens = make(t, b, t, kv * g, kv, 32, 32, lengths=lengths)
    out = jax.jit(functools.partial(fp.flash_prefill_reference, sm_scale=0.17, block_q=block, block_k=block))(
        q, k, v, pos, lens)
    assert_matches_dense(out, q, k, v, pos, lens, 0.17)


def test_mla_prefill_form_and_offset_positions():
    """KV == H with dk 192 != dv 128 (Kimi K2's expanded MLA), queries at positions 40.. over 90 keys."""
    rng = np.random.default_rng(7)
    b, t, s, h = 2, 50, 90, 4
    q = jnp.asarray(rng.standard_normal((b, t, h, 192)), F32)
    k = jnp.asarray(rng.standard_normal((b, s, h, 192)), F32)
    v = jnp.asarray(rng.standard_normal((b, s, h, 128)), F32)
    pos = jnp.broadcast_to(jnp.arange(40, 40 + t, dtype=jnp.int32), (b, t))
    lens = jnp.asarray([90, 63], jnp.int32)
    out = fp.flash_prefill_reference(q, k, v, pos, lens, sm_scale=0.07, block_q=16, block_k=32)
    assert out.shape == (b, t, h, 128)
    assert_matches_dense(out, q, k, v, pos, lens, 0.07)


def test_model_attention_is_flash_prefill():
    q, k, v, pos, lens = make(3, 3, 700, 8, 2, 64, 64, lengths=[700, 513, 512])  # 2 blocks of 512 on the CPU
    out = jax.jit(attention, static_argnums=5)(q, k, v, pos, lens, 0.125)
    assert_matches_dense(out, q, k, v, pos, lens, 0.125)


def test_masked_blocks_are_skipped_not_computed():
    """NaN values in key blocks no query can see (past every length) never reach the output: computing such a
    block would give 0 * NaN in the value product. The same NaN inside a visible block does reach it."""
    q, k, v, pos, _ = make(11, 2, 64, 2, 2, 16, 16)
    lens = jnp.asarray([20, 31], jnp.int32)
    run = functools.partial(fp.flash_prefill_reference, sm_scale=0.25, block_q=16, block_k=16)
    assert np.isfinite(np.asarray(run(q, k, v.at[:, 32:].set(jnp.nan), pos, lens))).all()
    assert np.isnan(np.asarray(run(q, k, v.at[:, 30:].set(jnp.nan), pos, lens))).any()
    jaxpr = str(jax.make_jaxpr(functools.partial(fp.flash_prefill_reference, sm_scale=0.25, block_q=16,
                                                 block_k=16))(q, k, v, pos, lens))
    assert "cond[" in jaxpr and "scan[" in jaxpr


def test_reference_memory_is_linear_in_t():
    """XLA temporaries of the compiled reference: 4x the tokens -> about 4x the bytes (dense would be 16x)."""
    def temp_bytes(t):
        args = [jax.ShapeDtypeStruct(s, F32) for s in ((1, t, 8, 64), (1, t, 2, 64), (1, t, 2, 64))]
        args += [jax.ShapeDtypeStruct((1, t), jnp.int32), jax.ShapeDtypeStruct((1,), jnp.int32)]
        f = jax.jit(functools.partial(fp.flash_prefill_reference, sm_scale=0.1))
        return f.lower(*args).compile().memory_analysis().temp_size_in_bytes

    small, big = temp_bytes(2048), temp_bytes(8192)
    assert big / small < 5.0, (small, big)
    assert big < 8 * 8192 * 8192 * 4 / 16  # far under one layer's dense f32 logits


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("case", [
    dict(t=70, h=8, kv=2, dk=64, dv=64, lengths=[70, 1, 0, 64]),
    dict(t=129, h=4, kv=4, dk=192, dv=128, lengths=[129, 128]),  # MLA prefill form
    dict(t=33, h=8, kv=1, dk=128, dv=128, lengths=None),
])
def test_pallas_matches_reference_float32(target, case):
    lengths = case["lengths"]
    b = len(lengths) if lengths else 1
    q, k, v, pos, lens = make(case["t"] + case["h"], b, case["t"], case["h"], case["kv"], case["dk"], case["dv"],
                              lengths=lengths)
    out = jax.jit(functools.partial(fp.flash_prefill, sm_scale=0.11, impl="pallas", interpret=True, target=target))(
        q, k, v, pos, lens)
    assert out.shape == (b, case["t"], case["h"], case["dv"])
    assert_matches_dense(out, q, k, v, pos, lens, 0.11)


@pytest.mark.parametrize("target", ["gpu", "tpu"])
def test_pallas_bf16_and_offset_positions(target):
    rng = np.random.default_rng(5)
    b, t, s, h, kv, d = 2, 40, 100, 4, 2, 128
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), BF16)
    k = jnp.asarray(rng.standard_normal((b, s, kv, d)), BF16)
    v = jnp.asarray(rng.standard_normal((b, s, kv, d)), BF16)
    pos = jnp.broadcast_to(jnp.arange(60, 60 + t, dtype=jnp.int32), (b, t))
    lens = jnp.asarray([100, 77], jnp.int32)
    out = fp.flash_prefill(q, k, v, pos, lens, sm_scale=0.09, impl="pallas", interpret=True, target=target)
    ref = fp.flash_prefill_reference(q.astype(F32), k.astype(F32), v.astype(F32), pos, lens, sm_scale=0.09)
    assert out.dtype == BF16
    assert_close(out.astype(F32), ref, TOL["bfloat16"])


def test_pallas_gradients_are_the_reference_gradients():
    """Training through the kernel path: the custom VJP gives the reference's gradients (the kernel is forward only)."""
    q, k, v, pos, lens = make(21, 2, 24, 4, 2, 16, 16, lengths=[24, 9])

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v, pos, lens, sm_scale=0.3)))

    kern = functools.partial(fp.flash_prefill, impl="pallas", interpret=True, target="gpu")
    got = jax.grad(functools.partial(loss, kern), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(functools.partial(loss, fp.flash_prefill_reference), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, TOL["float32"])
    assert float(jnp.abs(want[1]).max()) > 0


def test_bad_shapes_are_value_errors():
    q, k, v, pos, lens = make(1, 1, 8, 6, 4, 16, 16)
    with pytest.raises(ValueError, match="multiple"):
        fp.flash_prefill(q, k, v, pos, lens, sm_scale=0.1)
    q, k, v, pos, lens = make(1, 1, 8, 4, 2, 16, 16)
    with pytest.raises(ValueError, match="q_positions"):
        fp.flash_prefill(q, k, v, pos[:, :4], lens, sm_scale=0.1)
