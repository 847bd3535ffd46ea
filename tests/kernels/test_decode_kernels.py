"""The decode-shaped kernels of issue 15 at real shapes (few rows / pages so interpret mode stays fast):

* the FP8 grouped (MoE) kernel (block and per-channel scales, W8A16 and W8A8) against its reference, at GLM-5
  expert sizes (hidden 6144, moe 2048) and on ragged group sizes with empty experts and rows of no expert;
* INT4 W4A16 split-K (GPU body) at M <= 16 and the expert-aligned grouped tiling (no tile mixes experts);
* MLA decode with all 64 heads of Kimi K2 (latent 512 + rope 64) in one program;
* HBM bytes each reads per call, computed from its BlockSpecs and grid (:mod:`tests.kernels.hbm_reads`),
  equal to the ideal tensor sizes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe_tiles, tuning
from pallas_kernels.fp8_matmul import Fp8Weight, fp8_grouped_matmul, fp8_grouped_matmul_reference, quantize_fp8
from pallas_kernels.int4_matmul import Int4Weight, int4_grouped_matmul, int4_matmul, int4_matmul_reference, pack_int4
from pallas_kernels.mla_attention import mla_decode_attention, mla_decode_attention_reference
from tests.kernels.hbm_reads import read_bytes, record_calls
from tests.kernels.kernel_checks import TOL, assert_close, build_pool

GLM5_HIDDEN, GLM5_MOE = 6144, 2048
KIMI_HEADS, LATENT, ROPE = 64, 512, 64


def fp8_experts(rng, e, k, n, block) -> Fp8Weight:
    return quantize_fp8(jnp.asarray(rng.standard_normal((e, k, n)) * 0.05, jnp.float32), block)


def int4_experts(rng, e, k, n, group):
    nib = jnp.asarray(rng.integers(0, 16, size=(e, k, n)), jnp.uint8)
    return pack_int4(nib, jnp.asarray(rng.uniform(0.01, 0.1, size=(e, k // group, n)), jnp.float32), group)


def grouped(fn, **kw):
    return jax.jit(functools.partial(fn, impl="pallas", interpret=True, **kw))


# ------------------------------------------------------------------------------------------ FP8 grouped


SIZES = [[3, 0, 10, 5], [20, 0, 0, 0], [0, 0, 0, 1], [15, 15, 0, 0]]  # empty experts; last: sum > M (rows clip)


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("block,xdtype", [((128, 128), jnp.float32), (None, jnp.bfloat16)])
def test_fp8_grouped_matches_reference_on_ragged_groups(target, block, xdtype):
    rng = np.random.default_rng(11)
    w = fp8_experts(rng, 4, 256, 256, block)
    x = jnp.asarray(rng.standard_normal((20, 256)), xdtype)
    fn, ref = grouped(fp8_grouped_matmul, target=target), jax.jit(fp8_grouped_matmul_reference)
    for sizes in SIZES:
        gs = jnp.asarray(sizes, jnp.int32)
        out = fn(x, w, gs)
        assert out.shape == (20, 256) and out.dtype == x.dtype
        assert_close(out, ref(x, w, gs), TOL[jnp.dtype(xdtype).name])
        assert (np.asarray(out[min(sum(sizes), 20):]) == 0).all()


def test_fp8_grouped_at_glm5_expert_size(target="gpu"):  # the TPU body at this size: lowering + HBM-read tests
    rng = np.random.default_rng(12)
    w = fp8_experts(rng, 3, GLM5_HIDDEN, GLM5_MOE, (128, 128))  # gate/up projection of 3 experts
    x = jnp.asarray(rng.standard_normal((4, GLM5_HIDDEN)), jnp.bfloat16)
    gs = jnp.asarray([1, 0, 3], jnp.int32)
    assert_close(grouped(fp8_grouped_matmul, target=target)(x, w, gs), fp8_grouped_matmul_reference(x, w, gs),
                 TOL["bfloat16"])


def test_fp8_grouped_w8a8_gpu_body_matches_simulated_reference():
    rng = np.random.default_rng(13)
    w = fp8_experts(rng, 3, 256, 128, (128, 128))
    x = jnp.asarray(rng.standard_normal((9, 256)), jnp.bfloat16)
    gs = jnp.asarray([4, 0, 5], jnp.int32)
    out = grouped(fp8_grouped_matmul, target="gpu", act_quant=True)(x, w, gs)
    assert_close(out, fp8_grouped_matmul_reference(x, w, gs, act_quant=True), TOL["bfloat16"])


def test_model_dispatch_uses_the_grouped_kernel_path():
    from phaseserve.qarrays import grouped_dense

    rng = np.random.default_rng(14)
    w = fp8_experts(rng, 2, 256, 128, (128, 128))
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
    gs = jnp.asarray([2, 3], jnp.int32)
    np.testing.assert_array_equal(np.asarray(grouped_dense(x, w, gs)),
                                  np.asarray(fp8_grouped_matmul(x, w, gs, impl="reference")))


# ------------------------------------------------------------------------------------------ INT4 decode


def test_aligned_tiles_hold_one_expert_each():
    rng = np.random.default_rng(15)
    for sizes in ([3, 0, 17, 1, 0], [0, 0, 0, 0, 40], [9, 9, 9, 9, 9], [0, 0, 0, 0, 0]):
        m, bm = 40, 8
        te, tv, src, dest = (np.asarray(a) for a in moe_tiles.align_rows(jnp.asarray(sizes, jnp.int32), m, bm))
        expert_of_row = np.repeat(np.arange(5), sizes)[:m]
        rows = src.reshape(-1, bm)
        for t in range(len(te)):
            real = rows[t][rows[t] < m]
            assert tv[t] or len(real) == 0
            assert (expert_of_row[real] == te[t]).all()  # no row of another expert in the tile
        covered = min(sum(sizes), m)
        np.testing.assert_array_equal(src[dest[:covered]], np.arange(covered))  # every row lands where it came from
        assert (dest[covered:] == len(te) * bm).all()
        assert tv.sum() == sum(-(-min(s, m) // bm) for s in sizes) or sum(sizes) > m
        x = jnp.asarray(rng.standard_normal((m, 3)), jnp.float32)
        back = moe_tiles.scatter_back(moe_tiles.gather_tiles(x, jnp.asarray(src)), jnp.asarray(dest))
        np.testing.assert_array_equal(np.asarray(back[:covered]), np.asarray(x[:covered]))


@pytest.mark.parametrize("m", [1, 16])
def test_int4_split_k_gpu_body_at_decode_rows(m):
    rng = np.random.default_rng(16 + m)
    w = int4_experts(rng, 1, GLM5_HIDDEN, GLM5_MOE, 32)
    w = type(w)(w.packed[0], w.scale[0], 32)
    x = jnp.asarray(rng.standard_normal((m, GLM5_HIDDEN)), jnp.bfloat16)
    out = jax.jit(functools.partial(int4_matmul, impl="pallas", interpret=True, target="gpu"))(x, w)
    assert_close(out, int4_matmul_reference(x, w), TOL["bfloat16"])


# ------------------------------------------------------------------------------------------ MLA, Kimi heads


@pytest.mark.parametrize("target", ["gpu", "tpu"])
def test_mla_all_kimi_heads_in_one_program(target):
    rng = np.random.default_rng(17)
    pool = build_pool(rng, [1, 130], 64, 3, (LATENT + ROPE,), jnp.float8_e4m3fn)
    ql = jnp.asarray(rng.standard_normal((2, KIMI_HEADS, LATENT)), jnp.bfloat16)
    qr = jnp.asarray(rng.standard_normal((2, KIMI_HEADS, ROPE)), jnp.bfloat16)
    args = (ql, qr, pool.pages[0], pool.page_table, pool.lengths)
    out = jax.jit(functools.partial(mla_decode_attention, scales=pool.scales[0], sm_scale=0.0722, impl="pallas",
                                    interpret=True, target=target))(*args)
    assert_close(out, mla_decode_attention_reference(*args, scales=pool.scales[0], sm_scale=0.0722), TOL["bfloat16"])


# ------------------------------------------------------------------------------------------ HBM bytes per call


def nbytes(*arrays) -> int:
    return sum(a.size * a.dtype.itemsize for a in arrays)


def test_int4_split_k_reads_each_weight_byte_once_and_fills_the_gpu(monkeypatch):
    rng = np.random.default_rng(18)
    w = int4_experts(rng, 1, GLM5_HIDDEN, GLM5_MOE, 32)
    w = type(w)(w.packed[0], w.scale[0], 32)
    x = jnp.asarray(rng.standard_normal((8, GLM5_HIDDEN)), jnp.bfloat16)
    with record_calls(monkeypatch) as calls:
        int4_matmul(x, w, impl="pallas", interpret=True, target="gpu")
    (call,) = calls
    tm, tn, splits = call.grid
    assert splits > 1 and tm * tn * splits >= tuning.DEFAULT_GPU_CORES  # one wave at least, at M = 8
    xlo, xhi, packed, scale = read_bytes(call)
    assert (packed, scale) == (nbytes(w.packed), nbytes(w.scale))  # the ideal: every weight byte once
    assert xlo + xhi == tn * 16 * GLM5_HIDDEN * 2  # activations (padded to a 16-row tile) once per N tile


@pytest.mark.parametrize("kind", ["int4", "fp8-block", "fp8-channel"])
def test_grouped_kernels_read_only_routed_experts_once(monkeypatch, kind):
    """TPU bodies: their BlockSpecs select the expert (scalar-prefetched ids). GPU bodies pass every expert's N tile
    and each used tile's program reads its expert's [K, bn] slice (unused tiles read nothing): counted per program."""
    rng = np.random.default_rng(19)
    sizes = [3, 0, 13, 0]  # 16 decode rows on 2 of 4 local experts
    used = np.asarray([e for e, s in enumerate(sizes) if s])
    gs = jnp.asarray(sizes, jnp.int32)
    x = jnp.asarray(rng.standard_normal((16, GLM5_HIDDEN)), jnp.bfloat16)
    shape = (4, GLM5_HIDDEN, GLM5_MOE)
    if kind == "int4":  # random packed bytes and scales (the values do not matter for the traffic)
        w = Int4Weight(jnp.asarray(rng.integers(0, 256, (4, GLM5_HIDDEN // 2, GLM5_MOE), np.uint8)),
                       jnp.asarray(rng.uniform(0.01, 0.1, (4, GLM5_HIDDEN // 128, GLM5_MOE)), jnp.float32), 128)
        data, scales, fn = w.packed, w.scale, int4_grouped_matmul
    else:
        block = (128, 128) if kind == "fp8-block" else (GLM5_HIDDEN, 1)
        q = jnp.asarray(rng.standard_normal(shape, np.float32)).astype(jnp.float8_e4m3fn)
        sshape = (4, GLM5_HIDDEN // block[0], GLM5_MOE // block[1])
        w = Fp8Weight(q, jnp.asarray(rng.uniform(1e-3, 2e-3, sshape), jnp.float32), block)
        data, scales, fn = w.q, w.scale, fp8_grouped_matmul
    with record_calls(monkeypatch) as calls:
        fn(x, w, gs, impl="pallas", interpret=True, target="tpu")
        fn(x, w, gs, impl="pallas", interpret=True, target="gpu")
    tpu, gpu = calls
    reads = read_bytes(tpu)
    assert reads[-2] == nbytes(data[used])  # routed experts' weights, each byte once
    assert reads[-1] == nbytes(scales[used])
    used_tiles, (_, n_tiles) = int(np.sum(gpu.inputs[1])), gpu.grid
    w_spec = gpu.in_specs[-2]
    per_program = int(np.prod(w_spec.block_shape[1:])) * data.dtype.itemsize  # one expert's [K, bn] tile
    assert used_tiles == len(used) and used_tiles * n_tiles * per_program == nbytes(data[used])


def test_mla_reads_each_latent_page_once_for_all_heads(monkeypatch):
    rng = np.random.default_rng(20)
    lengths, page = [130, 320, 128], 64  # every row spans >= pages_per_block (2) pages: reads are exactly ideal
    pool = build_pool(rng, lengths, page, 5, (LATENT + ROPE,), jnp.float8_e4m3fn)
    ql = jnp.asarray(rng.standard_normal((3, KIMI_HEADS, LATENT)), jnp.bfloat16)
    qr = jnp.asarray(rng.standard_normal((3, KIMI_HEADS, ROPE)), jnp.bfloat16)
    args = (ql, qr, pool.pages[0], pool.page_table, pool.lengths)
    with record_calls(monkeypatch) as calls:
        mla_decode_attention(*args, scales=pool.scales[0], sm_scale=0.07, impl="pallas", interpret=True, target="tpu")
        mla_decode_attention(*args, scales=pool.scales[0], sm_scale=0.07, impl="pallas", interpret=True, target="gpu")
    tpu, gpu = calls
    ppb = tuning.mla_tpu(page, 5).pages_per_block
    reads = read_bytes(tpu)
    page_bytes = page * (LATENT + ROPE)  # fp8: one byte per value
    assert ppb == 2
    pages = sum(-(-n // page) for n in lengths)  # the ideal: each row's pages once, for all 64 heads
    assert sum(reads[2:2 + ppb]) == pages * page_bytes
    assert sum(reads[2 + ppb:]) == pages * page * 4  # f32 token scales
    assert gpu.grid[1] == 1  # GPU: one head block per row, so each split's pages are gathered once for 64 heads
