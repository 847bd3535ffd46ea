"""Smoke runs of every experiment through Hydra's compose API on a tiny model: each writes its JSON, markdown
report, config and PNG plots, and the JSON holds the fields the reports and the reproduce summary rely on.

Settings are cut to the bone (one or two concurrency points, one or two repeats, a few short requests) so the
whole file stays within a few minutes on two CPU cores; the full-size runs are committed under benchmarks/.
"""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from phaseserve.bench import integrity, kv_dtype, reproduce, weight_dtype
from phaseserve.config_hydra import REPO_ROOT

CONFIGS = str(REPO_ROOT / "configs")
# one MoE layer of the tiny MLA model: every representation still appears (attention, routed + shared experts)
COMMON = ["model=tiny_mla", "+model.overrides.num_hidden_layers=1", "+model.overrides.first_k_dense_replace=0",
          "progress=false", "workload.prompt.mean=20", "workload.output.mean=4"]
PNG = b"\x89PNG\r\n\x1a\n"


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name=name, overrides=COMMON + overrides)


def _outputs(out, pngs):
    data = json.loads((out / "results.json").read_text())
    md = (out / "README.md").read_text()
    assert (out / "config.yaml").read_text().count("tiny-mla-moe") >= 1
    for p in pngs:
        assert (out / p).read_bytes()[:8] == PNG, p
        assert f"![{p}]({p})" in md
    env = data["environment"]
    assert env["machine"] and env["jax"] and env["date"] and env["cpu_cores"] >= 1
    assert "## Environment" in md and "## Against the published shape" in md
    return data, md


def test_kv_dtype_fp8_admits_twice_the_bf16_requests(tmp_path):
    # budget: 1 BF16 request of 20 + 4 tokens (2 pages of 16) -> FP8 holds 2 in the same bytes
    cfg = _compose("experiment/kv_dtype", ["workload.concurrency=[1,2]", "cache.kv_budget_requests=1",
                                           "experiment.repeats=1"])
    res = kv_dtype.run(cfg, tmp_path, log=lambda *_: None)
    data, md = _outputs(tmp_path, ["throughput.png", "admitted.png", "tpot.png", "e2e_p95.png"])
    arms = data["arms"]
    assert set(arms) == {"BF16", "FP8"} and data["settings"]["budget_bytes"] > 0
    assert arms["BF16"]["admitted_at_saturation"] == 1 and arms["FP8"]["admitted_at_saturation"] == 2
    assert arms["BF16"]["first_offered_concurrency_not_fully_admitted"] == 2
    assert data["aggregate"]["FP8"]["2"]["peak_concurrency"]["median"] == 2
    assert data["aggregate"]["BF16"]["2"]["peak_concurrency"]["median"] == 1
    h = data["headline"]["FP8"]
    assert h["admitted_ratio"] == 2.0 and h["peak_gain"] > 0 and h["cost_per_token_ratio"] == pytest.approx(
        1 / h["peak_gain"])
    assert len(data["records"]) == 4 and all(r["compiles"] == 0 for r in data["records"])  # warmed up
    assert all(r["finish_reasons"] == {"length": r["requests"]} for r in data["records"])
    assert "Peak vs peak" in md and "| 2 | FP8 | 2.00 |" in md
    assert res["arms"]["FP8"]["num_pages"] > res["arms"]["BF16"]["num_pages"] > 1
    rows = reproduce._summary("kv_dtype", res)  # the rows the combined report takes from this experiment
    assert [r[0] for r in rows] == ["FP8/BF16 KV: admitted at saturation, one budget",
                                    "FP8/BF16 KV: peak vs peak throughput", "FP8/BF16 KV: cost per token"]
    assert rows[0][2] == "2 / 1 = 2.00x"


def test_weight_dtype_reports_decode_and_prefill_side_by_side(tmp_path):
    cfg = _compose("experiment/weight_dtype", ["workload.concurrency=[2]", "experiment.repeats=2",
                                               "experiment.prefill_prompt=32", "experiment.prefill_requests=2"])
    res = weight_dtype.run(cfg, tmp_path, log=lambda *_: None)
    data, md = _outputs(tmp_path, ["decode_throughput.png", "prefill_throughput.png"])
    w = data["weights"]
    assert w["fp8"]["decode_by_rep"] != w["int4"]["decode_by_rep"]  # really two representations
    assert any("int4" in k for k in w["int4"]["decode_by_rep"]) and any("fp8" in k for k in w["fp8"]["decode_by_rep"])
    h = data["headline"]["int4"]
    assert h["decode_ratio_c1"] > 0 and h["prefill_ratio"] > 0
    assert len(data["ratios"]["int4"]["decode"]["2"]["values"]) == 2  # one paired ratio per repeat
    pre = [r for r in data["records"] if r["point"] == "prefill"]
    assert len(pre) == 4 and all(r["prefill_tokens"] == 64 and r["output_tokens"] == 2 for r in pre)
    assert "XLA on CPU does not fuse" in md and "## Prefill" in md
    rows = reproduce._summary("weight_dtype", res)
    assert [r[1] for r in rows] == ["92 / 60 = +53%", "+16% to +55%", "8,660 / 10,160 = -15%"]
    assert all(r[2].endswith("%") for r in rows)


