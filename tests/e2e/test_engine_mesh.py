"""Disaggregated serving over real (simulated) meshes: prefill on 2 devices with tensor parallelism, decode on 4
others with tensor x expert parallelism; tokens equal the single-device engine's, weights and cache really are
sharded, and the two phases' device sets are disjoint."""

from __future__ import annotations

import jax
import pytest

import phaseserve as ps
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
