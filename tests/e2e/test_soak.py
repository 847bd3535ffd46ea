"""The soaks, through Hydra's compose API.

- The engine soak's smoke run on a one-layer tiny model: a handful of requests on a tiny pool (so preemption, swap
  and a cancellation happen), the report written; nothing leaked, no false positive, float32 equal to the
  large-budget replay. The full-size run is committed under benchmarks/soak/.
- The HTTP server's reliability soak (issue #42): 15 s of sustained mixed load -- good requests, 4xx mistakes,
  client disconnects mid-stream, duplicate ids, oversized bodies -- then RSS growth bounded, every page free,
  invariants clean, nothing in flight, /health 200 and every response of its expected status and error code.
  The few-minute run is committed under benchmarks/reliability/."""

from __future__ import annotations

import json

from hydra import compose, initialize_config_dir

from lab.bench import reliability, soak
from phaseserve.config_hydra import REPO_ROOT


def test_soak_smoke(tmp_path):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="experiment/soak", overrides=[
            "model=tiny_mla", "+model.overrides.num_hidden_layers=1", "+model.overrides.first_k_dense_replace=0",
            "experiment.arms=[float32/swap]", "experiment.requests=14", "experiment.num_pages=12",
            "experiment.bad_fraction=0.2", "experiment.cancel_prob=0.2", "experiment.property_examples=0",
            # each step waits for its prefill, so a preemption's victim is a decoding request and every preemption
            # is a swap (with the overlap a victim may still be prefilling: recomputed, not swapped)
            "engine.overlap_prefill=false"])
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


def test_the_server_survives_sustained_mixed_load(tmp_path):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="experiment/reliability", overrides=[
            "experiment.seconds=15", "experiment.warmup_seconds=6", "experiment.concurrency=4", "engine.max_batch=2",
            "experiment.cancel_max_tokens=60", "experiment.keep_finished=64", "experiment.max_in_flight=16",
            "cache.num_pages=64"])
    res = reliability.run(cfg, tmp_path)
    assert res["unexpected_count"] == 0, res["unexpected"]
    assert all(res["checks"].values()), res["checks"]
    assert set(res["by_kind"]) == {"good", "bad", "cancelled", "duplicate", "oversized"}
    assert all(n >= 3 for n in res["by_kind"].values()), res["by_kind"]
    statuses = {(x["kind"], x["status"]) for x in res["responses"]}
    assert {("good", 200), ("oversized", 413), ("cancelled", 200)} <= statuses
    assert {s for k, s in statuses if k == "bad"} >= {400, 404, 401}
    assert res["pages"]["in_use_after_drain"] == 0 and res["pages"]["peak_in_use"] > 0 and res["health"] == 200
    assert res["rss_mib"]["growth_since_baseline"] < 64
    assert res["engine_outputs_kept"] <= 64 + 16 + 4
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["requests"] == res["requests"] > 50
    assert "| every response as expected | pass |" in (tmp_path / "README.md").read_text()
    assert (tmp_path / reliability.PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
