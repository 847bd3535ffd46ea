"""Smoke run of the soak experiment through Hydra's compose API on a one-layer tiny model: a handful of requests on a
tiny pool (so preemption, swap and a cancellation happen), the report written; nothing leaked, no false positive,
float32 equal to the large-budget replay. The full-size run is committed under benchmarks/soak/."""

from __future__ import annotations

import json

from hydra import compose, initialize_config_dir

from lab.bench import soak
from phaseserve.config_hydra import REPO_ROOT


def test_soak_smoke(tmp_path):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="experiment/soak", overrides=[
            "model=tiny_mla", "+model.overrides.num_hidden_layers=1", "+model.overrides.first_k_dense_replace=0",
            "experiment.arms=[float32/swap]", "experiment.requests=14", "experiment.num_pages=12",
            "experiment.bad_fraction=0.2", "experiment.cancel_prob=0.2", "experiment.property_examples=0"])
    res = soak.run(cfg, tmp_path)
    arm = res["arms"]["float32/swap"]
    assert arm["pages_leaked"] == 0 and arm["false_positives"] == 0 and arm["unfinished"] == 0
    assert arm["preemptions"] > 0 and arm["swap"]["swap_ins"] == arm["swap"]["swap_outs"] == arm["preemptions"]
    assert arm["malformed_refused"] == arm["malformed_typed"] > 0 and arm["cancels"] > 0
    assert arm["replay"]["equal_rate"] == 1.0 and arm["replay"]["cancelled_prefix_ok"] == arm["replay"]["cancelled"]
    assert arm["invariant_checks"] >= arm["decode_steps"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["arms"]["float32/swap"]["requests"] == 14
    assert "| float32/swap | 14 |" in (tmp_path / "README.md").read_text()
    assert (tmp_path / soak.PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
