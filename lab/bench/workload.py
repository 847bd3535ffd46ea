"""Workloads and the client loop that drives an :class:`~phaseserve.engine.Engine` with them.

A workload (:class:`~phaseserve.config_hydra.WorkloadSpec`) is a prompt-length and an output-length
distribution (:func:`sample_lengths`), random prompt tokens (optionally a shared prefix), and an arrival
pattern that :func:`drive` plays against the engine:

- ``closed``: ``concurrency`` clients, each sending its next request as soon as its previous one finishes, so
  ``concurrency`` requests are always in flight (the engine queues what the KV cache cannot admit: *offered*
  concurrency vs the *admitted* concurrency the scheduler reports);
- ``burst``: every request arrives at t = 0 (the engine's ``max_batch`` bounds the running batch);
- ``poisson``: exponential inter-arrival times at ``rate`` requests/s (open loop).

One engine is reused across the points of a sweep (it compiles once per shape): :func:`reset_engine` checks it
is drained and leak-free and clears its metrics; :func:`warmup` compiles every batch and prompt bucket a run of
the workload can reach, so timed runs contain no compilation (the sweep runner counts compilations to prove it).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import numpy as np

from phaseserve.config_hydra import LengthSpec, as_list, max_length
from phaseserve.engine import Engine, Request
from phaseserve.engine.shapes import bucket, chunk_bucket

ARRIVALS = ("closed", "burst", "poisson")


# ---- lengths and requests ---------------------------------------------------------------------------------
def _get(spec: Any, key: str) -> Any:
    return spec[key] if isinstance(spec, dict) else getattr(spec, key)


def min_length(spec: LengthSpec | Any) -> int:
    return int(_get(spec, "mean")) if _get(spec, "dist") == "fixed" else int(_get(spec, "min"))


def sample_lengths(spec: LengthSpec | Any, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths (i64[n]) from a :class:`LengthSpec`."""
    dist, mean, lo, hi = _get(spec, "dist"), int(_get(spec, "mean")), int(_get(spec, "min")), int(_get(spec, "max"))
    if dist == "fixed":
        return np.full(n, mean, np.int64)
    if not 1 <= lo <= hi:
        raise ValueError(f"length distribution needs 1 <= min <= max, got [{lo}, {hi}]")
    if dist == "uniform":
        return rng.integers(lo, hi + 1, n)
    if dist == "lognormal":
        x = mean * np.exp(float(_get(spec, "sigma")) * rng.standard_normal(n))
        return np.clip(np.rint(x), lo, hi).astype(np.int64)
    raise ValueError(f"unknown length distribution {dist!r}; expected fixed, uniform or lognormal")


def num_requests(workload: Any, concurrency: int) -> int:
    if workload.num_requests is not None:
        return int(workload.num_requests)
    return max(int(workload.min_requests), int(workload.waves) * int(concurrency))


def make_requests(workload: Any, vocab_size: int, n: int, *, seed: int, tag: str,
                  output_len: int | None = None) -> list[Request]:
    """``n`` requests drawn from ``workload`` (``output_len`` overrides the output distribution)."""
    rng = np.random.default_rng(seed)
    prompts = sample_lengths(workload.prompt, n, rng)
    outputs = np.full(n, output_len) if output_len is not None else sample_lengths(workload.output, n, rng)
    prefix = rng.integers(0, vocab_size, int(workload.shared_prefix)).tolist()
    reqs = []
    for i in range(n):
        own = max(int(prompts[i]) - len(prefix), 1)
        reqs.append(Request(id=f"{tag}-{i}", prompt=prefix + rng.integers(0, vocab_size, own).tolist(),
                            max_tokens=int(outputs[i]), temperature=float(workload.temperature), seed=i,
                            ignore_eos=bool(workload.ignore_eos)))
    return reqs


def check_fits(workload: Any, engine: Engine) -> None:
    """Raise if the workload's longest request cannot fit the engine's context."""
    longest = max_length(workload.prompt) + max_length(workload.output)
    if longest > engine.max_context:
        raise ValueError(f"workload {workload.name!r}: prompt + output up to {longest} tokens exceeds the engine's "
                         f"context of {engine.max_context} (model positions, max_pages_per_seq * page_size)")


# ---- driving the engine -----------------------------------------------------------------------------------
def reset_engine(engine: Engine, max_batch: int) -> None:
    """Prepare a drained engine for the next measured run: fresh metrics and outputs, a new concurrency cap."""
    if engine.has_work:
        raise RuntimeError("engine still has queued or running requests")
    leaked = engine.num_pages - 1 - engine.allocator.num_free
    if leaked:
        raise RuntimeError(f"engine holds {leaked} pages with no request running (leak)")
    engine.reset_metrics()
    engine.max_batch = int(max_batch)


