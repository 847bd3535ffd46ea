"""Smoke runs of every experiment through Hydra's compose API on a tiny model: each writes its JSON, markdown
report, config and PNG plots, and the JSON holds the fields the reports and the reproduce summary rely on.

Settings are cut to the bone (one or two concurrency points, one or two repeats, a few short requests) so the
whole file stays within a few minutes on two CPU cores; the full-size runs are committed under benchmarks/.
"""

from __future__ import annotations

import json

from hydra import compose, initialize_config_dir

from lab.bench import integrity, kv_dtype, reproduce, weight_dtype
from phaseserve.config_hydra import REPO_ROOT

CONFIGS = str(REPO_ROOT / "configs")
# one MoE layer of the tiny MLA model: every representation still appears (attention, routed + shared experts)
COMMON = ["model=tiny_mla", "+model.overrides.num_hidden_layers=1", "+model.overrides.first_k_dense_replace=0",
          "progress=false", "workload.prompt.mean=20", "workload.output.mean=4"]
PNG = b"\x89PNG\r\n\x1a\n"


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name=name, overrides=COMMON + overrides)


def _run(module, cfg, out):
    """Run an experiment; its last logged lines must be its verdict lines, then the run directory."""
    lines: list[str] = []
    res = module.run(cfg, out, log=lines.append)
    verdicts = json.loads((out / "results.json").read_text())["summary"]["verdicts"]
    assert len(verdicts) >= 2 and lines[-1] == f"run directory: {out}"
    assert lines[-1 - len(verdicts):-1] == [f"{v['claim']}: {v['measured']} (published {v['published']}) -> "
                                             f"{v['outcome']}" for v in verdicts]
    return res, verdicts


def _outputs(out, pngs):
    data = json.loads((out / "results.json").read_text())
    md = (out / "README.md").read_text()
    assert (out / "config.yaml").read_text().count("tiny-mla-moe") >= 1
    for p in pngs:
        assert (out / p).read_bytes()[:8] == PNG, p
        assert f"![{p}]({p})" in md
    env = data["environment"]
    assert env["machine"] and env["jax"] and env["date"] and env["cpu_cores"] >= 1
    assert "## Environment" in md and "Verdicts" in md and "## Against the published shape" not in md
    assert all(r["compiles"] == 0 for r in data["records"])  # asserted by the sweep runner
    return data, md


def test_kv_dtype_fp8_admits_twice_the_bf16_requests(tmp_path):
    # budget: 1 BF16 request of 20 + 4 tokens (2 pages of 16) -> FP8 holds 2 in the same bytes
    cfg = _compose("experiment/kv_dtype", ["workload.concurrency=[1,2]", "cache.kv_budget_requests=1",
                                           "experiment.repeats=1"])
    res, verdicts = _run(kv_dtype, cfg, tmp_path)
    data, md = _outputs(tmp_path, ["throughput.png", "admitted.png", "tpot.png", "e2e_p95.png"])
    arms, summary = data["arms"], data["summary"]
    assert set(arms) == {"BF16", "FP8"} and data["settings"]["budget_bytes"] > 0
    assert arms["BF16"]["admitted_at_saturation"] == 1 and arms["FP8"]["admitted_at_saturation"] == 2
    assert summary["peaks"]["BF16"]["first_offered_concurrency_not_fully_admitted"] == 2
    assert summary["aggregate"]["FP8"]["2"]["peak_concurrency"]["median"] == 2
    assert summary["aggregate"]["BF16"]["2"]["peak_concurrency"]["median"] == 1
    h = summary["headline"]["FP8"]
    assert h["admitted_ratio"] == 2.0 and h["peak_gain"]["n"] == 1
    assert len(data["records"]) == 4 and all(r["finish_reasons"] == {"length": r["requests"]} for r in data["records"])
    assert "| 2 | FP8 | 2.00 |" in md
    assert res["arms"]["FP8"]["num_pages"] > res["arms"]["BF16"]["num_pages"] > 1
    assert verdicts[0]["measured"] == "2 / 1 = 2.00x" and verdicts[0]["outcome"].startswith("reproduced")
    assert verdicts[1]["outcome"] == "unresolved (fewer than 3 repeats)"  # one repeat judges nothing


