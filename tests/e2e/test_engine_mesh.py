"""Disaggregated serving over real (simulated) meshes: prefill on 2 devices with tensor parallelism, decode on 4
others with tensor x expert parallelism; tokens equal the single-device engine's, weights and cache really are
sharded, and the two phases' device sets are disjoint. With ``impl="pallas"`` (interpret mode on the CPU) every
kernel call runs under ``shard_map`` (``phaseserve.kernel_mesh``) and the engine's provenance table says which
implementation and layout each op built."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import phaseserve as ps
from phaseserve.config import ModelConfig
from tests.e2e.engine_utils import make_checkpoint, random_requests, serve_config


@pytest.mark.parametrize("variant", ["qwen3_moe_norm", "deepseek_v3_grouped"])
def test_sharded_disaggregated_equals_single_device(variant, tmp_path):
    assert len(jax.devices()) >= 6, "tests/conftest.py simulates 8 CPU devices"
    _, cfg, params = make_checkpoint(variant, tmp_path, seed=2)
    reqs = random_requests(cfg.vocab_size, 5, seed=3)
    single = ps.Engine(cfg, params, serve_config("colocated")).generate(reqs)
    mesh = ps.MeshConfig(prefill_devices=(0, 1), decode_devices=(2, 3, 4, 5), prefill_tp=2, decode_tp=2, decode_ep=2)
    eng = ps.Engine(cfg, params, serve_config("disaggregated", mesh=mesh))
    outs = eng.generate(reqs)
    assert [o.tokens for o in outs] == [o.tokens for o in single]
    assert {d.id for d in eng.prefill_mesh.devices.flat} == {0, 1}
    assert {d.id for d in eng.decode_mesh.devices.flat} == {2, 3, 4, 5}
    moe = eng.decode_params.layers[1].mlp.w_gate
    assert moe.sharding.spec[0] == "ep" and len(moe.sharding.device_set) == 4
    attn = eng.prefill_params.layers[0].attn
    wo = attn.wo
    assert wo.sharding.spec[0] == "tp" and {d.id for d in wo.sharding.device_set} == {0, 1}
    pages = eng.pool.layers[0]
    if cfg.is_mla:
        assert pages.latent.sharding.is_fully_replicated  # the latent is replicated across TP ranks
    else:
        assert pages.k.sharding.spec[2] == "tp"  # KV heads split across TP ranks
    assert eng.allocator.num_free == eng.num_pages - 1


# ---- Pallas kernels under the meshes (interpret mode): shard_map'd calls give the single-device tokens ----------
GQA_MOE = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=128, hidden_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64, moe_layers=(True,), max_position_embeddings=64)
MLA_MOE = ModelConfig(architecture="DeepseekV3ForCausalLM", vocab_size=128, hidden_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=4, head_dim=32, intermediate_size=64, attention="mla", kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=64, num_shared_experts=1, scoring_func="sigmoid", moe_layers=(True,),
                      max_position_embeddings=64)
# prefill FP8 (16x16 blocks), decode INT4 (groups of 16), FP8 KV; the rest float32 so the tokens compare exactly
KERNEL_QUANT = ps.QuantConfig(prefill_weights="base=float32,attention=fp8:b16x16,routed_experts=fp8:b16x16",
                              decode_weights="base=float32,attention=int4:g16:f32,routed_experts=int4:g16:f32",
                              kv_dtype="float8_e4m3fn", prefill_kv_dtype="float32")
MESHES = {  # prefill TP on both; decode TP x EP (GQA: the pool split over KV heads) and EP alone (MLA)
    "gqa": ps.MeshConfig(prefill_devices=(0, 1), decode_devices=(2, 3, 4, 5), prefill_tp=2, decode_tp=2, decode_ep=2),
    "mla": ps.MeshConfig(prefill_devices=(0, 1), decode_devices=(4, 5, 6, 7), prefill_tp=2, decode_ep=4),
}


def _kernel_engine(cfg, params, mesh):
    serve = ps.ServeConfig(mode="disaggregated", quant=KERNEL_QUANT, max_batch=4, mesh=mesh,
                           cache=ps.CacheConfig(page_size=4, num_pages=24, max_pages_per_seq=4))
    return ps.Engine(cfg, params, serve, attn_impl="pallas", matmul_impl="pallas")


@pytest.mark.parametrize("arch", ["gqa", pytest.param("mla", marks=pytest.mark.slow)])
def test_pallas_kernels_under_meshes_equal_single_device(arch):
    cfg = GQA_MOE if arch == "gqa" else MLA_MOE
    params = ps.init_params(cfg, jax.random.key(7))
    rng = np.random.default_rng(11)
    reqs = [ps.Request(id=f"r{i}", prompt=rng.integers(0, cfg.vocab_size, int(n)).tolist(), max_tokens=4,
                       ignore_eos=True) for i, n in enumerate(rng.integers(3, 12, 4))]  # one prefill and decode shape
    single = [o.tokens for o in _kernel_engine(cfg, params, ps.MeshConfig()).generate(reqs)]
    eng = _kernel_engine(cfg, params, MESHES[arch])
    outs = eng.generate(reqs)
    assert [o.error for o in outs] == [None] * 4
    assert [o.tokens for o in outs] == single and all(len(t) == 4 for t in single)
    rows = eng.summary()["kernels"]
    built = {(r["phase"], r["op"], r["impl"]) for r in rows if r["platform"] == "default"}  # the CPU body that ran
    attn = "paged_decode_attention" if arch == "gqa" else "mla_decode_attention"
    assert {("prefill", "fp8_matmul", "pallas"), ("prefill", "fp8_grouped_matmul", "pallas"),
            ("prefill", "flash_prefill", "pallas"), ("decode", "int4_matmul", "pallas"),
            ("decode", "int4_grouped_matmul", "pallas"), ("decode", attn, "pallas")} <= built
    assert not [r for r in rows if r["platform"] == "default" and r["impl"] != "pallas"]  # no fallback ran
    layouts = {(r["phase"], r["op"]): r["layout"] for r in rows if r["platform"] == "default"}
    assert layouts[("decode", "int4_grouped_matmul")].startswith("shard_map ep")  # experts split over EP
    assert layouts[("prefill", "flash_prefill")] == "shard_map heads@tp"
    if arch == "gqa":
        assert layouts[("decode", attn)] == "shard_map heads@tp"  # the pool is split over KV heads
        assert "tp" in layouts[("decode", "int4_grouped_matmul")]  # and the expert width over TP
    else:
        assert layouts[("decode", attn)] == "shard_map replicated"  # no TP on this decode mesh: whole latent, heads
