"""Every planner table for a set of deployments, as one JSON-able dict and one markdown report."""

from __future__ import annotations

import dataclasses
from typing import Any

from lab import figures
from lab.markdown import table
from lab.planner.published import (
    READING_CHECKS,
    TOLERANCE,
    check_published,
    roles_summary,
    sensitivity,
    throughput_vs_published,
)
from phaseserve.planner.deployment import deployment, plan
from phaseserve.planner.inputs import HARDWARE, Assumptions, with_overrides

CAPACITY_COLUMNS = ("model", "gpu", "num_gpus", "weights", "kv", "checkpoint_gib", "weight_gib_per_device",
                    "kv_bytes_per_token", "kv_budget_gib_per_device", "fits", "kv_tokens")


def _pct(rows: list[dict]) -> list[dict]:
    return [{"#": i + 1, **{k: v for k, v in r.items() if k != "id"}, "error": f"{100 * r['error']:+.2f}%"}
            for i, r in enumerate(rows)]


def capacity_report(models: list[str], gpus: list[str], num_gpus: int | dict[str, int], weights: list[str],
                    kvs: list[str], prompt_len: int, output_len: int, concurrencies: list[int],
                    compare_models: list[str] = (), compare_gpus: list[str] = (),
                    assumptions: Assumptions | None = None, **overrides: Any) -> tuple[dict[str, Any], str]:
    """Every planner table for a set of deployments: ``(json-able dict, markdown)``.

    ``num_gpus`` is one count or ``{"default": n, "<model>": m}``. ``compare_*`` adds KV tokens of those models
    (INT4 weights, FP8 KV) on each of ``compare_gpus``. A configuration whose weights leave no KV budget has
    ``fits`` false, 0 tokens and a ``note`` saying so.
    """
    a = with_overrides(assumptions, overrides)
    counts = num_gpus if isinstance(num_gpus, dict) else {"default": num_gpus}

    def n_for(m: str) -> int:
        return int(counts.get(m, counts.get("default", 8)))

    out: dict[str, Any] = {"assumptions": a.to_dict(), "gb_rule": figures.GB_RULE,
                           "workload": {"prompt_len": prompt_len, "output_len": output_len}}
    out["published_capacity"] = check_published(a)
    out["published_roles"] = roles_summary(out["published_capacity"])
    out["published_readings"] = check_published(a, READING_CHECKS)
    out["published_throughput"] = throughput_vs_published(prompt_len, output_len, a)
    cap, dec, pre = [], [], []
    for m in models:
        for g in gpus:
            for w in weights:
                for kv in kvs:
                    p = plan(m, g, n_for(m), w, kv, prompt_len=prompt_len, output_len=output_len, assumptions=a)
                    wl = p.pop("workload")
                    note = "" if p["fits"] else (f"does not fit: weights {p['weight_gib_per_device']:.1f} GiB "
                                                 f"per device leave {p['kv_budget_gib_per_device']:.1f} GiB for KV")
                    cap.append({k: p[k] for k in CAPACITY_COLUMNS}
                               | {"admitted_reserve": wl["admitted_reserve"],
                                  "admitted_on_demand": wl["admitted_on_demand"], "note": note})
                    d = deployment(m, g, n_for(m), w, kv, a)
                    curve = d.decode_curve(concurrencies, prompt_len, output_len)
                    dec.append({"model": m, "gpu": g, "weights": w, "kv": kv}
                               | {f"c={r['concurrency']}": r["tok_s"] if r["fits_kv"] else None for r in curve})
                pr = deployment(m, g, n_for(m), w, kvs[0], a).prefill_time(prompt_len)
                pre.append({"model": m, "gpu": g, "weights": w, "prompt_tok_s": pr["prompt_tok_s"],
                            "seconds_per_prompt": pr["seconds"]})
    out["capacity"], out["decode_tok_s"], out["prefill"] = cap, dec, pre
    out["by_hardware"] = [
        {k: p[k] for k in ("model", "gpu", "num_gpus", "weights", "kv", "weight_gib_per_device", "fits",
                           "kv_tokens")}
        for m in compare_models for g in compare_gpus for p in [plan(m, g, n_for(m), "int4", "fp8", assumptions=a)]]
    out["hardware"] = [dataclasses.asdict(h) for h in HARDWARE.values()]
    out["sensitivity"] = sensitivity()
    return out, capacity_markdown(out)