def test_integrity_overhead_and_fault_matrix(tmp_path):
    cfg = _compose("experiment/integrity", ["workload.concurrency=[2]", "experiment.repeats=2",
                                            "experiment.arms=[on,off]",
                                            "experiment.faults=[point_at_other,free_behind,poison_scale]",
                                            "experiment.fault_trials=1", "experiment.fault_requests=3",
                                            "experiment.fault_prompt=20", "experiment.fault_output=6"])
    res = integrity.run(cfg, tmp_path, log=lambda *_: None)
    data, md = _outputs(tmp_path, ["throughput.png", "e2e_p95.png"])
    agg = data["aggregate"]
    assert agg["on"]["2"]["integrity_checks"]["median"] > 0
    assert agg["off"]["2"]["integrity_checks"]["median"] == 0 and set(agg) == {"on", "off"}
    assert set(data["deltas"]) == {"on"} and len(data["deltas"]["on"]["throughput"]["2"]["values"]) == 2
    m = data["fault_matrix"]
    assert m["totals"]["on"] == {"injected": 3, "detected": 3, "missed": 0, "false_positives": 0,
                                 "victim_tokens_silently_changed": 0, "others_tokens_changed": 0, "leaked_pages": 0,
                                 "errors": 0}
    assert m["totals"]["noop"]["injected"] == 3 and m["totals"]["noop"]["detected"] == 0
    assert m["clean_after_matrix"] == {"on": True, "noop": True}
    assert all(t["caught_at_injection_step"] for t in m["trials"] if t["tracker"] == "on")
    assert "Fault-injection matrix" in md and "| poison_scale | on | 1 | 1 | 0 | 0 |" in md
    rows = {r[0]: r[2] for r in reproduce._summary("integrity", res)}
    assert rows["faults with tracker on: detected / injected, false positives"] == "3 / 3, 0"
    assert rows["faults with tracker noop: detected / injected, false positives"] == "0 / 3, 0"
    assert rows["integrity on vs off: throughput"].startswith("c=2: ")


def test_reproduce_runs_the_experiments_into_one_report(tmp_path):
    """kv_dtype (and the capacity planner when its entry point exists) through reproduce: sub-configs composed
    with the shared and per-experiment overrides, sub-reports in subdirectories, one combined report. (The rows
    each experiment contributes are checked in that experiment's test above.)"""
    cfg = _compose("experiment/reproduce", [
        "experiment.experiments=[kv_dtype,capacity]",
        'experiment.overrides=["model=tiny_mla","+model.overrides.num_hidden_layers=1",'
        '"+model.overrides.first_k_dense_replace=0","progress=false","workload.prompt.mean=20",'
        '"workload.output.mean=4","experiment.repeats=1"]',
        'experiment.per_experiment.kv_dtype=["cache.kv_budget_requests=1","workload.concurrency=[2]"]'])
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):  # sub-experiments compose their own configs
        res = reproduce.run(cfg, tmp_path, log=lambda *_: None)
    data = json.loads((tmp_path / "results.json").read_text())
    md = (tmp_path / "README.md").read_text()
    expected = ["kv_dtype"] + (["capacity"] if reproduce.CAPACITY_SCRIPT.exists() else [])
    assert list(data["runs"]) == expected == list(res["runs"])
    for name in expected:
        assert (tmp_path / name / "README.md").exists(), name
        assert f"[{name}/README.md]({name}/README.md)" in md and data["runs"][name]["seconds"] > 0
    assert "cache.kv_budget_requests=1" in data["runs"]["kv_dtype"]["overrides"]
    assert json.loads((tmp_path / "kv_dtype" / "results.json").read_text())["settings"]["concurrency"] == [2]
    kv = data["runs"]["kv_dtype"]["summary"]
    assert kv[0][0].startswith("FP8/BF16 KV: admitted") and kv[0][2].endswith("= 2.00x")
    if "capacity" in expected:
        assert (tmp_path / "capacity" / "capacity.json").exists()
        assert data["runs"]["capacity"]["summary"][0][0].startswith("planner vs published")
    assert "| result | published (GPU) | measured here |" in md and "## Environment" in md
    assert "## Where this machine agrees with the published shape" in md and "capacity under one budget" in md
