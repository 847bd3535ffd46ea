"""The hostile Ray soak (``lab/bench/ray_soak.py``) run short: good requests one at a time, every kind of malformed
body and transfer-port garbage at once through the HTTP server on a two-node Ray cluster; then 0 leaked pages or
staging entries, 0 5xx answers to client errors, 0 integrity aborts, no actor death, /health 200, and the good
requests' text equal to an in-process engine's. The committed run (minutes) is ``benchmarks/ray_soak``."""

from __future__ import annotations

import pytest

from lab.bench.ray_soak import SoakSpec, bad_bodies, report, soak, verdict


@pytest.mark.slow  # a Ray cluster and two engines: run by `pytest -m slow` (README)
def test_a_short_hostile_soak_passes_every_check():
    res = soak(SoakSpec(seconds=20.0, max_good=12))
    v = res["verdict"]
    assert v["passed"], (v["checks"], res["loops"]["errors"][:5])
    assert v["good"] >= 3 and v["bad"] >= len(bad_bodies()) and v["garbage_connections"] > 0
    assert "| 0 5xx answers to client errors | yes |" in report(res)


def test_the_verdict_can_fail():
    """One 5xx, one leaked page or one differing text each fail the soak."""
    base = {"loops": {"good": [{"text": "a"}], "bad": {"x": {400: 3}}, "garbage": {"flood": 1}},
            "idle": {"decode_pages_held": 0, "prefill_pages_held": 0, "staged_entries": 0, "staging_pages": 0,
                     "deaths": {"prefill": 0, "decode": 0}},
            "integrity_aborts_total": 0, "health_after": 200, "replay": ["a"]}
    assert verdict(base)["passed"]
    assert not verdict({**base, "loops": {**base["loops"], "bad": {"x": {400: 3, 500: 1}}}})["passed"]
    assert not verdict({**base, "idle": {**base["idle"], "prefill_pages_held": 1}})["passed"]
    assert not verdict({**base, "replay": ["b"]})["passed"]
