"""The planner's ``weight_layout="engine"``: weight bytes per device as phaseserve itself places the weights, counted
on an abstract mesh, equal to the shards of the engine's own placement (``sharding.param_shardings``) on a CPU mesh;
and, for the real presets, larger than vLLM's even split by exactly what the engine's rules replicate."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from phaseserve import planner, presets
from phaseserve.planner.deployment import engine_weight_bytes
from phaseserve.quant.quantize import abstract_quantized, named_leaves, shape_dtype_tree, tensor_class
from phaseserve.sharding import make_mesh, param_shardings


@pytest.mark.parametrize("policy", ["kimi-int4", "glm-fp8", "bfloat16"])
@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 1), (1, 4)])
def test_engine_layout_equals_the_engines_shards(policy, tp, ep):
    cfg = presets.preset_config("moonlight-16b-a3b").replace(num_layers=2, moe_layers=(False, True))
    params = shape_dtype_tree(abstract_quantized(cfg, policy))
    mesh = make_mesh(jax.devices()[: tp * ep], tp=tp, ep=ep)
    shardings = param_shardings(cfg, params, mesh)
    placed = sum(math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
                 for a, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True))
    assert engine_weight_bytes(cfg, planner.weight_policy(policy).describe(), tp, ep) == placed


def test_engine_layout_adds_the_replicated_tensors():
    """Kimi K2.6 INT4 on 8 devices (tp 8): the engine's placement holds embeddings, lm_head, the MLA down-projections
    (q_a / kv_a: kv_lora / q_lora axes are replicated), norms and routers whole on every device."""
    even = planner.deployment("kimi-k2.6", "tpu-v5p", 8, "int4", "fp8", load_mtp=False)
    engine = planner.deployment("kimi-k2.6", "tpu-v5p", 8, "int4", "fp8", load_mtp=False, weight_layout="engine")
    cfg = presets.preset_config("kimi-k2.6")
    params = shape_dtype_tree(abstract_quantized(cfg, even.policy))
    replicated = 0.0
    for path, leaf in named_leaves(params):
        whole = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(leaf))
        if tensor_class(path, len(leaf.shape)) in ("embeddings", "lm_head", "norms", "router") or \
                path.endswith(("wq_a", "wkv_a", "q_a", "kv_a")):
            replicated += whole * (1 - 1 / 8)  # held whole instead of an eighth
    extra = engine.weight_bytes_per_device - even.weight_bytes_per_device
    assert extra > 4 * 2**30  # embeddings + lm_head alone: 2 x 2.2 GiB
    assert extra == pytest.approx(replicated, rel=1e-9)
    with pytest.raises(planner.PlannerError):
        planner.deployment("kimi-k2.6", "tpu-v5p", 8, "int4", "fp8", weight_layout="packed")
