"""Where the engine's decode step spends its time: a per-op profile from XLA's own trace, grouped by component.

The engine's compiled decode step (``engine.decode_step.decode_step`` with the integrity hooks, pool donated, as
``engine.workers.DecodeWorker`` builds it) and the tracker's separate jitted tag check are run under
``jax.profiler``; every executed XLA op (a thunk of the CPU runtime, or a fused kernel) is attributed to a component
by the name scope its HLO instruction carries (``jax.named_scope`` in ``cache.attend``, ``model.moe`` and
``engine.decode_step``):

==================  ============================================================================================
component           ops
==================  ============================================================================================
attention           scope ``attention`` (the paged attention kernel or its reference)
MoE dispatch        scope ``moe_dispatch`` (routing and the routed experts; the shared expert is a dense projection)
dense projections   other dot products (q/kv/o projections, absorbed MLA products, dense MLP, shared expert, lm head)
sampling            scope ``sampling``
page writes         scope ``page_write`` (the new token's KV scattered into the pool)
integrity           scope ``integrity`` in the step (masks, finite guard) plus the separate tag-check launch
rest                every other op (norms, rope, embeddings, residuals, copies)
==================  ============================================================================================

An op without a component scope (a relayout copy of a weight, say) is counted with the component of its users.
Control-flow ops (``while``, ``conditional``, ``call``) are not counted themselves: their trace events span the ops
of their bodies, which are counted one by one (counting both would count a loop's body twice, as the profiles
committed before 2026-12-02 did for the MoE dispatch's expert loop). ``--top N`` also lists the N ops that took the
most time, by component, name scope and HLO result shape.
Component times are op time summed over XLA's worker threads (ops of one step run on several threads at once, so
they can add up to more than the step's wall time, which is reported beside them). Each row: a model, a batch
size, a fixed real context (``context`` tokens per row), a pool of ``pool_factor`` x the pages the batch needs
(plus the null page). Times are medians over ``steps`` profiled steps, in ms per step.
:func:`pool_growth` times the step at a pool 1x and 100x the batch's pages at the same context (interleaved).

    python -m lab.bench.profile_decode --out benchmarks/engine/profile_before
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from omegaconf import OmegaConf

from lab.bench.measure import environment
from lab.markdown import fmt
from phaseserve.cache.integrity import IntegrityTracker, check_tags
from phaseserve.cache.paged import as_stored, init_pool
from phaseserve.config import ModelConfig
from phaseserve.config_hydra import repo_path
from phaseserve.engine.decode_step import DecodeBatch, decode_step
from phaseserve.model.attention_mla import with_head_major_kv_b
from phaseserve.model.params import init_params, param_count

MODELS = {"default": "configs/model/default_random.yaml", "dsv3-15m": "configs/model/dsv3_15m.yaml",
          "race": "configs/model/race_tiny.yaml", "race-mla512": "configs/model/race_mla512.yaml"}
COMPONENTS = ["attention", "MoE dispatch", "dense projections", "sampling", "page writes", "integrity", "rest"]
SCOPES = {"attention": "attention", "moe_dispatch": "MoE dispatch", "sampling": "sampling",
          "page_write": "page writes", "integrity": "integrity"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"%([\w.\-]+)")


def model_config(name: str) -> ModelConfig:
    """The model shape of ``MODELS[name]`` (a Hydra model config's ``hf`` block)."""
    return ModelConfig.from_hf_config(OmegaConf.to_container(OmegaConf.load(repo_path(MODELS[name])).hf))


def classify_hlo(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> component (see the module table), from its op_name metadata and opcode. An
    instruction without a component scope (e.g. a relayout copy of a weight) takes the scope of its users."""
    out, scoped, unscoped = {}, {}, {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.groups()
        op = _OP_NAME.search(rest)
        scopes = op.group(1).split("/") if op else []
        comp = next((SCOPES[s] for s in scopes if s in SCOPES), None)
        if comp is not None:
            scoped[name] = (comp, rest)
        else:
            is_dot = " dot(" in rest or "convolution(" in rest or bool(op and op.group(1).endswith("dot_general"))
            unscoped[name] = ("dense projections" if is_dot else "rest", rest)
    used_by: dict[str, set[str]] = defaultdict(set)
    for name, (comp, rest) in scoped.items():
        out[name] = comp
        for operand in _OPERAND.findall(rest):
            used_by[operand].add(comp)
    for name, (comp, _) in unscoped.items():
        users = used_by.get(name, set())
        out[name] = next(iter(users)) if len(users) == 1 else comp
    return out


CONTAINERS = ("while", "conditional", "call")
_CONTAINER = re.compile(r"\s(?:" + "|".join(CONTAINERS) + r")\(%")  # the opcode, then its first operand


def containers(hlo_text: str) -> set[str]:
    """Names of the control-flow instructions (:data:`CONTAINERS`) of an HLO module: their trace events contain
    their bodies' ops."""
    out = set()
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m and _CONTAINER.search(m.group(2)):
            out.add(m.group(1))
    return out


def describe_hlo(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> ``"<last name scope> <result shape>"`` (how ``--top`` names an op)."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            name, rest = m.groups()
            op = _OP_NAME.search(rest)
            scope = op.group(1).split("/")[-1] if op else ""
            out[name] = f"{scope} {rest.split(' ')[0]}".strip()
    return out


def _op_times(trace_dir: str) -> dict[str, float]:
    """Total ns per executed op name over the XLA worker threads of one trace (every op, containers included)."""
    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(path)
    totals: dict[str, float] = defaultdict(float)
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            for ev in line.events:
                if ev.duration_ns > 0 and not ev.name.startswith(("Threadpool", "ThunkExecutor", "end:")):
                    totals[ev.name] += ev.duration_ns
    return totals


def random_pool(cfg: ModelConfig, num_pages: int, page_size: int, kv_dtype: str, key: jax.Array) -> Any:
    """A page pool filled with random values (never zeros): N(0, 0.25), plus one on FP8 scales (kept positive)."""
    pool = init_pool(cfg, num_pages, page_size, kv_dtype)
    leaves, tree = jax.tree.flatten(pool)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [as_stored(jax.random.normal(k, x.shape) * 0.5
                                               + (1.0 if x.ndim <= 3 and kv_dtype.startswith("float8") else 0.0),
                                               x.dtype) for k, x in zip(keys, leaves, strict=True)])


def setup(cfg: ModelConfig, batch: int, *, context: int = 160, page_size: int = 16, pool_factor: int = 1,
          kv_dtype: str = "float32", seed: int = 0) -> dict[str, Any]:
    """Params (MLA's kv_b laid out per head, as a decode worker holds them), a random-filled pool and one decode batch
    whose rows each hold ``context`` cached tokens."""
    key = jax.random.key(seed)
    params = with_head_major_kv_b(cfg, init_params(cfg, key, "float32"))
    per_row = -(-(context + 1) // page_size)
    num_pages = 1 + batch * per_row * pool_factor
    pool = random_pool(cfg, num_pages, page_size, kv_dtype, jax.random.fold_in(key, 1))
    rng = np.random.default_rng(seed)
    pages = rng.permutation(np.arange(1, num_pages))[: batch * per_row].reshape(batch, per_row).astype(np.int32)
    b = DecodeBatch(tokens=rng.integers(0, cfg.vocab_size, batch).astype(np.int32),
                    positions=np.full(batch, context, np.int32), page_table=pages, active=np.ones(batch, bool),
                    temperature=np.zeros(batch, np.float32), top_k=np.zeros(batch, np.int32),
                    top_p=np.ones(batch, np.float32), seeds=np.arange(batch, dtype=np.uint32),
                    steps=np.zeros(batch, np.int32), want_logprobs=np.zeros(batch, bool))
    tags = jnp.asarray(rng.integers(1, 2**31, num_pages).astype(np.uint32))
    expected = np.asarray(tags)[pages]
    return {"params": params, "pool": pool, "batch": b, "tags": tags, "expected": expected,
            "live": np.full(batch, per_row, np.int32), "num_pages": num_pages}


def compiled_step(cfg: ModelConfig):
    """The engine's decode step as the decode worker jits it (integrity hooks on, pool donated)."""
    return jax.jit(lambda p, pool, b, ok: decode_step(p, cfg, pool, b, ok, tracker=IntegrityTracker),
                   donate_argnums=(1,))


def op_profile(run, hlos: list[tuple[str, str | None]], *, steps: int, top: int = 0) -> dict[str, Any]:
    """ms per step by component (median over ``steps`` traced calls of ``run()``, which runs one step and blocks)
    for the compiled modules ``hlos``: ``(HLO text, component)`` where a component (e.g. "integrity" for the tag
    check's own launch) takes every op of that module, None classifies its ops by name scope (:func:`classify_hlo`).
    Control-flow ops are skipped (their bodies are counted). With ``top`` > 0 also ``"top ops"``: the ``top``
    largest ops by mean ms per step, as ``[component, description, ms]``."""
    names: dict[str, str] = {}
    skip: set[str] = set()
    described: dict[str, str] = {}
    for text, forced in sorted(hlos, key=lambda h: h[1] is not None):  # a forced module's op names win a clash
        classified = classify_hlo(text)
        names.update({op: forced or comp for op, comp in classified.items()})
        skip |= containers(text)
        described.update(describe_hlo(text))
    by_op: dict[tuple[str, str], float] = defaultdict(float)
    per_step: list[dict[str, float]] = []
    for _ in range(steps):
        d = tempfile.mkdtemp()
        jax.profiler.start_trace(d)
        wall = run()
        jax.profiler.stop_trace()
        comp = dict.fromkeys(COMPONENTS, 0.0)
        for op, ns in _op_times(d).items():
            if op in skip:
                continue
            c = names.get(op, "rest")
            comp[c] += ns / 1e6
            by_op[(c, described.get(op, op))] += ns / 1e6 / steps
        comp["op time"] = sum(comp.values())
        comp["wall"] = wall
        per_step.append(comp)
    out: dict[str, Any] = {k: float(np.median([p[k] for p in per_step])) for k in [*COMPONENTS, "op time", "wall"]}
    if top:
        out["top ops"] = [[c, desc, ms] for (c, desc), ms in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]]
    return out


def profile_point(cfg: ModelConfig, batch: int, *, steps: int = 5, top: int = 0, **kw) -> dict[str, Any]:
    """ms per decode step by component (:func:`op_profile`) for one batch size, the tag check's launch included."""
    s = setup(cfg, batch, **kw)
    step, check = compiled_step(cfg), jax.jit(check_tags)
    args = (s["tags"], s["batch"].page_table, s["expected"], s["live"])
    ok = check(*args)
    state = {"pool": s["pool"]}
    hlos = [(check.lower(*args).compile().as_text(), "integrity"),
            (step.lower(s["params"], state["pool"], s["batch"], ok).compile().as_text(), None)]

    def run() -> float:
        t0 = time.perf_counter()
        ok = check(*args)
        nxt, state["pool"], _ = step(s["params"], state["pool"], s["batch"], ok)
        nxt.block_until_ready()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(2):  # warm
        run()
    return op_profile(run, hlos, steps=steps, top=top)


def pool_growth(cfg: ModelConfig, batch: int, *, factor: int = 100, repeats: int = 7, **kw) -> dict[str, Any]:
    """Decode step ms (median, range) with the pool 1x and ``factor``x the batch's pages, same real context;
    the two pools' steps interleaved."""
    arms = {}
    for f in (1, factor):
        s = setup(cfg, batch, pool_factor=f, **kw)
        step = compiled_step(cfg)
        ok = jnp.ones(batch, bool)
        pool = s["pool"]
        for _ in range(2):
            nxt, pool, _ = step(s["params"], pool, s["batch"], ok)
            nxt.block_until_ready()
        arms[f] = [s, step, pool, ok, []]
    for _ in range(repeats):
        for arm in arms.values():
            s, step, pool, ok, times = arm
            t0 = time.perf_counter()
            nxt, arm[2], _ = step(s["params"], pool, s["batch"], ok)
            nxt.block_until_ready()
            times.append((time.perf_counter() - t0) * 1e3)
    out = {f"{f}x": {"pages": arm[0]["num_pages"], "median_ms": float(np.median(arm[4])),
                     "min_ms": float(np.min(arm[4])), "max_ms": float(np.max(arm[4]))} for f, arm in arms.items()}
    out["ratio"] = out[f"{factor}x"]["median_ms"] / out["1x"]["median_ms"]
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Decode step profile: {result['label']}", "",
             "ms per step (median of the profiled steps) by component: op time summed over XLA's threads, from XLA's "
             "per-op trace on this machine; `wall` is the step's wall time "
             "(`python -m lab.bench.profile_decode`; grouping rules in the module docstring). "
             f"Context {result['context']} tokens per row, float32 weights, {result['kv']} KV, pool sized to the "
             "batch. "
             f"Load average at start {result['environment']['load_average_1m_5m_15m']} on "
             f"{result['environment']['cpu_cores']} cores.", ""]
    header = ["model", "batch", *COMPONENTS, "op time", "wall"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in result["rows"]:
        lines.append("| " + " | ".join([r["model"], str(r["batch"]), *(fmt(r["ms"][c], 2) for c in
                                                                      [*COMPONENTS, "op time", "wall"])]) + " |")
    for r in result["rows"]:
        if r.get("top_ops"):
            lines += ["", f"### Top ops: {r['model']}, batch {r['batch']}", "",
                      "ms per step (mean over the profiled steps, op time summed over threads) of each op, grouped by "
                      "component, the op's last name scope and its HLO result shape (the same op of every layer "
                      "summed).", "", "| component | op (name scope, result shape) | ms |", "|---|---|---|"]
            lines += [f"| {c} | `{desc}` | {fmt(ms, 2)} |" for c, desc, ms in r["top_ops"]]
    if result.get("pool_growth"):
        lines += ["", "## Pool growth at a fixed real context", "",
                  "| model | batch | pages 1x | ms 1x [range] | pages 100x | ms 100x [range] | ratio |",
                  "|---|---|---|---|---|---|---|"]
        for g in result["pool_growth"]:
            a, b = g["1x"], g["100x"]
            lines.append(f"| {g['model']} | {g['batch']} | {a['pages']} | {fmt(a['median_ms'], 2)} "
                         f"[{fmt(a['min_ms'], 2)}, {fmt(a['max_ms'], 2)}] | {b['pages']} | {fmt(b['median_ms'], 2)} "
                         f"[{fmt(b['min_ms'], 2)}, {fmt(b['max_ms'], 2)}] | {fmt(g['ratio'], 2)} |")
    return "\n".join(lines) + "\n"


def compare(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Markdown: each (model, batch[, chunk]) row of two profiles side by side, ms per step ``before -> after``
    (decode profiles, or prefill ones from ``profile_prefill``, whose rows also carry ``chunk``)."""
    point = ["batch", "chunk"] if "chunk" in after["rows"][0] else ["batch"]
    b_rows = {(r["model"], *(r[c] for c in point)): r["ms"] for r in before["rows"]}
    keys = [*COMPONENTS, "op time", "wall"]
    step = "Prefill chunk step" if "chunk" in point else "Decode step"
    lines = [f"# {step} profile: {before['label']} -> {after['label']}", "",
             "ms per step by component (op time summed over XLA's threads; `wall` is the step's wall time), "
             "before -> after, from the two committed JSON files; grouping rules in "
             "`lab/bench/profile_decode.py`. Load average at start: before "
             f"{before['environment']['load_average_1m_5m_15m']}, after "
             f"{after['environment']['load_average_1m_5m_15m']} on {after['environment']['cpu_cores']} cores "
             "(a shared machine: absolute times move with the load).",
             "", f"| model | {' | '.join(point)} | " + " | ".join(keys) + " |",
             "|" + "---|" * (len(keys) + 1 + len(point))]
    for r in after["rows"]:
        old = b_rows.get((r["model"], *(r[c] for c in point)))
        if old is None:
            continue
        cells = [f"{fmt(old[k], 2)} -> {fmt(r['ms'][k], 2)}" for k in keys]
        lines.append(f"| {r['model']} | " + " | ".join(str(r[c]) for c in point) + " | " + " | ".join(cells) + " |")
    growth = {g["model"]: g for g in before.get("pool_growth", [])}
    if after.get("pool_growth"):
        lines += ["", f"Pool 100x at a fixed real context ({after['kv']} KV; step ms ratio 100x / 1x, median of the "
                  "interleaved steps):", ""]
        for g in after["pool_growth"]:
            old = growth.get(g["model"])
            lines.append(f"- {g['model']}, batch {g['batch']}: {fmt(old['ratio'], 3) if old else '–'} -> "
                         f"{fmt(g['ratio'], 3)}")
    return "\n".join(lines) + "\n"


def write(out: str | Path, result: dict[str, Any], md: str) -> None:
    """``out``.json (the result) and ``out``.md (its report), folders made as needed."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(md)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                    help="only write --out.md comparing two profile JSON files")
    ap.add_argument("--label", default="")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=5, help="profiled steps per point (and interleaved pool-growth steps)")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--top", type=int, default=0, help="also list the N ops that took the most time per point")
    ap.add_argument("--kv", default="float32", help="KV storage dtype (float32, bfloat16, float8_e4m3fn)")
    ap.add_argument("--pool-growth", action="store_true", help="also time the step with a 100x pool")
    ap.add_argument("--growth-batches", nargs="+", type=int, default=[8], help="batch sizes of --pool-growth")
    ap.add_argument("--growth-only", action="store_true", help="skip the per-op profile (with --pool-growth)")
    a = ap.parse_args(argv)
    if a.compare:
        before, after = (json.loads(Path(f).read_text()) for f in a.compare)
        Path(a.out).with_suffix(".md").write_text(compare(before, after))
        return
    result: dict[str, Any] = {"label": a.label or Path(a.out).name, "context": a.context, "kv": a.kv,
                              "environment": environment(), "rows": [], "pool_growth": []}
    for name in a.models:
        cfg = model_config(name)
        result.setdefault("params", {})[name] = param_count(init_params(cfg, jax.random.key(0)))
        for b in [] if a.growth_only else a.batches:
            ms = profile_point(cfg, b, steps=a.steps, top=a.top, context=a.context, kv_dtype=a.kv)
            row = {"model": name, "batch": b, "ms": ms}
            if a.top:
                row["top_ops"] = ms.pop("top ops")
            result["rows"].append(row)
            print(name, b, {k: round(v, 2) for k, v in ms.items()}, flush=True)
        for b in a.growth_batches if a.pool_growth else []:
            g = pool_growth(cfg, b, repeats=a.steps, context=a.context, kv_dtype=a.kv)
            result["pool_growth"].append({"model": name, "batch": b, **g})
            print(name, "pool growth", b, g, flush=True)
    result["environment_end_load"] = [round(x, 2) for x in __import__("os").getloadavg()]
    write(a.out, result, markdown(result))


if __name__ == "__main__":
    main()