def drive(engine: Engine, requests: list[Request], concurrency: int, arrival: str = "closed",
          rate: float = 8.0, seed: int = 0) -> dict:
    """Play ``requests`` against ``engine`` with an arrival pattern; return the engine's summary plus extras.

    Extras: ``decode_tok_per_s`` (tokens of decode steps / decode time), ``prefill_tok_per_s`` (prompt tokens /
    prefill time, handoff included), ``offered_concurrency``, ``num_pages``, and ``steady_tok_per_s``: output
    tokens per second from the start until the last request is sent (closed loop), i.e. while every client still
    has a request in flight -- the sustained rate at this offered load, without the drain at the end, where a
    partial last wave runs at a small batch (``None`` when every request is sent at once).
    """
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    reset_engine(engine, max_batch=concurrency if arrival == "closed" else engine.serve.max_batch)
    pending = deque(requests)
    outs = []
    m = engine.metrics
    m.start = start = time.perf_counter()
    if arrival == "poisson":
        times = np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, len(requests)))
    n_sent = 0

    def send(k: int) -> None:
        nonlocal n_sent
        for _ in range(min(k, len(pending))):
            outs.append(engine.add_request(pending.popleft()))
            n_sent += 1

    steady: tuple[float, int] | None = None

    if arrival == "burst":
        send(len(pending))
    elif arrival == "closed":
        send(concurrency)
    while pending or engine.has_work:
        if arrival == "poisson":
            now = time.perf_counter() - start
            due = int(np.searchsorted(times, now, side="right")) - n_sent
            if due <= 0 and not engine.has_work:
                time.sleep(max(float(times[n_sent]) - now, 0.0))
                continue
            send(due)
        engine.step()
        if arrival == "closed" and pending:
            send(concurrency - sum(1 for o in outs if not o.finished))
            if not pending:
                steady = (time.perf_counter() - start, sum(len(o.tokens) for o in outs))
    m.end = time.perf_counter()
    s = engine.summary()
    s["decode_tok_per_s"] = m.decode_tokens / m.decode_time if m.decode_time else 0.0
    s["prefill_tok_per_s"] = m.prefill_tokens / m.prefill_time if m.prefill_time else 0.0
    s["decode_time_s"], s["prefill_time_s"] = m.decode_time, m.prefill_time
    s["steady_tok_per_s"] = steady[1] / steady[0] if steady else None
    s["steady_window_s"] = steady[0] if steady else None
    s["offered_concurrency"] = int(concurrency)
    s["num_pages"] = engine.num_pages
    s["finish_reasons"] = {r: sum(1 for o in outs if o.finish_reason == r) for r in {o.finish_reason for o in outs}}
    return s


def warmup(engine: Engine, workload: Any, max_concurrency: int, vocab_size: int) -> int:
    """Compile every decode batch bucket up to ``max_concurrency`` and every prefill (batch, prompt) bucket the
    workload reaches, with untimed runs, and the handoff's chunk sizes (``Engine.warm_handoff``). Each run
    generates the workload's longest output, so its decode steps pass through every page-table width
    (``shapes.width_bucket``) a request of that prompt bucket reaches. Returns the number of runs."""
    engine.warm_handoff()
    lo, hi = min_length(workload.prompt), max_length(workload.prompt)
    new_tokens = max(3, max_length(workload.output))
    t_buckets = sorted({chunk_bucket(n) for n in range(lo, hi + 1)})
    runs = 0
    for t in t_buckets:
        length = min(t, hi)
        b = 1
        while b <= bucket(max_concurrency):
            reset_engine(engine, max_batch=b)
            rng = np.random.default_rng(runs)
            reqs = [Request(id=f"warm{runs}-{i}", prompt=rng.integers(0, vocab_size, length).tolist(),
                            max_tokens=new_tokens, ignore_eos=True) for i in range(b)]
            engine.generate(reqs)
            runs += 1
            b *= 2
    reset_engine(engine, max_batch=engine.serve.max_batch)
    return runs


def probe_admission(engine: Engine, requests: list[Request]) -> dict:
    """Offer every request at once and run one scheduling round: how many the KV cache admits, and the pages
    they hold. The requests are then cancelled (nothing is kept)."""
    reset_engine(engine, max_batch=len(requests))
    for r in requests:
        engine.add_request(r)
    engine.step()
    admitted = len(engine.scheduler.running)
    used = engine.allocator.num_used
    for r in requests:
        engine.cancel(r.id)
    reset_engine(engine, max_batch=engine.serve.max_batch)
    return {"offered": len(requests), "admitted": admitted, "pages_in_use": int(used),
            "usable_pages": engine.num_pages - 1}


def concurrencies(workload: Any) -> list[int]:
    return [int(c) for c in as_list(workload.concurrency)]
