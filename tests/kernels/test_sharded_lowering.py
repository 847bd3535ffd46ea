"""The engine's *sharded* steps export for ``cuda`` and ``tpu`` from this CPU process with every Pallas kernel inside
a ``shard_map`` (``phaseserve.kernel_mesh``), and no weight or page pool is all-gathered.

Two views of one step, since an exported module is not yet partitioned (GSPMD inserts its collectives when the
module is compiled for the target):

- exported StableHLO for ``cuda`` / ``tpu``: every kernel custom call (Triton / Mosaic) takes per-device operands,
  never an operand of the global shape of a sharded INT4 / FP8 weight or FP8 page array (a kernel outside
  ``shard_map`` gets the whole array, i.e. XLA gathers it; the stored dtypes tell weights and pages from
  activations), and the module has no ``all_gather``;
- the same step compiled for this machine's 8 CPU devices (the Pallas bodies in interpret mode, partitioned by the
  same SPMD partitioner): no ``all-gather`` produces an array of the global shape of a sharded weight or pool array.

The negative controls turn the ``shard_map`` off: both views then find the gathered weights (and pages).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax import export

import phaseserve as ps
from phaseserve import kernel_mesh
from phaseserve.config import ModelConfig
from phaseserve.engine.decode_step import DecodeBatch
from phaseserve.model import transformer
from phaseserve.sharding import sharded_step

TRITON = "__gpu$xla.gpu.triton"
KERNEL_CALLS = {"cuda": TRITON, "tpu": "tpu_custom_call"}
MLIR_DTYPES = {"float32": "f32", "bfloat16": "bf16", "uint8": "ui8", "float8_e4m3fn": "f8E4M3FN", "int32": "i32"}
# shapes the TPU bodies tile (K % 256 at INT4 g32, N % 128, head_dim 128), TP=2 x EP=2 on the decode mesh; no
# weight's per-device shape equals another weight's global shape (the check compares shapes)
GQA = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=256, hidden_size=256, num_layers=1, num_heads=8,
                  num_kv_heads=2, head_dim=128, intermediate_size=256, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=512, moe_layers=(True,), max_position_embeddings=64)
MLA = ModelConfig(architecture="DeepseekV3ForCausalLM", vocab_size=256, hidden_size=256, num_layers=1, num_heads=4,
                  num_kv_heads=4, head_dim=128, intermediate_size=256, attention="mla", kv_lora_rank=128,
                  qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=512, scoring_func="sigmoid", moe_layers=(True,), max_position_embeddings=64)
QUANT = ps.QuantConfig(prefill_weights="base=float32,attention=fp8:b128x128,routed_experts=fp8:b128x128",
                       decode_weights="base=float32,attention=int4:g32:f32,routed_experts=int4:g32:f32",
                       kv_dtype="float8_e4m3fn", prefill_kv_dtype="float32")
MESH = ps.MeshConfig(prefill_devices=(0, 1), decode_devices=(2, 3, 4, 5), prefill_tp=2, decode_tp=2, decode_ep=2)
B, PAGES = 4, 4
STORED = ("uint8", "float8_e4m3fn")  # INT4 packed and FP8 weights, FP8 pages: no activation has these dtypes


def _engine(cfg: ModelConfig) -> ps.Engine:
    serve = ps.ServeConfig(mode="disaggregated", quant=QUANT, max_batch=B, mesh=MESH,
                           cache=ps.CacheConfig(page_size=16, num_pages=24, max_pages_per_seq=PAGES, integrity=False))
    return ps.Engine(cfg, ps.init_params(cfg, jax.random.key(0)), serve, attn_impl="pallas", matmul_impl="pallas")


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _sharded_globals(*trees) -> set[tuple[tuple[int, ...], str]]:
    """(global shape, dtype name) of every array of ``trees`` that is split across devices."""
    return {(tuple(a.shape), str(a.dtype)) for t in trees for a in jax.tree.leaves(t)
            if not a.sharding.is_fully_replicated}


def _decode_step(eng: ps.Engine):
    """The engine's jitted decode step and abstract (sharded) arguments for B rows."""
    rng = np.random.default_rng(0)
    batch = DecodeBatch(tokens=rng.integers(0, 256, B).astype(np.int32), positions=np.full(B, 5, np.int32),
                        page_table=rng.integers(1, 24, (B, PAGES)).astype(np.int32), active=np.ones(B, bool),
                        temperature=np.zeros(B, np.float32), top_k=np.zeros(B, np.int32), top_p=np.ones(B, np.float32),
                        seeds=np.zeros(B, np.uint32), steps=np.zeros(B, np.int32), want_logprobs=np.zeros(B, bool))
    return eng.decode._decode, (_abstract(eng.decode_params), _abstract(eng.pool), batch, None)


