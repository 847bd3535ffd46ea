"""Soak: a bounded, randomized run of the engine under a small KV budget, checked against a large-budget replay.

Per arm (a KV dtype x a preemption mode, ``"float32/recompute"``, ``"float8_e4m3fn/swap"``, ...), one engine with
``admission="on_demand"`` and a page pool far smaller than the workload is driven step by step (open loop: a few
arrivals per step). The workload, drawn once from ``seed`` and identical for every arm: random prompt and output
lengths, tenants with shared prompt prefixes (prefix-cache hits), half greedy and half sampled requests (random
temperature / top-k / top-p / seed), a fraction of malformed requests (every kind of bad field), and random
cancellations of running requests. After every step ``check_invariants()`` runs (allocator, page tables, scheduler).

Reported per arm: requests, preemptions, cancels, refused malformed requests (and whether each got a typed
``RequestError``), integrity false positives (aborts with a ``KVIntegrityError``: no fault is injected here), pages
leaked after draining, invariant checks, swap traffic, and token equality with a replay of the same valid
requests on a large-budget engine (no preemption): per request, completed requests must equal the replay, cancelled
ones must be a prefix of it. Float32 KV must be exact under every mode; FP8 KV is reported per preemption mode.

The longer Hypothesis run: the property tests (arbitrary requests mixed with good ones on a live engine, arbitrary
descriptors and control messages on the servers, arbitrary field values through ``validate``) run once more with
``property_examples`` examples each instead of CI's bounded count; their outcome is recorded with the soak.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from lab.bench import report as rp
from lab.bench.measure import environment
from lab.bench.schema import experiment_spec
from phaseserve.cache.integrity import KVIntegrityError
from phaseserve.config import CacheConfig, ServeConfig
from phaseserve.config_hydra import REPO_ROOT, serve_config_from_hydra
from phaseserve.engine import Engine, Request, RequestError

PLOT = "replay_equality.png"
# every kind of malformed field the validation layer must refuse with a typed error
BAD_FIELDS: list[dict[str, Any]] = [
    {"seed": -1}, {"seed": 2**32}, {"seed": "7"}, {"top_k": 2**31}, {"top_k": -1},
    {"tenant": None}, {"tenant": 3}, {"tenant": b"x"}, {"tenant": "\ud800"}, {"temperature": float("nan")},
    {"temperature": None}, {"temperature": -0.5}, {"temperature": float("inf")}, {"top_p": 0.0},
    {"top_p": float("nan")}, {"top_p": "1"}, {"max_tokens": 0}, {"max_tokens": None}, {"max_tokens": 2.5},
    {"stop_token_ids": None}, {"stop_token_ids": 3}, {"stop_token_ids": (-1,)}, {"ignore_eos": "no"},
    {"prompt": []}, {"prompt": None}, {"prompt": [True, 1]}, {"prompt": [1.5]}, {"prompt": [-1]}, {"prompt": "abc"},
    {"id": None}, {"id": 7}, {"id": ["x"]},
]


@dataclass
class SoakSpec:
    name: str = "soak"
    arms: list[str] = field(default_factory=lambda: ["float32/recompute", "float32/swap", "float8_e4m3fn/recompute",
                                                     "float8_e4m3fn/swap"])  # KV dtype / preemption mode
    requests: int = 400  # valid and malformed together
    num_pages: int = 40  # the small pool (null page included)
    replay_pages: int = 2048  # the large-budget replay's pool
    page_size: int = 4
    max_pages_per_seq: int = 32
    max_batch: int = 8
    prompt_len: list[int] = field(default_factory=lambda: [2, 40])  # uniform, inclusive
    max_tokens: list[int] = field(default_factory=lambda: [1, 24])
    tenants: int = 3
    shared_prefix: int = 16  # tokens of a tenant's shared prefix (a request starts with it with prob. 1/2)
    sampled_fraction: float = 0.5
    bad_fraction: float = 0.05
    cancel_prob: float = 0.03  # per step: cancel one random running request
    arrivals_per_step: int = 2
    max_seconds: float = 300.0  # per arm: stop submitting after this (the run then drains)
    seed: int = 0
    property_examples: int = 200  # Hypothesis examples per property test in the longer run (0: skip it)
    property_tests: list[str] = field(default_factory=lambda: [
        "tests/unit/test_validation.py", "tests/e2e/test_serving_faults.py",
        "tests/e2e/test_reliability.py::test_property_arbitrary_requests_mixed_with_good_ones"])


def make_workload(spec: SoakSpec, vocab: int) -> list[Request]:
    """The soak's requests (the same for every arm): valid ones and, at ``bad_fraction``, malformed ones."""
    rng = np.random.default_rng(spec.seed)
    prefixes = [rng.integers(0, vocab, spec.shared_prefix).tolist() for _ in range(spec.tenants)]
    out = []
    for i in range(spec.requests):
        t = int(rng.integers(spec.tenants))
        n = int(rng.integers(spec.prompt_len[0], spec.prompt_len[1] + 1))
        prompt = rng.integers(0, vocab, n).tolist()
        if rng.random() < 0.5:
            prompt = (prefixes[t] + prompt)[: max(n, spec.shared_prefix + 1)]
        req = Request(id=f"s{i}", prompt=prompt, max_tokens=int(rng.integers(spec.max_tokens[0],
                                                                                 spec.max_tokens[1] + 1)),
                      tenant=f"t{t}", ignore_eos=bool(rng.random() < 0.5), seed=int(rng.integers(2**32)))
        if rng.random() < spec.sampled_fraction:
            req = req.replace(temperature=float(rng.uniform(0.3, 1.5)), top_k=int(rng.integers(0, 40)),
                              top_p=float(rng.uniform(0.5, 1.0)))
        if rng.random() < spec.bad_fraction:
            req = req.replace(**BAD_FIELDS[int(rng.integers(len(BAD_FIELDS)))])
        out.append(req)
    return out


