"""Kernel dispatch: the body is chosen per lowering platform (jax.export for tpu / cuda from this CPU process builds
Mosaic / Triton without ``target=``), fallbacks to the reference are counted and logged with their reason, and
float32 dots inside kernels run at HIGHEST precision (bf16 ones at the default); FP8 on a GPU without FP8
conversions (compute capability < 8.9) is a refused shape, not a compile error."""

from __future__ import annotations

import functools
import logging
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import common
from pallas_kernels.int4_matmul import int4_matmul, quantize_int4
from pallas_kernels.paged_attention import paged_decode_attention

TRITON = "__gpu$xla.gpu.triton"


def custom_calls(fn, platform, *args) -> set[str]:
    exp = export.export(jax.jit(fn), platforms=[platform],
                        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
    return set(re.findall(r"custom_call @([\w$.]+)", exp.mlir_module()))


def test_export_builds_the_lowering_platforms_body_without_target():
    rng = np.random.default_rng(0)
    w = quantize_int4(jnp.asarray(rng.standard_normal((256, 128)), jnp.float32), 32)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    fn = functools.partial(int4_matmul, w=w, impl="pallas")
    assert "tpu_custom_call" in custom_calls(fn, "tpu", x)
    assert TRITON in custom_calls(fn, "cuda", x)
    assert not {"tpu_custom_call", TRITON} & custom_calls(fn, "cpu", x)  # CPU: interpret mode (plain HLO)
    auto = functools.partial(int4_matmul, w=w, impl="auto")  # in a CPU process "auto" is the reference
    assert not {"tpu_custom_call", TRITON} & (custom_calls(auto, "tpu", x) | custom_calls(auto, "cuda", x))


def test_fallback_is_counted_and_logged_with_its_reason(caplog):
    rng = np.random.default_rng(1)
    w = quantize_int4(jnp.asarray(rng.standard_normal((512, 128)), jnp.float32), 128)  # TPU: K/2 % (8 * 64) != 0
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.float32)
    new = common.Provenance()  # the caller's sink
    with caplog.at_level(logging.WARNING, logger="pallas_kernels"):
        calls = custom_calls(functools.partial(int4_matmul, w=w, impl="pallas", provenance=new), "tpu", x)  # this CPU
    assert "tpu_custom_call" not in calls  # the refused shape is not built as a Mosaic kernel
    fallbacks = [(k, n) for k, n in new.items() if k[2] == "fallback"]
    ((op, platform, impl, reason), count), = fallbacks
    assert (op, platform, impl, count) == ("int4_matmul", "tpu", "fallback", 1) and "cannot tile" in reason
    assert new[("int4_matmul", "cuda", "pallas", "")] == 1  # the Triton body takes this shape
    assert any("int4_matmul" in r.message and "cannot tile" in r.message for r in caplog.records)
    rows = [r for r in common.provenance_rows(new) if r["impl"] == "fallback" and r["op"] == "int4_matmul"]
    assert rows and rows[0]["reason"] == reason


def test_float32_dots_in_kernels_are_highest_precision():
    rng = np.random.default_rng(2)
    w = quantize_int4(jnp.asarray(rng.standard_normal((256, 128)), jnp.float32), 32)
    for dtype, want in ((jnp.float32, True), (jnp.bfloat16, False)):
        x = jnp.asarray(rng.standard_normal((4, 256)), dtype)
        jaxpr = str(jax.make_jaxpr(functools.partial(int4_matmul, impl="pallas", interpret=True, target="gpu"))(x, w))
        assert ("precision=(Precision.HIGHEST" in jaxpr) == want


@pytest.mark.parametrize("cc,refused", [("8.0", True), ("8.6", True), ("8.9", False), ("9.0", False)])
def test_fp8_pages_are_refused_on_gpus_without_fp8_conversions(monkeypatch, cc, refused):
    gpu = types.SimpleNamespace(platform="gpu", compute_capability=cc)
    monkeypatch.setattr(jax, "devices", lambda *a: [gpu])
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((2, 8, 128)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((4, 16, 2, 128)), jnp.float8_e4m3fn)
    sc = jnp.asarray(rng.uniform(0.5, 1.0, (4, 16, 2)), jnp.float32)
    pt, lens = jnp.asarray([[0, 1], [2, 3]], jnp.int32), jnp.asarray([20, 7], jnp.int32)
    fn = functools.partial(paged_decode_attention, k_scales=sc, v_scales=sc, impl="pallas", interpret=False,
                           target="gpu")
    if refused:
        with pytest.raises(common.UnsupportedShapeError, match="compute capability >= 8.9"):
            jax.eval_shape(fn, q, kv, kv, pt, lens)
    else:
        assert jax.eval_shape(fn, q, kv, kv, pt, lens).shape == q.shape
    common.check_gpu_fp8("bf16 pages", jnp.bfloat16, False)  # 16-bit pages are fine on any GPU
