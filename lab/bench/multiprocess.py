"""Experiment: disaggregated serving on Ray against the single-process engine, and the KV bytes on the wire.
Settings in ``configs/experiment/multiprocess.yaml``; entry point ``experiments/multiprocess.py``.

1. Throughput at the same concurrency: ``ps.Engine`` (disaggregated mode, one process) against
   :class:`~phaseserve.distributed.RayEngine` -- the same engine and scheduler, its prefill and decode workers in two
   Ray actors (each its own process and devices; KV pulled over ``jax.experimental.transfer``, control through
   Ray calls). Same weights (the actors build them from the same :class:`~phaseserve.distributed.ModelSource`), same
   ``ServeConfig``, same requests. Both arms are warmed up on a batch of the same shapes, then run back to back per
   repeat with the order rotated; tokens/s is output tokens over the wall time of ``generate`` (prompt to last
   token). Greedy tokens of the two arms are compared.
2. Bytes per prompt token on the wire for each KV dtype of ``experiment.wire_kv``: what the decode actor pulled
   (whole pages, so a partly filled last page counts), per prompt token, beside ``kv_bytes_per_token`` and the
   in-process handoff's count.

On a CPU the actors share the same cores with the engine's process, and every step waits for its actor call, so
(1) measures the cost of the split (a Ray call per prefill batch and decode step, the transfer), not the gain of
dedicated devices per phase.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from lab.bench import report as rp
from lab.bench.measure import aggregate, environment, paired, rotated
from lab.markdown import fmt
from phaseserve.cache.paged import kv_bytes_per_token
from phaseserve.config import canonical_dtype
from phaseserve.config_hydra import as_list, serve_config, to_container
from phaseserve.engine import Engine, Request

ARMS = ["one process", "Ray actors"]
WIRE_LENGTHS = [5, 16, 27, 32, 40]  # a partly filled last page, exact pages (page size 16)


def requests(tag: str, n: int, prompt: int, new: int, vocab: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [Request(id=f"{tag}{i}", prompt=rng.integers(1, vocab, prompt).tolist(), max_tokens=new, ignore_eos=True)
            for i in range(n)]


def _timed(generate, reqs: list[Request]) -> tuple[dict, dict]:
    t = time.perf_counter()
    outs = generate(reqs)
    dt = time.perf_counter() - t
    bad = [(o.id, o.finish_reason, o.error) for o in outs if o.finish_reason != "length"]
    if bad:
        raise RuntimeError(f"requests did not finish normally: {bad[:3]}")
    return {"tok_per_s": sum(len(o.tokens) for o in outs) / dt, "wall_s": dt}, {o.id: list(o.tokens) for o in outs}


def run(cfg: DictConfig, out_dir: str | Path, log=print) -> dict:
    from phaseserve.distributed import ModelSource, RayEngine, RayOptions

    spec, out_dir = cfg.experiment, Path(out_dir)
    env = environment()
    mspec = ModelSource.from_hydra(cfg)
    model_cfg, params = mspec.load()
    concs = [int(c) for c in as_list(spec.concurrency)]
    base = dataclasses.replace(serve_config(cfg, model_cfg), max_batch=max(concs))
    prompt, new, repeats = int(spec.prompt_len), int(spec.new_tokens), int(spec.repeats)
    options = RayOptions.from_dict(spec.get("ray"))
    options.compilation_cache_dir = options.compilation_cache_dir or tempfile.mkdtemp(prefix="ps_jax_cache_")
    options.transfer_timeout_s = float(spec.transfer_timeout_s)

    records, agree, transfer = [], {}, {}
    engine = Engine(model_cfg, params, base)
    remote = RayEngine(mspec, base, options)
    try:
        gen = {"one process": engine.generate, "Ray actors": remote.generate}
        for c in concs:
            engine.max_batch = remote.max_batch = c
            warm = requests("w", c, prompt, new, model_cfg.vocab_size, seed=c)
            for arm in ARMS:
                gen[arm](warm)
            before = remote.decode.snapshot()
            toks: dict[str, dict] = {}
            for rep in range(repeats):
                reqs = requests(f"q{c}-{rep}-", c, prompt, new, model_cfg.vocab_size, seed=100 * (rep + 1) + c)
                for order, arm in enumerate(rotated(ARMS, rep)):
                    rec, toks[arm] = _timed(gen[arm], reqs)
                    rec.update(arm=arm, point=c, repeat=rep, order=order, load_1m=round(os.getloadavg()[0], 2))
                    records.append(rec)
                    log(f"concurrency {c} repeat {rep + 1}/{repeats} {arm}: {rec['tok_per_s']:.1f} tok/s")
                agree.setdefault(c, []).append(float(np.mean([np.mean(np.equal(toks[ARMS[0]][k], toks[ARMS[1]][k]))
                                                              for k in toks[ARMS[0]]])))
            after = remote.decode.snapshot()
            n = after.get("transfers", 0) - before.get("transfers", 0)
            transfer[c] = {"transfers": n, "mean_s": (after.get("seconds", 0) - before.get("seconds", 0)) / max(n, 1)}
    finally:
        remote.close()
    env["kernels"] = rp.kernel_rows(engine)  # the timed in-process engine's (the actors trace in their processes)
    wire = [wire_bytes(mspec, model_cfg, params, base, options, canonical_dtype(str(kv)))
            for kv in as_list(spec.wire_kv)]
    agg = aggregate(records, ["tok_per_s", "wall_s"])
    ratio = paired(records, "Ray actors", "one process", "tok_per_s")
    results = {"experiment": "multiprocess", "environment": env,
               "settings": {"model": to_container(cfg.model), "quant": to_container(cfg.quant),
                            "concurrency": concs, "prompt_len": prompt, "new_tokens": new, "repeats": repeats,
                            "wire_lengths": WIRE_LENGTHS, "page_size": base.cache.page_size},
               "records": records, "aggregate": agg, "ratio_tok_per_s": ratio, "greedy_agreement": agree,
               "transfer": transfer, "wire": wire}
    plots = _plots(out_dir, agg, ratio, concs)
    rp.write_outputs(out_dir, cfg, results, _markdown(results, plots))
    return results


def wire_bytes(mspec: Any, model_cfg: Any, params: Any, base: Any, options: Any, kv: str) -> dict:
    """Bytes the decode actor pulled per prompt token for prompts of :data:`WIRE_LENGTHS` tokens in ``kv``."""
    from phaseserve.distributed import RayEngine

    serve = dataclasses.replace(base, max_batch=len(WIRE_LENGTHS), quant=dataclasses.replace(base.quant, kv_dtype=kv))
    reqs = [Request(id=f"b{i}", prompt=list(range(1, n + 1)), max_tokens=2, ignore_eos=True)
            for i, n in enumerate(WIRE_LENGTHS)]
    remote = RayEngine(mspec, serve, options)
    try:
        remote.generate(reqs)
        pulled = remote.handoff.bytes_moved
    finally:
        remote.close()
    engine = Engine(model_cfg, params, serve)
    engine.generate(reqs)
    n = sum(WIRE_LENGTHS)
    return {"kv": kv, "wire_bytes_per_prompt_token": pulled / n,
            "kv_bytes_per_token": kv_bytes_per_token(model_cfg, kv),
            "handoff_bytes_per_prompt_token": engine.handoff.bytes_moved / n}


def verdict_lines(results: dict) -> list[str]:
    """Two or three lines of numbers with ranges: the experiment's last words on the console."""
    r, wire = results["ratio_tok_per_s"], results["wire"]
    parts = [f"concurrency {c}: {fmt(x['median'])}x [{fmt(x['min'])}, {fmt(x['max'])}]" for c, x in r.items()]
    lines = [f"Ray actors / one process tokens/s (median [range] of {results['settings']['repeats']} paired "
             f"repeats): " + "; ".join(parts),
             "greedy agreement between the arms: " + ", ".join(
                 f"{fmt(min(v))}" + (f"..{fmt(max(v))}" if max(v) != min(v) else "")
                 for v in results["greedy_agreement"].values())]
    if len(wire) >= 2:
        lines.append("wire bytes per prompt token: " + ", ".join(
            f"{w['kv']} {fmt(w['wire_bytes_per_prompt_token'])}" for w in wire)
            + f" (ratio {fmt(wire[0]['wire_bytes_per_prompt_token'] / wire[1]['wire_bytes_per_prompt_token'])})")
    return lines


