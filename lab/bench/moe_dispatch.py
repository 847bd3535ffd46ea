"""The CPU's MoE dispatches side by side: blocks, the batched capacity part, every expert densely (``model.moe``).

A chain of a model's MoE layers (routing, routed and shared experts, the residual added between layers; one jit per
arm) runs on ``tokens`` random rows per point, the arms interleaved in every repeat with the order alternating:
``blocks`` (``blocked_experts(cap=0)``: every assignment through the loop over one-expert blocks),
``capacity`` (the default ``cap = moe.default_cap(...)``: each expert's first ``cap`` assignments in one
batched FFN over all experts, the overflow through the blocks), ``capacity_wide`` (the same, the overflow in
blocks of ``block_rows`` rows) and ``dense`` (``dense_experts``: every expert on every token in one batched FFN, no
weights copied, E / k times the FFN rows). Reports ms per chain
(median [min, max]), the per-repeat ratios over ``blocks`` (and capacity / capacity_wide), and the largest
difference of the outputs relative to the output's scale (the arms differ only in where each assignment's FFN runs).

    python -m lab.bench.moe_dispatch --out benchmarks/engine/moe_dispatch/xeon_260mb
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import jax
import numpy as np

from lab.bench.measure import environment, stats
from lab.bench.profile_decode import MODELS, model_config, write
from lab.bench.report import environment_section, markdown_table, spread
from phaseserve.config import ModelConfig
from phaseserve.model import moe as M
from phaseserve.model.params import MoEParams, init_params
from phaseserve.quant.policy import resolve_policy
from phaseserve.quant.quantize import quantize_params


def chain(cfg: ModelConfig, cap: int | None = None, bt: int | None = None, dense: bool = False):
    """jit(moes, x [N, D]) -> x [N, D] through every MoE layer with ``blocked_experts(..., cap=cap, bt=bt)``, or
    with ``dense_experts`` when ``dense``."""

    def dispatch(p, c, x, w, idx):
        if dense:
            return M.dense_experts(p, c, x, w, idx)
        return M.blocked_experts(p, c, x, w, idx, cap=cap, bt=bt)

    @jax.jit
    def run(moes: list[MoEParams], x: jax.Array) -> jax.Array:
        for p in moes:
            x = x + M.moe(p, cfg, x, dispatch)[0]
        return x

    return run


def measure(cfg: ModelConfig, tokens: int, repeats: int, seed: int = 0, weights: str = "float32") -> dict[str, Any]:
    """One point: both arms on the same ``tokens`` random rows, interleaved ``repeats`` times (after a warm-up), the
    weights in the quantization preset ``weights`` (float32 activations)."""
    params = quantize_params(init_params(cfg, jax.random.key(seed)), resolve_policy(weights, base="float32"))
    moes = [layer.mlp for layer in params.layers if isinstance(layer.mlp, MoEParams)]
    x = jax.random.normal(jax.random.key(seed + tokens), (tokens, cfg.hidden_size))
    bt = M.block_rows(tokens * cfg.num_experts_per_tok, cfg.num_experts)
    arms = {"blocks": chain(cfg, 0), "capacity": chain(cfg, None), "capacity_wide": chain(cfg, None, bt),
            "dense": chain(cfg, dense=True)}
    outs = {name: np.asarray(f(moes, x)) for name, f in arms.items()}
    ms: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(repeats):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            t = time.perf_counter()
            arms[name](moes, x).block_until_ready()
            ms[name].append(1e3 * (time.perf_counter() - t))
    ratio = [c / b for c, b in zip(ms["capacity"], ms["blocks"], strict=True)]
    dense = [d / b for d, b in zip(ms["dense"], ms["blocks"], strict=True)]
    ratio_wide = [c / w for c, w in zip(ms["capacity"], ms["capacity_wide"], strict=True)]
    scale = float(np.max(np.abs(outs["blocks"])))
    cap = M.default_cap(moes[0], cfg, tokens, cfg.hidden_size, x.dtype)
    return {"tokens": tokens, "cap": cap, "block_rows": bt,
            "overflow_rows": min(bt, M.OVERFLOW_BLOCK_ROWS) if cap else bt, "moe_layers": len(moes),
            "ms": ms, "ratio": ratio, "ratio_wide": ratio_wide,
            "ratio_dense": dense,
            "rel_diff": max(float(np.max(np.abs(outs[a] - outs["blocks"]))) for a in arms if a != "blocks") / scale}


def markdown(result: dict[str, Any]) -> str:
    rows = [[r["model"], r["tokens"], r["cap"], r["block_rows"], r.get("overflow_rows", r["block_rows"]),
             spread(stats(r["ms"]["blocks"])), spread(stats(r["ms"]["capacity"])), spread(stats(r["ratio"])),
             spread(stats(r["ratio_wide"])) if "ratio_wide" in r else "–",
             spread(stats(r["ratio_dense"])) if "ratio_dense" in r else "–", f"{r['rel_diff']:.1e}"]
            for r in result["rows"]]
    return "\n".join([
        f"# MoE dispatch on the CPU: blocks, capacity part, every expert densely ({result['label']})", "",
        __doc__.split("\n\n")[1].replace("\n", " "), "",
        f"Weights: {result.get('weights', 'float32')} (activations float32). "
        f"{result['repeats']} interleaved repeats per point; ms per chain of the model's MoE layers; ratio < 1: the "
        "capacity part is faster. `cap`: capacity rows per expert the default picks (0: it runs the blocks only); "
        "`bt`: rows per block of the blocks arm; `overflow bt`: rows per block past the capacity in the capacity arm "
        "(`moe.OVERFLOW_BLOCK_ROWS`); `capacity / wide`: the capacity arm over the same dispatch with the overflow "
        "in blocks of `bt` rows (the rule before 2026-12-05), interleaved in the same repeats; `dense / blocks`: every "
        "expert on every token (`moe.dense_experts`) over the blocks arm.", "",
        markdown_table(["model", "tokens", "cap", "bt", "overflow bt", "blocks ms", "capacity ms", "capacity / blocks",
                        "capacity / wide", "dense / blocks", "max rel. diff"], rows), "",
        environment_section(result["environment"]), "",
    ])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    ap.add_argument("--label", default="")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[32, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--weights", default="float32", help="quantization preset of the weights, e.g. all-fp8, kimi-int4")
    a = ap.parse_args(argv)
    result: dict[str, Any] = {"label": a.label or a.out.rstrip("/").split("/")[-1], "repeats": a.repeats,
                              "weights": a.weights, "environment": environment(), "rows": []}
    for name in a.models:
        cfg = model_config(name)
        for n in a.tokens:
            row = {"model": name, "load_average_1m": os.getloadavg()[0],
                   **measure(cfg, n, a.repeats, weights=a.weights)}
            result["rows"].append(row)
            print(name, n, "cap", row["cap"], "ratio", spread(stats(row["ratio"])), "dense / blocks",
                  spread(stats(row["ratio_dense"])), flush=True)
    write(a.out, result, markdown(result))


if __name__ == "__main__":
    main()
