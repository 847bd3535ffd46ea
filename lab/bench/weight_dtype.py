"""Experiment 2: FP8 vs INT4 weights -- bytes per decode token, decode throughput across concurrency, prefill.

Published shape (GLM-5.x, 8-way TP; figures in :mod:`lab.figures`): INT4 weights (routed experts INT4,
the rest BF16) instead of FP8 shrink the checkpoint 705 -> 421 GB and speed decode up (60 -> 92 tok/s at
concurrency 1; +16% to +55% across concurrencies); prefill loses (FP8 ~10,160 prompt tok/s vs INT4 ~8,660).

The model (``configs/experiment/weight_dtype.yaml``) is a random-weight model of the default architecture with
many experts, so that routed experts are >90% of the FP8 bytes as in GLM-5 and Kimi K2 (the shipped 3.8M-param
model has 59%). Measured in one process: one engine per weight policy (each applied to both phases), the same
KV dtype; the bytes of the decode weights each engine actually holds (``size_report`` of its decode params, by
tensor class); interleaved repeats of a decode sweep over ``workload.concurrency`` (decode-step tokens/s) and of a
prefill-only run (``max_tokens = 1``: prompt tokens / prefill time).

Bytes read per decode step are counted two ways from those weights: ``all experts`` (what this engine's XLA path
reads: ``quant.grouped_dense`` dequantizes the whole expert tensor of a layer every step) and ``routed``
(a kernel that reads only the experts the batch selects: ``E * (1 - (1 - k/E)^B)`` per layer under uniform routing).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lab import figures
from lab.bench import publish
from lab.bench import report as rp
from lab.bench import verdict as vd
from lab.bench.measure import Arm, aggregate, build_engines, environment, interleaved, paired, stats
from lab.bench.operating_point import regime_lines
from lab.bench.schema import experiment_spec
from lab.bench.workload import concurrencies, drive, make_requests, num_requests
from phaseserve.config_hydra import as_list, load_model, to_container
from phaseserve.quant.size_report import size_report

METRICS = ["decode_tok_per_s", "output_tok_per_s", "tpot.p50", "tpot.p95", "e2e.p95", "prefill_tok_per_s",
           "peak_concurrency"]
PREFILL = "prefill"


@dataclass
class WeightDtypeSpec:
    name: str = "weight_dtype"
    weights: Any = field(default_factory=lambda: ["fp8", "int4"])  # policies, each for both phases; or one
    reference: str = "fp8"  # the denominator of every ratio
    repeats: int = 5
    prefill_prompt: int = 128  # prompt tokens per request of the prefill run (max_tokens = 1)
    prefill_requests: int = 16  # requests per prefill run


def published() -> dict[str, float]:
    return {"decode_c1_ratio": figures.ratio("glm5.decode_c1_tok_s.int4", "glm5.decode_c1_tok_s.fp8"),
            "decode_gain_min": figures.value("glm5.decode_gain.min"),
            "decode_gain_max": figures.value("glm5.decode_gain.max"),
            "prefill_ratio": figures.ratio("glm5.prefill_tok_s.int4", "glm5.prefill_tok_s.fp8"),
            "checkpoint_ratio": figures.gib("glm5.checkpoint.int4") / figures.gib("glm5.checkpoint.fp8")}


def weight_bytes(params: Any) -> dict[str, Any]:
    """Stored bytes of a params tree, total and by tensor class (scales included)."""
    rep = size_report(params)
    return {"total": rep.total_bytes, "by_class": rep.by_class(), "by_rep": rep.by_rep(),
            "routed_experts": rep.bytes_of("routed_experts")}


def run(cfg: DictConfig, out_dir: str | Path, log=print) -> dict:
    spec: WeightDtypeSpec = experiment_spec(cfg, WeightDtypeSpec)
    env = environment()
    weights = [str(x) for x in as_list(spec.weights)]
    concs = concurrencies(cfg.workload)
    w = cfg.workload
    pre_w = OmegaConf.create(to_container(w))
    pre_w.prompt = {"dist": "fixed", "mean": int(spec.prefill_prompt), "min": 1, "max": int(spec.prefill_prompt),
                    "sigma": 0.5}
    pre_w.output = {"dist": "fixed", "mean": 1, "min": 1, "max": 1, "sigma": 0.5}
    model_cfg, params = load_model(cfg)
    arms = [Arm(x, {"quant.prefill_weights": x, "quant.decode_weights": x}) for x in weights]
    max_c = max(concs + [int(spec.prefill_requests)])
    engines = build_engines(cfg, model_cfg, params, arms, max_concurrency=max_c, workloads=[w, pre_w], log=log)
    sizes = {name: {"decode": weight_bytes(eng.decode_params), "prefill": weight_bytes(eng.prefill_params)}
             for name, eng in engines.items()}

    def one(eng, arm, point, rep):
        if point == PREFILL:
            n = int(spec.prefill_requests)
            reqs = make_requests(pre_w, model_cfg.vocab_size, n, seed=int(w.seed) + 7 + 1000 * rep, tag=f"p{rep}")
            return drive(eng, reqs, n, "closed")
        reqs = make_requests(w, model_cfg.vocab_size, num_requests(w, point), seed=int(w.seed) + 1000 * rep + point,
                             tag=f"c{point}r{rep}")
        return drive(eng, reqs, point, str(w.arrival), float(w.rate), seed=rep)

    records = interleaved(engines, concs + [PREFILL], int(spec.repeats), one, desc="weight_dtype",
                          progress=bool(cfg.progress))
    env["kernels"] = rp.kernel_rows(*engines.values())
    ref = spec.reference if spec.reference in weights else weights[0]
    results = {"experiment": "weight_dtype", "environment": env, "settings": {
        "model": to_container(cfg.model), "num_experts": model_cfg.num_experts,
        "experts_per_token": model_cfg.num_experts_per_tok, "moe_layers": sum(model_cfg.moe_layers),
        "workload": to_container(w), "concurrency": concs, "kv": str(cfg.quant.kv_dtype), "repeats": spec.repeats,
        "prefill_prompt": spec.prefill_prompt, "prefill_requests": spec.prefill_requests, "mode": cfg.engine.mode,
        "weights": weights, "reference": ref}, "weights": sizes, "records": records}
    publish.publish(out_dir, results, sys.modules[__name__], cfg, log)
    return results


# ---- derived from the raw results (re-renderable from results.json) -------------------------------------------
def bytes_per_step(sizes: dict, settings: dict, concurrency: int) -> dict[str, float]:
    """Decode weight bytes read per step at ``concurrency``: all experts (this engine's path) and routed only."""
    d = sizes["decode"]
    experts, rest = d["routed_experts"], d["total"] - d["routed_experts"]
    e, k = max(settings["num_experts"], 1), settings["experts_per_token"]
    touched = 1.0 - (1.0 - k / e) ** concurrency
    return {"all_experts": float(d["total"]), "routed": rest + experts * touched}


def summarize(res: dict, out_dir: Path | None = None) -> dict:
    s, sizes, records = res["settings"], res["weights"], res["records"]
    names, ref, concs = s["weights"], s["reference"], s["concurrency"]
    agg = aggregate(records, METRICS)
    pre = [r for r in records if r["point"] == PREFILL]
    dec = [r for r in records if r["point"] != PREFILL]
    ratios = {n: {"decode": paired(dec, n, ref, "decode_tok_per_s"),
                  "prefill": paired(pre, n, ref, "prefill_tok_per_s")[PREFILL]} for n in names if n != ref}
    byte_rows = {n: {c: bytes_per_step(sizes[n], s, c) for c in concs} for n in names}
    pub = published()
    verdicts = []
    for n, r in ratios.items():
        b_ratio = sizes[n]["decode"]["total"] / sizes[ref]["decode"]["total"]
        share = sizes[ref]["decode"]["routed_experts"] / sizes[ref]["decode"]["total"]
        verdicts.append(vd.Verdict(
            f"{n}/{ref} decode weight bytes read per token (routed experts {100 * share:.0f}% of {ref}'s bytes)",
            f"x{b_ratio:.3f} ({sizes[n]['decode']['total'] / 2**20:.2f} / {sizes[ref]['decode']['total'] / 2**20:.2f}"
            " MiB, every concurrency)", f"checkpoint x{pub['checkpoint_ratio']:.3f}",
            vd.REPRODUCED + " in direction" if b_ratio < 1 else vd.NOT_REPRODUCED))
        want = {c: pub["decode_c1_ratio"] if c == 1 else 1 + pub["decode_gain_min"] for c in concs}
        verdicts.append(vd.Verdict(
            f"{n}/{ref} decode-step tok/s, {r['decode'][concs[-1]].get('n', 0)} paired repeats",
            vd.points_text({c: r["decode"][c] for c in concs}),
            f"{rp.pct(pub['decode_c1_ratio'])} at c=1, {rp.pct(1 + pub['decode_gain_min'])}.."
            f"{rp.pct(1 + pub['decode_gain_max'])} across concurrencies",
            vd.across({c: vd.direction(r["decode"][c], want[c]) for c in concs})))
        verdicts.append(vd.Verdict(f"{n}/{ref} prefill prompt tok/s", vd.ratio_text(r["prefill"]),
                                   rp.pct(pub["prefill_ratio"]), vd.direction(r["prefill"], pub["prefill_ratio"])))
    return {"aggregate": agg, "ratios": ratios, "bytes_per_step": byte_rows, "published": pub,
            "verdicts": [v.to_dict() for v in verdicts], "load": stats([r.get("load_1m") for r in records]),
            "reruns": sum(r.get("reruns", 0) for r in records),
            "regime": regime_lines(s["model"].get("name"), "bfloat16", concs)}


def plots(out_dir: Path, res: dict, summary: dict) -> list[str]:
    s, agg = res["settings"], summary["aggregate"]
    names, concs = s["weights"], s["concurrency"]
    spread = s["repeats"] > 1
    band = "median; band = min..max over repeats" if spread else "one repeat"
    rp.line_plot(out_dir / "decode_throughput.png", rp.metric_series(agg, "decode_tok_per_s", names, concs),
                 xlabel="concurrency", ylabel="decode-step tokens/s",
                 title=f"Decode throughput by weight representation ({band})")
    pre = {n: ([agg[n][PREFILL]["prefill_tok_per_s"]["median"]], [agg[n][PREFILL]["prefill_tok_per_s"]["min"]],
               [agg[n][PREFILL]["prefill_tok_per_s"]["max"]]) for n in names}
    rp.bar_plot(out_dir / "prefill_throughput.png", ["prefill"], pre, ylabel="prompt tokens/s",
                title="Prefill throughput (median" + (", error bars = min..max over repeats)" if spread else ")"))
    return ["decode_throughput.png", "prefill_throughput.png"]


def markdown(res: dict, summary: dict, plot_files: list[str]) -> str:
    s, sizes, agg = res["settings"], res["weights"], summary["aggregate"]
    names, ref, concs = s["weights"], s["reference"], s["concurrency"]
    lines = ["# Weight representation: " + " vs ".join(names), "",
             "Verdicts (paired ratios: median, 95% bootstrap CI of the median, min..max over repeats):", ""]
    lines += [f"- {vd.Verdict(**v).line()}" for v in summary["verdicts"]] + [""]
    m = s["model"]
    lines += ["## Setup", "",
              f"- model `{m.get('name')}`: {s['num_experts']} routed experts, {s['experts_per_token']} per token, "
              f"{s['moe_layers']} MoE layers (overrides {m.get('overrides') or {}}); mode {s['mode']}; KV {s['kv']}; "
              "each policy applies to both phases",
              *[f"- {x} FP8 and INT4 weights are not on the curve: the BF16-weight curve of the same model is the "
                "closest one measured." for x in summary.get("regime", [])],
              f"- decode sweep: concurrency {concs}, prompt {s['workload']['prompt']['mean']}, output "
              f"{s['workload']['output']['mean']} tokens; prefill run: {s['prefill_requests']} requests x "
              f"{s['prefill_prompt']} prompt tokens, max_tokens 1; {s['repeats']} interleaved repeats; timed runs "
              f"repeated because JAX compiled inside them: {summary['reruns']} (a second compile would have stopped "
              "the run)", f"- machine load (1-minute load average) over the timed runs: {rp.spread(summary['load'])} "
              f"on {res['environment'].get('cpu_cores')} cores", ""]
    classes = sorted({c for n in names for c in sizes[n]["decode"]["by_class"]})
    lines += ["## Decode weights held by each engine (bytes, scales included)", "", rp.markdown_table(
        ["tensor class"] + names,
        [[c] + [sizes[n]["decode"]["by_class"].get(c, 0) for n in names] for c in classes]
        + [["total"] + [sizes[n]["decode"]["total"] for n in names]]), ""]
    lines += ["## Decode weight bytes read per token (MiB)", "",
              "all experts: this engine's XLA path reads every expert each step; routed: only the experts a batch "
              "of that size selects under uniform routing (a kernel that skips the rest).", "", rp.markdown_table(
        ["concurrency"] + [f"{n} {k}" for k in ("all experts", "routed") for n in names]
        + [f"{n}/{ref} {k}" for k in ("all experts", "routed") for n in names if n != ref],
        [[c] + [summary["bytes_per_step"][n][c][k] / c / 2**20 for k in ("all_experts", "routed") for n in names]
         + [summary["bytes_per_step"][n][c][k] / summary["bytes_per_step"][ref][c][k]
            for k in ("all_experts", "routed") for n in names if n != ref] for c in concs]), ""]
    rows = [[c, n, rp.spread(agg[n][c]["decode_tok_per_s"]), rp.spread(agg[n][c]["output_tok_per_s"]),
             rp.fmt(agg[n][c]["tpot.p50"]["median"]), rp.fmt(agg[n][c]["e2e.p95"]["median"])]
            for c in concs for n in names]
    lines += ["## Decode sweep (median [min, max] over repeats)", "", rp.markdown_table(
        ["concurrency", "weights", "decode-step tok/s", "output tok/s", "TPOT p50 (s)", "e2e p95 (s)"], rows), ""]
    lines += ["## Prefill", "", rp.markdown_table(
        ["weights", "prompt tok/s"], [[n, rp.spread(agg[n][PREFILL]["prefill_tok_per_s"])] for n in names]), ""]
    for n, r in summary["ratios"].items():
        lines += [f"## {n} / {ref}, paired within each repeat", "", rp.markdown_table(
            ["point", "ratio (median, CI, range)"],
            [[c, vd.ratio_text(r["decode"][c])] for c in concs] + [[PREFILL, vd.ratio_text(r["prefill"])]]), ""]
    lines += [f"![{p}]({p})" for p in plot_files] + ["", rp.environment_section(res["environment"]), ""]
    return "\n".join(lines)
