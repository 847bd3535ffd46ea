"""Kernel dispatch and provenance without process-global state: the implementation choice travels in an explicit
:class:`~phaseserve.kernel_mesh.KernelDispatch` (mesh, ``matmul_impl`` / ``attn_impl``, phase, and the provenance
log its owner passes), never in a context variable or a module-level table; each call records what it built
(fallbacks with their reason) in the log of the dispatch it was made with, and a benchmark JSON's environment block
carries the rows of the engines it measured."""

from __future__ import annotations

import collections
import contextvars
import importlib
import json
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import pallas_kernels
import phaseserve as ps
from lab.bench.report import kernel_rows, write_json
from pallas_kernels.int4_matmul import quantize_int4
from phaseserve import kernel_mesh, qarrays, sharding
from phaseserve.config import ModelConfig
from phaseserve.qarrays import dense

GQA_MOE = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=128, hidden_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64, moe_layers=(True,), max_position_embeddings=64)
# prefill FP8, decode INT4, FP8 KV (as tests/e2e/test_engine_mesh.py): every kernel of a GQA MoE model runs
KERNEL_QUANT = ps.QuantConfig(prefill_weights="base=float32,attention=fp8:b16x16,routed_experts=fp8:b16x16",
                              decode_weights="base=float32,attention=int4:g16:f32,routed_experts=int4:g16:f32",
                              kv_dtype="float8_e4m3fn", prefill_kv_dtype="float32")


def _traced(matmul_impl: str, w, x, log):
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    kd = kernel_mesh.KernelDispatch(mesh, matmul_impl=matmul_impl, phase="decode", log=log)
    return jax.jit(lambda w, x: dense(x, w, kd.with_weights([(w, ("embed", "mlp"))])))(w, x)


def test_each_dispatch_records_its_own_calls_and_benchmark_json_carries_them(tmp_path):
    rng = np.random.default_rng(3)
    w = quantize_int4(jnp.asarray(rng.standard_normal((64, 32)), jnp.float32), 16)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    ref, ker = collections.Counter(), collections.Counter()
    out_ref, out_ker = _traced("reference", w, x, ref), _traced("pallas", w, x, ker)  # CPU: interpret mode
    np.testing.assert_allclose(np.asarray(out_ker), np.asarray(out_ref), rtol=1e-5, atol=1e-5)
    assert {k[1:4] for k in ref} == {("int4_matmul", "any", "reference")}  # only its own call
    assert ("int4_matmul", "default", "pallas") in {k[1:4] for k in ker}  # the interpret body this CPU ran
    assert "reference" not in {k[3] for k in ker} and {k[5] for k in ker} == {"one device"}
    before = (ref.copy(), ker.copy())
    np.testing.assert_allclose(np.asarray(dense(x, w)), np.asarray(out_ref), rtol=1e-6)  # kernel_mesh.DIRECT
    assert (ref, ker) == before  # recorded nowhere
    rows = kernel_rows(kernel_mesh.provenance_rows(ref), kernel_mesh.provenance_rows(ker))  # as an experiment sets
    assert rows == kernel_mesh.provenance_rows(ref + ker)
    data = json.loads(write_json(tmp_path / "results.json", {"environment": {"jax": jax.__version__, "kernels": rows}},
                                 ).read_text())
    assert {(r["phase"], r["op"], r["impl"]) for r in data["environment"]["kernels"]} >= {
        ("decode", "int4_matmul", "reference"), ("decode", "int4_matmul", "pallas")}
    assert all(r["count"] >= 1 for r in data["environment"]["kernels"])


def test_bad_impl_is_a_clear_error():
    with pytest.raises(ValueError, match="matmul_impl"):
        kernel_mesh.KernelDispatch(matmul_impl="triton")
    with pytest.raises(ValueError, match="attn_impl"):
        kernel_mesh.KernelDispatch(attn_impl="flash")


def _modules(*packages):
    for pkg in packages:
        yield pkg
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            yield importlib.import_module(info.name)


def test_no_process_global_dispatch_state():
    """No module of the kernels (``pallas_kernels``) or of the model's dispatch path holds a context variable or a
    module-level provenance Counter: the choice and the log travel in the arguments."""
    import phaseserve.cache
    import phaseserve.model

    bad = [f"{mod.__name__}.{name}" for mod in _modules(pallas_kernels, phaseserve.model, phaseserve.cache)
           for name, value in vars(mod).items() if isinstance(value, contextvars.ContextVar | collections.Counter)]
    for mod in (kernel_mesh, qarrays, sharding):
        bad += [f"{mod.__name__}.{name}" for name, value in vars(mod).items()
                if isinstance(value, contextvars.ContextVar | collections.Counter)]
    assert not bad, bad
    assert not hasattr(kernel_mesh, "kernel_scope") and not hasattr(pallas_kernels.common, "PROVENANCE")


def test_two_engines_with_different_impls_record_only_their_own():
    """Two engines traced in one process, one on the Pallas kernels (interpret mode) and one on the references: each
    engine's table lists its own builds only, and together they are what the lab's JSON gets."""
    params = ps.init_params(GQA_MOE, jax.random.key(7))
    serve = ps.ServeConfig(mode="disaggregated", quant=KERNEL_QUANT, max_batch=2,
                           cache=ps.CacheConfig(page_size=4, num_pages=16, max_pages_per_seq=4))
    engines = {impl: ps.Engine(GQA_MOE, params, serve, attn_impl=impl, matmul_impl=impl)
               for impl in ("pallas", "reference")}
    req = ps.Request(id="r", prompt=[3, 1, 4, 1, 5], max_tokens=2, ignore_eos=True)
    tokens = {impl: eng.generate([req])[0].tokens for impl, eng in engines.items()}
    assert tokens["pallas"] == tokens["reference"]
    rows = {impl: eng.summary()["kernels"] for impl, eng in engines.items()}
    kernels = {"fp8_matmul", "fp8_grouped_matmul", "int4_matmul", "int4_grouped_matmul", "flash_prefill",
               "paged_decode_attention"}
    assert {r["op"] for r in rows["pallas"]} >= kernels
    grouped = {"fp8_grouped_matmul", "int4_grouped_matmul"}  # the CPU's reference MoE dispatch is einsums, not these
    assert {r["op"] for r in rows["reference"]} & kernels == kernels - grouped
    assert {r["impl"] for r in rows["reference"]} == {"reference", "xla"}
    assert {r["platform"] for r in rows["reference"]} == {"any"}
    ran = {(r["op"], r["impl"]) for r in rows["pallas"] if r["platform"] == "default"}  # the interpret bodies
    assert {op for op, _ in ran} == kernels and {i for _, i in ran} == {"pallas"}
    assert "reference" not in {r["impl"] for r in rows["pallas"] if r["platform"] in ("any", "default")}
    merged = kernel_rows(*engines.values())
    assert sum(r["count"] for r in merged) == sum(r["count"] for rs in rows.values() for r in rs)