def test_weight_dtype_reports_bytes_decode_and_prefill_side_by_side(tmp_path):
    cfg = _compose("experiment/weight_dtype", ["workload.concurrency=[2]", "experiment.repeats=2",
                                               "experiment.prefill_prompt=32", "experiment.prefill_requests=2",
                                               "model.overrides.n_routed_experts=8",
                                               "model.overrides.moe_intermediate_size=128",
                                               "model.overrides.num_experts_per_tok=2"])
    res, verdicts = _run(weight_dtype, cfg, tmp_path)
    data, md = _outputs(tmp_path, ["decode_throughput.png", "prefill_throughput.png"])
    w = data["weights"]
    assert w["fp8"]["decode"]["by_rep"] != w["int4"]["decode"]["by_rep"]  # really two representations
    assert any("int4" in k for k in w["int4"]["decode"]["by_rep"])
    assert any("fp8" in k for k in w["fp8"]["decode"]["by_rep"])
    ratio = w["int4"]["decode"]["total"] / w["fp8"]["decode"]["total"]
    assert verdicts[0]["measured"].startswith(f"x{ratio:.3f}")  # the byte ratio of the weights the engines hold
    assert len(data["summary"]["ratios"]["int4"]["decode"]["2"]["values"]) == 2  # one paired ratio per repeat
    pre = [r for r in data["records"] if r["point"] == "prefill"]
    assert len(pre) == 4 and all(r["prefill_tokens"] == 64 and r["output_tokens"] == 2 for r in pre)
    assert "## Prefill" in md and "## Decode weight bytes read per token" in md
    assert "XLA on CPU does not fuse" not in md  # no prose written in advance


def test_integrity_overhead_and_fault_matrix(tmp_path):
    cfg = _compose("experiment/integrity", ["workload.concurrency=[2]", "experiment.repeats=2",
                                            "experiment.arms=[on,off]",
                                            "experiment.faults=[point_at_other,free_behind,poison_scale]",
                                            "experiment.fault_trials=1", "experiment.fault_requests=3",
                                            "experiment.fault_prompt=20", "experiment.fault_output=6"])
    res, verdicts = _run(integrity, cfg, tmp_path)
    data, md = _outputs(tmp_path, ["throughput.png", "e2e_p95.png"])
    agg = data["summary"]["aggregate"]
    assert agg["on"]["2"]["integrity_checks"]["median"] > 0
    assert agg["off"]["2"]["integrity_checks"]["median"] == 0 and set(agg) == {"on", "off"}
    deltas = data["summary"]["deltas"]
    assert set(deltas) == {"on"} and len(deltas["on"]["throughput"]["2"]["values"]) == 2
    m = data["fault_matrix"]
    assert m["totals"]["on"] == {"injected": 3, "detected": 3, "missed": 0, "false_positives": 0,
                                 "victim_tokens_silently_changed": 0, "others_tokens_changed": 0, "leaked_pages": 0,
                                 "errors": 0}
    assert m["totals"]["noop"]["injected"] == 3 and m["totals"]["noop"]["detected"] == 0
    assert m["clean_after_matrix"] == {"on": True, "noop": True}
    assert all(t["caught_at_injection_step"] for t in m["trials"] if t["tracker"] == "on")
    assert "Fault-injection matrix" in md and "| poison_scale | on | 1 | 1 | 0 | 0 |" in md
    assert verdicts[0]["measured"] == "3 / 3, 0" and verdicts[0]["outcome"] == "reproduced"
    assert verdicts[1]["claim"] == "check on/off throughput, 2 paired repeats"
    assert verdicts[1]["outcome"] == "unresolved at c=2"  # two repeats judge nothing


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
    kv = data["summary"]["by_experiment"]["kv_dtype"]
    assert kv[0]["claim"].startswith("FP8/BF16 KV requests admitted") and kv[0]["measured"].endswith("= 2.00x")
    if "capacity" in expected:
        assert (tmp_path / "capacity" / "capacity.json").exists()
        roles = [v["claim"] for v in data["summary"]["by_experiment"]["capacity"]]
        assert roles == ["planner, fitted figure", "planner, follows figure", "planner, count figures",
                         "planner, held-out figures"]
    assert "| experiment | result | published (GPU) | measured here | verdict |" in md and "## Environment" in md
