"""Long-context prefill benchmark: memory and efficiency of one prefill as T grows.

For each (variant, T) point a fresh subprocess builds a random-weight model (the default architecture with its
context raised; or a 64-head 2-layer variant of it), compiles one ``prefill`` of a single T-token prompt (logits
at the last token, every layer's KV returned as the engine's prefill does) and reports:

- ``temp_bytes``: XLA's temporaries of the compiled prefill (``compile().memory_analysis()``);
- ``peak_rss_bytes``: the subprocess's peak resident set (``resource.getrusage(...).ru_maxrss``) after one run,
  so points never contaminate each other;
- ``seconds``, ``flops`` and ``flops_per_s``: the median of :func:`repeats` timed runs after compilation; FLOPs
  counted analytically (:func:`prompt_flops`: 2 x the weights each token multiplies, the lm head once, and
  causal attention's ``2 * H * (dk + dv)`` per visible (query, key) pair).

Each point is time-boxed; a point that runs out of time keeps what it printed before (the temporaries) and says
so.

The engine point (:func:`measure_engine`, ``--engine-only`` runs it alone and keeps the prefill points): a 32K-token
prompt served end to end by the engine (prefilled in chunks over the prefill page pool, then 64 decode tokens) with
its peak RSS; chunked vs unchunked greedy tokens at 2K (float32 equality, FP8 KV agreement); and the TTFT of a
90%-shared prompt (prefix reuse skipping compute) against a miss.

``python experiments/long_context.py hydra.run.dir=benchmarks/long_context`` (or ``python -m
lab.bench.long_context [--out DIR]``) prints the table and writes ``long_context.json`` and ``long_context.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
# (variant, T, time box in seconds)
POINTS = [("default", 1024, 300), ("default", 4096, 300), ("default", 16384, 600), ("default", 65536, 900),
          ("heads64", 4096, 300), ("heads64", 16384, 600), ("heads64", 32768, 900)]
VARIANTS = {"default": {}, "heads64": {"num_attention_heads": 64, "num_key_value_heads": 64, "num_hidden_layers": 2}}
LIMITS = {"ratio_64k_16k_max": 4.5, "flops_16k_vs_1k_min": 0.7}
# the engine end-to-end point: a T-token prompt in chunks of `budget`, then new_tokens; the checks at check_T
ENGINE = {"T": 32768, "new_tokens": 64, "budget": 2048, "check_T": 2048, "check_budget": 256, "rss_limit_gib": 8,
          "box_s": 3500}
ENGINE_PARTS = ("e2e", "checks")


def model_config(variant: str, max_context: int):
    """The default architecture (configs/model/default_random.yaml) with ``max_position_embeddings`` raised."""
    from omegaconf import OmegaConf

    from phaseserve.config import ModelConfig

    hf = OmegaConf.to_container(OmegaConf.load(REPO / "configs/model/default_random.yaml").hf)
    hf.update(VARIANTS[variant], max_position_embeddings=max_context)
    return ModelConfig.from_hf_config(hf)


def prompt_flops(cfg, params, t: int) -> dict[str, float]:
    """FLOPs of one T-token prefill: weights (MoE: the routed experts a token uses) and causal attention."""
    import jax

    per_token = 0.0
    for layer in params.layers:
        for path, leaf in jax.tree_util.tree_leaves_with_path(layer):
            name = jax.tree_util.keystr(path)
            if leaf.ndim < 2 or "router" in name:
                continue  # norms, biases; the router is counted below
            size = float(np.prod(leaf.shape))
            if leaf.ndim == 3:  # stacked routed experts [E, ., .]: top-k of E per token
                size *= cfg.num_experts_per_tok / cfg.num_experts
            per_token += 2 * size
        if hasattr(layer.mlp, "router"):
            per_token += 2 * float(np.prod(layer.mlp.router.shape))
    head = params.lm_head if params.lm_head is not None else params.embed
    dk = cfg.head_dim
    dv = cfg.v_head_dim if cfg.is_mla else cfg.head_dim
    attention = cfg.num_layers * cfg.num_heads * 2 * (dk + dv) * t * (t + 1) / 2
    weights = per_token * t + 2 * float(np.prod(head.shape))
    return {"weights": weights, "attention": attention, "total": weights + attention}


def repeats(t: int) -> int:
    """Timed runs per default-architecture point (the median is reported): 3 up to 16K tokens, 1 beyond (minutes
    each on the CPU); the 64-head variant runs once (only its memory is compared)."""
    return 3 if t <= 16384 else 1


def measure_point(variant: str, t: int) -> None:
    """Child process: print one JSON line after compiling (temporaries) and one after the timed run."""
    import jax
    import jax.numpy as jnp

    from phaseserve.model.params import init_params
    from phaseserve.model.transformer import prefill

    cfg = model_config(variant, max(t, 256))
    params = init_params(cfg, jax.random.key(0), "float32")
    tokens = jax.random.randint(jax.random.key(1), (1, t), 0, cfg.vocab_size, jnp.int32)
    fn = jax.jit(lambda p, tok: prefill(p, cfg, tok, logits_at=jnp.full((1,), t - 1, jnp.int32)))
    t0 = time.perf_counter()
    compiled = fn.lower(params, tokens).compile()
    mem = compiled.memory_analysis()
    row = {"variant": variant, "T": t, "heads": cfg.num_heads, "layers": cfg.num_layers,
           "temp_bytes": int(mem.temp_size_in_bytes), "compile_s": time.perf_counter() - t0}
    print(json.dumps(row), flush=True)
    times = []
    for _ in range(repeats(t) if variant == "default" else 1):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, tokens))
        times.append(time.perf_counter() - t0)
    seconds = float(np.median(times))
    flops = prompt_flops(cfg, params, t)
    row.update(seconds=seconds, seconds_all=times, flops=flops["total"], attention_flops=flops["attention"],
               flops_per_s=flops["total"] / seconds, tokens_per_s=t / seconds,
               peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(json.dumps(row), flush=True)


def _engine(cfg, params, budget: int, context: int, quant=None, max_batch: int = 1):
    """A float32 engine (or ``quant``) for one long prompt at a time: 16-token pages, the pool sized to ``context``."""
    import phaseserve as ps

    quant = quant or ps.QuantConfig(prefill_weights="float32", decode_weights="float32", kv_dtype="float32",
                                    prefill_kv_dtype="float32")
    pages = max_batch * -(-context // 16) + 1
    return ps.Engine(cfg, params, ps.ServeConfig(quant=quant, max_batch=max_batch, max_prefill_tokens=budget,
                                                 max_context=context,
                                                 cache=ps.CacheConfig(page_size=16, num_pages=pages)))


def _generate(engine, prompts: list[list[int]], new: int, **kw) -> list:
    from phaseserve.engine import Request

    return engine.generate([Request(id=f"q{i}", prompt=p, max_tokens=new, ignore_eos=True, **kw)
                            for i, p in enumerate(prompts)])


def _first_token(engine, req):
    """Submit ``req`` to a running engine and step until its first token: its output."""
    out = engine.add_request(req)
    while out.metrics.first_token is None and out.finish_reason is None:
        engine.step()
    return out


def measure_engine(t: int, parts: tuple[str, ...] = ENGINE_PARTS) -> None:
    """Child process: the engine end to end on the default architecture (random weights, context raised), one JSON
    line per part -- first a ``t``-token prompt prefilled in chunks then decoded (the process's peak RSS right after
    it), then chunked vs unchunked greedy tokens at :data:`ENGINE` ``check_T`` (float32, then FP8 KV agreement)
    and the TTFT of a 90%-shared prompt vs a miss (``parts``: "e2e", "checks")."""
    import jax

    from phaseserve.model.params import init_params

    cfg = model_config("default", t + ENGINE["new_tokens"])
    params = init_params(cfg, jax.random.key(0), "float32")
    rng = np.random.default_rng(0)
    if "e2e" in parts:
        _end_to_end(cfg, params, t, rng)
    if "checks" in parts:
        _checks(cfg, params, rng)


def _end_to_end(cfg, params, t: int, rng) -> None:
    """The ``t``-token prompt in chunks, then ``new_tokens`` decoded; the process's peak RSS right after."""
    e, new = ENGINE, ENGINE["new_tokens"]
    eng = _engine(cfg, params, e["budget"], t + new)
    long_prompt = rng.integers(0, cfg.vocab_size, t).tolist()
    t0 = time.perf_counter()
    out = _generate(eng, [long_prompt], new)[0]
    seconds = time.perf_counter() - t0
    print(json.dumps({"part": "e2e", "T": t, "new_tokens": new, "chunk": e["budget"], "finish": out.finish_reason,
                      "generated": len(out.tokens), "seconds": seconds, "ttft_s": out.metrics.ttft,
                      "prefill_steps": eng.metrics.prefill_batches, "decode_steps": eng.metrics.decode_steps,
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)


def _checks(cfg, params, rng) -> None:
    """Chunked vs unchunked greedy tokens at ``check_T`` (float32 equality, FP8 KV agreement); prefix-hit TTFT."""
    import phaseserve as ps
    from phaseserve.engine import Request

    e, new = ENGINE, ENGINE["new_tokens"]
    ct = e["check_T"]
    prompt = rng.integers(0, cfg.vocab_size, ct).tolist()
    runs = {}
    for name, budget, quant in [("float32_unchunked", ct, None), ("float32_chunked", e["check_budget"], None),
                                ("fp8_unchunked", ct, ps.QuantConfig(prefill_weights="float32",
                                                                     decode_weights="float32")),
                                ("fp8_chunked", e["check_budget"], ps.QuantConfig(prefill_weights="float32",
                                                                                  decode_weights="float32"))]:
        eng = _engine(cfg, params, budget, ct + new, quant)
        runs[name] = (_generate(eng, [prompt], new)[0].tokens, eng.metrics.prefill_batches)
    fp8 = [a == b for a, b in zip(runs["fp8_unchunked"][0], runs["fp8_chunked"][0], strict=True)]
    print(json.dumps({"part": "chunked_vs_unchunked", "T": ct, "new_tokens": new, "chunk": e["check_budget"],
                      "float32_equal": runs["float32_unchunked"][0] == runs["float32_chunked"][0],
                      "prefill_steps": {k: v[1] for k, v in runs.items()},
                      "fp8_agreement": float(np.mean(fp8)),
                      "fp8_first_divergence": next((i for i, ok in enumerate(fp8) if not ok), None)}), flush=True)

    # prefix reuse: TTFT of a prompt sharing 90% of its tokens with a cached one vs a miss (warm shapes first)
    shared = int(0.9 * ct) // 16 * 16
    eng = _engine(cfg, params, e["check_budget"], ct + new, max_batch=2)
    ttft = {}
    for tenant in ("warmup", "measured"):  # the warm-up compiles every shape the measured pair runs
        base = rng.integers(0, cfg.vocab_size, ct).tolist()
        hit = base[:shared] + rng.integers(0, cfg.vocab_size, ct - shared).tolist()
        miss_out = _first_token(eng, Request(id=f"m-{tenant}", prompt=base, max_tokens=new, ignore_eos=True,
                                             tenant=tenant))
        hit_out = _first_token(eng, Request(id=f"h-{tenant}", prompt=hit, max_tokens=new, ignore_eos=True,
                                            tenant=tenant))  # arrives while the miss still holds its pages
        while eng.has_work:
            eng.step()
        ttft[tenant] = (miss_out.metrics.ttft, hit_out.metrics.ttft, hit_out.metrics.prefix_hit_tokens)
    miss_s, hit_s, hit_tokens = ttft["measured"]
    print(json.dumps({"part": "prefix_ttft", "T": ct, "shared_tokens": hit_tokens, "miss_ttft_s": miss_s,
                      "hit_ttft_s": hit_s, "ratio": hit_s / miss_s}), flush=True)


def run_engine_point(t: int, box_s: float, parts: tuple[str, ...] = ENGINE_PARTS) -> dict:
    """:func:`measure_engine` in a fresh interpreter, killed after ``box_s`` seconds: its parts by name, and the
    status of the run (``status``, or ``status_<part>`` when only some parts ran)."""
    rows, status, partial = _run_child(["--engine", str(t), "--parts", *parts], box_s)
    key = "status" if tuple(parts) == ENGINE_PARTS else "status_" + "+".join(parts)
    out = {key: status, **{r.pop("part"): r for r in rows}}
    if partial is not None:
        out["peak_rss_bytes_partial"] = partial
    return out


def engine_markdown(eng: dict) -> str:
    """The engine section of long_context.md."""
    lines = ["", "## The engine end to end (default architecture, random float32 weights, 16-token pages)", ""]
    e2e, cmp, pre = eng.get("e2e"), eng.get("chunked_vs_unchunked"), eng.get("prefix_ttft")
    if e2e:
        lines.append(f"- {e2e['T']:,}-token prompt prefilled in {e2e['prefill_steps']} chunks of "
                     f"{e2e['chunk']:,} tokens, then {e2e['generated']} decode tokens: peak RSS "
                     f"{e2e['peak_rss_bytes'] / 2**30:.2f} GiB (limit {ENGINE['rss_limit_gib']} GiB), TTFT "
                     f"{e2e['ttft_s']:.0f} s, {e2e['seconds']:.0f} s in all; finish {e2e['finish']}.")
    if cmp:
        lines.append(f"- Chunked ({cmp['chunk']}-token chunks) vs unchunked at {cmp['T']:,} tokens + "
                     f"{cmp['new_tokens']} greedy tokens: float32 tokens equal: {cmp['float32_equal']}; FP8 KV "
                     f"(BF16 prefill KV) agreement {cmp['fp8_agreement']:.2f} (first divergence at token "
                     f"{cmp['fp8_first_divergence']}).")
    if pre:
        lines.append(f"- Prefix reuse at {pre['T']:,} tokens, {pre['shared_tokens']:,} shared: TTFT "
                     f"{pre['hit_ttft_s']:.2f} s vs {pre['miss_ttft_s']:.2f} s for a miss = {pre['ratio']:.3f}x "
                     f"(limit 0.25x).")
    runs = [f"{k.removeprefix('status').lstrip('_') or 'all parts'}: {v}" for k, v in eng.items()
            if k.startswith("status")]
    lines.append(f"- Status ({'; '.join(runs) or 'not run'}).")
    return "\n".join(lines) + "\n"


def _peak_rss_so_far(pid: int) -> int | None:
    """VmHWM of a live process (Linux), bytes: the peak resident set up to now."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _run_child(args: list[str], box_s: float) -> tuple[list[dict], str, int | None]:
    """``python -m lab.bench.long_context *args`` killed after ``box_s`` seconds: (the JSON lines it printed,
    status, its peak RSS at the kill or None)."""
    cmd = [sys.executable, "-m", "lab.bench.long_context", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial = None
    try:
        out, err = proc.communicate(timeout=box_s)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}: {err.strip().splitlines()[-1:]}"
    except subprocess.TimeoutExpired:
        partial = _peak_rss_so_far(proc.pid)
        proc.kill()
        out, _ = proc.communicate()
        status = f"timed out after {box_s:.0f} s (run not finished)"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], status, partial


def run_point(variant: str, t: int, box_s: float) -> dict:
    """Run one point in a fresh interpreter, killed after ``box_s`` seconds; the last JSON line it printed (a killed
    point reports its peak RSS up to the kill as ``peak_rss_bytes_partial``)."""
    rows, status, partial = _run_child(["--point", variant, str(t)], box_s)
    row = rows[-1] if rows else {"variant": variant, "T": t}
    row["status"] = status
    if partial is not None:
        row["peak_rss_bytes_partial"] = partial
    return row


def run_points(points: list[tuple[str, int, float]], log=print) -> list[dict]:
    """The timed default-architecture points up to 16K run alone, one after another (their FLOP/s are compared);
    the rest run in one lane per variant, the lanes side by side (only their memory is compared)."""
    def lane(pts):
        rows = []
        for variant, t, box in pts:
            rows.append(run_point(variant, t, box))
            log(json.dumps(rows[-1]))
        return rows

    alone = [p for p in points if p[0] == "default" and p[1] <= 16384]
    rest = [p for p in points if p not in alone]
    rows = lane(alone)
    lanes = [[p for p in rest if p[0] == v] for v in VARIANTS]
    with ThreadPoolExecutor(max_workers=len(lanes)) as pool:
        for lane_rows in pool.map(lane, [ln for ln in lanes if ln]):
            rows += lane_rows
    order = {(v, t): i for i, (v, t, _) in enumerate(POINTS)}
    return sorted(rows, key=lambda r: order.get((r["variant"], r["T"]), len(order)))


def summarize(rows: list[dict]) -> dict:
    """The ratios the issue asks for, from the points that have them (None where a point is missing)."""
    def get(variant, t, key):
        return next((r.get(key) for r in rows if r["variant"] == variant and r["T"] == t), None)

    def ratio(a, b):
        return None if a is None or b is None else a / b

    return {
        "temp_64k_over_16k": ratio(get("default", 65536, "temp_bytes"), get("default", 16384, "temp_bytes")),
        "rss_64k_over_16k": ratio(get("default", 65536, "peak_rss_bytes"), get("default", 16384, "peak_rss_bytes")),
        "heads64_temp_32k_over_16k": ratio(get("heads64", 32768, "temp_bytes"), get("heads64", 16384, "temp_bytes")),
        "flops_per_s_16k_over_1k": ratio(get("default", 16384, "flops_per_s"), get("default", 1024, "flops_per_s")),
        "limits": LIMITS,
    }


def markdown(rows: list[dict], summary: dict) -> str:
    lines = ["# Long-context prefill: memory and efficiency of one prefill", "",
             "One T-token prompt, batch 1, float32 random weights, one subprocess per point (CPU, shared 2 cores).",
             "Seconds: median [min, max] of the timed runs; GFLOP/s and tok/s from the median.",
             "", "| variant | heads x layers | T | XLA temporaries MiB | peak RSS MiB | seconds | GFLOP | GFLOP/s "
             "| tok/s | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    def rss(r):
        if r.get("peak_rss_bytes") is not None:
            return f"{r['peak_rss_bytes'] / 2**20:,.1f}"
        part = r.get("peak_rss_bytes_partial")
        return "-" if part is None else f">= {part / 2**20:,.1f} (at the kill)"

    def seconds(r):
        runs = r.get("seconds_all") or []
        if len(runs) < 2:
            return "-" if r.get("seconds") is None else f"{r['seconds']:.1f}"
        return f"{r['seconds']:.1f} [{min(runs):.1f}, {max(runs):.1f}]"

    for r in rows:
        def num(key, fmt, scale=1.0, r=r):
            return "-" if r.get(key) is None else fmt.format(r[key] / scale)
        lines.append(f"| {r['variant']} | {r.get('heads', '-')} x {r.get('layers', '-')} | {r['T']} | "
                     f"{num('temp_bytes', '{:,.1f}', 2**20)} | {rss(r)} | "
                     f"{seconds(r)} | {num('flops', '{:,.1f}', 1e9)} | "
                     f"{num('flops_per_s', '{:.2f}', 1e9)} | "
                     f"{num('tokens_per_s', '{:,.0f}')} | {r['status']} |")
    lines += ["", "| ratio | measured | limit |", "|---|---|---|"]
    fmt = (lambda x: "-" if x is None else f"{x:.2f}")  # noqa: E731
    lines.append(f"| temporaries 64K / 16K (default) | {fmt(summary['temp_64k_over_16k'])} | <= 4.5 |")
    lines.append(f"| peak RSS 64K / 16K (default) | {fmt(summary['rss_64k_over_16k'])} | <= 4.5 |")
    lines.append(f"| temporaries 32K / 16K (64 heads) | {fmt(summary['heads64_temp_32k_over_16k'])} | (linear: 2) |")
    lines.append(f"| FLOP/s 16K / 1K (default) | {fmt(summary['flops_per_s_16k_over_1k'])} | >= 0.7 |")
    return "\n".join(lines) + "\n"


@dataclasses.dataclass
class LongContextSpec:
    """``experiment:`` node of configs/experiment/long_context.yaml."""

    name: str = "long_context"
    points: list[str] = dataclasses.field(default_factory=lambda: [f"{v}:{t}:{b}" for v, t, b in POINTS])
    engine: bool = True  # also the engine end-to-end point (ENGINE)


def parse_point(text: str) -> tuple[str, int, float]:
    """``"variant:T:box_seconds"`` -> (variant, T, box)."""
    variant, t, box = text.split(":")
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {sorted(VARIANTS)}")
    return variant, int(t), float(box)


def write(out: Path, rows: list[dict], engine: dict | None, log=print) -> dict:
    """long_context.json and long_context.md under ``out`` (the table printed)."""
    summary = summarize(rows)
    out.mkdir(parents=True, exist_ok=True)
    data = {"points": rows, "summary": summary, **({"engine": engine} if engine else {})}
    (out / "long_context.json").write_text(json.dumps(data, indent=2) + "\n")
    table = markdown(rows, summary) + (engine_markdown(engine) if engine else "")
    (out / "long_context.md").write_text(table)
    log(table)
    return summary


def run_and_write(points: list[tuple[str, int, float]], out: Path, log=print, engine: bool = True) -> dict:
    """Measure ``points`` (and the engine point), write long_context.json and long_context.md under ``out``."""
    rows = run_points(points, log)
    eng = run_engine_point(ENGINE["T"], ENGINE["box_s"]) if engine else None
    return write(out, rows, eng, log)


def run(cfg, out_dir: str) -> dict:
    """Hydra entry (experiments/long_context.py): the points of ``cfg.experiment``."""
    from lab.bench.schema import experiment_spec

    spec = experiment_spec(cfg, LongContextSpec)
    return run_and_write([parse_point(p) for p in spec.points], Path(out_dir), engine=spec.engine)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", nargs=2, metavar=("VARIANT", "T"), help="(internal) measure one point and exit")
    ap.add_argument("--out", default="benchmarks/long_context", help="directory for the JSON and markdown")
    ap.add_argument("--render", action="store_true", help="re-render long_context.md from the JSON in --out")
    ap.add_argument("--only", nargs="*", default=None, help="variant:T points to run (default: all)")
    ap.add_argument("--engine", type=int, metavar="T", help="(internal) measure the engine point and exit")
    ap.add_argument("--engine-only", action="store_true",
                    help="run only the engine point; keep the prefill points already in --out's JSON")
    ap.add_argument("--parts", nargs="*", default=list(ENGINE_PARTS), choices=ENGINE_PARTS,
                    help="engine parts to run (--engine-only merges them into the engine results already there)")
    args = ap.parse_args(argv)
    if args.point:
        measure_point(args.point[0], int(args.point[1]))
        return 0
    if args.engine:
        measure_engine(args.engine, tuple(args.parts))
        return 0
    path = Path(args.out) / "long_context.json"
    if args.render or args.engine_only:
        new = run_engine_point(ENGINE["T"], ENGINE["box_s"], tuple(args.parts)) if args.engine_only else {}
        data = json.loads(path.read_text())  # read after the run: another run may have written meanwhile
        write(Path(args.out), data["points"], {**data.get("engine", {}), **new} or None)
        return 0
    run_and_write([p for p in POINTS if args.only is None or f"{p[0]}:{p[1]}" in args.only], Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
