"""The HTTP layer's CPU cost (``lab.bench.http_cost``): the server over a model-free stub backend, driven by the
official ``openai`` client, streams every token of every request, and the report splits the server's CPU time into
a per-write and a per-request part."""

from __future__ import annotations

from lab.bench import http_cost


def test_writes_per_request_follow_the_stream_interval():
    assert http_cost.events_per_request(32, 1) == 32
    assert http_cost.events_per_request(32, 4) == 9  # tokens 1 | 2-5 | ... | 30-32 (the last one shorter)
    assert http_cost.events_per_request(1, 4) == 1


def test_the_stub_backend_finishes_each_request_at_its_length():
    b = http_cost.StubBackend(step_s=0.0)
    outs = [b.submit(http_cost.Request(id=f"r{n}", prompt=[1, 2], max_tokens=n)) for n in (1, 3)]
    while b.has_work:
        b.advance()
    assert [len(o.tokens) for o in outs] == [1, 3] and all(o.finish_reason == "length" for o in outs)
    assert b.steps == 3 and b.stats()["running"] == 0


def test_measure_reports_server_cpu_per_request_and_the_per_write_split():
    lines: list[str] = []
    res = http_cost.measure([1, 4], requests=6, concurrency=3, tokens=9, prompt_len=8, step_s=0.001, repeats=2,
                            log=lines.append)
    rows = {r["stream_interval"]: r for r in res["rows"]}
    assert rows[1]["events_per_request"] == 9 and rows[4]["events_per_request"] == 3
    for r in rows.values():
        cpu = r["server_cpu_ms_per_request"]
        assert 0 < cpu["min"] <= cpu["median"] <= cpu["max"]
        assert r["client_cpu_ms_per_request"]["median"] > 0
    assert res["stub_steps"] >= (2 + 1) * 2 * 2 * 9  # runs (warm-up included) x intervals x waves x tokens
    assert set(res["fit"]) == {"ms_per_event", "ms_per_request"}
    assert len(lines) == 2 * 2 and "# What the HTTP layer costs" in http_cost.markdown(res)
