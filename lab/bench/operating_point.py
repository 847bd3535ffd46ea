"""The decode step's cost vs the batch, and the operating point it implies for the KV-dtype experiments.

The published FP8-KV result is a chain: a fixed KV budget -> FP8 pages admit 2x the requests -> the decode step
costs about the same at 2x the batch (it streams the weights once per step, whatever the batch, until the matrix
units saturate) -> more tokens per second at the peak. The third link is a property of the *operating point*:
it holds where the step is bandwidth-bound (weights dominate the step) and fails where the step grows linearly
with the batch (compute- or overhead-bound). This experiment measures where each model sits, on this machine:

- machine rates of the same run: memory bandwidth (STREAM-like: a numpy copy, a jitted scale and a jitted
  read-only reduction over arrays far larger than the caches) and the dense matmul rate (jitted f32 and bf16);
- the engine's real decode step (:meth:`phaseserve.engine.workers.DecodeWorker.step`: the integrity check, the
  jitted step with the donated pool, the host transfer) at batch 1..64, every row holding ``context`` cached
  tokens, for the shipped model and random-weight models of the default architecture scaled up, in float32 and
  BF16 weights (arms interleaved, repeats with the order rotated: :func:`lab.bench.measure.interleaved`);
- per curve: the doubling gain ``2 t(B) / t(2B)`` (the throughput a 2x batch buys: 2.0 when the step is flat,
  1.0 when it is linear), the measured ridge ``t(1) / slope`` (the batch at which the step's per-row cost, the
  slope of its tail, adds up to its fixed cost) and the roofline ridge from the measured rates;
- the GPU side: the same rule on the planner's roofline curve (:mod:`phaseserve.planner.roofline`) for
  Moonlight-16B-A3B on one H200.

:func:`choose` is the operating-point rule (a pure function of the curves, tested on synthetic ones): the smallest
model (then the cheapest weights) with a batch ``B >= min_batch`` whose doubling gain is at least ``min_gain``,
taking the largest such ``B``; BF16 KV is then budgeted to admit ``B`` and FP8 admits ~2B. The kv_dtype
experiment applies it before measuring anything, so the predicted gain is written down first.

    python experiments/operating_point.py hydra.run.dir=benchmarks/operating_point
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from lab.bench import publish
from lab.bench import report as rp
from lab.bench import verdict as vd
from lab.bench.measure import aggregate, environment, interleaved, stats
from lab.bench.schema import experiment_spec, with_overrides
from phaseserve.config_hydra import REPO_ROOT, load_model, repo_path, serve_config, to_container

CURVE = "benchmarks/operating_point/results.json"  # the committed curve other experiments read
WIDTH_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads",
              "num_key_value_heads", "q_lora_rank", "kv_lora_rank")  # scaled together by ``width``
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass
class ModelEntry:
    name: str = "model"
    checkpoint: bool = False  # True: the composed cfg.model (the shipped checkpoint); else default_random scaled
    width: int = 1  # WIDTH_KEYS x width
    layers: int | None = None  # num_hidden_layers; None: the base model's
    overrides: dict[str, Any] = field(default_factory=dict)  # further config.json keys


@dataclass
class OperatingPointSpec:
    name: str = "operating_point"
    models: list[ModelEntry] = field(default_factory=list)
    weights: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    context: int = 64  # cached tokens per row (the kv_dtype workload's mean context: 32 + 64 / 2)
    steps: int = 5  # timed steps per point (median)
    repeats: int = 3  # interleaved repeats of the whole sweep per model
    bandwidth_mib: int = 512  # array size of the bandwidth probes
    matmul_n: int = 2048  # square matmul size of the rate probe
    min_gain: float = 1.5  # the rule: predicted throughput gain of doubling the batch
    min_batch: int = 4
    gpu_model: str = "moonlight-16b-a3b"
    gpu: str = "h200"
    gpu_context: int = 1152  # the GPU workload's mean context (gpu_kv_budget: 1,024 + 256 / 2)
    gpu_batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])


# ---- the rule (pure functions of measured curves) -------------------------------------------------------------
def doubling_gains(curve: dict[int, float]) -> dict[int, float]:
    """``{B: 2 t(B) / t(2B)}`` for every ``B`` whose double is on the curve (``curve``: batch -> step seconds)."""
    return {b: 2 * curve[b] / curve[2 * b] for b in sorted(curve) if 2 * b in curve and curve[2 * b] > 0}


def regime(curve: dict[int, float], min_gain: float = 1.5) -> dict[str, Any]:
    """Where a step-time curve is flat (bandwidth-bound) and where it is linear, in numbers.

    ``slope``: seconds per extra row over the last two points; ``ridge_batch``: ``t(1) / slope`` (where the rows'
    cost equals the fixed cost; None when the tail is flat); ``flat_until``: the largest ``B`` whose doubling still
    buys ``min_gain``; ``t_ratio``: ``t(B) / t(1)`` per batch.
    """
    bs = sorted(curve)
    t1 = curve[bs[0]]
    slope = (curve[bs[-1]] - curve[bs[-2]]) / (bs[-1] - bs[-2]) if len(bs) > 1 else 0.0
    gains = doubling_gains(curve)
    flat = [b for b, g in gains.items() if g >= min_gain]
    return {"t1_s": t1, "slope_s_per_row": slope, "ridge_batch": t1 / slope if slope > 0 else None,
            "flat_until": max(flat) if flat else None, "doubling_gain": gains,
            "t_ratio": {b: curve[b] / t1 for b in bs},
            "cheap_doublings": flat,
            "bound": (f"a 2x batch buys >= {min_gain:g}x tokens/s at B = {flat}" if flat
                      else f"no batch where a 2x batch buys {min_gain:g}x (linear in the batch)")}


def choose(curves: list[dict], min_gain: float = 1.5, min_batch: int = 4) -> dict | None:
    """The operating point: ``curves`` are ``{"model", "params", "weights", "curve": {B: seconds}}``.

    Candidates: batches ``B >= min_batch`` whose double is measured and whose doubling gain ``2 t(B) / t(2B)`` is at
    least ``min_gain``. The rule takes the smallest model (by parameters; then the fewer weight bytes) that has a
    candidate, at its largest candidate ``B``: BF16 KV is budgeted for ``B`` requests, FP8 then admits ~2B, and the
    predicted peak-vs-peak gain is the doubling gain at ``B``. None when no curve has a candidate (a step linear in
    the batch everywhere: a bigger batch buys nothing).
    """
    best = None
    for c in curves:
        curve = {int(b): float(t) for b, t in c["curve"].items()}
        ok = [b for b, g in doubling_gains(curve).items() if b >= min_batch and g >= min_gain]
        if not ok:
            continue
        key = (c["params"], WEIGHT_BYTES.get(c["weights"], 4))
        if best is None or key < best[0]:
            b = max(ok)
            best = (key, {"model": c["model"], "params": c["params"], "weights": c["weights"], "batch": b,
                          "fp8_batch": 2 * b, "predicted_gain": 2 * curve[b] / curve[2 * b],
                          "step_s": [curve[b], curve[2 * b]], "min_gain": min_gain, "min_batch": min_batch})
    return best[1] if best else None


RULE_TEXT = ("the smallest model (then the fewer weight bytes) with a batch B >= {min_batch} whose doubling gain "
             "2 t(B) / t(2B) on the measured decode-step curve is at least {min_gain:g}, at its largest such B; "
             "BF16 KV budgeted for B requests (FP8 then admits ~2B); predicted peak gain = that doubling gain")


def load_curves(path: str | Path = CURVE) -> dict:
    """The committed curve results (``results.json`` of this experiment)."""
    p = repo_path(str(path))
    if not p.exists():
        raise FileNotFoundError(f"no operating-point curve at {p}: run experiments/operating_point.py first")
    return json.loads(p.read_text())


def cpu_curves(res: dict) -> list[dict]:
    """The rule's input from a results dict: one entry per (model, weights), batch -> the fastest step seen at that
    batch over every repeat (on a shared machine the least-disturbed estimate of the step's own cost; the report's
    tables give the medians and ranges beside it)."""
    agg = aggregate(res["records"], ["step_min_s"])
    out = []
    for m in res["models"]:
        for w in res["settings"]["weights"]:
            arm = f"{m['name']}/{w}"
            if arm in agg:
                out.append({"model": m["name"], "params": m["params"], "weights": w,
                            "curve": {int(b): v["step_min_s"]["min"] for b, v in agg[arm].items()}})
    return out


def model_overrides(res: dict, name: str) -> dict:
    """The ``model`` config node (default_random + overrides) that rebuilds curve model ``name``."""
    m = next((x for x in res["models"] if x["name"] == name), None)
    if m is None:
        raise KeyError(f"model {name!r} is not on the curve ({[x['name'] for x in res['models']]})")
    return m["model_node"]


def regime_lines(model_name: str, weights: str, batches: list[int], path: str | Path = CURVE) -> list[str]:
    """Report lines: the regime of ``model_name`` in ``weights`` at ``batches`` from the committed curve (empty
    when the curve or the model is missing)."""
    try:
        res = load_curves(path)
    except FileNotFoundError:
        return []
    curves = {(c["model"], c["weights"]): c["curve"] for c in cpu_curves(res)}
    curve = curves.get((model_name, weights))
    if curve is None:
        return []
    r = regime(curve, res["settings"]["min_gain"])
    pts = "; ".join(f"B={b}: t(B)/t(1) = {r['t_ratio'][b]:.2f}" + (f", doubling gain {r['doubling_gain'][b]:.2f}"
                                                                    if b in r["doubling_gain"] else "")
                    for b in batches if b in curve)
    ridge = f"{r['ridge_batch']:.1f}" if r["ridge_batch"] else "none"
    return [f"Regime (decode-step curve of `{model_name}`, {weights} weights, {res['settings']['context']}-token "
            f"context, `{path}`, measured {res['environment']['date']}): {r['bound']}; measured ridge B ~ {ridge}; "
            f"{pts}."]


# ---- models -------------------------------------------------------------------------------------------------------
def model_node(cfg: DictConfig, entry: ModelEntry) -> dict:
    """The ``model`` config node of one entry: the composed model, or default_random scaled by width / layers."""
    if entry.checkpoint:
        return {**to_container(cfg.model), "name": entry.name}
    base = OmegaConf.load(REPO_ROOT / "configs/model/default_random.yaml")
    hf = to_container(base.hf)
    ov = {k: int(hf[k]) * int(entry.width) for k in WIDTH_KEYS}
    if entry.layers is not None:
        ov["num_hidden_layers"] = int(entry.layers)
    ov.update(entry.overrides or {})
    return {"name": entry.name, "checkpoint": None, "preset": None, "hf": hf, "overrides": ov,
            "dtype": "float32", "seed": 0}


def model_facts(model_cfg: Any) -> dict:
    """Parameters and the per-token numbers the roofline needs (uniform routing over experts)."""
    from phaseserve.model.params import abstract_params, param_count
    from phaseserve.quant.size_report import size_report

    rep = size_report(abstract_params(model_cfg, "float32"))
    params = param_count(abstract_params(model_cfg))
    experts = sum(r.params for r in rep.rows if r.tensor_class == "routed_experts")
    embed = sum(r.params for r in rep.rows if r.tensor_class == "embeddings")
    k, e = model_cfg.num_experts_per_tok, max(model_cfg.num_experts, 1)
    return {"params": params, "routed_expert_params": experts, "embedding_params": embed,
            "active_params_per_token": params - embed - experts + experts * k / e,
            "experts_per_token": k, "num_experts": e}


def roofline_step(facts: dict, batch: int, weight_bytes: int, bandwidth: float, flops: float) -> dict:
    """Lower bound of one decode step (seconds) from the machine's rates: the weights read (only the experts the
    batch touches, ``E (1 - (1 - k/E)^B)`` per layer, as :func:`phaseserve.planner.roofline.decode_time` counts them)
    over the bandwidth, or the matmul FLOPs over the matmul rate, whichever is larger."""
    k, e = facts["experts_per_token"], facts["num_experts"]
    frac = 1 - (1 - k / e) ** batch if e > 1 else 1.0
    rest = facts["params"] - facts["embedding_params"] - facts["routed_expert_params"]
    mem = (rest + facts["routed_expert_params"] * frac) * weight_bytes / bandwidth
    comp = 2 * facts["active_params_per_token"] * batch / flops
    return {"memory_s": mem, "compute_s": comp, "step_s": max(mem, comp), "bound": "memory" if mem >= comp else
            "compute"}


# ---- machine rates ------------------------------------------------------------------------------------------------
def machine_rates(mib: int = 512, n: int = 2048, repeats: int = 5) -> dict:
    """Bandwidth (bytes/s: numpy copy and jitted scale count read + write, the jitted sum counts the read) and
    dense matmul rates (FLOP/s, f32 and bf16), medians of ``repeats``."""
    import jax
    import jax.numpy as jnp

    def best(fn, count):
        fn()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return {"median": count / float(np.median(ts)), "max": count / min(ts), "min": count / max(ts)}

    mm = {}
    for dt in ("float32", "bfloat16"):
        p = jax.random.normal(jax.random.key(2), (n, n), dt)
        q = jax.random.normal(jax.random.key(3), (n, n), dt)
        dot = jax.jit(jnp.dot)
        mm[dt] = best(lambda p=p, q=q, dot=dot: dot(p, q).block_until_ready(), 2 * n ** 3)
    nbytes = mib << 20
    a = np.random.default_rng(0).random(nbytes // 8)
    b = np.empty_like(a)
    x = jnp.asarray(np.random.default_rng(1).random(nbytes // 4, dtype=np.float32))
    scale, total = jax.jit(lambda v: v * 1.0001), jax.jit(jnp.sum)
    out = {"copy_numpy": best(lambda: np.copyto(b, a), 2 * nbytes),
           "scale_jax": best(lambda: scale(x).block_until_ready(), 2 * nbytes),
           "read_jax": best(lambda: total(x).block_until_ready(), nbytes)}
    return {"bandwidth_b_per_s": out, "matmul_flop_per_s": mm, "bandwidth_mib": mib, "matmul_n": n,
            "bandwidth": max(v["median"] for v in out.values())}


# ---- the engine's decode step -------------------------------------------------------------------------------------
def _rows(engine: Any, batch: int, context: int, vocab: int, tag: str) -> list:
    """``batch`` live sequences, each holding pages for ``context`` cached tokens (random ids; pool as allocated)."""
    from phaseserve.engine.request import Request, RequestOutput, Sequence

    rng = np.random.default_rng(batch)
    rows = []
    for i in range(batch):
        rid = f"{tag}-{batch}-{i}"
        prompt = rng.integers(0, vocab, context).tolist()
        engine.tables.add(rid)
        if not engine.tables.grow(rid, context + 1, engine.serve.cache.page_size):
            raise RuntimeError(f"pool too small for {batch} rows of {context} tokens")
        rows.append(Sequence(request=Request(id=rid, prompt=prompt, max_tokens=1 << 20, ignore_eos=True),
                             output=RequestOutput(id=rid), tokens=list(prompt), num_prompt=context))
    return rows


def time_steps(engine: Any, rows: list, steps: int) -> dict:
    """Median / min / max seconds of ``steps`` decode steps of the engine's decode worker over ``rows``."""
    ts = [engine.decode.step(rows)[2] for _ in range(steps)]
    return {"step_s": float(np.median(ts)), "step_min_s": float(min(ts)), "step_max_s": float(max(ts)),
            "tok_per_s": len(rows) / float(np.median(ts)), "batch": len(rows)}


