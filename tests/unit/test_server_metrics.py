"""The server's Prometheus exposition also carries the metrics vLLM exports under vLLM's ``vllm:`` names, with the
same values as their ``phaseserve:`` originals (dashboards built for vLLM read this server)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from phaseserve.server.metrics import VLLM_NAMES, ServerMetrics


def _samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_vllm_names_mirror_the_phaseserve_metrics():
    m = ServerMetrics("m")
    m.on_step({"running": 3, "waiting": 2, "kv_pages_used": 6, "kv_pages_free": 2, "preemptions": 4,
               "prefix_lookup_pages": 5, "prefix_hit_pages": 1})
    m.ttft.observe(0.2)
    m.finished.labels("m", "length").inc()
    got = _samples(m.render().decode())
    lab = (("model_name", "m"),)
    assert got[("vllm:num_requests_running", lab)] == 3 and got[("vllm:num_requests_waiting", lab)] == 2
    assert got[("vllm:num_preemptions_total", lab)] == 4
    assert got[("vllm:kv_cache_usage_perc", lab)] == 0.75
    assert got[("vllm:time_to_first_token_seconds_count", lab)] == 1
    assert got[("vllm:request_success_total", (("finished_reason", "length"), ("model_name", "m")))] == 1
    for (name, labels), v in got.items():
        if name.startswith("vllm:") and name != "vllm:kv_cache_usage_perc":
            assert got[(name.replace("vllm:", "phaseserve:"), labels)] == v or name.endswith("_created")
            assert any(name.removeprefix("vllm:").startswith(n.removesuffix("_total")) for n in VLLM_NAMES)
    assert not any(n.startswith("vllm:prefix_cache") for n, _ in got)  # pages here, tokens in vLLM: not aliased
