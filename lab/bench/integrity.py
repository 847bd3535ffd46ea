"""Experiment 3: what the page-tag integrity check costs, and what it catches.

Published shape: on 8,192-token inputs / 1,000-token outputs the check changes throughput and p95 latency by
less than 1%, and when disabled a no-op tracker costs nothing.

Overhead (one process, arms interleaved, order rotated): ``on`` (``cache.integrity=true``: the jitted batched tag
check before every decode step, the per-row ok mask and finite guard inside it), ``off``
(``cache.integrity=false``) and ``noop``. In this engine disabling the check *is* installing the
:class:`~phaseserve.cache.integrity.NoopTracker` (the decode step is then traced without a tracker: same jaxpr as
no tracker at all), so ``off`` and ``noop`` are two independently built engines on the same code path: their
paired difference is an A/A measurement of the noise floor, against which the ``on`` overhead is judged.
Throughput and p95 end-to-end latency deltas are paired within each repeat and judged through the bootstrap
confidence interval of their median against the published 1% bound (:func:`lab.bench.verdict.bound`); the
A/A ratio is reported beside them as the measured noise.

Fault matrix: each fault of :class:`~lab.faults.FaultInjector` is injected into a live batch (a
fault hook before the ``inject_at_step``-th decode step, one victim request), with the tracker on and with the
no-op tracker. Counted for victims only: injected, detected (the victim ends ``aborted`` with a
``KVIntegrityError`` for a bookkeeping fault, or ``error`` with a ``NonFiniteLogitsError`` -- its attention output
was NaN/inf, zeroed by the guard -- for NaN/inf poisoned into a page), missed; false positives are other requests
aborted. Also recorded: whether a missed
fault silently changed the victim's tokens, and whether any other request's tokens differ from the fault-free
run (collateral damage) -- the harm the check exists to prevent.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lab import figures
from lab.bench import publish
from lab.bench import report as rp
from lab.bench import verdict as vd
from lab.bench.measure import (
    Arm,
    aggregate,
    build_engines,
    environment,
    interleaved,
    paired,
    progress_bar,
    stats,
)
from lab.bench.operating_point import regime_lines
from lab.bench.schema import experiment_spec
from lab.bench.workload import concurrencies, drive, make_requests, num_requests
from lab.faults import FaultInjector
from phaseserve.cache.integrity import KVIntegrityError
from phaseserve.config_hydra import as_list, load_model, to_container
from phaseserve.engine.request import NonFiniteLogitsError

FAULTS = ["point_at_free_page", "free_behind", "point_at_other", "point_out_of_range", "double_allocate",
          "poison_data", "poison_scale"]
ARM_INTEGRITY = {"on": True, "off": False, "noop": False}
METRICS = ["output_tok_per_s", "decode_tok_per_s", "e2e.p95", "tpot.p95", "tpot.p50", "integrity_checks"]


@dataclass
class IntegritySpec:
    name: str = "integrity"
    arms: Any = field(default_factory=lambda: ["on", "off", "noop"])  # subset of on / off / noop, or one
    reference: str = "off"  # denominator of the overhead ratios
    repeats: int = 5
    faults: list[str] = field(default_factory=lambda: list(FAULTS))
    fault_trackers: list[str] = field(default_factory=lambda: ["on", "noop"])
    fault_trials: int = 2  # per fault and tracker (a different victim and step each)
    fault_requests: int = 6  # the live batch faults are injected into
    fault_prompt: int = 40
    fault_output: int = 12
    inject_at_step: int = 3  # 1-based decode step before which the fault is injected (trial t: + t)
    curve_model: str | None = "shipped-3.8M"  # this model's decode-step curve (operating_point results): the regime


def run(cfg: DictConfig, out_dir: str | Path, log=print) -> dict:
    spec: IntegritySpec = experiment_spec(cfg, IntegritySpec)
    env = environment()
    arm_names = [str(a) for a in as_list(spec.arms)]
    for a in arm_names + list(spec.fault_trackers):
        if a not in ARM_INTEGRITY:
            raise ValueError(f"integrity arm must be one of {sorted(ARM_INTEGRITY)}, got {a!r}")
    concs = concurrencies(cfg.workload)
    w = cfg.workload
    model_cfg, params = load_model(cfg)
    arms = [Arm(a, {"cache.integrity": ARM_INTEGRITY[a]}) for a in arm_names]
    engines = build_engines(cfg, model_cfg, params, arms, max_concurrency=max(concs), log=log)

    def one(eng, arm, conc, rep):
        reqs = make_requests(w, model_cfg.vocab_size, num_requests(w, conc), seed=int(w.seed) + 1000 * rep + conc,
                             tag=f"c{conc}r{rep}")
        return drive(eng, reqs, conc, str(w.arrival), float(w.rate), seed=rep)

    records = interleaved(engines, concs, int(spec.repeats), one, desc="integrity", progress=bool(cfg.progress))
    env["kernels"] = rp.kernel_rows(*engines.values())
    del engines
    ref = spec.reference if spec.reference in arm_names else arm_names[-1]
    matrix = fault_matrix(cfg, model_cfg, params, spec, log) if spec.faults and spec.fault_trackers else {}
    results = {"experiment": "integrity", "environment": env, "settings": {
        "model": to_container(cfg.model), "workload": to_container(w), "concurrency": concs,
        "kv": str(cfg.quant.kv_dtype),
        "weights": str(cfg.quant.decode_weights), "curve_model": spec.curve_model,
        "bytes_per_step": step_bytes(model_cfg, str(cfg.quant.decode_weights), str(cfg.quant.kv_dtype), w),
        "repeats": spec.repeats, "arms": arm_names, "reference": ref, "mode": cfg.engine.mode,
        "fault_settings": {k: getattr(spec, k) for k in ("faults", "fault_trackers", "fault_trials", "fault_requests",
                                                          "fault_prompt", "fault_output", "inject_at_step")}},
        "fault_matrix": matrix, "records": records}
    publish.publish(out_dir, results, sys.modules[__name__], cfg, log)
    return results


def step_bytes(model_cfg: Any, weights: str, kv: str, workload: Any) -> dict:
    """What one decode step reads: the decode weights (every parameter at the weights' width; an upper bound for
    routed experts) and one row's KV at the workload's mean context (prompt + output / 2)."""
    from phaseserve.cache.paged import kv_bytes_per_token
    from phaseserve.config import canonical_dtype
    from phaseserve.model.params import abstract_params, param_count

    width = {"float32": 4, "bfloat16": 2}.get(canonical_dtype(weights), 1)
    ctx = int(workload.prompt.mean) + int(workload.output.mean) // 2
    return {"weight_bytes": param_count(abstract_params(model_cfg)) * width, "mean_context": ctx,
            "kv_bytes_per_row": ctx * kv_bytes_per_token(model_cfg, canonical_dtype(kv))}


# ---- fault matrix -----------------------------------------------------------------------------------------
def _injector(kind: str, victim: str, other: str, at_step: int, fired: dict):
    def hook(engine, rows):
        fired["steps"] += 1
        if fired["steps"] != at_step or victim not in {s.id for s in rows}:
            return
        inj = FaultInjector(engine.tables)
        if kind == "point_at_free_page":
            inj.point_at_free_page(victim, 0)
        elif kind == "free_behind":
            inj.free_behind(victim, 1)
        elif kind == "point_at_other":
            inj.point_at_other(victim, 0, other, 0)
        elif kind == "point_out_of_range":
            inj.point_out_of_range(victim, 1)
        elif kind == "double_allocate":
            inj.double_allocate(victim, 0, other)
        elif kind in ("poison_data", "poison_scale"):
            engine.pool = inj.poison(engine.pool, 0, engine.tables.owned(victim)[0], 2, target=kind.split("_")[1])
        else:
            raise ValueError(f"unknown fault {kind!r}")
        fired["injected"] = True
        fired["tokens_at_injection"] = len(engine.outputs[victim].tokens)

    return hook


def fault_matrix(cfg: DictConfig, model_cfg: Any, params: Any, spec: IntegritySpec, log=print) -> dict:
    """Inject every fault into a live batch with each tracker; count per victim (see the module docstring)."""
    fw = OmegaConf.create(to_container(cfg.workload))
    fw.prompt = {"dist": "fixed", "mean": int(spec.fault_prompt), "min": 1, "max": int(spec.fault_prompt), "sigma": 0.5}
    fw.output = {"dist": "fixed", "mean": int(spec.fault_output), "min": 1, "max": int(spec.fault_output),
                 "sigma": 0.5}
    n = int(spec.fault_requests)
    fcfg = OmegaConf.create(to_container(cfg))
    fcfg.engine.max_batch = n
    arms = [Arm(t, {"cache.integrity": ARM_INTEGRITY[t]}) for t in spec.fault_trackers]
    engines = build_engines(fcfg, model_cfg, params, arms, max_concurrency=n, workloads=[fw], log=log)
    scaled = "float8" in str(cfg.quant.kv_dtype)
    faults = [f for f in spec.faults if scaled or f != "poison_scale"]
    trials: list[dict] = []
    t0 = time.perf_counter()
    with progress_bar(spec.fault_trials * len(faults) * len(arms), "fault matrix", bool(cfg.progress)) as bar:
        for t in range(int(spec.fault_trials)):
            reqs = make_requests(fw, model_cfg.vocab_size, n, seed=int(fw.seed) + 555 + t, tag=f"f{t}")
            drive(engines[arms[0].name], reqs, n, "closed")
            ref = {rid: list(o.tokens) for rid, o in engines[arms[0].name].outputs.items()}
            vi = (2 * t + 1) % n
            victim, other, step = reqs[vi].id, reqs[(vi + 1) % n].id, int(spec.inject_at_step) + t
            for kind in faults:
                for arm in arms:
                    eng = engines[arm.name]
                    trials.append(_trial(eng, reqs, ref, kind, victim, other, step, arm.name, t))
                    if trials[-1]["state_damaged"]:  # rebuild: the next trial must start from a clean engine
                        engines.update(build_engines(fcfg, model_cfg, params, [arm], max_concurrency=n,
                                                     workloads=[fw], log=lambda *_: None))
                    bar.update(1)
        clean = {}
        for arm in arms:  # a fault-free run after the matrix must match the reference exactly
            drive(engines[arm.name], reqs, n, "closed")
            clean[arm.name] = {rid: list(o.tokens) for rid, o in engines[arm.name].outputs.items()} == ref
    table = {}
    for kind in faults:
        for arm in arms:
            ts = [x for x in trials if x["fault"] == kind and x["tracker"] == arm.name]
            table.setdefault(kind, {})[arm.name] = {
                "injected": sum(x["injected"] for x in ts), "detected": sum(x["detected"] for x in ts),
                "missed": sum(x["injected"] and not x["detected"] for x in ts),
                "false_positives": sum(len(x["false_positives"]) for x in ts),
                "victim_tokens_silently_changed": sum(x["victim_silently_changed"] for x in ts),
                "others_tokens_changed": sum(len(x["others_changed"]) for x in ts),
                "leaked_pages": sum(x["leaked_pages"] for x in ts), "errors": sum(bool(x["error"]) for x in ts)}
    totals = {arm.name: {k: sum(table[f][arm.name][k] for f in faults) for k in next(iter(table.values()))[arm.name]}
              for arm in arms} if table else {}
    return {"table": table, "totals": totals, "trials": trials, "clean_after_matrix": clean,
            "skipped": [f for f in spec.faults if f not in faults], "seconds": time.perf_counter() - t0}


def _trial(eng, reqs, ref, kind, victim, other, step, tracker, t) -> dict:
    fired = {"steps": 0, "injected": False, "tokens_at_injection": None}
    eng.fault_hooks[:] = [_injector(kind, victim, other, step, fired)]
    rec = {"fault": kind, "tracker": tracker, "trial": t, "victim": victim, "step": step, "error": None}
    try:
        drive(eng, reqs, len(reqs), "closed")
    except Exception as e:  # noqa: BLE001 -- a missed fault may break the engine; that is a result
        rec["error"] = f"{type(e).__name__}: {e}"
    finally:
        eng.fault_hooks[:] = []
    outs = eng.outputs
    v = outs.get(victim)
    detected = v is not None and ((v.finish_reason == "aborted" and isinstance(v.error, KVIntegrityError))
                                  or (v.finish_reason == "error" and isinstance(v.error, NonFiniteLogitsError)
                                      and v.error.where == "attention"))  # the guard's catch (not the logits')
    others = [r.id for r in reqs if r.id != victim and r.id in outs]
    leaked = eng.num_pages - 1 - eng.allocator.num_free if not eng.has_work else -1
    try:
        eng.check_invariants()
        invariants = True
    except AssertionError:
        invariants = False
    rec.update(
        injected=bool(fired["injected"]), detected=bool(detected and fired["injected"]),
        caught_at_injection_step=bool(detected and len(v.tokens) == fired["tokens_at_injection"]),
        victim_silently_changed=bool(v is not None and not detected and v.tokens != ref[victim]),
        false_positives=[r for r in others if outs[r].finish_reason == "aborted"],
        others_changed=[r for r in others if outs[r].finish_reason != "aborted" and outs[r].tokens != ref[r]],
        leaked_pages=max(leaked, 0), invariants_ok=invariants,
        error_kind=getattr(v.error, "kind", "nonfinite") if detected else None)
    # a missed fault can leave stale bytes in freed pages, but every position is written before it is read; the
    # fault-free rerun after the matrix checks that (clean_after_matrix). Broken bookkeeping means a rebuild.
    rec["state_damaged"] = bool(rec["error"] or leaked != 0 or not invariants)
    return rec


# ---- derived from the raw results (re-renderable from results.json) -------------------------------------------
def summarize(res: dict, out_dir: Path | None = None) -> dict:
    s, records, m = res["settings"], res["records"], res["fault_matrix"]
    names, ref, concs = s["arms"], s["reference"], s["concurrency"]
    agg = aggregate(records, METRICS)
    deltas = {a: {"throughput": paired(records, a, ref, "output_tok_per_s"),
                  "e2e_p95": paired(records, a, ref, "e2e.p95"),
                  "tpot_p95": paired(records, a, ref, "tpot.p95")} for a in names if a != ref}
    limit = figures.value("integrity.max_delta")
    outcomes = {a: {k: {c: vd.bound(d[k][c], limit) for c in concs} for k in d} for a, d in deltas.items()}
    verdicts = []
    if m and "on" in m["totals"]:
        t = m["totals"]["on"]
        ok = t["detected"] == t["injected"] > 0 and not t["false_positives"]
        verdicts.append(vd.Verdict("faults caught with the check on (detected / injected, false positives)",
                                   f"{t['detected']} / {t['injected']}, {t['false_positives']}",
                                   "every fault, no false positive", vd.REPRODUCED if ok else vd.NOT_REPRODUCED))
    if "on" in deltas:
        reps = deltas["on"]["throughput"][concs[-1]].get("n", 0)
        for key, label in (("throughput", "throughput"), ("e2e_p95", "p95 latency")):
            verdicts.append(vd.Verdict(f"check on/off {label}, {reps} paired repeats",
                                       vd.points_text({c: deltas["on"][key][c] for c in concs}),
                                       f"within {100 * limit:g}%", vd.across(outcomes["on"][key])))
    regime = regime_lines(s.get("curve_model") or "shipped-3.8M", s.get("weights", "bfloat16"), concs)
    sb = s.get("bytes_per_step")
    if sb:
        regime.append(f"Bytes one decode step reads at the mean context ({sb['mean_context']:,} tokens): weights "
                      f"{sb['weight_bytes'] / 1e6:.1f} MB, KV {sb['kv_bytes_per_row'] / 1e6:.2f} MB per row ("
                      + ", ".join(f"c={c}: KV {c * sb['kv_bytes_per_row'] / sb['weight_bytes']:.2f}x the weights"
                                  for c in concs) + "); the curve's rows hold 64 tokens, so where the KV outweighs "
                      "the weights the step is bound by the KV read, not by the weights the curve measures.")
    return {"aggregate": agg, "deltas": deltas, "outcomes": outcomes, "verdicts": [v.to_dict() for v in verdicts],
            "regime": regime,
            "load": stats([r.get("load_1m") for r in records]),
            "reruns": sum(r.get("reruns", 0) for r in records)}


def plots(out_dir: Path, res: dict, summary: dict) -> list[str]:
    s, agg = res["settings"], summary["aggregate"]
    band = "median; band = min..max over repeats" if s["repeats"] > 1 else "one repeat"
    rp.line_plot(out_dir / "throughput.png", rp.metric_series(agg, "output_tok_per_s", s["arms"], s["concurrency"]),
                 xlabel="concurrency", ylabel="output tokens/s", title=f"Integrity check: throughput ({band})")
    rp.line_plot(out_dir / "e2e_p95.png", rp.metric_series(agg, "e2e.p95", s["arms"], s["concurrency"]),
                 xlabel="concurrency", ylabel="end-to-end latency p95 (s)",
                 title=f"Integrity check: p95 latency ({band})")
    return ["throughput.png", "e2e_p95.png"]


def markdown(res: dict, summary: dict, plot_files: list[str]) -> str:
    s, agg, deltas, m = res["settings"], summary["aggregate"], summary["deltas"], res["fault_matrix"]
    names, ref, concs = s["arms"], s["reference"], s["concurrency"]
    lines = ["# Page-tag integrity check: overhead and fault detection", "",
             "Verdicts (paired ratios: median, 95% bootstrap CI of the median, min..max over repeats):", ""]
    lines += [f"- {vd.Verdict(**v).line()}" for v in summary["verdicts"]] + [""]
    lines += ["## Setup", "",
              f"- model `{s['model'].get('name')}`; mode {s['mode']}; KV {s['kv']}; workload `{s['workload']['name']}`:"
              f" prompt {s['workload']['prompt']['mean']}, output {s['workload']['output']['mean']} tokens "
              f"(published: {figures.value('integrity.input_tokens'):,.0f} / "
              f"{figures.value('integrity.output_tokens'):,.0f}); concurrency {concs}; {s['repeats']} interleaved "
              f"repeats, order rotated; timed runs repeated because JAX compiled inside them: {summary['reruns']}; "
              f"machine load (1-minute load average) over the timed runs {rp.spread(summary['load'])} on "
              f"{res['environment'].get('cpu_cores')} cores",
              "- arms: `on` = integrity check; `off` = `cache.integrity=false`, which installs the no-op tracker; "
              "`noop` = a second, independently built engine on that same code path, so `noop` vs `off` is an A/A "
              "measurement of the noise", *[f"- {x}" for x in summary.get("regime", [])], ""]
    rows = [[c, a, rp.spread(agg[a][c]["output_tok_per_s"]), rp.spread(agg[a][c]["e2e.p95"]),
             rp.spread(agg[a][c]["tpot.p95"]), rp.fmt(agg[a][c]["integrity_checks"]["median"])]
            for c in concs for a in names]
    lines += ["## Overhead sweep (median [min, max] over repeats)", "", rp.markdown_table(
        ["concurrency", "arm", "output tok/s", "e2e p95 (s)", "TPOT p95 (s)", "rows checked"], rows), ""]
    for a, d in deltas.items():
        lines += [f"### {a} / {ref}, paired within each repeat (median, 95% CI, range; outcome vs the published "
                  "1% bound)", "", rp.markdown_table(
            ["concurrency", "throughput", "outcome", "e2e p95", "outcome", "TPOT p95"],
            [[c, vd.ratio_text(d["throughput"][c]), summary["outcomes"][a]["throughput"][c],
              vd.ratio_text(d["e2e_p95"][c]), summary["outcomes"][a]["e2e_p95"][c], vd.ratio_text(d["tpot_p95"][c])]
             for c in concs]), ""]
    if "on" in agg and ref in agg:
        lines += ["Time the check adds to a decode step (TPOT p50, on minus off, medians): " + "; ".join(
            f"c={c}: {1000 * (agg['on'][c]['tpot.p50']['median'] - agg[ref][c]['tpot.p50']['median']):+.2f} ms on "
            f"{1000 * agg[ref][c]['tpot.p50']['median']:.1f} ms" for c in concs
            if agg["on"][c]["tpot.p50"]["median"] is not None and agg[ref][c]["tpot.p50"]["median"]) + ".", ""]
    if m:
        fs = s["fault_settings"]
        lines += ["## Fault-injection matrix (victims only)", "",
                  f"{fs['fault_trials']} trial(s) per fault and tracker, each a live batch of {fs['fault_requests']} "
                  f"requests ({fs['fault_prompt']} prompt + {fs['fault_output']} output tokens), one victim, the "
                  f"fault injected before decode step {fs['inject_at_step']} + trial.", ""]
        rows = [[kind, arm, x["injected"], x["detected"], x["missed"], x["false_positives"],
                 x["victim_tokens_silently_changed"], x["others_tokens_changed"], x["leaked_pages"]]
                for kind, by in m["table"].items() for arm, x in by.items()]
        lines += [rp.markdown_table(["fault", "tracker", "injected", "detected", "missed", "false positives",
                                     "victim tokens silently changed", "others' tokens changed", "leaked pages"],
                                    rows), ""]
        on_trials = [x for x in m["trials"] if x["tracker"] == "on"]
        lines.append(f"Caught in the step that first reads the bad page: "
                     f"{sum(x['caught_at_injection_step'] for x in on_trials)} of "
                     f"{sum(x['injected'] for x in on_trials)}. Engine state after the matrix (fault-free rerun equals "
                     f"the reference): {m['clean_after_matrix']}."
                     + (f" Skipped (BF16 pool has no scales): {m['skipped']}." if m["skipped"] else ""))
        lines.append("")
    lines += [f"![{p}]({p})" for p in plot_files] + ["", rp.environment_section(res["environment"]), ""]
    return "\n".join(lines)