def _prefill_step(eng: ps.Engine, cfg: ModelConfig):
    """The causal prefill pass on the prefill mesh, with the prefill worker's kernel dispatch."""
    kd = kernel_mesh.KernelDispatch(eng.prefill_mesh, matmul_impl="pallas", attn_impl="pallas", phase="prefill")
    step = jax.jit(sharded_step(lambda p, tokens, lengths, kd: transformer.prefill(p, cfg, tokens, lengths,
                                                                                  logits_at=lengths - 1, kd=kd),
                                cfg, kd))
    return step, (_abstract(eng.prefill_params), np.zeros((B, 16), np.int32), np.full(B, 9, np.int32))


def _kernel_operands(text: str, platform: str) -> list[tuple[tuple[int, ...], str]]:
    """(shape, MLIR dtype) of every operand of every kernel custom call in an exported module."""
    out = []
    for line in text.splitlines():
        if f"custom_call @{KERNEL_CALLS[platform]}" in line:
            operands = line.rsplit(" : (", 1)[1].split(") -> ")[0]
            out += [(tuple(int(d) for d in dims.split("x")[:-1]), dims.split("x")[-1])
                    for dims in re.findall(r"tensor<([0-9x]+[A-Za-z0-9]+)>", operands)]
    return out


def _gathered_kernel_operands(fn, args, platform: str, sharded) -> list:
    exp = export.export(fn, platforms=[platform], disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(
        *args)
    text = exp.mlir_module()
    operands = _kernel_operands(text, platform)
    assert operands, f"no {KERNEL_CALLS[platform]} in the exported {platform} step"
    assert "all_gather" not in text
    # either stored dtype: a CPU-built FP8 pool keeps uint8 bits and is bitcast to FP8 before the kernel reads it
    globals_ = {(shape, MLIR_DTYPES[st]) for shape, dt in sharded if dt in STORED for st in STORED}
    return [o for o in operands if o in globals_]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("arch", ["gqa", "mla"])
def test_sharded_steps_export_with_per_device_kernel_operands(arch, platform):
    cfg = GQA if arch == "gqa" else MLA
    eng = _engine(cfg)
    fn, args = _decode_step(eng)
    assert not _gathered_kernel_operands(fn, args, platform, _sharded_globals(eng.decode_params, eng.pool))
    fn, args = _prefill_step(eng, cfg)
    assert not _gathered_kernel_operands(fn, args, platform, _sharded_globals(eng.prefill_params))


def test_without_shard_map_the_kernels_take_gathered_operands(monkeypatch):
    eng = _engine(GQA)
    monkeypatch.setattr(kernel_mesh.KernelDispatch, "sharded", lambda self, impl: False)  # kernels left to GSPMD
    fn, args = _decode_step(eng)
    gathered = {shape for shape, _ in _gathered_kernel_operands(fn, args, "cuda",
                                                                _sharded_globals(eng.decode_params, eng.pool))}
    # INT4 weights and the FP8 pool, whole (told apart by shape)
    assert gathered & {shape for shape, _ in _sharded_globals(eng.decode_params)}
    assert gathered & {shape for shape, _ in _sharded_globals(eng.pool)}


@pytest.mark.parametrize("shard_map", [True, False])
def test_compiled_sharded_decode_step_gathers_no_weight_or_pool(shard_map, monkeypatch):
    if not shard_map:  # the negative control: kernels left to GSPMD get their weights and the pool gathered
        monkeypatch.setattr(kernel_mesh.KernelDispatch, "sharded", lambda self, impl: False)
    eng = _engine(GQA)
    fn, args = _decode_step(eng)
    hlo = fn.lower(*args).compile().as_text()
    stored = {shape for shape, dt in _sharded_globals(eng.decode_params, eng.pool) if dt in STORED}
    gathers = [tuple(int(d) for d in dims.split(",") if d)
               for dims in re.findall(r"= \w+\[([0-9,]*)\]\{[^}]*\} all-gather\(", hlo)]
    gathered = [g for g in gathers if g in stored]  # any dtype: XLA:CPU gathers FP8 pages converted to f16
    if shard_map:
        assert not gathered, gathered
    else:
        assert tuple(eng.pool.layers[0].k.shape) in gathered and len(gathered) > 2
