"""A smoke run of the HTTP load experiment (``experiments/http_load.py``) on a tiny model: the server starts on a free
loopback port, the official ``openai`` client in its own process drives it beside the in-process arm, every
request of every arm completes, each record says how many timed runs were repeated because JAX compiled inside
them and splits the HTTP arm's wall time into the client's ramp, the engine's span and the tail (on the clock the
two processes share), and the report and headline are written; ``experiment.client_cpus`` splits the CPUs and
pins every thread; ``experiment.frontend_cpus`` adds the arm with uvicorn's thread moved, undone after;
``experiment.replay_control`` the in-process arm fed the last HTTP run's arrivals. Each run's refill (a freed slot
until its replacement arrives) splits into parts that add up to it."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from hydra import compose, initialize_config_dir

from lab.bench import http_load
from phaseserve.config_hydra import REPO_ROOT

OVERRIDES = ["model=tiny_mla", "+model.overrides.num_hidden_layers=1", "+model.overrides.first_k_dense_replace=0",
             "progress=false", "workload.prompt.mean=20", "workload.output.mean=4", "workload.concurrency=[2]",
             "workload.waves=2", "experiment.repeats=1", "experiment.headline_concurrency=2", "engine.max_batch=2"]


@pytest.mark.slow  # ~1.5 min of CPU (six arms, two processes): run by `pytest -m slow` (README)
def test_http_load_runs_every_arm_and_reports_the_ratio(tmp_path):
    usable = os.sched_getaffinity(0)
    front = max(usable)  # the http-frontend arm moves uvicorn's thread here for its runs
    split = len(usable) > 1  # the client on its own CPU and the loaded control need two
    extra = [f"experiment.frontend_cpus=[{front}]", "experiment.replay_control=true"]
    if split:
        extra += [f"experiment.client_cpus=[{front}]", "experiment.loaded_control=true"]
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="experiment/http_load", overrides=[*OVERRIDES, *extra])
    lines: list[str] = []
    res = http_load.run(cfg, tmp_path, log=lines.append)
    assert os.sched_getaffinity(0) == usable  # the pins were undone
    records = json.loads((tmp_path / "results.json").read_text())["records"]
    assert sorted(r["arm"] for r in records) == ["http", "http-coalesced", "http-frontend", "in-process",
                                                 *(["in-process-loaded"] if split else []), "in-process-replay"]
    http_duty = next(r["client_cpu_s"] / r["wall_s"] for r in records if r["arm"] == "http")
    for r in records:
        if r["arm"] == "in-process-loaded":  # the client burned CPU at the duty of the last http run (the warm-up's
            assert 0 < r["busy_duty"] <= 1 and r["client_cpu_s"] > 0.2 * r["busy_duty"] * r["wall_s"], r
        elif r["arm"] in ("in-process", "in-process-replay"):  # or the timed one's, whichever ran last); the quiet
            assert r["busy_duty"] == 0 and r["client_cpu_s"] == 0  # arms burned nothing
    assert http_duty > 0
    fills = {r["arm"]: r["fill_s"] for r in records}  # in-process the first batch is added in one loop; over HTTP
    assert 0 <= fills["in-process"] < 1e-3, fills  # each request comes in its own handler
    assert all(0 < fills[a] < r["wall_s"] for a in fills if a.startswith("http") for r in records if r["arm"] == a)
    for r in records:  # a closed loop's second wave: each replacement arrives after the request it replaces ended
        assert 0 < r["refill_s"] < r["wall_s"], r
        parts = [r[k] for k in http_load.PARTS]
        if r["arm"].startswith("http"):  # over HTTP: back to the client, its next request, to the server's handler,
            assert all(p > 0 for p in parts[:3]) and parts[3] >= 0, r  # through the engine loop's inbox: in order,
            assert abs(sum(parts) - r["refill_s"]) < 1e-9, r  # and adding up to the whole wait
        else:
            assert parts == [0, 0, 0, 0], r
    assert len({r["requests"] for r in records}) == 1 and records[0]["requests"] >= 2  # the same requests per arm
    for r in records:
        assert r["output_tokens"] == 4 * r["requests"], r["arm"]  # every request completed its 4 tokens
        assert r["reruns"] in (0, 1) and r["server_cpu_s"] > 0
        # the per-thread split covers the process: engine loop + uvicorn + the rest ~= the process's CPU time
        parts = [r[f"cpu_{g}_s"] for g in http_load.THREADS]
        assert all(p >= 0 for p in parts) and r["cpu_engine_loop_s"] > 0, r
        assert abs(sum(parts) - r["server_cpu_s"]) < 0.05 + 0.1 * r["server_cpu_s"], (parts, r["server_cpu_s"])
        if r["arm"].startswith("in-process"):  # uvicorn idles meanwhile
            assert r["cpu_http_s"] < 0.1 * r["cpu_engine_loop_s"], r
        else:
            assert r["cpu_http_s"] > 0, r
    for r in records:
        if r["arm"].startswith("in-process"):
            assert r["ramp_s"] == r["tail_s"] == r["build_s"] == 0 and r["engine_tok_per_s"] == r["output_tok_per_s"]
            continue
        assert r["client_cpu_s"] > 0
        # one clock across the two processes: the client sends before the engine sees the first request, and the
        # engine finishes before the client reads the last stream end; the three parts make up the client's wall
        assert 0 < r["ramp_s"] < r["wall_s"] and 0 < r["tail_s"] < r["wall_s"], r
        assert abs(r["ramp_s"] + r["engine_wall_s"] + r["tail_s"] - r["wall_s"]) < 1e-6
        # the client's HTTP client built its first requests after its first send began, before the run ended
        assert 0 < r["build_s"] < r["wall_s"], r
        assert r["engine_tok_per_s"] > r["output_tok_per_s"]
    ratio = res["ratio_http_over_in_process"]["http"]["output_tok_per_s"]
    r = ratio.get(2) or ratio.get("2")
    assert r["n"] == 1 and r["median"] > 0
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["http_stack"] == {
        "loop": "uvloop", "http": "httptools"}  # installed with the package: uvicorn's fast paths
    md = (tmp_path / "README.md").read_text()
    assert "Timed runs repeated because JAX compiled inside them" in md and "uvicorn thread CPU s" in md
    assert "fill ms" in md and "client build ms" in md and "client refill ms" in md and "inbox ms" in md
    assert f"uvicorn's thread moved to CPUs [{front}]" in md
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["frontend_cpus"] == [front]
    assert any(line.startswith("http throughput at concurrency 2:") for line in lines)
    assert any(line.startswith("  of which the server side") for line in lines)
    if split:
        assert any(line.startswith("http over in-process-loaded at concurrency 2:") for line in lines), lines
        assert "## http / in-process-loaded" in md
    assert any(line.startswith("http over in-process-replay at concurrency 2:") for line in lines), lines
    assert "## http / in-process-replay" in md


def _stop_after(conn, seconds: float) -> None:
    time.sleep(seconds)
    conn.send("stop")


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the forked child only sleeps and writes to a pipe
def test_busy_keeps_the_cpu_busy_at_the_duty_until_told_to_stop():
    import multiprocessing as mp

    from openai.types import Completion  # noqa: F401  (imported here, so busy() starts when the stopper does)

    # the stop comes from another process, as in the experiment: a thread of this one has to wait for busy()'s loop
    # to hand over the interpreter lock, seconds at duty 1.0 on a loaded machine
    ctx = mp.get_context("fork")
    for duty in (0.25, 1.0):
        parent, child = ctx.Pipe()
        stopper = ctx.Process(target=_stop_after, args=(parent, 0.5))
        stopper.start()
        out = http_load.busy(child, duty)
        stopper.join()
        assert 0.45 < out["wall_s"] < 2.0, out
        # about duty x wall of CPU (this machine is shared: a loose lower bound, a firm upper one)
        assert 0.3 * duty * out["wall_s"] < out["client_cpu_s"] < 1.5 * duty * out["wall_s"] + 0.05, (duty, out)


def test_loaded_control_needs_client_cpus(tmp_path):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="experiment/http_load", overrides=[*OVERRIDES, "experiment.loaded_control=true"])
    with pytest.raises(ValueError, match="loaded_control needs experiment.client_cpus"):
        http_load.run(cfg, tmp_path)


def test_frontend_cpus_must_be_usable():
    usable = os.sched_getaffinity(0)
    assert http_load.frontend_cpus(None) is None and http_load.frontend_cpus([]) is None
    assert http_load.frontend_cpus([min(usable)]) == {min(usable)}
    with pytest.raises(ValueError, match="frontend_cpus"):
        http_load.frontend_cpus([max(usable) + 1])


def test_client_cpus_split_the_usable_cpus_and_pin_every_thread():
    usable = os.sched_getaffinity(0)
    assert http_load.split_cpus(None) is None and http_load.split_cpus([]) is None
    with pytest.raises(ValueError, match="proper subset"):
        http_load.split_cpus(sorted(usable))  # the server would have no CPU
    with pytest.raises(ValueError, match="proper subset"):
        http_load.split_cpus([max(usable) + 1])  # not a CPU this process may use
    first = min(usable)
    if len(usable) > 1:  # a split needs a CPU on each side; pinning below works on one CPU too
        assert http_load.split_cpus([first]) == ({first}, usable - {first})
    started, release = threading.Event(), threading.Event()
    tid: list[int] = []

    def worker():
        tid.append(threading.get_native_id())
        started.set()
        release.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    started.wait(10)
    try:
        http_load.pin_process({first})
        assert os.sched_getaffinity(0) == {first} and os.sched_getaffinity(tid[0]) == {first}  # a running thread too
    finally:
        http_load.pin_process(usable)
        release.set()
        t.join()
    assert os.sched_getaffinity(0) == usable


def test_refill_parts_pair_the_kth_finish_with_the_replacement_that_took_its_slot():
    finished, arrivals = [1.0, 2.0, 5.0, 6.0], [0.0, 0.0, 3.0, 4.5]  # concurrency 2: requests 3 and 4 replace 1 and 2
    assert http_load.refill_parts(2, finished, arrivals) == {"refill_s": 2.25}  # mean(3 - 1, 4.5 - 2)
    parts = http_load.refill_parts(2, finished, arrivals, ends=[1.5, 2.25, 5.5, 6.5], built=[0.1, 0.2, 2.0, 3.0],
                                   received=[0.2, 0.3, 2.5, 4.0])
    assert parts == pytest.approx({"refill_s": 2.25, "deliver_s": 0.375, "client_refill_s": 0.625, "transit_s": 0.75,
                                   "inbox_s": 0.5})
    assert http_load.refill_parts(4, finished, arrivals) == {"refill_s": 0.0}  # one wave: nothing was replaced


def test_replay_adds_each_request_when_it_is_due():
    """The in-process-replay arm's driver: the first wave at its offsets from the start, each replacement its delay
    after the finish it replaces (not before; a step later at most), every request run to its end."""
    from lab.bench.workload import make_requests
    from phaseserve.engine import Engine

    with initialize_config_dir(config_dir=str(REPO_ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="experiment/http_load", overrides=OVERRIDES)
    engine = Engine.from_hydra(cfg)
    reqs = make_requests(cfg.workload, engine.cfg.vocab_size, 4, seed=0, tag="r")
    first, later = [0.0, 0.15], [0.1, 0.2]
    summary = http_load.replay(engine, reqs, 2, first, later)
    outs = list(engine.outputs.values())
    assert len(outs) == 4 and all(len(o.tokens) == 4 for o in outs) and summary["output_tokens"] == 16
    arrivals = sorted(o.metrics.arrival - engine.metrics.start for o in outs)
    finished = sorted(o.metrics.finished - engine.metrics.start for o in outs)
    due = [*first, finished[0] + later[0], finished[1] + later[1]]
    step = max(finished)  # a generous bound on one step: the whole run
    assert all(d <= a < d + step for a, d in zip(arrivals, sorted(due), strict=True)), (arrivals, due)
