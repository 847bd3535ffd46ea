"""Kernel provenance outside the engine: a kernel scope records which implementation each call built (fallbacks
with their reason), ``matmul_impl`` picks it, and every benchmark JSON's environment block carries the table."""

from __future__ import annotations

import collections
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from lab.bench.report import write_json
from pallas_kernels.int4_matmul import quantize_int4
from phaseserve import kernel_mesh
from phaseserve.qarrays import dense


def _traced(matmul_impl: str, w, x, log):
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("tp",))

    def f(w, x):
        with kernel_mesh.kernel_scope(mesh, [(w, ("embed", "mlp"))], matmul_impl=matmul_impl, phase="decode",
                                      log=log):
            return dense(x, w)

    return jax.jit(f)(w, x)


def test_scope_records_each_call_and_benchmark_json_carries_it(tmp_path):
    rng = np.random.default_rng(3)
    w = quantize_int4(jnp.asarray(rng.standard_normal((64, 32)), jnp.float32), 16)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    ref, ker = collections.Counter(), collections.Counter()
    out_ref, out_ker = _traced("reference", w, x, ref), _traced("pallas", w, x, ker)  # CPU: interpret mode
    np.testing.assert_allclose(np.asarray(out_ker), np.asarray(out_ref), rtol=1e-5, atol=1e-5)
    assert {k[1:4] for k in ref} == {("int4_matmul", "any", "reference")}
    assert ("int4_matmul", "default", "pallas") in {k[1:4] for k in ker}  # the interpret body this CPU ran
    assert {k[5] for k in ker} == {"one device"}
    data = json.loads(write_json(tmp_path / "results.json", {"environment": {"jax": jax.__version__}}).read_text())
    rows = data["environment"]["kernels"]
    assert {(r["phase"], r["op"], r["impl"]) for r in rows} >= {("decode", "int4_matmul", "reference"),
                                                                 ("decode", "int4_matmul", "pallas")}
    assert all(r["count"] >= 1 for r in rows)
    assert "kernels" not in json.loads(write_json(tmp_path / "plain.json", {"rows": [1]}).read_text())


def test_bad_impl_is_a_clear_error():
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    with pytest.raises(ValueError, match="matmul_impl"):
        with kernel_mesh.kernel_scope(mesh, [], matmul_impl="triton"):
            pass
