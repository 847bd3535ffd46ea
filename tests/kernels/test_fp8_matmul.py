"""FP8 matmul: the references against numpy (W8A16 and the simulated W8A8 activation quantization), and the
Pallas kernel bodies (Triton GPU, Mosaic TPU; interpret mode) against them for 128x128 block and per-channel
scales, f32/bf16 activations, M and N that are not tile multiples; typed errors where a shape is refused."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import UnsupportedShapeError
from pallas_kernels.fp8_matmul import (
    ACT_BLOCK,
    E4M3_MAX,
    fp8_matmul,
    fp8_matmul_reference,
    quantize_activations_fp8,
    quantize_fp8,
)
from tests.kernels.kernel_checks import TOL, assert_close


def weight(rng, k, n, block):
    return quantize_fp8(jnp.asarray(rng.standard_normal((k, n)), jnp.float32), block)


def dense_weight(w) -> np.ndarray:
    """f64 [K, N] from q and the block scales, block by block."""
    q = np.asarray(w.q.astype(jnp.float32), np.float64)
    s = np.asarray(w.scale, np.float64)
    bk, bn = w.block
    out = np.empty_like(q)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * bk:(i + 1) * bk, j * bn:(j + 1) * bn] = q[i * bk:(i + 1) * bk, j * bn:(j + 1) * bn] * s[i, j]
    return out


@pytest.mark.parametrize("block", [(128, 128), None])
def test_references_match_numpy(block):
    rng = np.random.default_rng(0)
    w = weight(rng, 256, 192, block)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    dense = dense_weight(w)
    assert_close(jax.jit(fp8_matmul_reference)(jnp.asarray(x), w), x @ dense, 1e-5)
    xq, xs = quantize_activations_fp8(jnp.asarray(x))
    assert float(jnp.max(jnp.abs(xq.astype(jnp.float32)))) <= E4M3_MAX
    xd = np.asarray(xq.astype(jnp.float32), np.float64) * np.repeat(np.asarray(xs, np.float64), ACT_BLOCK, axis=1)
    assert 0 < np.linalg.norm(xd - x) / np.linalg.norm(x) < 0.05  # e4m3 keeps 3 mantissa bits
    w8a8 = jax.jit(functools.partial(fp8_matmul_reference, act_quant=True))(jnp.asarray(x), w)
    assert_close(w8a8, xd @ dense, 1e-5)


# (scale block, M, K, N, x dtype)
CASES = [
    ((128, 128), 5, 256, 256, jnp.float32),
    ((128, 128), 20, 512, 384, jnp.bfloat16),  # 3 scale columns, M not a tile multiple
    (None, 3, 384, 128, jnp.bfloat16),  # per-channel scales
    (None, 33, 256, 256, jnp.float32),
]


@pytest.mark.parametrize("target", ["gpu", "tpu"])
@pytest.mark.parametrize("block,m,k,n,xdtype", CASES)
def test_w8a16_kernel_matches_reference(target, block, m, k, n, xdtype):
    rng = np.random.default_rng(m + k)
    w = weight(rng, k, n, block)
    x = jnp.asarray(rng.standard_normal((m, k)), xdtype)
    out = jax.jit(functools.partial(fp8_matmul, impl="pallas", interpret=True, target=target))(x, w)
    assert out.shape == (m, n) and out.dtype == x.dtype
    assert_close(out, jax.jit(fp8_matmul_reference)(x, w), TOL[jnp.dtype(xdtype).name])


@pytest.mark.parametrize("block,m,n", [((128, 128), 20, 384), (None, 33, 256)])
def test_w8a8_gpu_kernel_matches_simulated_reference(block, m, n):
    rng = np.random.default_rng(m)
    w = weight(rng, 512, n, block)
    x = jnp.asarray(rng.standard_normal((m, 512)), jnp.bfloat16)
    fn = functools.partial(fp8_matmul, act_quant=True, impl="pallas", interpret=True, target="gpu")
    ref = jax.jit(functools.partial(fp8_matmul_reference, act_quant=True))(x, w)
    assert_close(jax.jit(fn)(x, w), ref, TOL["bfloat16"])


def test_act_quant_defaults_to_w8a16_off_gpu():
    rng = np.random.default_rng(5)
    w = weight(rng, 256, 128, (128, 128))
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    out = jax.jit(functools.partial(fp8_matmul, impl="pallas", interpret=True, target="gpu"))(x, w)
    # W8A8 would differ from the W8A16 reference by ~2% here, twice the bf16 tolerance
    assert_close(out, jax.jit(fp8_matmul_reference)(x, w), TOL["bfloat16"])
    from phaseserve.qarrays import dense  # the model's dispatch: fp8_matmul with its defaults

    np.testing.assert_array_equal(np.asarray(jax.jit(dense)(x, w), np.float32),
                                  np.asarray(jax.jit(fp8_matmul_reference)(x, w), np.float32))


def test_refused_shapes_raise_typed_errors_and_auto_falls_back():
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)
    w64 = weight(rng, 256, 128, (128, 64))  # TPU tiles N by 128, scale blocks are 64 wide
    with pytest.raises(UnsupportedShapeError, match="cannot tile"):
        fp8_matmul(x, w64, impl="pallas", interpret=True, target="tpu")
    with pytest.raises(UnsupportedShapeError, match="act_quant"):
        fp8_matmul(x, w64, act_quant=True, impl="pallas", interpret=True, target="tpu")
    x200 = jnp.asarray(rng.standard_normal((3, 200)), jnp.float32)
    w200 = weight(rng, 200, 128, (128, 128))  # K = 200: no K step divides it and the 128-row scale block
    with pytest.raises(UnsupportedShapeError, match="cannot tile"):
        fp8_matmul(x200, w200, impl="pallas", interpret=True, target="gpu")
    np.testing.assert_array_equal(np.asarray(fp8_matmul(x200, w200, impl="auto")),
                                  np.asarray(fp8_matmul_reference(x200, w200)))
    with pytest.raises(UnsupportedShapeError, match="K % 128"):
        fp8_matmul(x200, w200, act_quant=True, impl="reference")
    with pytest.raises(ValueError, match="2-D weight"):
        fp8_matmul(x[:, :128], w64)
