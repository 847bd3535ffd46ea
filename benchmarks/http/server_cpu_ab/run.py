"""Server CPU per streamed request, two checkouts side by side in one run (their runs interleaved).

Each round starts, for each checkout in turn (order alternating), a fresh process that serves that checkout's
server over the model-free stub backend of ``lab.bench.http_cost`` (each step sleeps 10 ms and gives every
running request one token; uvicorn in a thread, every server thread pinned to CPU 0) and drives it with the same
``openai`` client process as ``http_load`` (pinned to CPU 1): one untimed run, then ``--runs`` timed runs of 64
streamed completions of 32 tokens, 32 at a time, one event per token. Per run: the server process's CPU time and its
uvicorn thread's, per request.

    git worktree add /tmp/base <commit>
    cd benchmarks/http/server_cpu_ab && python run.py /tmp/base ../../.. --rounds 6 --runs 5 > README.md
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path


def serve_and_measure(runs: int) -> list[tuple[float, float]]:
    """In the checkout on sys.path: (server CPU ms, uvicorn-thread CPU ms) per request, per timed run."""
    import phaseserve

    if not Path(phaseserve.__file__).resolve().is_relative_to(Path.cwd()):
        raise RuntimeError(f"phaseserve imported from {phaseserve.__file__}, not from the checkout {Path.cwd()}")
    from lab.bench.http_cost import StubBackend
    from lab.bench.http_load import Client, pin_process, thread_cpu_s
    from phaseserve.data.tokenizer import ByteTokenizer
    from phaseserve.engine.request import Request
    from phaseserve.server import create_app
    from phaseserve.server.launch import start_in_thread

    pin_process({0})
    app = create_app(StubBackend(0.01), ByteTokenizer(), "stub")
    server, thread, base = start_in_thread(app, keep_alive_s=300)
    client = Client(base, "stub", 300.0, {1})
    rng = random.Random(0)
    reqs = [Request(id=f"r{i}", prompt=[rng.randrange(256) for _ in range(64)], max_tokens=32, temperature=0.0,
                    ignore_eos=True) for i in range(64)]
    out = []
    try:
        for rep in range(runs + 1):
            t0, c0 = thread_cpu_s({"http": thread.native_id}), time.process_time()
            rec = client.run(reqs, 32)
            t1, c1 = thread_cpu_s({"http": thread.native_id}), time.process_time()
            if rec["output_tokens"] != 64 * 32:
                raise RuntimeError(f"{rec['output_tokens']} tokens came back, {64 * 32} expected")
            if rep:  # the first run warms the client, the server and the request paths
                out.append((1e3 * (c1 - c0) / 64, 1e3 * (t1["http"] - t0["http"]) / 64))
    finally:
        client.close()
        server.should_exit = True
        thread.join(10)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # this process serves the checkout in a.new
        print(json.dumps(serve_and_measure(a.runs)))
        return
    trees = {"base": a.base.resolve(), "new": a.new.resolve()}
    res: dict[str, list] = {k: [] for k in trees}
    for rnd in range(a.rounds):
        for name in (["base", "new"] if rnd % 2 == 0 else ["new", "base"]):
            p = subprocess.run([sys.executable, __file__, str(trees[name]), str(trees[name]), "--child", "--runs",
                                str(a.runs)], capture_output=True, text=True, cwd=trees[name],
                               env={**os.environ, "PYTHONPATH": str(trees[name])})
            if p.returncode:
                sys.exit(p.stderr[-3000:])
            res[name] += json.loads(p.stdout.strip().splitlines()[-1])
    commits = {k: subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip() for k, t in trees.items()}
    print("# Server CPU per streamed request: two checkouts side by side\n")
    print(f"`{Path(__file__).name}` ({a.rounds} rounds x {a.runs} timed runs per checkout, interleaved); "
          f"base {commits['base']}, new {commits['new']}; date {time.strftime('%Y-%m-%dT%H:%M:%S%z')}.\n")
    print("| checkout | server CPU ms per request | uvicorn thread CPU ms per request | runs |\n|---|---|---|---|")
    med = {}
    for name, runs in res.items():
        cols = []
        for i in range(2):
            v = sorted(r[i] for r in runs)
            cols.append(f"{statistics.median(v):.3f} [{v[0]:.3f}, {v[-1]:.3f}]")
        med[name] = [statistics.median(r[i] for r in runs) for i in range(2)]
        print(f"| {name} ({commits[name]}) | {cols[0]} | {cols[1]} | {len(runs)} |")
    print(f"\nnew / base, medians: server CPU {med['new'][0] / med['base'][0]:.3f}x, uvicorn thread "
          f"{med['new'][1] / med['base'][1]:.3f}x")


if __name__ == "__main__":
    main()