def _serve(base: ServeConfig, kv: str, cache: CacheConfig, max_batch: int) -> ServeConfig:
    return dataclasses.replace(base, quant=dataclasses.replace(base.quant, kv_dtype=kv), cache=cache,
                               max_batch=max_batch)


def soak_arm(cfg, params, serve: ServeConfig, spec: SoakSpec, reqs: list[Request]) -> tuple[dict, dict, list[dict]]:
    """Drive one engine through the workload; (counters, outputs by id of the valid requests, its kernel rows)."""
    eng = Engine(cfg, params, serve)
    rng = np.random.default_rng(spec.seed + 1)
    pending, outs, cancelled, checks = list(reqs), {}, set(), 0
    bad = {"refused": 0, "typed": 0, "accepted": 0}
    t0 = time.perf_counter()
    while pending or eng.has_work:
        if time.perf_counter() - t0 > spec.max_seconds:
            pending = []
        for r in pending[: spec.arrivals_per_step]:
            out = eng.add_request(r)
            if out.finish_reason == "error":
                bad["refused"] += 1
                bad["typed"] += isinstance(out.error, RequestError)
            else:
                outs[r.id] = out
        pending = pending[spec.arrivals_per_step:]
        eng.step()
        eng.check_invariants()
        checks += 1
        if eng.scheduler.running and rng.random() < spec.cancel_prob:
            victim = sorted(s.id for s in eng.scheduler.running)[int(rng.integers(len(eng.scheduler.running)))]
            if eng.cancel(victim):
                cancelled.add(victim)
    elapsed = time.perf_counter() - t0
    finished = [o for o in outs.values() if o.finish_reason in ("length", "stop")]
    counters = dict(
        requests=len(outs) + bad["refused"], valid=len(outs), completed=len(finished), cancels=len(cancelled),
        malformed_refused=bad["refused"], malformed_typed=bad["typed"], preemptions=eng.metrics.preemptions,
        decode_steps=eng.metrics.decode_steps, invariant_checks=checks, seconds=round(elapsed, 2),
        prefill_tokens=eng.metrics.prefill_tokens, prefill_seconds=round(eng.metrics.prefill_time, 2),
        integrity_checks=eng.metrics.integrity_checks,
        false_positives=sum(isinstance(o.error, KVIntegrityError) for o in outs.values()),
        errors=sum(o.finish_reason == "error" for o in outs.values()),
        pages_leaked=eng.num_pages - 1 - eng.allocator.num_free, swap=dict(eng.swap_stats),
        unfinished=sum(o.finish_reason is None for o in outs.values()))
    return counters, {rid: (o.tokens, o.finish_reason, rid in cancelled, o.metrics.preemptions > 0)
                      for rid, o in outs.items()}, rp.kernel_rows(eng)


