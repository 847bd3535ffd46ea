"""Where the engine's prefill chunk step spends its time: the decode profiler's per-op method on the prefill side.

The compiled chunk step (``engine.prefill_step.chunk_step``, pool donated, as ``engine.workers.PrefillWorker`` jits
it on one device) runs a batch of ``batch`` prompts of ``chunk`` tokens each, every row's first chunk (the cached
prefix is empty), under ``jax.profiler``; each executed op is attributed to a component by its name scope as in
:mod:`lab.bench.profile_decode` (attention: the flash prefill and the keys read back from the pool;
page writes: the chunk's KV into its pages; MoE dispatch; dense projections; sampling of the first token; rest).
Integrity has no prefill-side op. Times are op time summed over XLA's worker threads (medians over ``steps``
profiled steps, ms per step); ``wall`` is the step's wall time. The batch x chunk tokens are what one
``max_prefill_tokens`` step holds (2048 by default: 16 prompts of 128 tokens).

    python -m lab.bench.profile_prefill --out benchmarks/engine/profile/prefill --top 15
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from lab.bench.measure import environment
from lab.bench.profile_decode import COMPONENTS, MODELS, compare, model_config, op_profile, random_pool, write
from lab.markdown import fmt
from phaseserve.config import ModelConfig
from phaseserve.engine.prefill_step import ChunkBatch, chunk_step
from phaseserve.model.params import init_params


def setup(cfg: ModelConfig, batch: int, chunk: int, *, page_size: int = 16, seed: int = 0) -> dict[str, Any]:
    """Params, a random-filled float32 prefill pool with each row's pages, and one ChunkBatch of ``batch`` first
    chunks of ``chunk`` random tokens."""
    key = jax.random.key(seed)
    params = init_params(cfg, key, "float32")
    per_row = -(-chunk // page_size)
    pool = random_pool(cfg, 1 + batch * per_row, page_size, "float32", jax.random.fold_in(key, 1))
    rng = np.random.default_rng(seed)
    pages = rng.permutation(np.arange(1, 1 + batch * per_row)).reshape(batch, per_row).astype(np.int32)
    b = ChunkBatch(tokens=rng.integers(0, cfg.vocab_size, (batch, chunk)).astype(np.int32),
                   positions=np.tile(np.arange(chunk, dtype=np.int32), (batch, 1)),
                   valid=np.ones((batch, chunk), bool), lengths=np.full(batch, chunk, np.int32),
                   last=np.full(batch, chunk - 1, np.int32), page_table=pages,
                   temperature=np.zeros(batch, np.float32), top_k=np.zeros(batch, np.int32),
                   top_p=np.ones(batch, np.float32), seeds=np.arange(batch, dtype=np.uint32),
                   steps=np.zeros(batch, np.int32), targets=np.full((batch, chunk), -1, np.int32),
                   want_logprobs=np.zeros(batch, bool), want_prompt=np.zeros(batch, bool))
    return {"params": params, "pool": pool, "batch": b}


def profile_point(cfg: ModelConfig, batch: int, chunk: int, *, steps: int = 5, top: int = 0,
                  page_size: int = 16) -> dict[str, Any]:
    """ms per chunk step by component (``profile_decode.op_profile``) for ``batch`` prompts of ``chunk`` tokens."""
    s = setup(cfg, batch, chunk, page_size=page_size)
    step = jax.jit(lambda p, pool, b: chunk_step(p, cfg, pool, b), donate_argnums=(1,))
    state = {"pool": s["pool"]}
    hlo = step.lower(s["params"], state["pool"], s["batch"]).compile().as_text()

    def run() -> float:
        t0 = time.perf_counter()
        first, state["pool"], _, _ = step(s["params"], state["pool"], s["batch"])
        first.block_until_ready()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(2):  # warm
        run()
    return op_profile(run, [(hlo, None)], steps=steps, top=top)


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"# Prefill chunk step profile: {result['label']}", "",
             "ms per chunk step (median of the profiled steps) by component: op time summed over XLA's threads, from "
             "XLA's per-op trace on this machine; `wall` is the step's wall time (`python -m "
             "lab.bench.profile_prefill`; grouping rules in `lab/bench/profile_decode.py`). Each row: "
             "`batch` prompts' first chunks of `chunk` tokens in one step, float32 weights and prefill KV. "
             f"Machine: {env.get('machine')} ({env.get('cpu_detail', '')}), {env.get('cpu_cores')} cores, load "
             f"average at start {env['load_average_1m_5m_15m']}; commit {env.get('git_commit')}.", ""]
    header = ["model", "batch", "chunk", "tokens", *COMPONENTS, "op time", "wall", "tokens/s (wall)"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in result["rows"]:
        n = r["batch"] * r["chunk"]
        cells = [r["model"], str(r["batch"]), str(r["chunk"]), str(n),
                 *(fmt(r["ms"][c], 2) for c in [*COMPONENTS, "op time", "wall"]), fmt(n / r["ms"]["wall"] * 1e3, 0)]
        lines.append("| " + " | ".join(cells) + " |")
    for r in result["rows"]:
        if r.get("top_ops"):
            lines += ["", f"### Top ops: {r['model']}, {r['batch']} x {r['chunk']} tokens", "",
                      "| component | op (name scope, result shape) | ms |", "|---|---|---|"]
            lines += [f"| {c} | `{desc}` | {fmt(ms, 2)} |" for c, desc, ms in r["top_ops"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    ap.add_argument("--label", default="")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--points", nargs="+", default=["1x128", "8x128", "16x128"],
                    help="BATCHxCHUNK: prompts per step and tokens per prompt")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=0, help="also list the N ops that took the most time per point")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="write OUT.md comparing two profile JSON files instead of profiling")
    a = ap.parse_args(argv)
    if a.compare:
        before, after = (json.loads(Path(f).read_text()) for f in a.compare)
        Path(a.out).with_suffix(".md").write_text(compare(before, after))
        return
    result: dict[str, Any] = {"label": a.label or Path(a.out).name, "environment": environment(), "rows": []}
    for name in a.models:
        cfg = model_config(name)
        for point in a.points:
            b, c = (int(x) for x in point.lower().split("x"))
            ms = profile_point(cfg, b, c, steps=a.steps, top=a.top)
            row = {"model": name, "batch": b, "chunk": c, "ms": ms}
            if a.top:
                row["top_ops"] = ms.pop("top ops")
            result["rows"].append(row)
            print(name, point, {k: round(v, 2) for k, v in ms.items()}, flush=True)
    write(a.out, result, markdown(result))


if __name__ == "__main__":
    main()