def _plots(out_dir: Path, agg: dict, ratio: dict, concs: list[int]) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rp.line_plot(out_dir / "tokens_per_s.png", rp.metric_series(agg, "tok_per_s", ARMS, concs),
                 xlabel="concurrency", ylabel="output tokens/s", title="one process vs Ray actors (CPU)")
    return ["tokens_per_s.png"]


def _markdown(res: dict, plots: list[str]) -> str:
    s, agg = res["settings"], res["aggregate"]
    rows = [[c, rp.spread(agg[ARMS[0]][c]["tok_per_s"]), rp.spread(agg[ARMS[1]][c]["tok_per_s"]),
             f"{fmt(res['ratio_tok_per_s'][c]['median'])}x [{fmt(res['ratio_tok_per_s'][c]['min'])}, "
             f"{fmt(res['ratio_tok_per_s'][c]['max'])}]", fmt(min(res["greedy_agreement"][c])),
             fmt(res["transfer"][c]["mean_s"])] for c in s["concurrency"]]
    wire = [[w["kv"], w["wire_bytes_per_prompt_token"], w["kv_bytes_per_token"], w["handoff_bytes_per_prompt_token"]]
            for w in res["wire"]]
    band = "bands: min to max over repeats" if s["repeats"] > 1 else "one repeat: no band"
    return "\n".join([
        "# Disaggregated serving on Ray against one process (CPU)", "",
        *[f"- {line}" for line in verdict_lines(res)], "",
        f"Model: `{s['model'].get('name')}`; representations {s['quant']}; prompts of {s['prompt_len']} random "
        f"tokens, {s['new_tokens']} new tokens, greedy; {s['repeats']} repeats per concurrency, arms back to back "
        "with the order rotated, each warmed up on a batch of the same shapes first; medians with [min, max]. "
        "One process: `ps.Engine` in disaggregated mode. Ray actors: `phaseserve.distributed.RayEngine`, the same "
        "engine with its prefill and decode workers in two Ray actors (a local Ray cluster), a Ray call per prefill "
        "batch and decode step, KV over `jax.experimental.transfer` (loopback). On this CPU the actors and the "
        "engine's process share the same cores.", "",
        rp.markdown_table(["concurrency", "one process tok/s", "Ray actors tok/s", "ratio (paired)",
                           "greedy agreement (min)", "mean pull+land s"], rows), "",
        f"Bytes per prompt token (prompts of {s['wire_lengths']} tokens, page size {s['page_size']}): the wire "
        "count covers whole pages (a prompt's last page is padded), as the in-process handoff's does.", "",
        rp.markdown_table(["KV dtype", "wire bytes / prompt token", "kv_bytes_per_token",
                           "in-process handoff bytes / prompt token"], wire), "",
        *[f"![{p}]({p})" for p in plots], "", f"Plot: median per concurrency; {band}.", "",
        rp.environment_section(res["environment"]),
    ])