def compare(got: dict, ref: dict) -> dict:
    """Token equality with the replay: completed requests equal, cancelled ones a prefix."""
    done = {k: v for k, v in got.items() if v[1] in ("length", "stop")}
    cancel = {k: v for k, v in got.items() if v[2]}
    equal = sum(v[0] == ref[k] for k, v in done.items())
    prefix = sum(v[0] == ref[k][: len(v[0])] for k, v in cancel.items())
    tok_same = sum(sum(a == b for a, b in zip(v[0], ref[k], strict=False)) for k, v in done.items())
    tok_all = sum(max(len(v[0]), len(ref[k])) for k, v in done.items())
    pre = {k: v for k, v in done.items() if v[3]}
    return dict(completed=len(done), equal=equal, equal_rate=equal / len(done) if done else math.nan,
                preempted=len(pre), preempted_equal=sum(v[0] == ref[k] for k, v in pre.items()),
                unpreempted_equal=sum(v[0] == ref[k] for k, v in done.items() if not v[3]),
                cancelled=len(cancel), cancelled_prefix_ok=prefix,
                token_agreement=tok_same / tok_all if tok_all else math.nan,
                differing=sorted(k for k, v in done.items() if v[0] != ref[k])[:20])


def run(cfg: DictConfig, out_dir: str | Path) -> dict:
    spec: SoakSpec = experiment_spec(cfg, SoakSpec)
    model_cfg, params, base = serve_config_from_hydra(cfg)
    reqs = make_workload(spec, model_cfg.vocab_size)
    small = CacheConfig(page_size=spec.page_size, num_pages=spec.num_pages, max_pages_per_seq=spec.max_pages_per_seq,
                        admission="on_demand")
    large = CacheConfig(page_size=spec.page_size, num_pages=spec.replay_pages,
                        max_pages_per_seq=spec.max_pages_per_seq)
    replays: dict[str, dict] = {}
    arms, kernels = {}, []
    for arm in spec.arms:
        kv, mode = arm.split("/")
        counters, got, rows = soak_arm(model_cfg, params, _serve(base, kv, dataclasses.replace(small, preemption=mode),
                                                           spec.max_batch), spec, reqs)
        if kv not in replays:
            valid = [r for r in reqs if isinstance(r.id, str) and r.id in got]
            eng = Engine(model_cfg, params, _serve(base, kv, large, max(spec.max_batch, 64)))
            replays[kv] = {o.id: o.tokens for o in eng.generate(valid)}
            kernels.append(rp.kernel_rows(eng))
        kernels.append(rows)
        arms[arm] = dict(counters, replay=compare(got, replays[kv]))
        print(arm, {k: v for k, v in arms[arm].items() if k != "replay"}, arms[arm]["replay"])
    env = environment() | {"kernels": rp.kernel_rows(*kernels)}
    results = {"experiment": "soak", "properties": property_run(spec), "spec": dataclasses.asdict(spec),
               "environment": env, "model": model_cfg.architecture, "weights": base.quant.decode_weights,
               "arms": arms}
    rp.write_outputs(Path(out_dir), cfg, results, render(results))
    plot(results, Path(out_dir))
    return results


def plot(results: dict, out_dir: Path) -> Path:
    """``replay_equality.png``: per arm, the share of completed requests equal to the replay, preempted or not."""
    arms = list(results["arms"])
    rs = [results["arms"][a]["replay"] for a in arms]
    bars = {"preempted": ([100 * r["preempted_equal"] / max(r["preempted"], 1) for r in rs], None, None),
            "not preempted": ([100 * r["unpreempted_equal"] / max(r["completed"] - r["preempted"], 1) for r in rs],
                              None, None)}
    return rp.bar_plot(out_dir / PLOT, [a.replace("/", "\n") for a in arms], bars,
                       ylabel="% of completed requests equal to the replay",
                       title="Soak: outputs vs a large-budget replay, by KV dtype / preemption mode")