def capacity_markdown(out: dict[str, Any]) -> str:
    """The report of :func:`capacity_report`'s dict (every number read from it)."""
    wl = out["workload"]
    prompt_len, output_len = wl["prompt_len"], wl["output_len"]
    pub = out["published_capacity"]
    worst = max(pub, key=lambda r: abs(r["error"]))
    md = ["# Capacity planner: published figures, assumptions, tables\n\n"
          "The capacity and roofline model of `phaseserve/planner/` on the presets of `phaseserve/presets.py` (public "
          "`config.json` values; nothing downloaded, nothing allocated): `python experiments/capacity.py` "
          "(settings `configs/capacity.yaml`). Published figures and sources: `docs/published.md`.",
          f"## Published capacity figures vs the planner (one assumption set; \"GB\" read as {out['gb_rule']})\n\n"
          f"{sum(abs(r['error']) < TOLERANCE for r in pub)} of {len(pub)} within {100 * TOLERANCE:g}% (largest "
          f"error {100 * worst['error']:+.2f}%, {worst['figure']}). What each match shows:\n\n"
          + "\n".join(out["published_roles"]) + "\n\n" + table(_pct(pub)),
          "## Published checkpoint sizes and the GB rule\n\n" + table(_pct(out["published_readings"])),
          "## Sensitivity: the published figures (#) when one assumption changes\n\n" + table(out["sensitivity"]),
          f"## Capacity (workload {prompt_len} + {output_len} tokens)\n\n{table(out['capacity'])}",
          f"## Roofline decode tok/s per replica vs concurrency (context {prompt_len} + {output_len // 2}; "
          f"— = exceeds the KV cache under on-demand admission)\n\n{table(out['decode_tok_s'])}",
          f"## Roofline prefill ({prompt_len}-token prompts, one replica)\n\n{table(out['prefill'])}",
          "## Published throughput vs the roofline (upper bounds; not asserted)\n\n"
          + table(out["published_throughput"])]
    if out["by_hardware"]:
        md.append(f"## KV tokens by hardware (INT4 weights, FP8 KV)\n\n{table(out['by_hardware'])}")
    md.append(f"## Hardware specs\n\n{table(out['hardware'])}")
    md.append("## Assumptions\n\n" + table([{"assumption": k, "value": v} for k, v in out["assumptions"].items()]))
    return "\n\n".join(md) + "\n"


def capacity_verdicts(out: dict[str, Any]) -> list[str]:
    """The capacity experiment's last lines, computed from :func:`capacity_report`'s dict: the published figures
    within tolerance (held-out errors named), and the configurations that do not fit."""
    pub = out["published_capacity"]
    held = [r for r in pub if r["role"] == "held-out"]
    ok = sum(abs(r["error"]) < TOLERANCE for r in pub)
    worst = max(abs(r["error"]) for r in pub)
    lines = [f"planner vs published capacity figures: {ok} of {len(pub)} within {100 * TOLERANCE:g}% (errors "
             f"{min(100 * r['error'] for r in pub):+.1f}%..{max(100 * r['error'] for r in pub):+.1f}%, largest "
             f"|{100 * worst:.1f}%|) -> " + ("reproduced" if ok == len(pub) else "not reproduced"),
             "held out (set nothing): " + "; ".join(f"{r['figure']} {100 * r['error']:+.1f}%" for r in held)]
    no_fit = [r for r in out["capacity"] if not r["fits"]]
    if no_fit:
        lines.append(f"does not fit ({len(no_fit)} of {len(out['capacity'])} configurations): " + "; ".join(
            f"{r['model']} {r['weights']} weights / {r['kv']} KV ({r['kv_budget_gib_per_device']:+.1f} GiB for KV)"
            for r in no_fit))
    return lines