def measure_model(cfg: DictConfig, node: dict, spec: OperatingPointSpec, log=print) -> tuple[dict, list[dict]]:
    """Facts and interleaved step-time records of one model in every weight dtype (one engine per dtype, its
    decode step compiled for every batch before the timed runs; the rows' pages are allocated per run)."""
    from phaseserve.engine import Engine

    mcfg = with_overrides(cfg, {"model": node})
    model_cfg, params = load_model(mcfg)
    facts = model_facts(model_cfg)
    pages = -(-(spec.context + 1) // int(cfg.cache.page_size))
    base = {"engine.mode": "colocated", "engine.max_batch": max(spec.batches),
            "cache.num_pages": 1 + max(spec.batches) * pages, "cache.kv_budget_bytes": None,
            "cache.kv_budget_requests": None, "quant.kv_dtype": "bfloat16"}
    engines = {}
    for w in spec.weights:
        t0 = time.perf_counter()
        arm_cfg = with_overrides(mcfg, {**base, "quant.prefill_weights": w, "quant.decode_weights": w})
        eng = engines[f"{node['name']}/{w}"] = Engine(model_cfg, params, serve_config(arm_cfg, model_cfg),
                                                      attn_impl=str(cfg.engine.attn_impl))
        for b in spec.batches:  # compile this batch bucket and table width outside the timed runs
            one(eng, b, spec.context, model_cfg.vocab_size, 2)
        log(f"[{node['name']}/{w}] engine built, decode step compiled for {list(spec.batches)} in "
            f"{time.perf_counter() - t0:.1f}s")
    del params
    records = interleaved(engines, list(spec.batches), int(spec.repeats),
                          lambda eng, arm, b, rep: one(eng, b, spec.context, model_cfg.vocab_size, int(spec.steps)),
                          desc=node["name"], progress=bool(cfg.progress))
    for r in records:
        r["model"], r["weights"] = node["name"], r["arm"].split("/")[1]
    facts["kernels"] = rp.kernel_rows(*engines.values())
    return facts, records


def one(engine: Any, batch: int, context: int, vocab: int, steps: int) -> dict:
    """Time ``steps`` decode steps of ``batch`` fresh rows (pages allocated, then released)."""
    rows = _rows(engine, batch, context, vocab, "op")
    try:
        return time_steps(engine, rows, steps)
    finally:
        for s in rows:
            engine.tables.release(s.id)


def gpu_curve(spec: OperatingPointSpec) -> dict:
    """The planner's roofline decode curve for ``gpu_model`` on one ``gpu`` in BF16 weights and BF16 / FP8 KV,
    with the KV capacity of each dtype and the rule applied to the BF16 curve."""
    from phaseserve.planner import deployment

    out: dict[str, Any] = {"model": spec.gpu_model, "gpu": spec.gpu, "context": spec.gpu_context}
    for kv in ("bf16", "fp8"):
        d = deployment(spec.gpu_model, spec.gpu, 1, weights="bf16", kv=kv)
        rows = [d.decode_time(b, spec.gpu_context) for b in spec.gpu_batches]
        out[kv] = {"kv_tokens": d.kv_tokens, "curve": {r["concurrency"]: r["step_s"] for r in rows},
                   "bound": {r["concurrency"]: r["bound"] for r in rows}}
    params = deployment(spec.gpu_model, spec.gpu, 1, weights="bf16", kv="bf16").serving.total_params
    out["params"] = params
    out["choice"] = choose([{"model": spec.gpu_model, "params": params, "weights": "bfloat16",
                             "curve": out["bf16"]["curve"]}], spec.min_gain, spec.min_batch)
    out["regime"] = regime(out["bf16"]["curve"], spec.min_gain)
    return out


# ---- the experiment -----------------------------------------------------------------------------------------------
def run(cfg: DictConfig, out_dir: str | Path, log=print) -> dict:
    spec: OperatingPointSpec = experiment_spec(cfg, OperatingPointSpec)
    env = environment()
    t0 = time.perf_counter()
    rates = machine_rates(spec.bandwidth_mib, spec.matmul_n)
    log(f"bandwidth {rates['bandwidth'] / 1e9:.1f} GB/s; matmul f32 "
        f"{rates['matmul_flop_per_s']['float32']['median'] / 1e9:.0f} GFLOP/s")
    models, records = [], []
    for entry in spec.models:
        node = model_node(cfg, entry)
        facts, recs = measure_model(cfg, node, spec, log)
        models.append({"name": entry.name, "model_node": node, **facts})
        records += recs
        log(f"[{entry.name}] {facts['params'] / 1e6:.1f}M params measured")
    rates_after = machine_rates(spec.bandwidth_mib, spec.matmul_n)
    env["kernels"] = rp.kernel_rows(*(m.pop("kernels") for m in models))
    results = {"experiment": "operating_point", "environment": env, "settings": {
        k: getattr(spec, k) for k in ("weights", "batches", "context", "steps", "repeats", "min_gain", "min_batch")},
        "machine": {"before": rates, "after": rates_after}, "models": models, "gpu": gpu_curve(spec),
        "records": records, "seconds": time.perf_counter() - t0,
        "load_average_end": [round(x, 2) for x in os.getloadavg()]}
    publish.publish(out_dir, results, sys.modules[__name__], cfg, log)
    return results


def summarize(res: dict, out_dir: Path | None = None) -> dict:
    s, m = res["settings"], res["machine"]
    bw = float(np.median([m["before"]["bandwidth"], m["after"]["bandwidth"]]))
    flops = {dt: float(np.median([m[k]["matmul_flop_per_s"][dt]["median"] for k in ("before", "after")]))
             for dt in ("float32", "bfloat16")}
    curves = cpu_curves(res)
    facts = {x["name"]: x for x in res["models"]}
    per = {}
    for c in curves:
        f, w = facts[c["model"]], c["weights"]
        roof = {b: roofline_step(f, b, WEIGHT_BYTES[w], bw, flops[w]) for b in s["batches"]}
        roof_ridge = next((b for b in s["batches"] if roof[b]["bound"] == "compute"), None)
        per[f"{c['model']}/{w}"] = {**regime(c["curve"], s["min_gain"]), "roofline": roof,
                                     "roofline_first_compute_bound_batch": roof_ridge}
    choice = choose(curves, s["min_gain"], s["min_batch"])
    verdicts = [vd.Verdict("a CPU operating point where a 2x batch costs about the same step",
                           (f"{choice['model']} ({choice['weights']} weights): B={choice['batch']} -> "
                            f"{choice['fp8_batch']}, doubling gain {choice['predicted_gain']:.2f}")
                           if choice else "none on this curve",
                           f"doubling gain >= {s['min_gain']:g} at B >= {s['min_batch']}",
                           vd.REPRODUCED if choice else vd.NOT_REPRODUCED)]
    return {"bandwidth": bw, "matmul": flops, "curves": curves, "regimes": per, "choice": choice,
            "gpu_choice": res["gpu"]["choice"], "verdicts": [v.to_dict() for v in verdicts],
            "load": stats([r.get("load_1m") for r in res["records"]])}


def plots(out_dir: Path, res: dict, summary: dict) -> list[str]:
    agg = aggregate(res["records"], ["step_s"])
    bs = res["settings"]["batches"]
    series = {}
    for arm, by in agg.items():
        t1 = by[bs[0]]["step_s"]["median"]
        series[arm] = (bs, [by[b]["step_s"]["median"] / t1 for b in bs],
                       [by[b]["step_s"]["min"] / t1 for b in bs], [by[b]["step_s"]["max"] / t1 for b in bs])
    series["linear (t ∝ B)"] = (bs, [float(b) for b in bs], None, None)
    rp.line_plot(out_dir / "step_vs_batch.png", series, xlabel="decode batch (rows)",
                 ylabel="step time / step time at batch 1",
                 title=f"Engine decode step vs batch ({res['settings']['context']}-token context; band = min..max "
                       "over repeats; flat = bandwidth-bound)",
                 styles={"linear (t ∝ B)": {"color": "gray", "linestyle": ":", "marker": None}})
    tput = {arm: (bs, [b / by[b]["step_s"]["median"] for b in bs], None, None) for arm, by in agg.items()}
    rp.line_plot(out_dir / "rows_per_s.png", tput, xlabel="decode batch (rows)", ylabel="decode tokens/s",
                 title="Decode tokens/s vs batch (median over repeats)")
    return ["step_vs_batch.png", "rows_per_s.png"]


def markdown(res: dict, summary: dict, plot_files: list[str]) -> str:
    s, env, agg = res["settings"], res["environment"], aggregate(res["records"], ["step_s", "step_min_s"])
    bs, ch = s["batches"], summary["choice"]
    mm = res["machine"]
    lines = ["# Decode step vs batch: where the decode step is bandwidth-bound (operating point)", "",
             "Verdict:", ""] + [f"- {vd.Verdict(**v).line()}" for v in summary["verdicts"]] + [""]
    lines += ["## Machine rates (same run; before / after the curves)", "", rp.markdown_table(
        ["probe", "before", "after"],
        [[f"bandwidth {k} (GB/s)", f"{mm['before']['bandwidth_b_per_s'][k]['median'] / 1e9:.1f}",
          f"{mm['after']['bandwidth_b_per_s'][k]['median'] / 1e9:.1f}"] for k in mm["before"]["bandwidth_b_per_s"]]
        + [[f"matmul {dt} {mm['before']['matmul_n']}^3 (GFLOP/s)",
            f"{mm['before']['matmul_flop_per_s'][dt]['median'] / 1e9:.0f}",
            f"{mm['after']['matmul_flop_per_s'][dt]['median'] / 1e9:.0f}"] for dt in ("float32", "bfloat16")]), "",
             f"Roofline inputs: bandwidth {summary['bandwidth'] / 1e9:.1f} GB/s (the best probe, median of before "
             f"and after); matmul {summary['matmul']['float32'] / 1e9:.0f} GFLOP/s f32, "
             f"{summary['matmul']['bfloat16'] / 1e9:.0f} GFLOP/s bf16. Machine balance (f32): "
             f"{summary['matmul']['float32'] / summary['bandwidth']:.1f} FLOP/byte.", ""]
    lines += ["## Models", "", rp.markdown_table(
        ["model", "params", "routed experts", "active params / token", "weights f32 (MB)"],
        [[x["name"], f"{x['params'] / 1e6:.1f}M", f"{x['num_experts']} (top-{x['experts_per_token']}), "
          f"{100 * x['routed_expert_params'] / x['params']:.0f}% of params",
          f"{x['active_params_per_token'] / 1e6:.1f}M",
          f"{4 * x['params'] / 1e6:.0f}"] for x in res["models"]]), ""]
    rows = []
    for arm, r in summary["regimes"].items():
        by = agg[arm]
        rows.append([arm] + [f"{1e3 * by[b]['step_s']['median']:.2f} ({1e3 * by[b]['step_min_s']['min']:.2f})"
                             for b in bs]
                    + [f"{r['doubling_gain'].get(16, float('nan')):.2f}",
                       f"{r['ridge_batch']:.1f}" if r["ridge_batch"] else "none",
                       r["roofline_first_compute_bound_batch"] or f">{bs[-1]}", r["bound"]])
    lines += [f"## Decode step (ms: median over {s['repeats']} interleaved repeats of each repeat's median of "
              f"{s['steps']} steps, and in brackets the fastest step seen; every row holds {s['context']} cached "
              "tokens, BF16 KV, integrity on)", "",
              "The rule and the regime columns read the fastest step per point (the least-disturbed estimate of the "
              "step's own cost on a shared machine).", "",
              "doubling gain = 2 t(B) / t(2B): the throughput a 2x batch buys (2.0 flat, 1.0 linear); measured ridge = "
              "t(1) / slope of the last two points; roofline: the first batch at which the matmul time exceeds the "
              "weight-read time at the measured rates (experts read only where the batch routes).", "",
              rp.markdown_table(["model / weights"] + [f"B={b}" for b in bs]
                                + ["gain 16->32", "measured ridge B", "roofline compute-bound from B", "regime"],
                                rows), ""]
    gains = [[arm] + [f"{r['doubling_gain'][b]:.2f}" for b in bs if b in r["doubling_gain"]]
             for arm, r in summary["regimes"].items()]
    spread = {arm: max(by[b]["step_s"]["median"] / by[b]["step_min_s"]["min"] for b in bs) for arm, by in agg.items()}
    lines += [f"Noise: the median step is up to {max(spread.values()):.1f}x the fastest step of its point "
              f"(median over curves {float(np.median(list(spread.values()))):.1f}x) at a load of "
              f"{rp.spread(summary['load'])} on {env.get('cpu_cores')} cores; a doubling gain below 1 is that noise, "
              "not the step getting cheaper with more rows.", ""]
    lines += ["### Doubling gain by batch (fastest steps)", "", rp.markdown_table(
        ["model / weights"] + [f"{b}->{2 * b}" for b in bs if 2 * b in bs], gains), ""]
    lines += ["## Operating point (the rule; kv_dtype applies it before measuring)", "",
              "Rule: " + RULE_TEXT.format(**s) + ".", ""]
    if ch:
        lines += [f"- CPU: `{ch['model']}` ({ch['params'] / 1e6:.1f}M params), {ch['weights']} weights: BF16 KV admits "
                  f"B = {ch['batch']}, FP8 ~{ch['fp8_batch']}; step {1e3 * ch['step_s'][0]:.2f} ms -> "
                  f"{1e3 * ch['step_s'][1]:.2f} ms; predicted peak gain "
                  f"{rp.pct(ch['predicted_gain'])} (before FP8's own dequantization cost)."]
    else:
        lines += ["- CPU: no curve has a batch >= min_batch whose doubling buys the gain: no operating point."]
    g = res["gpu"]
    gc = g["choice"]
    lines += [f"- GPU ({g['model']} on one {g['gpu']}, planner roofline, BF16 weights, {g['context']}-token context): "
              + (f"BF16 KV budgeted for B = {gc['batch']}, FP8 ~{gc['fp8_batch']}; predicted gain "
                 f"{rp.pct(gc['predicted_gain'])}" if gc else "no operating point")
              + f"; resident KV tokens BF16 {g['bf16']['kv_tokens']:,} vs FP8 {g['fp8']['kv_tokens']:,} "
              f"(= {g['bf16']['kv_tokens'] // g['context']} vs {g['fp8']['kv_tokens'] // g['context']} requests at "
              "that context); roofline step (ms) by batch: " + ", ".join(
                  f"{b}: {1e3 * t:.1f} ({g['bf16']['bound'][b]})" for b, t in g["bf16"]["curve"].items()) + ".", ""]
    lines += [f"![{p}]({p})" for p in plot_files]
    lines += ["", f"Run time {res['seconds'] / 60:.1f} min; machine load (1-minute load average) over the timed runs "
              f"{rp.spread(summary['load'])} on {env.get('cpu_cores')} cores, at the end {res['load_average_end']}.",
              "", rp.environment_section(env), ""]
    return "\n".join(lines)


# ---- applying the rule to another experiment ------------------------------------------------------------------------
def apply_operating_point(cfg: DictConfig, path: str | Path = CURVE) -> tuple[DictConfig, dict]:
    """``cfg`` moved to the operating point :func:`choose` picks on the committed curve: that model and weights,
    the BF16 KV budget for ``B`` requests, offered concurrency ``[B, 2B]`` (each dtype's peak); and the record of
    the choice (rule, curve, prediction), written into the results before anything is measured."""
    res = load_curves(path)
    s = res["settings"]
    choice = choose(cpu_curves(res), s["min_gain"], s["min_batch"])
    if choice is None:
        raise ValueError(f"the curve at {path} has no operating point (no batch >= {s['min_batch']} whose doubling "
                         f"buys {s['min_gain']:g}x): nothing to run there")
    b, w = choice["batch"], choice["weights"]
    out = with_overrides(cfg, {"model": model_overrides(res, choice["model"]), "quant.prefill_weights": w,
                               "quant.decode_weights": w, "cache.kv_budget_requests": b, "cache.kv_budget_bytes": None,
                               "cache.budget_dtype": "bfloat16", "workload.concurrency": [b, 2 * b]})
    info = {"curve": str(path), "curve_date": res["environment"]["date"], "curve_commit": res["environment"].get(
        "git_commit"), "rule": RULE_TEXT.format(**s), **choice}
    return out, info
