"""What the HTTP layer alone costs the server in CPU time, per request and per streamed event.

The server (:func:`phaseserve.server.create_app`, uvicorn in a thread) runs over a :class:`StubBackend`: no model,
each ``advance`` sleeps ``step_s`` (a device step that holds no CPU and releases the interpreter lock) and gives
every running request one token. The official ``openai`` client (:class:`lab.bench.http_load.Client`, its
own process) streams ``requests`` completions of ``tokens`` tokens, ``concurrency`` at a time. The server process's
CPU time during a run is then the HTTP layer's (request parsing and validation, the engine loop's hand-over,
text decoding, SSE encoding, socket writes) plus the stub's bookkeeping, which is a few list appends per step.

For each ``stream_interval`` (tokens per event) it reports the server CPU seconds per request; two intervals give a
per-event and a per-request cost by a straight-line fit (CPU per request = fixed + per_event x events per request).
With ``cpus`` the client runs on the first set and every server thread on the second, as in ``http_load``.

    python -m lab.bench.http_cost --out benchmarks/http/frontend_cost --client-cpus 1
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from lab.bench.http_load import Client, pin_process, split_cpus
from lab.bench.measure import environment, stats
from lab.bench.report import spread
from lab.markdown import fmt
from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.engine.request import Limits, Request, RequestOutput


class StubBackend:
    """The :class:`~phaseserve.server.loop.EngineBackend` interface without a model: ``advance`` sleeps ``step_s``
    and appends one token (``token``) to every running request, finishing it at its ``max_tokens``."""

    limits = Limits(vocab_size=264, max_context=4096, page_size=16, max_pages=256)

    def __init__(self, step_s: float, token: int = 97):
        self.step_s, self.token = step_s, token
        self.running: dict[str, tuple[Request, RequestOutput]] = {}
        self.steps = 0

    def submit(self, req: Request) -> RequestOutput:
        out = RequestOutput(id=req.id)
        self.running[req.id] = (req, out)
        return out

    def cancel(self, rid: str) -> bool:
        return self.running.pop(rid, None) is not None

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def advance(self, deliver=None) -> None:
        time.sleep(self.step_s)
        self.steps += 1
        for rid, (req, out) in list(self.running.items()):
            out.tokens.append(self.token)
            if len(out.tokens) >= req.max_tokens:
                out.finish_reason = "length"
                del self.running[rid]

    def idle(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {"running": len(self.running), "waiting": 0, "kv_pages_used": 0, "kv_pages_free": 0}

    def close(self) -> None:
        pass


def events_per_request(tokens: int, interval: int) -> int:
    """Streamed writes of one completion of ``tokens`` tokens while its handler keeps up: the first token at once,
    then one per ``interval`` new tokens (the last, shorter group with the end; the usage chunk and ``[DONE]`` go in
    that same write)."""
    return 1 + -(-(tokens - 1) // interval)


def measure(intervals: list[int], *, requests: int = 64, concurrency: int = 32, tokens: int = 32,
            prompt_len: int = 64, step_s: float = 0.01, repeats: int = 5, client_cpus: list[int] | None = None,
            log=print) -> dict[str, Any]:
    """Server CPU per request for each stream interval (median and range over ``repeats`` runs, intervals
    interleaved), and the straight-line split into a per-event and a per-request cost."""
    from phaseserve.server import create_app
    from phaseserve.server.launch import http_stack, start_in_thread

    cpus = split_cpus(client_cpus)
    backend = StubBackend(step_s)
    app = create_app(backend, ByteTokenizer(), "stub")
    server, thread, base = start_in_thread(app, keep_alive_s=300.0)  # the client keeps its connections
    if cpus is not None:
        pin_process(cpus[1])
    client = Client(base, "stub", 300.0, None if cpus is None else cpus[0])
    rng = random.Random(0)
    reqs = [Request(id=f"r{i}", prompt=[rng.randrange(256) for _ in range(prompt_len)], max_tokens=tokens,
                    temperature=0.0, ignore_eos=True) for i in range(requests)]
    runs: dict[int, list[dict]] = {i: [] for i in intervals}
    try:
        for rep in range(repeats + 1):  # the first round warms the client, the server and the request paths
            for interval in intervals:
                app.state.loops[0].stream_interval = interval
                cpu0 = time.process_time()
                rec = client.run(reqs, concurrency)
                cpu = time.process_time() - cpu0
                if rec["output_tokens"] != tokens * requests:
                    raise RuntimeError(f"{rec['output_tokens']} tokens came back, {tokens * requests} expected")
                if rep:
                    runs[interval].append({"server_cpu_s": cpu, "wall_s": rec["wall_s"],
                                           "client_cpu_s": rec["client_cpu_s"]})
                    log(f"repeat {rep}/{repeats} interval {interval}: server CPU {cpu:.3f} s, wall "
                        f"{rec['wall_s']:.3f} s")
    finally:
        client.close()
        server.should_exit = True
        thread.join(30)
    rows = []
    for interval, recs in runs.items():
        rows.append({"stream_interval": interval, "events_per_request": events_per_request(tokens, interval),
                     "server_cpu_ms_per_request": stats([r["server_cpu_s"] / requests * 1e3 for r in recs]),
                     "client_cpu_ms_per_request": stats([r["client_cpu_s"] / requests * 1e3 for r in recs]),
                     "wall_s": stats([r["wall_s"] for r in recs])})
    fit = None
    if len(rows) >= 2:
        x = np.array([r["events_per_request"] for r in rows], float)
        y = np.array([r["server_cpu_ms_per_request"]["median"] for r in rows])
        slope, intercept = np.polyfit(x, y, 1)
        fit = {"ms_per_event": float(slope), "ms_per_request": float(intercept)}
    return {"experiment": "http_cost", "environment": environment(), "http_stack": http_stack(),
            "settings": {"requests": requests, "concurrency": concurrency, "tokens": tokens, "prompt_len": prompt_len,
                         "step_s": step_s, "repeats": repeats,
                         "cpus": None if cpus is None else {"client": sorted(cpus[0]), "server": sorted(cpus[1])}},
            "rows": rows, "fit": fit, "stub_steps": backend.steps}


def markdown(res: dict[str, Any]) -> str:
    s, env = res["settings"], res["environment"]
    cpus = s["cpus"]
    where = (f"the client process pinned to {cpus['client']}, every server thread to {cpus['server']}" if cpus
             else "client and server not pinned")
    lines = ["# What the HTTP layer costs the server (CPU time, no model)", "",
             f"The server over a stub backend (each step sleeps {s['step_s'] * 1e3:g} ms and gives every running "
             f"request one token), driven by the `openai` client: {s['requests']} streamed completions of "
             f"{s['tokens']} tokens ({s['prompt_len']}-token prompts), {s['concurrency']} at a time; {where}; uvicorn "
             f"with {res['http_stack']['loop']} and {res['http_stack']['http']}. Server CPU is the server process's "
             f"CPU time during a run (`python -m lab.bench.http_cost`). Medians [min, max] of "
             f"{s['repeats']} runs per interval, intervals interleaved.", "",
             "| tokens per event | writes per request | server CPU ms per request | client CPU ms per request | "
             "run wall s |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['stream_interval']} | {r['events_per_request']} | {spread(r['server_cpu_ms_per_request'])}"
                     f" | {spread(r['client_cpu_ms_per_request'])} | {spread(r['wall_s'])} |")
    if res["fit"]:
        f = res["fit"]
        lines += ["", f"Straight line through the medians: {fmt(f['ms_per_event'] * 1e3, 3)} us of server CPU per "
                      f"streamed write and {fmt(f['ms_per_request'], 3)} ms per request besides."]
    lines += ["", f"- date: {env.get('date')}", f"- machine: {env.get('machine')}, {env.get('cpu_cores')} cores",
              f"- load average at start: {env.get('load_average_1m_5m_15m')}", f"- git commit: {env.get('git_commit')}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    ap.add_argument("--intervals", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--client-cpus", nargs="*", type=int, default=None)
    a = ap.parse_args(argv)
    res = measure(a.intervals, requests=a.requests, concurrency=a.concurrency, tokens=a.tokens,
                  step_s=a.step_ms / 1e3, repeats=a.repeats, client_cpus=a.client_cpus or None)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
