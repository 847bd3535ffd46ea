"""INT4 W4A16: the documented packing, the references against numpy, and the dense and grouped (MoE) Pallas
kernels (Triton GPU and Mosaic TPU bodies, interpret mode) against the references for groups 32 and 128,
M/N that are not tile multiples, f32 and bf16 activations and scales; typed errors where a shape is refused."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import UnsupportedShapeError
from pallas_kernels.int4_matmul import (
    Int4Weight,
    int4_grouped_matmul,
    int4_grouped_matmul_reference,
    int4_matmul,
    int4_matmul_reference,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from tests.kernels.kernel_checks import TOL, assert_close


def random_weight(rng, lead, k, n, group, scale_dtype=jnp.float32) -> tuple[Int4Weight, np.ndarray]:
    """Random nibbles and scales -> (packed weight, f64 dense truth [..., K, N])."""
    nib = rng.integers(0, 16, size=(*lead, k, n)).astype(np.uint8)
    scale = rng.uniform(0.01, 0.1, size=(*lead, k // group, n)).astype(np.float32)
    w = pack_int4(jnp.asarray(nib), jnp.asarray(scale).astype(scale_dtype), group)
    s = np.asarray(w.scale.astype(jnp.float32), np.float64)
    return w, (nib.astype(np.float64) - 8) * np.repeat(s, group, axis=-2)


def test_packing_layout_is_the_documented_one():
    rng = np.random.default_rng(0)
    g, k, n = 32, 64, 3
    w, _ = random_weight(rng, (), k, n, g)
    nib = np.asarray(unpack_int4(w)).astype(np.int64) + 8
    packed = np.asarray(w.packed)
    for grp in range(k // g):
        for j in range(g // 2):
            row = packed[grp * g // 2 + j]
            np.testing.assert_array_equal(row & 0xF, nib[grp * g + j])
            np.testing.assert_array_equal(row >> 4, nib[grp * g + g // 2 + j])


def test_references_match_numpy():
    rng = np.random.default_rng(1)
    w, dense = random_weight(rng, (), 256, 48, 32)
    x = rng.standard_normal((7, 256)).astype(np.float32)
    assert_close(jax.jit(int4_matmul_reference)(jnp.asarray(x), w), x @ dense, 1e-5)
    we, dense_e = random_weight(rng, (3,), 256, 48, 128)
    sizes = [4, 0, 9]
    xg = rng.standard_normal((15, 256)).astype(np.float32)
    want = np.zeros((15, 48))
    start = 0
    for e, size in enumerate(sizes):
        want[start:start + size] = xg[start:start + size] @ dense_e[e]
        start += size
    got = jax.jit(int4_grouped_matmul_reference)(jnp.asarray(xg), we, jnp.asarray(sizes, jnp.int32))
    assert_close(got, want, 1e-5)
    assert (np.asarray(got[13:]) == 0).all()


def test_quantize_roundtrip_is_close():
    w = jnp.asarray(np.random.default_rng(2).standard_normal((256, 64)), jnp.float32)
    err = float(jax.jit(lambda a: jnp.linalg.norm(quantize_int4(a, 32).dequantize() - a) / jnp.linalg.norm(a))(w))
    assert 0 < err < 0.12  # 4-bit symmetric RTN on Gaussian weights


def dense_call(x, w, **kw):
    return jax.jit(functools.partial(int4_matmul, **kw))(x, w)


# (group, x shape, N, x dtype, scale dtype)
DENSE = [
    (32, (1, 256), 128, jnp.bfloat16, jnp.float32),  # decode M=1
    (32, (2, 3, 512), 96, jnp.float32, jnp.float32),  # leading dims, M=6, N=96 (not a multiple of 128)
    (128, (17, 1024), 256, jnp.bfloat16, jnp.bfloat16),  # bf16 scales (TPU: f32 VMEM copy)
    (128, (64, 1024), 128, jnp.float32, jnp.float32),
]


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("group,xshape,n,xdtype,sdtype", DENSE)
def test_dense_kernel_matches_reference(target, group, xshape, n, xdtype, sdtype):
    rng = np.random.default_rng(group + n)
    w, _ = random_weight(rng, (), xshape[-1], n, group, sdtype)
    x = jnp.asarray(rng.standard_normal(xshape), xdtype)
    out = dense_call(x, w, impl="pallas", interpret=True, target=target)
    assert out.shape == (*xshape[:-1], n) and out.dtype == x.dtype
    assert_close(out, jax.jit(int4_matmul_reference)(x, w), TOL[jnp.dtype(xdtype).name])


GROUP_SIZES = [[7, 0, 20, 9], [40, 0, 0, 0], [0, 0, 3, 37], [10, 10, 10, 10], [30, 30, 0, 0]]  # last: sum > M


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("group,k,xdtype", [(32, 256, jnp.bfloat16), (128, 1024, jnp.float32)])
def test_grouped_kernel_matches_reference(target, group, k, xdtype):
    rng = np.random.default_rng(group)
    w, _ = random_weight(rng, (4,), k, 128, group)
    x = jnp.asarray(rng.standard_normal((40, k)), xdtype)
    fn = jax.jit(functools.partial(int4_grouped_matmul, impl="pallas", interpret=True, target=target))
    ref = jax.jit(int4_grouped_matmul_reference)
    for sizes in GROUP_SIZES:
        gs = jnp.asarray(sizes, jnp.int32)
        out = fn(x, w, gs)
        assert out.shape == (40, 128) and out.dtype == x.dtype
        assert_close(out, ref(x, w, gs), TOL[jnp.dtype(xdtype).name])
        rows = min(sum(sizes), 40)
        assert (np.asarray(out[rows:]) == 0).all()


def test_model_dispatch_and_auto_is_reference_on_cpu():
    from phaseserve.qarrays import dense, grouped_dense

    rng = np.random.default_rng(3)
    w, _ = random_weight(rng, (), 256, 64, 32)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(dense(x, w)), np.asarray(int4_matmul_reference(x, w)))
    we, _ = random_weight(rng, (2,), 256, 64, 32)
    gs = jnp.asarray([1, 2], jnp.int32)
    np.testing.assert_array_equal(np.asarray(grouped_dense(x, we, gs)),
                                  np.asarray(int4_grouped_matmul_reference(x, we, gs)))


def test_refused_shapes_raise_typed_errors_and_auto_falls_back():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.float32)
    w128, _ = random_weight(rng, (), 512, 128, 128)  # TPU: K/2 = 256 is not a multiple of 8 * 64
    with pytest.raises(UnsupportedShapeError, match="cannot tile"):
        int4_matmul(x, w128, impl="pallas", interpret=True, target="tpu")
    w40, _ = random_weight(rng, (), 512, 40, 32)  # GPU: N = 40 has no power-of-two tile >= 16
    with pytest.raises(UnsupportedShapeError, match="cannot tile"):
        int4_matmul(x, w40, impl="pallas", interpret=True, target="gpu")
    np.testing.assert_array_equal(np.asarray(int4_matmul(x, w40, impl="auto")),
                                  np.asarray(int4_matmul_reference(x, w40)))
    with pytest.raises(ValueError, match="2-D weight"):
        int4_matmul(x[:, :256], w40)
    with pytest.raises(ValueError, match="group_sizes"):
        int4_grouped_matmul(x, w40, jnp.asarray([3], jnp.int32))
