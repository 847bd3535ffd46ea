"""The TPU compile experiment's report: markdown tables (kernels x generations, steps with memory per chip beside the
planner, the difference by tensor class) and the memory-per-chip plot. Input: the ``results.json`` dict of
:func:`lab.bench.tpu_compile.run` (so a committed run re-renders without recompiling)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lab.markdown import table

GIB, MIB = 2**30, 2**20


def _gib(x: float | None) -> float | None:
    return None if x is None else x / GIB


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:+.1f}%"


def kernel_table(rows: list[dict]) -> str:
    """kernel x generation: the block shape, compiled or the error, VMEM used / limit (and tuning's estimate)."""
    out = []
    for r in rows:
        est = r.get("vmem_estimate_bytes")
        out.append({
            "kernel": r["kernel"], "gen": r["generation"], "block shape": r["blocks"],
            "compiled": "yes" if r["ok"] else f"**no**: {r['error'][:120]}",
            "VMEM used MiB": r["vmem_used_bytes"] / MIB if r["ok"] else None,
            "VMEM limit MiB": r["vmem_limit_bytes"] / MIB if r["ok"] else None,
            "tuning estimate MiB": None if est is None else est / MIB,
            "XLA temp MiB": r["temp_bytes"] / MIB if r["ok"] else None,
            "compile s": r["seconds"],
        })
    return table(out)


def kernel_summary(rows: list[dict]) -> str:
    gens = sorted({r["generation"] for r in rows})
    kernels = sorted({r["kernel"] for r in rows})
    ok = sum(r["ok"] for r in rows)
    worst = max((r for r in rows if r["ok"]), key=lambda r: r["vmem_used_bytes"], default=None)
    line = f"{ok} of {len(rows)} kernel compiles succeeded ({len(kernels)} kernel cases x {len(gens)} generations: " \
           f"{', '.join(gens)})."
    if worst is not None:
        line += (f" Largest VMEM use: {worst['vmem_used_bytes'] / MIB:.1f} MiB of the "
                 f"{worst['vmem_limit_bytes'] / MIB:.0f} MiB limit ({worst['kernel']}, {worst['generation']}).")
    return line


def step_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        c = r["compiled"][-1]
        decode = r["spec"]["phase"] == "decode"
        out.append({
            "step": f"{r['spec']['model']} {r['spec']['phase']}",
            "slice": f"{r['topology']} ({r['spec']['chips']} chips)",
            "mesh": f"tp{r['spec']['tp']} ep{r['spec']['ep']}",
            "compiled layers": f"{c['layers']} ({c['moe_layers']} MoE)",
            "compile s": sum(x["compile_s"] for x in r["compiled"]),
            "weights GiB/chip": _gib(r["weights_padded_bytes"]), "planner (even)": _gib(r["planner"]["weights_bytes"]),
            "Δ": _pct(r["weights_vs_planner"]),
            "planner (engine layout)": _gib(r["planner"].get("weights_engine_layout_bytes")),
            "Δ engine": _pct(r.get("weights_vs_planner_engine_layout")),
            "KV GiB/chip": _gib(r["kv_padded_bytes"]),
            "planner KV": _gib(r["planner"]["kv_bytes"]) if decode else None,
            "Δ KV": _pct(r["kv_vs_planner"]) if decode else "–",
            "Δ KV unpadded": _pct(r["kv_logical_bytes"] / r["planner"]["kv_bytes"] - 1) if decode else "–",
            "temp GiB": _gib(r["temp_bytes"]), "code MiB": r["code_bytes"] / MIB,
            "total / HBM GiB": f"{r['total_bytes'] / GIB:.1f} / {r['hbm_bytes'] / GIB:.0f}",
            "fits": r["fits_hbm"],
            "planner fits (even / engine)": f"{'yes' if r['planner']['fits'] else 'no'} / "
                                            f"{'yes' if r['planner'].get('fits_engine_layout') else 'no'}",
        })
    return table(out)


def cost_table(rows: list[dict]) -> str:
    out = []
    for r in rows:
        rl = r["roofline"]
        out.append({
            "step": f"{r['spec']['model']} {r['spec']['phase']} {r['spec']['generation']}",
            "rows x tokens": f"{r['spec']['batch']} x {1 if r['spec']['phase'] == 'decode' else r['spec']['chunk']}",
            "TFLOP/chip (full depth)": r["flops_full"] / 1e12, "GB accessed/chip": r["bytes_accessed_full"] / 1e9,
            "per MoE layer TFLOP": r["per_moe_layer"].get("flops", 0) / 1e12,
            "per MoE layer GB": r["per_moe_layer"].get("bytes_accessed", 0) / 1e9,
            "compute ms": 1e3 * rl["compute_s"], "memory ms": 1e3 * rl["memory_s"], "roofline ms": 1e3 * rl["step_s"],
            "bound": rl["bound"], "planner roofline ms": 1e3 * r["planner"].get("roofline_s", float("nan")),
        })
    return table(out)


def check_table(rows: list[dict]) -> str:
    """The compiled models' argument bytes: memory_analysis vs the sum of the arguments in the compiled layouts."""
    out = []
    for r in rows:
        for c in r["compiled"]:
            out.append({"step": r["name"], "layers": c["layers"], "memory_analysis GiB": _gib(c["argument_bytes"]),
                        "layouts GiB": _gib(c["args_padded_bytes"]), "unpadded GiB": _gib(c["args_logical_bytes"]),
                        "Mosaic calls": c["mosaic_calls"]})
    return table(out)


def provenance_table(rows: list[dict]) -> str:
    """What each step's kernel calls built in the TPU branch, and what fell back to the XLA reference (and why)."""
    out = []
    for r in rows:
        c = r["compiled"][-1]
        out.append({"step": r["name"], "Mosaic calls": c["mosaic_calls"],
                    "Pallas kernels (layout)": "; ".join(c.get("tpu_kernels") or []) or "–",
                    "XLA reference instead": "; ".join(c.get("tpu_fallbacks") or []) or "none"})
    return table(out)


def class_table(row: dict) -> str:
    """Per tensor class of one step: engine bytes per chip (layout), the planner's even split, what is replicated."""
    g, t = row["spec"]["chips"], row["planner"]["attn_tp"]
    out = []
    for cls, b in sorted(row["classes"].items(), key=lambda kv: -kv[1]["padded"]):
        even = b["whole"] / (g if cls == "routed_experts" else t)
        out.append({"class": cls, "engine GiB/chip": b["padded"] / GIB, "unpadded GiB": b["logical"] / GIB,
                    "replicated GiB": b["replicated"] / GIB, "planner's split GiB": even / GIB,
                    "Δ GiB": (b["padded"] - even) / GIB})
    return table(out)


def markdown(results: dict) -> str:
    env = results["environment"]
    parts = [f"# TPU compile without a TPU ({results['date']})", "",
             f"jax {env['jax']}, jaxlib {env['jaxlib']}, libtpu {env['libtpu']}, compiled on a "
             f"{env['host_backend']} host (deviceless topologies). Git {results.get('git', '?')}.", ""]
    if results.get("kernels"):
        parts += ["## Kernels", "", kernel_summary(results["kernels"]), "", kernel_table(results["kernels"]), ""]
    steps = results.get("steps") or []
    if steps:
        parts += ["## Steps: memory per chip beside the planner", "",
                  "Weights and KV per chip are the full model's, each argument sized in the TPU layout the compiler "
                  "chose for its compiled twin (tile padding included); temp and code are the compiled (cut) model's. "
                  "Planner (even): every non-expert weight split over the attention TP ranks (vLLM's placement, the "
                  "published figures' basis); planner (engine layout): `weight_layout=\"engine\"`, phaseserve's own "
                  "placement. Decode pools are sized to the planner's pages per chip; a prefill pool holds only the "
                  "prompts in flight (no planner figure).",
                  "", step_table(steps), "", "![memory per chip](memory_per_chip.png)", "",
                  "## Steps: cost analysis and roofline", "",
                  "Per chip, at the chip's published BF16 rate and HBM bandwidth, extrapolated to the full depth from "
                  "the 1- and 2-MoE-layer compiles. `cost_analysis` counts neither the FLOPs nor the bytes inside "
                  "the Pallas (Mosaic) kernels (they carry no cost estimate; a kernel-only module reports ~0): what "
                  "it counts is the XLA code around them. The decode bound is therefore not the weights' read, and "
                  "the prefill bound is the MoE dispatch glue (expert-sorted gathers, the EP roll, pads, scatter-add: "
                  "copies of the 65,536 routed rows, ~1-2 GB each, ~60-75 GB per MoE layer per chip by XLA's count). "
                  "The planner's analytic roofline (weights and KV read, matmul FLOPs) is beside it.",
                  "", cost_table(steps), "",
                  "## Kernels inside the steps", "", provenance_table(steps), "",
                  "## Check: compiled argument bytes vs the layouts", "", check_table(steps), ""]
        for r in steps:
            parts += [f"### {r['name']}: weights by tensor class", "", class_table(r), ""]
    for e in results.get("step_errors") or []:
        parts += [f"- **{e['name']}** did not compile: {e['error']}"]
    return "\n".join(parts).rstrip() + "\n"


def memory_plot(path: Path, steps: list[dict]) -> Path | None:
    """Stacked bars per step (weights, KV, temp + code) beside the planner's weights + KV, and each chip's HBM."""
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [f"{r['spec']['model']}\n{r['spec']['phase']} {r['spec']['generation']}x{r['spec']['chips']}"
             for r in steps]
    x = np.arange(len(steps))
    w = np.array([r["weights_padded_bytes"] for r in steps]) / GIB
    kv = np.array([r["kv_padded_bytes"] for r in steps]) / GIB
    tmp = np.array([r["temp_bytes"] + r["code_bytes"] for r in steps]) / GIB
    pw = np.array([r["planner"]["weights_bytes"] for r in steps]) / GIB
    pk = np.array([r["planner"]["kv_bytes"] if r["spec"]["phase"] == "decode" else 0 for r in steps]) / GIB
    fig, ax = plt.subplots(figsize=(max(6.4, 1.3 * len(steps)), 4.4), dpi=110)
    ax.bar(x - 0.2, w, 0.38, label="weights (compiled layout)")
    ax.bar(x - 0.2, kv, 0.38, bottom=w, label="KV pool")
    ax.bar(x - 0.2, tmp, 0.38, bottom=w + kv, label="temp + code")
    ax.bar(x + 0.2, pw, 0.38, label="planner weights", alpha=0.6)
    ax.bar(x + 0.2, pk, 0.38, bottom=pw, label="planner KV (decode)", alpha=0.6)
    for i, r in enumerate(steps):
        ax.hlines(r["hbm_bytes"] / GIB, i - 0.45, i + 0.45, colors="k", linestyles="--", linewidth=1)
    ax.set_xticks(x, names, fontsize=7)
    ax.set_ylabel("GiB per chip (dashed: HBM)")
    ax.set_title("Memory per chip: compiled steps (left) vs the planner (right)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def summary_lines(results: dict) -> list[str]:
    lines = []
    if results.get("kernels"):
        lines.append(kernel_summary(results["kernels"]))
    for r in results.get("steps") or []:
        kv = f"({_pct(r['kv_vs_planner'])})" if r["spec"]["phase"] == "decode" else "(prefill pool)"
        lines.append(f"{r['name']}: weights {r['weights_padded_bytes'] / GIB:.1f} GiB/chip "
                     f"(planner {r['planner']['weights_bytes'] / GIB:.1f}, {_pct(r['weights_vs_planner'])}), "
                     f"KV {r['kv_padded_bytes'] / GIB:.1f} GiB {kv}, "
                     f"fits {'yes' if r['fits_hbm'] else 'no'}, roofline {1e3 * r['roofline']['step_s']:.2f} ms")
    for e in results.get("step_errors") or []:
        lines.append(f"{e['name']}: FAILED {e['error'][:200]}")
    return lines


def as_rows(results: dict[str, Any]) -> list[dict]:
    return list(results.get("steps") or [])
