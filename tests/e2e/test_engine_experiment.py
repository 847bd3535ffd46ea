"""Smoke run of the engine experiment (phaseserve against transformers generate) on a tiny model through Hydra's
compose API: JSON, markdown and plots are written, both arms are measured for every batch and repeat, the greedy
tokens agree in float32, no timed engine run compiled, and the console verdict lines carry the measured ratios."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from lab.markdown import fmt
from phaseserve.config_hydra import REPO_ROOT

PNG = b"\x89PNG\r\n\x1a\n"


def test_engine_experiment_writes_both_arms_and_agrees_in_float32(tmp_path):
    pytest.importorskip("transformers")
    from lab.bench import engine_speed

    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="experiment/engine", overrides=[
            "model=tiny_mla", "+model.overrides.num_hidden_layers=1", "+model.overrides.first_k_dense_replace=0",
            "progress=false", "experiment.batches=[2]", "experiment.prompt_len=8", "experiment.new_tokens=4",
            "experiment.repeats=2"])
    res = engine_speed.run(cfg, tmp_path, log=lambda *_: None)
    data = json.loads((tmp_path / "results.json").read_text())
    md = (tmp_path / "README.md").read_text()
    for png in ("tokens_per_s.png", "tpot.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG and f"![{png}]({png})" in md
    recs = data["records"]
    assert sorted((r["arm"], r["point"], r["repeat"]) for r in recs) == sorted(
        (a, b, k) for a in engine_speed.ARMS for b in (2,) for k in (0, 1))
    assert all(r["tok_per_s"] > 0 and r["tpot_s"] > 0 for r in recs)
    engine_recs = [r for r in recs if r["arm"] != engine_speed.HF]
    assert all(r["reruns"] == 0 for r in engine_recs)  # warmed up: no compile inside a timed run
    assert all(0 <= r["host_fraction"] < 1 for r in engine_recs)
    assert data["greedy_agreement"] == {"2": 1.0} and data["greedy_agreement_replicas"] == {"2": 1.0}
    assert data["settings"]["replicas"] == 2 and "phaseserve, replicas" in data["ratio_tok_per_s"]
    assert {r["arm"] for r in recs} == set(engine_speed.ARMS)
    check = data["thread_check"]["2"]  # at each batch, transformers runs with the thread count that batch's check
    assert set(check) >= {"1"}  # found faster
    assert data["environment"]["torch_threads"] == {"2": int(max(check, key=lambda n: check[n]["median"]))}
    ratio = res["ratio_tok_per_s"][engine_speed.SHARED][2]["median"]
    lines = engine_speed.verdict_lines(res)
    assert len(lines) == 3 and f"batch 2: {fmt(ratio)}x" in lines[0] and lines[0] in md
    rep = res["ratio_tok_per_s"][engine_speed.REPLICAS][2]["median"]
    assert f"2 data-parallel replicas: batch 2: {fmt(rep)}x" in lines[0] and "| replicas tok/s |" in md
    assert res["ratio_replicas_over_one_engine"][2]["n"] == 2
