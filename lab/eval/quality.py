"""The quality table: every representation the design serves, measured on the shipped default model.

Weights alone (``WEIGHTS``: ``float32`` reference, ``bfloat16``, ``fp8``, ``int4`` RTN and ``int4`` GPTQ in the Kimi
layout -- routed experts INT4 group 32, the rest BF16), from ``ps.forward``: held-out perplexity, KL and top-1 against
float32, checked against ``LIMITS``.

Per serving representation (``ROWS``: prefill weights, decode weights, KV dtype -- the five weight representations,
FP8 KV on float32 weights, and the published combination FP8 prefill + INT4 GPTQ decode + FP8 KV):

- tool calls on held-out requests through the real engine: exact match, validity, argument accuracy, and greedy
  token agreement with the float32 engine;
- next-token distributions *as served* (``cached_decode.served_logits``: the first half of each held-out window
  prefilled with the prefill weights, its KV stored in the row's KV dtype, the second half teacher-forced through
  the decode weights' decode step): perplexity, KL to float32 and top-1 agreement on the second half.

Each metric has a 95% percentile-bootstrap interval over requests / windows (``bench.measure.bootstrap_ci``), and so
has its paired difference to the float32 row (same requests, same windows): a difference is *significant* when that
interval excludes 0. GPTQ is calibrated on training-split text; its params are quantized once and handed to the
engine already in their representation (kept bit for bit).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import phaseserve as ps
from lab.bench.measure import bootstrap_ci
from lab.data.corpus import eval_windows, text_stream
from lab.eval.cached_decode import served_logits
from lab.eval.generation import engine_generate_fn, heldout_perplexity, score_tool_calls
from lab.eval.metrics import kl_divergence, token_match_rate, token_nll, top1_agreement
from phaseserve.data.toolcalls import iter_examples
from phaseserve.quant import collect_calibration, quantize_params

WEIGHTS = {  # name -> policy string (engine QuantConfig weights)
    "float32": "float32",
    "bfloat16": "bfloat16",
    "fp8": "glm-fp8",
    "int4-rtn": "kimi-int4",
    "int4-gptq": "kimi-int4,routed_experts=int4:g32:bf16:gptq",
}
KV = ("bfloat16", "float8_e4m3fn")
# Each representation against the float32 model (on the held-out windows): KL (nats) at most, top-1 agreement at
# least, perplexity ratio at most. Set from the measurement (benchmarks/quality: 32 windows; 2 windows in the
# tests) with about 2-3x headroom on KL; an INT4 quantizer that drops one bit of each code fails them (KL 0.031,
# top-1 0.90 on the tests' 2 windows; tests/e2e/test_quality.py breaks it on purpose).
LIMITS = {
    "float32": {"kl": 1e-9, "top1": 1.0, "ppl_ratio": 1.0 + 1e-6},
    "bfloat16": {"kl": 0.001, "top1": 0.98, "ppl_ratio": 1.005},
    "fp8": {"kl": 0.005, "top1": 0.97, "ppl_ratio": 1.02},
    "int4-rtn": {"kl": 0.012, "top1": 0.93, "ppl_ratio": 1.03},
    "int4-gptq": {"kl": 0.012, "top1": 0.93, "ppl_ratio": 1.03},
}
# name -> (prefill weights, decode weights, KV dtype); float32 is the reference every row is compared with.
ROWS = {
    "float32": ("float32", "float32", "float32"),
    "bfloat16": ("bfloat16", "bfloat16", "bfloat16"),
    "fp8": ("fp8", "fp8", "bfloat16"),
    "int4-rtn": ("int4-rtn", "int4-rtn", "bfloat16"),
    "int4-gptq": ("int4-gptq", "int4-gptq", "bfloat16"),
    "fp8-kv": ("float32", "float32", "float8_e4m3fn"),
    "published": ("fp8", "int4-gptq", "float8_e4m3fn"),
}
TOOL_METRICS = ("exact_match", "validity", "argument_accuracy")
LOGIT_METRICS = ("ppl", "kl", "top1")


def _calibration(params, cfg, n: int, seq_len: int, seed: int):
    stream = text_stream("train")
    starts = np.random.default_rng(seed).integers(0, len(stream) - seq_len - 1, n)
    return collect_calibration(params, cfg, np.stack([stream[s: s + seq_len] for s in starts]))


def represented(params, cfg, name: str, calibration=None):
    return quantize_params(params, WEIGHTS[name], calibration=calibration if "gptq" in name else None)


def _logit_metrics(ref_params, params, cfg, windows: np.ndarray) -> dict[str, float]:
    fwd = jax.jit(lambda p, t: ps.forward(p, cfg, t))
    kls, tops = [], []
    for s in range(0, len(windows), 8):
        t = jnp.asarray(windows[s: s + 8, :-1])
        ref, test = fwd(ref_params, t), fwd(params, t)
        kls.append(kl_divergence(ref, test))
        tops.append(top1_agreement(ref, test))
    return {"kl": float(np.mean(kls)), "top1": float(np.mean(tops))}


def weight_metrics(f32, cfg, windows: np.ndarray, name: str, calibration=None) -> dict[str, float]:
    """Perplexity of representation ``name`` on ``windows`` (i32[N, T+1]), and its KL / top-1 against float32."""
    params = represented(f32, cfg, name, calibration)
    return {**heldout_perplexity(params, cfg, windows), **_logit_metrics(f32, params, cfg, windows)}


def check(name: str, metrics: dict[str, float], ref: dict[str, float]) -> list[str]:
    """What breaks :data:`LIMITS` for representation ``name`` (``metrics`` vs the float32 ``ref``); [] when all hold."""
    lim, out = LIMITS[name], []
    if metrics["kl"] > lim["kl"]:
        out.append(f"{name}: KL {metrics['kl']:.5f} > {lim['kl']}")
    if metrics["top1"] < lim["top1"]:
        out.append(f"{name}: top-1 agreement {metrics['top1']:.4f} < {lim['top1']}")
    if metrics["ppl"] / ref["ppl"] > lim["ppl_ratio"]:
        out.append(f"{name}: perplexity ratio {metrics['ppl'] / ref['ppl']:.4f} > {lim['ppl_ratio']}")
    return out


def _engine(cfg, params, prefill: str, decode: str, kv: str, max_len: int) -> ps.Engine:
    """An engine serving ``decode`` weights (and ``prefill`` ones, disaggregated, when they differ). GPTQ params arrive
    already quantized; the engine's policy names their representation (kimi-int4), which keeps them bit for bit."""
    plain = {name: WEIGHTS[name].replace(",routed_experts=int4:g32:bf16:gptq", "") for name in (prefill, decode)}
    quant = ps.QuantConfig(prefill_weights=plain[prefill], decode_weights=plain[decode], kv_dtype=kv,
                           prefill_kv_dtype="bfloat16" if kv != "float32" else "float32", int4_group_size=32)
    pages = -(-max_len // 16)
    serve = ps.ServeConfig(mode="disaggregated" if prefill != decode else "colocated", quant=quant, max_batch=32,
                           cache=ps.CacheConfig(page_size=16, num_pages=32 * pages + 2, max_pages_per_seq=pages))
    return ps.Engine(cfg, params, serve)


def tool_requests(cfg, n: int, max_tokens: int, mix: str, seed: int) -> list:
    """``n`` held-out requests of ``mix`` whose prompt and answer fit the model's context."""
    fits = (r for r in iter_examples("heldout", seed, mix)
            if len(r.prompt_ids(ps_tok())) + max_tokens <= cfg.max_position_embeddings)
    return list(itertools.islice(fits, n))


def served_metrics(ref_logits: list, params_pre, params_dec, cfg, windows: np.ndarray, kv: str) -> tuple[dict, list]:
    """Per-window samples (``nll``, ``kl``, ``top1``) of one representation as served (module docstring), and its
    logits. windows i32[N, T + 1]; ``ref_logits`` the float32 row's logits per batch of 8 (empty: this is it)."""
    t = windows.shape[1] - 1
    prefix = t // 2
    samples: dict[str, list[float]] = {"nll": [], "kl": [], "top1": []}
    logits_out = []
    for i, s in enumerate(range(0, len(windows), 8)):
        w = jnp.asarray(windows[s: s + 8])
        logits = served_logits(params_pre, params_dec, cfg, w[:, :-1], prefix=prefix, kv_dtype=kv)
        ref = ref_logits[i] if ref_logits else logits
        logits_out.append(logits)
        nll = token_nll(logits, w[:, prefix:])  # f32[B, T - prefix + 1]
        for r in range(w.shape[0]):
            samples["nll"].append(float(jnp.mean(nll[r])))
            samples["kl"].append(kl_divergence(ref[r: r + 1], logits[r: r + 1]))
            samples["top1"].append(top1_agreement(ref[r: r + 1], logits[r: r + 1]))
    return samples, logits_out


def run(model_path: str | Path, out_dir: str | Path, *, num_requests: int = 48, max_tokens: int = 96,
        num_windows: int = 32, calib_sequences: int = 32, seed: int = 0, tool_mix: str = "basic",
        progress=lambda msg: None) -> dict:
    """Measure everything, write ``quality.json`` and ``README.md`` into ``out_dir``, return the results."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg, f32 = ps.load_checkpoint(model_path, "float32")
    windows = eval_windows("heldout", seq_len=min(256, cfg.max_position_embeddings), num=num_windows)
    calib = _calibration(f32, cfg, calib_sequences, 128, seed)
    reqs = tool_requests(cfg, num_requests, max_tokens, tool_mix, seed)
    prompts = [r.prompt_ids(ps_tok()) for r in reqs]
    max_len = max(len(p) for p in prompts) + max_tokens
    rows: dict[str, Any] = {"settings": {"model": str(model_path),
                                         "num_requests": len(reqs), "max_tokens": max_tokens, "tool_mix": tool_mix,
                                         "num_windows": num_windows, "calib_sequences": calib_sequences, "seed": seed,
                                         "kinds": sorted({r.kind for r in reqs})},
                            "weights": {}, "rows": {}}
    reps = {}
    for name in WEIGHTS:
        progress(f"weights {name}")
        reps[name] = represented(f32, cfg, name, calib)
        rows["weights"][name] = {**heldout_perplexity(reps[name], cfg, windows),
                                 **_logit_metrics(f32, reps[name], cfg, windows)}
    ref = rows["weights"]["float32"]
    rows["limits_broken"] = {name: check(name, m, ref) for name, m in rows["weights"].items()}
    ref_logits: list = []
    ref_tokens = None
    for name, (pre, dec, kv) in ROWS.items():
        progress(f"row {name}: prefill {pre}, decode {dec}, KV {kv}")
        samples, logits = served_metrics(ref_logits, reps[pre], reps[dec], cfg, windows, kv)
        ref_logits = ref_logits or logits
        eng = _engine(cfg, f32 if pre != dec else reps[dec], pre, dec, kv, max_len)
        if pre != dec:  # disaggregated: the prefill copy is made from float32, the decode copy handed in quantized
            eng.decode.params = ps.sharding.shard_params(cfg, reps[dec], eng.decode_mesh)
        toks = engine_generate_fn(eng)(prompts, max_tokens)
        ref_tokens = ref_tokens or toks
        report = score_tool_calls(toks, reqs)
        samples.update({"exact_match": [float(x) for x in report.exact],
                        "validity": [float(x) for x in report.valid],
                        "arg_hits": [h for h, _ in report.argument_hits],
                        "arg_total": [t for _, t in report.argument_hits]})
        rows["rows"][name] = {"prefill_weights": pre, "decode_weights": dec, "kv": kv, "samples": samples,
                              "exact_by_kind": report.exact_by_kind,
                              "token_agreement_vs_f32": token_match_rate(ref_tokens, toks)}
    rows["intervals"] = intervals(rows["rows"])
    (out / "quality.json").write_text(json.dumps(rows, indent=1))
    (out / "README.md").write_text(markdown(rows, cfg))
    return rows


# ---- confidence intervals -------------------------------------------------------------------------------------
def _mean(x, axis=-1):
    return np.mean(x, axis=axis)


def _ppl(nll, axis=-1):
    return np.exp(np.mean(nll, axis=axis))


def _ratio(hits, total, axis=-1):
    return np.sum(hits, axis=axis) / np.maximum(np.sum(total, axis=axis), 1)


STATISTICS = {  # metric -> (sample keys, statistic over them)
    "exact_match": (("exact_match",), _mean), "validity": (("validity",), _mean),
    "argument_accuracy": (("arg_hits", "arg_total"), _ratio),
    "ppl": (("nll",), _ppl), "kl": (("kl",), _mean), "top1": (("top1",), _mean),
}


def intervals(rows: dict, ref: str = "float32", confidence: float = 0.95) -> dict:
    """Per row and metric: the value, its bootstrap CI, and the paired difference to ``ref`` with its CI and
    whether that CI excludes 0 (``significant``)."""
    out: dict = {}
    for name, row in rows.items():
        out[name] = {}
        for metric, (keys, stat) in STATISTICS.items():
            xs = tuple(np.asarray(row["samples"][k], float) for k in keys)
            refs = tuple(np.asarray(rows[ref]["samples"][k], float) for k in keys)
            k = len(keys)

            def diff(*both, axis=-1, stat=stat, k=k):
                return stat(*both[:k], axis=axis) - stat(*both[k:], axis=axis)

            lo, hi = bootstrap_ci(xs, stat, confidence, paired=k > 1)  # a request's hits and total stay together
            dlo, dhi = bootstrap_ci(xs + refs, diff, confidence, paired=True)
            d = float(diff(*xs, *refs))
            out[name][metric] = {"value": float(stat(*xs)), "ci": [lo, hi], "diff": d, "diff_ci": [dlo, dhi],
                                 "significant": bool(dlo is not None and (dlo > 0 or dhi < 0))}
    return out


def render(out_dir: str | Path, model_path: str | Path) -> list[str]:
    """Rewrite ``README.md`` from ``quality.json`` (limits and intervals recomputed; nothing measured); returns the
    last lines."""
    out = Path(out_dir)
    rows = json.loads((out / "quality.json").read_text())
    ref = rows["weights"]["float32"]
    rows["limits_broken"] = {name: check(name, m, ref) for name, m in rows["weights"].items()}
    rows["intervals"] = intervals(rows["rows"])
    cfg = ps.ModelConfig.from_hf_config(json.loads((Path(model_path) / "config.json").read_text()))
    (out / "README.md").write_text(markdown(rows, cfg))
    return final_lines(rows, out)


def _sig_rows(rows: dict) -> list[str]:
    return [f"{name} {metric} {iv['diff']:+.4f}" for name, ms in rows["intervals"].items() for metric, iv in ms.items()
            if iv["significant"]]


def final_lines(rows: dict, out_dir: str | Path) -> list[str]:
    """The experiment's last lines: weights within LIMITS, the published combination against float32 on exact match
    and validity, the significant differences, then the run directory."""
    ref, broken = rows["weights"]["float32"], rows.get("limits_broken", {})
    reps = [n for n in rows["weights"] if n != "float32"]
    ok = not any(broken.values())
    iv = rows["intervals"]
    pub = "; ".join(f"{m} {iv['published'][m]['value']:.3f} vs {iv['float32'][m]['value']:.3f} "
                    f"(difference {iv['published'][m]['diff']:+.3f}, 95% CI {_ci(iv['published'][m]['diff_ci'])}"
                    f"{', significant' if iv['published'][m]['significant'] else ', within the interval'})"
                    for m in ("exact_match", "validity"))
    sig = _sig_rows(rows)
    return [
        "weights vs float32 (KL nats, top-1, perplexity): " + "; ".join(
            f"{n} {rows['weights'][n]['kl']:.4f}, {rows['weights'][n]['top1']:.3f}, "
            f"{100 * (rows['weights'][n]['ppl'] / ref['ppl'] - 1):+.2f}%" for n in reps)
        + " -> " + ("every limit holds" if ok else "; ".join(x for xs in broken.values() for x in xs)),
        f"published combination (FP8 prefill, INT4 GPTQ decode, FP8 KV) vs float32: {pub}",
        "significant differences from float32 (paired 95% bootstrap CI excludes 0): " + ("; ".join(sig) or "none"),
        f"run directory: {out_dir}"]


def ps_tok():
    from phaseserve.data import ByteTokenizer

    return ByteTokenizer()


def _ci(ci) -> str:
    return "n/a" if ci[0] is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def markdown(rows: dict, cfg) -> str:
    st, ref, iv = rows["settings"], rows["weights"]["float32"], rows["intervals"]
    lines = ["# Quality of each representation on the default model", "",
             f"Model: {st.get('model', 'models/default')} ({cfg.architecture}, {cfg.num_layers} layers, "
             f"{cfg.num_experts} experts, "
             f"context {cfg.max_position_embeddings}). Tool calls: {st['num_requests']} held-out requests "
             f"({st['tool_mix']} mix: {', '.join(st['kinds'])}), greedy, at most {st['max_tokens']} tokens, "
             "through the engine. Next-token "
             f"metrics: {st['num_windows']} held-out windows of standard-library source, the first half prefilled, the "
             "second half teacher-forced through the decode step with the row's KV dtype (as served). Brackets: 95% "
             "percentile-bootstrap CI over requests / windows; Δ: paired difference to float32 with its CI, "
             "**bold** where that CI excludes 0 (significant).", "",
             "| representation (prefill / decode / KV) | exact match | validity | argument accuracy | perplexity | "
             "KL to float32 (nats) | top-1 agreement | greedy tokens = float32 |",
             "|---|---|---|---|---|---|---|---:|"]
    for name, row in rows["rows"].items():
        cells = []
        for m in ("exact_match", "validity", "argument_accuracy", "ppl", "kl", "top1"):
            x = iv[name][m]
            digits = 5 if m == "kl" else 3
            delta = "" if name == "float32" else f"; Δ {x['diff']:+.{digits}f} {_ci(x['diff_ci'])}"
            cell = f"{x['value']:.{digits}f} {_ci(x['ci'])}{delta}"
            cells.append(f"**{cell}**" if x["significant"] else cell)
        lines.append(f"| {name} ({row['prefill_weights']} / {row['decode_weights']} / {row['kv']}) | "
                     + " | ".join(cells) + f" | {row['token_agreement_vs_f32']:.3f} |")
    lines += ["", "Exact match by kind of request: " + "; ".join(
        f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["exact_by_kind"].items())
        for name, row in rows["rows"].items()), "",
        "Weights alone (full forward over whole windows, against `LIMITS`):", "",
        "| weights | perplexity | vs float32 | KL (nats) | top-1 agreement |", "|---|---:|---:|---:|---:|"]
    for name, r in rows["weights"].items():
        lines.append(f"| {name} | {r['ppl']:.4f} | {100 * (r['ppl'] / ref['ppl'] - 1):+.2f}% | {r['kl']:.5f} | "
                     f"{r['top1']:.4f} |")
    broken = [x for xs in rows.get("limits_broken", {}).values() for x in xs]
    lines += ["", "Each weight representation against float32 within `LIMITS` (lab/eval/quality.py): "
              + ("every limit holds." if not broken else "; ".join(broken)), "",
              "Significant differences from float32: " + ("; ".join(_sig_rows(rows)) or "none") + "."]
    return "\n".join(lines) + "\n"


__all__ = ["KV", "LIMITS", "ROWS", "STATISTICS", "WEIGHTS", "check", "final_lines", "intervals", "markdown", "render",
           "represented", "run", "served_metrics", "tool_requests", "weight_metrics"]
