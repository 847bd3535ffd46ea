"""Orbax save/restore of quantized param trees: bit-exact for every representation, restored straight into the
shardings of a different simulated mesh (8 CPU devices, see tests/conftest.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from pallas_kernels.fp8_matmul import Fp8Weight
from pallas_kernels.int4_matmul import Int4Weight
from phaseserve import presets
from phaseserve.model.params import abstract_params, is_info, map_infos
from phaseserve.quant import abstract_quantized, quantize_params, resolve_policy
from phaseserve.quant.checkpoint import (
    make_mesh,
    restore_params,
    restore_target,
    save_params,
    saved_policy,
    shardings_for,
    spec_for,
)
from phaseserve.quant.quantize import leaf_rep, named_leaves

# One tree holding every representation: f32 and bf16 plain, FP8 block and per-channel, INT4 g32 (bf16 scales)
# and g128 (f32 scales).
MIXED = ("base=float32,attention=fp8,shared_experts=fp8:channel,routed_experts=int4:g32:bf16,dense_mlp=int4:g128,"
         "lm_head=bfloat16")


def random_params(cfg, seed: int):
    rng = np.random.default_rng(seed)

    def leaf(info):
        if info.init in ("ones", "zeros"):
            return jnp.asarray((info.init == "ones") + 0.1 * rng.standard_normal(info.shape), jnp.float32)
        return jnp.asarray(rng.standard_normal(info.shape) / np.sqrt(info.shape[0]), jnp.float32)

    return map_infos(leaf, abstract_params(cfg))


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


@pytest.fixture(scope="module")
def cfg():
    return presets.preset_config("tiny-mla-moe")


def test_spec_for_follows_logical_axes_and_divisibility():
    mesh = make_mesh((2, 4), ("ep", "tp"))
    assert spec_for((8, 128, 128), ("experts", "embed", "expert_mlp"), mesh) == PartitionSpec("ep", None, "tp")
    assert spec_for((8, 4, 128), ("experts", "embed", "expert_mlp"), mesh) == PartitionSpec("ep", None, "tp")
    assert spec_for((5, 128, 130), ("experts", "embed", "expert_mlp"), mesh) == PartitionSpec(None, None, None)
    assert spec_for((128, 144), ("embed", "kv_lora"), mesh) == PartitionSpec(None, None)  # MLA latent replicated
    assert spec_for((256, 256), ("q_heads", "mlp"), mesh) == PartitionSpec("tp", None)  # one mesh axis per array
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh((4, 4), ("ep", "tp"))


def test_round_trip_every_representation_onto_another_mesh(cfg, tmp_path):
    params = quantize_params(random_params(cfg, 0), MIXED)
    assert {leaf_rep(x) for _, x in named_leaves(params)} >= {
        "float32", "bfloat16", "fp8:b128x128", "fp8:channel", "int4:g32:bf16", "int4:g128:f32"}
    abstract = abstract_quantized(cfg, MIXED)
    mesh_a = make_mesh((2, 4), ("ep", "tp"))
    placed = jax.device_put(params, shardings_for(abstract, mesh_a))
    assert placed.layers[1].mlp.w_gate.packed.sharding.spec == PartitionSpec("ep", None, "tp")
    path = save_params(tmp_path / "ckpt", placed, policy=MIXED)
    assert saved_policy(path) == resolve_policy(resolve_policy(MIXED).describe())

    mesh_b = make_mesh((4, 2), ("ep", "tp"), devices=jax.devices()[::-1])
    target = restore_target(abstract, mesh_b)
    restored = restore_params(path, target)
    assert jax.tree.structure(restored) == jax.tree.structure(params)
    for a, b, t in zip(jax.tree.leaves(params), jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(_bits(a), _bits(b))
        assert b.sharding == t.sharding
    w = restored.layers[1].mlp.w_gate
    assert isinstance(w, Int4Weight) and w.group_size == 32
    assert w.packed.sharding.mesh.shape == {"ep": 4, "tp": 2}
    assert len(w.packed.addressable_shards) == 8 and w.packed.addressable_shards[0].data.shape == (2, 64, 64)
    fp8 = restored.layers[1].mlp.shared.w_up
    assert isinstance(fp8, Fp8Weight) and fp8.block == (128, 1)

    # a 1-D tensor-parallel mesh with other axis names, target rebuilt from (cfg, recorded policy)
    mesh_c = make_mesh((8,), ("tp",))
    again = restore_params(path, cfg=cfg, mesh=mesh_c)
    assert again.layers[1].mlp.w_gate.packed.sharding.spec == PartitionSpec(None, None, "tp")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again), strict=True):
        assert np.array_equal(_bits(a), _bits(b))


def test_shipped_policies_round_trip(cfg, tmp_path):
    for policy in ("kimi-int4", "glm-fp8"):
        params = quantize_params(random_params(cfg, 1), policy)
        path = save_params(tmp_path / policy, params, policy=policy)
        restored = restore_params(path, cfg=cfg, mesh=make_mesh((2, 4), ("ep", "tp")))
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored), strict=True):
            assert np.array_equal(_bits(a), _bits(b)) and a.dtype == b.dtype
    with pytest.raises(FileExistsError):
        save_params(tmp_path / "glm-fp8", params)
    save_params(tmp_path / "glm-fp8", params, overwrite=True)
    with pytest.raises(ValueError, match="records no policy"):
        restore_params(tmp_path / "glm-fp8", cfg=cfg)
    assert not any(is_info(x) for x in jax.tree.leaves(restored))
