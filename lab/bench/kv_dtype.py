"""Experiment 1: BF16 vs FP8 decode KV cache under ONE fixed KV byte budget, across offered concurrency.

Published shape (Kimi K2.6, 8xH200; figures in :mod:`lab.figures`): FP8 KV halves the cache; under one
memory budget BF16 tops out at 32 concurrent requests (1,558 tok/s) while FP8 admits 64 (2,192 tok/s): about +41%
throughput at the system peak and about 30% lower cost per token.

What is measured here, all in one process: one engine per KV dtype, both sized by the same byte budget
(``cache.kv_budget_requests`` BF16 requests of the workload, or ``cache.kv_budget_bytes``); a closed-loop client
sweep over ``workload.concurrency`` (offered concurrency), arms interleaved; the concurrency the scheduler
actually admits (peak running rows); an admission probe at twice the largest offered load (where each dtype
runs out of pages); the peak-vs-peak throughput gain and the relative cost per token (cost ∝ 1/throughput on
fixed hardware). The peak gain is the median over repeats of (each dtype's best point in that repeat) ratio,
with its bootstrap interval and range (:mod:`lab.bench.verdict`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from lab import figures
from lab.bench import publish
from lab.bench import report as rp
from lab.bench import verdict as vd
from lab.bench.measure import Arm, aggregate, build_engines, dig, environment, interleaved, paired, stats
from lab.bench.operating_point import apply_operating_point
from lab.bench.schema import experiment_spec
from lab.bench.workload import concurrencies, drive, make_requests, max_length, num_requests, probe_admission
from phaseserve.cache.paged import kv_bytes_per_page, kv_bytes_per_token
from phaseserve.config import ConfigError, canonical_dtype
from phaseserve.config_hydra import as_list, budget_bytes_for_requests, load_model, pages_per_request, to_container

METRICS = ["steady_tok_per_s", "output_tok_per_s", "decode_tok_per_s", "tpot.p50", "tpot.p95", "e2e.p95", "ttft.p95",
           "peak_concurrency", "mean_concurrency", "peak_pages_in_use", "preemptions"]
THROUGHPUT = "steady_tok_per_s"  # sustained output tok/s while every client has a request in flight (workload.drive)
SHORT = {"bfloat16": "BF16", "float8_e4m3fn": "FP8", "float32": "F32"}


@dataclass
class KvDtypeSpec:
    name: str = "kv_dtype"
    repeats: int = 3  # interleaved repeats of the whole sweep
    probe_concurrency: int | None = None  # offered load of the admission probe; None: 2x the largest concurrency
    reference: str = "bfloat16"  # the denominator of every ratio
    operating_point: str | None = None  # a decode-step curve (operating_point results.json): run at its chosen point


def run(cfg: DictConfig, out_dir: str | Path, log=print) -> dict:
    """Run the experiment and write ``results.json``, ``README.md``, ``config.yaml`` and PNGs into ``out_dir``."""
    spec: KvDtypeSpec = experiment_spec(cfg, KvDtypeSpec)
    out_dir = Path(out_dir)
    env = environment()
    point = None
    if spec.operating_point:  # chosen from the curve before anything is measured: the prediction comes first
        cfg, point = apply_operating_point(cfg, spec.operating_point)
        log(f"operating point ({point['rule']}): {point['model']}, {point['weights']} weights, BF16 KV for "
            f"{point['batch']} requests; predicted peak gain {rp.pct(point['predicted_gain'])}")
    kvs = list(dict.fromkeys(canonical_dtype(str(k)) for k in as_list(cfg.quant.kv_dtype)))
    ref = canonical_dtype(spec.reference)
    concs = concurrencies(cfg.workload)
    if cfg.cache.num_pages is not None:
        raise ConfigError("kv_dtype compares dtypes under one byte budget: set cache.kv_budget_bytes or "
                          "cache.kv_budget_requests, not cache.num_pages")
    model_cfg, params = load_model(cfg)
    budget = (budget_bytes_for_requests(model_cfg, cfg) if cfg.cache.kv_budget_requests is not None
              else int(cfg.cache.kv_budget_bytes))
    arms = [Arm(SHORT.get(kv, kv), {"quant.kv_dtype": kv, "cache.kv_budget_bytes": budget,
                                    "cache.kv_budget_requests": None}) for kv in kvs]
    kv_of = {a.name: kv for a, kv in zip(arms, kvs, strict=True)}
    ref_arm = SHORT.get(ref, ref) if ref in kvs else arms[0].name
    probe_n = spec.probe_concurrency or 2 * max(concs)
    engines = build_engines(cfg, model_cfg, params, arms, max_concurrency=max(concs), log=log)
    w = cfg.workload
    probe_reqs = make_requests(w, model_cfg.vocab_size, probe_n, seed=int(w.seed) + 99991, tag="probe")
    probes = {name: probe_admission(eng, probe_reqs) for name, eng in engines.items()}

    def one(eng, arm, conc, rep):
        reqs = make_requests(w, model_cfg.vocab_size, num_requests(w, conc), seed=int(w.seed) + 1000 * rep + conc,
                             tag=f"c{conc}r{rep}")
        return drive(eng, reqs, conc, str(w.arrival), float(w.rate), seed=rep)

    records = interleaved(engines, concs, int(spec.repeats), one, desc="kv_dtype", progress=bool(cfg.progress))
    env["kernels"] = rp.kernel_rows(*engines.values())
    ps_ = int(cfg.cache.page_size)
    per_req = pages_per_request(max_length(w.prompt), max_length(w.output), ps_)
    arms_info = {}
    for name, eng in engines.items():
        arms_info[name] = {
            "kv_dtype": kv_of[name], "num_pages": eng.num_pages, "usable_pages": eng.num_pages - 1,
            "kv_bytes_per_token": kv_bytes_per_token(model_cfg, kv_of[name]),
            "kv_bytes_per_page": kv_bytes_per_page(model_cfg, kv_of[name], ps_),
            "resident_tokens": (eng.num_pages - 1) * ps_,
            "capacity_requests_computed": (eng.num_pages - 1) // per_req,
            "admitted_at_saturation": probes[name]["admitted"], "probe": probes[name]}
    results = {"experiment": "kv_dtype", "environment": env, "settings": {
        "model": to_container(cfg.model), "model_kv_width": model_cfg.kv_cache_width, "budget_bytes": budget,
        "page_size": ps_, "pages_per_request": per_req, "workload": to_container(w), "concurrency": concs,
        "repeats": spec.repeats, "probe_concurrency": probe_n, "mode": cfg.engine.mode, "reference": ref_arm,
        "weights": str(cfg.quant.decode_weights), "operating_point": point},
        "arms": arms_info, "records": records}
    publish.publish(out_dir, results, sys.modules[__name__], cfg, log)
    return results


def peak_gain_by_repeat(records: list[dict], num: str, den: str) -> dict:
    """Stats over repeats of (``num``'s best point / ``den``'s best point) within each repeat, with the bootstrap
    interval of their median: the peak-vs-peak gain."""
    gains = []
    for rep in sorted({r["repeat"] for r in records}):
        best = {a: max((dig(r, THROUGHPUT) or 0.0) for r in records if r["arm"] == a and r["repeat"] == rep)
                for a in (num, den)}
        if best[den]:
            gains.append(best[num] / best[den])
    return stats(gains, ci=True) | {"values": gains}


# ---- derived from the raw results (re-renderable from results.json) -------------------------------------------
def published() -> dict[str, float]:
    return {"admitted_ratio": figures.ratio("kimi.peak_requests.fp8", "kimi.peak_requests.bf16"),
            "peak_gain": figures.ratio("kimi.peak_tok_s.fp8", "kimi.peak_tok_s.bf16"),
            "cost_per_token_ratio": figures.value("kimi.cost_per_token_ratio")}


def summarize(res: dict, out_dir: Path | None = None) -> dict:
    s, info, records = res["settings"], res["arms"], res["records"]
    names, ref, concs = list(info), s["reference"], s["concurrency"]
    agg = aggregate(records, METRICS)
    peaks = {}
    for n in names:
        tput = {c: agg[n][c][THROUGHPUT]["median"] for c in concs}
        best = max(concs, key=lambda c: tput[c] or 0.0)
        peaks[n] = {"peak_tok_per_s": tput[best], "peak_at_offered_concurrency": best,
                    "peak_admitted_concurrency": agg[n][best]["peak_concurrency"]["median"],
                    "first_offered_concurrency_not_fully_admitted":
                        next((c for c in concs if (agg[n][c]["peak_concurrency"]["max"] or 0) < c), None)}
    pub = published()
    ratios, headline, verdicts = {}, {}, []
    for n in [x for x in names if x != ref]:
        ratios[n] = {"throughput": paired(records, n, ref, THROUGHPUT),
                     "end_to_end": paired(records, n, ref, "output_tok_per_s"),
                     "tpot_p50": paired(records, n, ref, "tpot.p50"),
                     "decode_tok_per_s": paired(records, n, ref, "decode_tok_per_s")}
        a, b = info[n], info[ref]
        adm = a["admitted_at_saturation"] / max(b["admitted_at_saturation"], 1)
        gain = peak_gain_by_repeat(records, n, ref)
        headline[n] = {"admitted_ratio": adm, "peak_gain": gain,
                       "cost_per_token_ratio": 1 / gain["median"] if gain["median"] else None,
                       "resident_tokens_ratio": a["resident_tokens"] / b["resident_tokens"]}
        verdicts.append(vd.Verdict(
            f"{n}/{ref} KV requests admitted under one budget",
            f"{a['admitted_at_saturation']} / {b['admitted_at_saturation']} = {adm:.2f}x",
            f"{figures.value('kimi.peak_requests.fp8'):.0f} / {figures.value('kimi.peak_requests.bf16'):.0f} = "
            f"{pub['admitted_ratio']:.0f}x",
            vd.at_least(adm, 0.9 * pub["admitted_ratio"]) + f" (threshold {0.9 * pub['admitted_ratio']:.1f}x)"))
        cost = f"; cost per token x{headline[n]['cost_per_token_ratio']:.2f}" if gain["median"] else ""
        verdicts.append(vd.Verdict(f"{n}/{ref} KV peak-vs-peak sustained tok/s", vd.ratio_text(gain) + cost,
                                   f"{rp.pct(pub['peak_gain'])}; cost per token x{pub['cost_per_token_ratio']:.2f}",
                                   vd.direction(gain, pub["peak_gain"])))
    return {"aggregate": agg, "peaks": peaks, "ratios": ratios, "headline": headline, "published": pub,
            "verdicts": [v.to_dict() for v in verdicts], "load": stats([r.get("load_1m") for r in records]),
            "reruns": sum(r.get("reruns", 0) for r in records), "mechanism": mechanism(res, agg)}


def mechanism(res: dict, agg: dict) -> dict:
    """The chain's third link, measured in this run: the step time (TPOT p50, medians) of the reference at the
    batch it admits (offered B = its saturation), of each other dtype at that batch (its own cost) and at offered
    2B (its bigger batch). Empty where B or 2B was not offered."""
    s, info, ref = res["settings"], res["arms"], res["settings"]["reference"]
    b = info[ref]["admitted_at_saturation"]
    if b not in s["concurrency"] or 2 * b not in s["concurrency"]:
        return {}
    t = {(n, c): agg[n][c]["tpot.p50"]["median"] for n in info for c in (b, 2 * b)}
    out = {"batch": b, "ref_tpot_s": t[ref, b]}
    for n in [x for x in info if x != ref]:
        adm = agg[n][2 * b]["peak_concurrency"]["median"]
        if not (t[ref, b] and t[n, b] and t[n, 2 * b] and adm):
            continue
        out[n] = {"tpot_same_batch_s": t[n, b], "own_cost": t[n, b] / t[ref, b], "tpot_double_s": t[n, 2 * b],
                  "admitted_double": adm, "step_ratio": t[n, 2 * b] / t[ref, b],
                  "implied_gain": (adm / b) * t[ref, b] / t[n, 2 * b]}
    return out


def operating_point_lines(res: dict, summary: dict) -> list[str]:
    """The choice and its prediction (recorded before the sweep ran), then the measured mechanism."""
    s, mech, ref = res["settings"], summary.get("mechanism") or {}, res["settings"]["reference"]
    p = s.get("operating_point")
    lines = []
    if p:
        lines += ["## Operating point (chosen from the decode-step curve before any throughput was measured)", "",
                  f"- Rule: {p['rule']}.",
                  f"- Curve: `{p['curve']}` (measured {p['curve_date']}, commit {p['curve_commit']}).",
                  f"- Chosen: `{p['model']}` ({p['params'] / 1e6:.1f}M params), {p['weights']} weights; BF16 KV "
                  f"budgeted for B = {p['batch']} requests, FP8 ~{p['fp8_batch']}; curve step "
                  f"{1e3 * p['step_s'][0]:.2f} ms at B, {1e3 * p['step_s'][1]:.2f} ms at 2B.",
                  f"- Prediction: FP8/BF16 peak-vs-peak gain {rp.pct(p['predicted_gain'])} (the curve's doubling "
                  "gain, before FP8's own dequantization cost).", ""]
    for n, m in mech.items():
        if not isinstance(m, dict):
            continue
        lines += [f"Measured mechanism (TPOT p50 medians of this run): {ref} at B = {mech['batch']}: "
                  f"{1e3 * mech['ref_tpot_s']:.2f} ms; {n} at B: {1e3 * m['tpot_same_batch_s']:.2f} ms ({n}'s own cost "
                  f"at the same batch x{m['own_cost']:.2f}); {n} at offered 2B (admitted {m['admitted_double']:.0f}): "
                  f"{1e3 * m['tpot_double_s']:.2f} ms (x{m['step_ratio']:.2f} of {ref}'s step at B); implied gain "
                  f"(rows ratio x step ratio) {rp.pct(m['implied_gain'])}.", ""]
    return lines


def plots(out_dir: Path, res: dict, summary: dict) -> list[str]:
    s, info, agg = res["settings"], res["arms"], summary["aggregate"]
    names, concs = list(info), s["concurrency"]
    band = "median; band = min..max over repeats" if s["repeats"] > 1 else "one repeat"
    rp.line_plot(out_dir / "throughput.png", rp.metric_series(agg, THROUGHPUT, names, concs),
                 xlabel="offered concurrency (closed-loop clients)", ylabel="sustained output tokens/s",
                 title=f"Throughput under one KV budget ({band})")
    rp.line_plot(out_dir / "tpot.png", {**{f"{n} p50": v for n, v in
                                           rp.metric_series(agg, "tpot.p50", names, concs).items()},
                                        **{f"{n} p95": v for n, v in
                                           rp.metric_series(agg, "tpot.p95", names, concs).items()}},
                 xlabel="offered concurrency", ylabel="time per output token (s)", title=f"TPOT p50 / p95 ({band})")
    rp.line_plot(out_dir / "e2e_p95.png", rp.metric_series(agg, "e2e.p95", names, concs),
                 xlabel="offered concurrency", ylabel="end-to-end latency p95 (s)",
                 title=f"p95 request latency ({band})")
    series = rp.metric_series(agg, "peak_concurrency", names, concs)
    series["offered (y = x)"] = (concs, concs, None, None)
    rp.line_plot(out_dir / "admitted.png", series, xlabel="offered concurrency", ylabel="admitted concurrency (peak)",
                 title=f"Where each dtype runs out of pages ({band}; dashed: admitted at saturation)",
                 styles={"offered (y = x)": {"color": "gray", "linestyle": ":", "marker": None}},
                 hlines={f"{n} saturation {info[n]['admitted_at_saturation']}": info[n]["admitted_at_saturation"]
                         for n in names})
    return ["throughput.png", "admitted.png", "tpot.png", "e2e_p95.png"]


def markdown(res: dict, summary: dict, plot_files: list[str]) -> str:
    s, info, agg, env = res["settings"], res["arms"], summary["aggregate"], res["environment"]
    names, ref, concs, peaks = list(info), s["reference"], s["concurrency"], summary["peaks"]
    lines = ["# KV cache dtype under one KV budget: " + " vs ".join(names), ""] + operating_point_lines(res, summary)
    lines += ["Verdicts (peak gain: median over repeats of each repeat's best-vs-best ratio, 95% bootstrap CI of the "
             "median, min..max):", ""]
    lines += [f"- {vd.Verdict(**v).line()}" for v in summary["verdicts"]] + [""]
    for n, h in summary["headline"].items():
        a, b = info[n], info[ref]
        lines += ["- Peaks (medians over repeats): " + ", ".join(
                      f"{x} {rp.fmt(peaks[x]['peak_tok_per_s'])} tok/s at offered "
                      f"{peaks[x]['peak_at_offered_concurrency']} "
                      f"(admitted {rp.fmt(peaks[x]['peak_admitted_concurrency'])})"
                      for x in (ref, n)) + ".",
                  f"- Resident KV tokens under the budget: {ref} {b['resident_tokens']:,}, {n} {a['resident_tokens']:,}"
                  f" ({h['resident_tokens_ratio']:.2f}x; bytes/token {b['kv_bytes_per_token']} vs "
                  f"{a['kv_bytes_per_token']}).", ""]
    lines += ["## Setup", "",
              f"- model: `{s['model'].get('name')}` (latent width {s['model_kv_width']} values/token/layer); "
              f"{s.get('weights', 'bfloat16')} weights; mode {s['mode']}; one KV budget of {s['budget_bytes']:,} "
              "bytes for every dtype",
              f"- workload: prompt {_len(s['workload']['prompt'])}, output {_len(s['workload']['output'])} tokens, "
              f"{s['workload']['arrival']} arrivals, {s['pages_per_request']} pages of {s['page_size']} reserved per "
              f"request; offered concurrency {concs}; {s['repeats']} interleaved repeat(s); "
              f"admission probe at {s['probe_concurrency']} offered; timed runs repeated because JAX compiled inside "
              f"them: {summary['reruns']}",
              f"- machine load (1-minute load average) over the timed runs: {rp.spread(summary['load'])} "
              f"on {env.get('cpu_cores')} cores", ""]
    lines += ["## Capacity", "", rp.markdown_table(
        ["KV dtype", "bytes/token", "pages", "resident tokens", "requests (computed)", "admitted (measured probe)",
         "first offered concurrency not fully admitted"],
        [[n, info[n]["kv_bytes_per_token"], info[n]["usable_pages"], info[n]["resident_tokens"],
          info[n]["capacity_requests_computed"], info[n]["admitted_at_saturation"],
          peaks[n]["first_offered_concurrency_not_fully_admitted"] or "none in sweep"] for n in names]), ""]
    rows = []
    for c in concs:
        for n in names:
            a = agg[n][c]
            rows.append([c, n, rp.fmt(a["peak_concurrency"]["median"]), rp.spread(a[THROUGHPUT]),
                         rp.spread(a["output_tok_per_s"]), rp.spread(a["decode_tok_per_s"]),
                         rp.fmt(a["tpot.p50"]["median"]), rp.fmt(a["tpot.p95"]["median"]),
                         rp.fmt(a["e2e.p95"]["median"]), rp.fmt(a["ttft.p95"]["median"])])
    lines += ["## Sweep (median [min, max] over repeats)", "",
              "sustained tok/s: output tokens per second until the last request is sent (every client busy); "
              "end-to-end tok/s: all output tokens over the whole run, including the drain at the end; decode-step "
              "tok/s: tokens of decode steps over the time of decode steps only.", "", rp.markdown_table(
        ["offered", "KV", "admitted", "sustained tok/s", "end-to-end tok/s", "decode-step tok/s", "TPOT p50 (s)",
         "TPOT p95 (s)", "e2e p95 (s)", "TTFT p95 (s)"], rows), ""]
    for n, r in summary["ratios"].items():
        lines += [f"### {n} / {ref}, paired within each repeat (median, 95% CI, range)", "", rp.markdown_table(
            ["offered", "sustained tok/s", "end-to-end tok/s", "TPOT p50", "decode-step tok/s"],
            [[c, vd.ratio_text(r["throughput"][c]), vd.ratio_text(r["end_to_end"][c]), vd.ratio_text(r["tpot_p50"][c]),
              vd.ratio_text(r["decode_tok_per_s"][c])] for c in concs]), ""]
    lines += [f"![{p}]({p})" for p in plot_files] + ["", rp.environment_section(env), ""]
    return "\n".join(lines)


def _len(spec: dict) -> str:
    return str(spec["mean"]) if spec["dist"] == "fixed" else f"{spec['dist']}[{spec['min']}, {spec['max']}]"
