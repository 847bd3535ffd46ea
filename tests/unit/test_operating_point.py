"""The operating-point rule (lab/bench/operating_point.py) on synthetic decode-step curves, the roofline bound
and the kv_dtype experiment's use of a curve. Pure functions: no engine, no JAX computation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from lab.bench import operating_point as op

BATCHES = [1, 2, 4, 8, 16, 32, 64]


def flat_then_linear(knee: float, fixed: float, rng: np.random.Generator) -> dict[int, float]:
    """t(B) = fixed while B <= knee, then linear through (knee, fixed), times a little multiplicative noise."""
    return {b: fixed * max(1.0, b / knee) * (1 + 0.01 * rng.random()) for b in BATCHES}


def linear(per_row: float, rng: np.random.Generator) -> dict[int, float]:
    return {b: per_row * b * (1 + 0.01 * rng.random()) for b in BATCHES}


def entry(model: str, params: int, curve: dict, weights: str = "bfloat16") -> dict:
    return {"model": model, "params": params, "weights": weights, "curve": curve}


def test_flat_then_linear_picks_the_last_batch_whose_doubling_stays_cheap():
    rng = np.random.default_rng(1)
    fixed = float(rng.uniform(0.01, 0.1))
    curve = flat_then_linear(12.0, fixed, rng)  # flat to 12: 8 -> 16 buys 2 * 12/16 = 1.5x, 16 -> 32 buys 1x
    gains = op.doubling_gains(curve)
    assert gains[4] == pytest.approx(2.0, rel=0.02) and gains[16] == pytest.approx(1.0, rel=0.02)
    got = op.choose([entry("m", 10, curve)], min_gain=1.4, min_batch=4)
    assert got["batch"] == 8 and got["fp8_batch"] == 16
    assert got["predicted_gain"] == pytest.approx(2 * curve[8] / curve[16])
    assert got["step_s"] == [curve[8], curve[16]]
    r = op.regime(curve, 1.4)
    assert r["flat_until"] == 8
    assert r["ridge_batch"] == pytest.approx(12.0, rel=0.05)  # t(1) / slope of the linear tail
    assert r["cheap_doublings"] == [1, 2, 4, 8] and "at B = [1, 2, 4, 8]" in r["bound"]


def test_linear_everywhere_has_no_operating_point():
    rng = np.random.default_rng(2)
    curve = linear(float(rng.uniform(1e-3, 1e-2)), rng)
    assert all(g == pytest.approx(1.0, rel=0.03) for g in op.doubling_gains(curve).values())
    assert op.choose([entry("m", 10, curve)], min_gain=1.5, min_batch=4) is None
    r = op.regime(curve, 1.5)
    assert r["flat_until"] is None and r["cheap_doublings"] == [] and r["bound"].startswith("no batch")
    assert r["ridge_batch"] == pytest.approx(1.0, rel=0.05)


def test_min_batch_excludes_a_flat_start_that_ends_too_soon():
    rng = np.random.default_rng(3)
    curve = flat_then_linear(2.0, 0.05, rng)  # only 1 -> 2 is cheap
    assert op.choose([entry("m", 10, curve)], min_gain=1.5, min_batch=4) is None
    assert op.choose([entry("m", 10, curve)], min_gain=1.5, min_batch=1)["batch"] == 1


def test_the_smallest_model_with_a_candidate_wins_then_the_cheaper_weights():
    rng = np.random.default_rng(4)
    curves = [entry("big", 500, flat_then_linear(64.0, 0.5, rng)),
              entry("small-linear", 5, linear(1e-3, rng)),
              entry("mid-f32", 50, flat_then_linear(20.0, 0.1, rng), "float32"),
              entry("mid-bf16", 50, flat_then_linear(40.0, 0.06, rng), "bfloat16")]
    got = op.choose(curves, min_gain=1.5, min_batch=4)
    assert (got["model"], got["weights"], got["batch"]) == ("mid-bf16", "bfloat16", 16)


def test_roofline_step_is_memory_bound_until_the_matmuls_take_longer():
    facts = {"params": 1_000_000, "embedding_params": 0, "routed_expert_params": 0, "experts_per_token": 1,
             "num_experts": 1, "active_params_per_token": 1_000_000}
    bw, flops = 10e9, 100e9  # 10 FLOP per byte: ridge at B = 10 * 4 / 2 = 20 for float32
    assert op.roofline_step(facts, 16, 4, bw, flops)["bound"] == "memory"
    r = op.roofline_step(facts, 32, 4, bw, flops)
    assert r["bound"] == "compute" and r["step_s"] == pytest.approx(2 * 1e6 * 32 / flops)
    moe = {**facts, "routed_expert_params": 800_000, "experts_per_token": 2, "num_experts": 8,
           "active_params_per_token": 400_000}
    one, many = op.roofline_step(moe, 1, 4, bw, 1e18), op.roofline_step(moe, 64, 4, bw, 1e18)
    assert one["memory_s"] == pytest.approx((200_000 + 800_000 * 0.25) * 4 / bw)  # batch 1 reads 2 of 8 experts
    assert many["memory_s"] == pytest.approx(1e6 * 4 / bw, rel=1e-3)  # batch 64 touches them all


def test_model_node_scales_the_default_architecture():
    cfg = OmegaConf.create({"model": {"name": "x"}})
    node = op.model_node(cfg, op.ModelEntry(name="w3", width=3, layers=5, overrides={"n_routed_experts": 16}))
    base = OmegaConf.load(op.REPO_ROOT / "configs/model/default_random.yaml").hf
    assert node["overrides"]["hidden_size"] == 3 * base.hidden_size
    assert node["overrides"]["kv_lora_rank"] == 3 * base.kv_lora_rank
    assert node["overrides"]["num_hidden_layers"] == 5 and node["overrides"]["n_routed_experts"] == 16
    assert node["checkpoint"] is None and node["hf"]["vocab_size"] == base.vocab_size


def test_apply_operating_point_moves_kv_dtype_to_the_chosen_point(tmp_path):
    rng = np.random.default_rng(5)
    node = {"name": "mid", "checkpoint": None, "preset": None, "hf": {"vocab_size": 264}, "overrides": {"x": 1},
            "dtype": "float32", "seed": 0}
    records = [{"arm": f"{m}/bfloat16", "point": b, "repeat": 0, "step_min_s": t}
               for m, curve in (("mid", flat_then_linear(40.0, 0.06, rng)), ("lin", linear(1e-3, rng)))
               for b, t in curve.items()]
    res = {"settings": {"weights": ["bfloat16"], "min_gain": 1.5, "min_batch": 4},
           "environment": {"date": "d", "git_commit": "c"}, "records": records,
           "models": [{"name": "mid", "params": 50, "model_node": node},
                      {"name": "lin", "params": 5, "model_node": {**node, "name": "lin"}}]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(res))
    cfg = OmegaConf.create({"model": {"name": "default", "checkpoint": "models/default", "preset": None, "hf": None,
                                      "overrides": {}, "dtype": "float32", "seed": 0},
                            "quant": {"prefill_weights": "float32", "decode_weights": "float32"},
                            "cache": {"kv_budget_requests": 16, "kv_budget_bytes": None, "budget_dtype": "float32"},
                            "workload": {"concurrency": [1, 4]}})
    out, info = op.apply_operating_point(cfg, path)
    assert info["model"] == "mid" and info["batch"] == 16 and info["rule"].startswith("the smallest model")
    assert out.model.checkpoint is None and out.model.overrides.x == 1
    assert out.quant.decode_weights == "bfloat16" and out.cache.kv_budget_requests == 16
    assert out.cache.budget_dtype == "bfloat16" and list(out.workload.concurrency) == [16, 32]
    res["records"] = [r for r in records if r["arm"].startswith("lin")]
    path.write_text(json.dumps(res))
    with pytest.raises(ValueError, match="no operating point"):
        op.apply_operating_point(cfg, path)
