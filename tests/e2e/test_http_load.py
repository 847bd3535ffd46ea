"""A smoke run of the HTTP load experiment (``experiments/http_load.py``) on a tiny model: the server starts on a free
loopback port, the official ``openai`` client in its own process drives it beside the in-process arm, every
request of every arm completes, each record says how many timed runs were repeated because JAX compiled inside
them, and the report and headline are written."""

from __future__ import annotations

import json

from hydra import compose, initialize_config_dir

from phaseserve.bench import http_load
from phaseserve.config_hydra import REPO_ROOT

OVERRIDES = ["model=tiny_mla", "+model.overrides.num_hidden_layers=1", "+model.overrides.first_k_dense_replace=0",
             "progress=false", "workload.prompt.mean=20", "workload.output.mean=4", "workload.concurrency=[2]",
             "workload.waves=1", "experiment.repeats=1", "experiment.headline_concurrency=2", "engine.max_batch=2"]


def test_http_load_runs_every_arm_and_reports_the_ratio(tmp_path):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="experiment/http_load", overrides=OVERRIDES)
    lines: list[str] = []
    res = http_load.run(cfg, tmp_path, log=lines.append)
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    assert sorted(r["arm"] for r in records) == ["http", "http-coalesced", "in-process"]
    assert len({r["requests"] for r in records}) == 1 and records[0]["requests"] >= 2  # the same requests per arm
    for r in records:
        assert r["output_tokens"] == 4 * r["requests"], r["arm"]  # every request completed its 4 tokens
        assert r["reruns"] in (0, 1) and r["server_cpu_s"] > 0
    assert all(r["client_cpu_s"] > 0 for r in records if r["arm"] != "in-process")
    ratio = res["ratio_http_over_in_process"]["http"]["output_tok_per_s"]
    r = ratio.get(2) or ratio.get("2")
    assert r["n"] == 1 and r["median"] > 0
    md = (tmp_path / "README.md").read_text()
    assert "Timed runs repeated because JAX compiled inside them" in md
    assert any(line.startswith("http throughput at concurrency 2:") for line in lines)