def _properties(p: dict | None) -> str:
    if p is None:
        return "Property tests: not run (`experiment.property_examples=0`)."
    return (f"Property tests (Hypothesis, {p['examples_per_property']} examples per property, `-k property` over "
            f"{', '.join(f'`{t}`' for t in p['tests'])}): exit code {p['returncode']}, `{p['summary']}` "
            f"({p['seconds']} s).")


def property_run(spec: SoakSpec) -> dict | None:
    """The property tests with ``spec.property_examples`` examples each (a pytest subprocess in the repository)."""
    if spec.property_examples <= 0:
        return None
    env = dict(os.environ, PHASESERVE_HYPOTHESIS_EXAMPLES=str(spec.property_examples))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "property",
                           *spec.property_tests], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    return dict(examples_per_property=spec.property_examples, tests=spec.property_tests, returncode=proc.returncode,
                summary=lines[-1] if lines else proc.stderr[-300:], seconds=round(time.perf_counter() - t0, 1))


def render(results: dict) -> str:
    s = results["spec"]
    rows, cost = [], []
    for arm, a in results["arms"].items():
        r, sw = a["replay"], a["swap"]
        rows.append([arm, a["requests"], a["preemptions"], a["cancels"],
                     f"{a['malformed_typed']}/{a['malformed_refused']}",
                     a["false_positives"], a["pages_leaked"], a["invariant_checks"],
                     f"{r['equal']}/{r['completed']} ({100 * r['equal_rate']:.1f}%)",
                     f"{r['preempted_equal']}/{r['preempted']}",
                     f"{r['unpreempted_equal']}/{r['completed'] - r['preempted']}",
                     f"{100 * r['token_agreement']:.2f}%", f"{r['cancelled_prefix_ok']}/{r['cancelled']}"])
        cost.append([arm, a["preemptions"], a["prefill_tokens"], a["prefill_seconds"], sw["swap_outs"],
                     f"{sw['bytes'] / 2**20:.3f}", f"{sw['seconds']:.2f}", a["seconds"]])
    table = rp.markdown_table(
        ["arm (KV / preemption)", "requests", "preemptions", "cancels", "malformed refused (typed / all)",
         "false positives", "pages leaked", "invariant checks", "completed = replay", "of them preempted",
         "of them not preempted", "token agreement", "cancelled = replay prefix"], rows)
    costs = rp.markdown_table(["arm", "preemptions", "prefill tokens", "prefill s", "swap-outs",
                               "swapped MiB (one way)", "swap s (both ways)", "arm s"], cost)
    return f"""# Soak: randomized serving under a small KV budget vs a large-budget replay

`python experiments/soak.py hydra.run.dir=benchmarks/soak`. Every number below is counted in this run
(`results.json`).

- model `{results['model']}`, {results['weights']} weights (only the KV dtype differs between arms)
- {s['requests']} requests, {s['bad_fraction']:.0%} of them malformed; prompts {s['prompt_len'][0]}-{s['prompt_len'][1]}
  tokens, half of them starting with one of {s['tenants']} tenants' {s['shared_prefix']}-token prefixes; outputs
  {s['max_tokens'][0]}-{s['max_tokens'][1]} tokens; {s['sampled_fraction']:.0%} sampled (random temperature, top-k,
  top-p, seed), the rest greedy
- a pool of {s['num_pages']} pages of {s['page_size']} tokens, `admission=on_demand`, at most {s['max_batch']}
  running, {s['arrivals_per_step']} arrivals per step, one random running request cancelled with probability
  {s['cancel_prob']} per step, `check_invariants()` after every step
- the replay: the same valid requests on {s['replay_pages']} pages (nothing is preempted)

{table}

![{PLOT}]({PLOT})

Cost of preemption per mode (recompute pays in prefill tokens, swap in host copies; times include compilation of
new shapes on a shared CPU):

{costs}

- *completed = replay*: requests that finished (length / stop) with exactly the replay's tokens; *token agreement*:
  matching tokens position by position over those requests; *cancelled = replay prefix*: cancelled requests whose
  tokens so far are a prefix of the replay's.
- *false positives*: requests aborted by the integrity check although no fault was injected.
- *swap*: pages copied to host at preemption and back at readmission (`CacheConfig.preemption="swap"`); bytes one
  way.

{_properties(results.get("properties"))}

{rp.environment_section(results['environment'])}
"""
