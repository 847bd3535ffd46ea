"""Experiment: two-process disaggregated serving against the single-process engine, and the KV bytes on the wire.
Settings in ``configs/experiment/multiprocess.yaml``; entry point ``experiments/multiprocess.py``.

1. Throughput at the same concurrency: ``ps.Engine`` (disaggregated mode, one process) against a prefill server
   process + decode server process + router (``phaseserve.serving``; KV pulled over ``jax.experimental.transfer``).
   Same weights (the servers build them from the same :class:`~phaseserve.serving.ModelSpec`), same
   ``ServeConfig``, same requests. Both arms are warmed up on a batch of the same shapes, then run back to back per
   repeat with the order rotated; tokens/s is output tokens over the wall time of ``generate`` (prompt to last
   token). Greedy tokens of the two arms are compared.
2. Bytes per prompt token on the wire for each KV dtype of ``experiment.wire_kv``: what the decode server pulled
   (whole staging pages, so a partly filled last page counts), per prompt token, beside ``kv_bytes_per_token`` and
   the in-process handoff's count.

On a CPU the processes share the same cores, so (1) measures the cost of the split (control plane, transfer,
polling) and any overlap of prefill and decode between the processes, not the gain of dedicated devices per phase.
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

ARMS = ["one process", "two processes"]
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
    from phaseserve.serving import Router, ServerSpec

    spec, out_dir = cfg.experiment, Path(out_dir)
    env = environment()
    from phaseserve.serving import ModelSpec

    mspec = ModelSpec.from_hydra(cfg)
    model_cfg, params = mspec.load()
    base = serve_config(cfg, model_cfg)
    concs = [int(c) for c in as_list(spec.concurrency)]
    prompt, new, repeats = int(spec.prompt_len), int(spec.new_tokens), int(spec.repeats)
    cache_dir = tempfile.mkdtemp(prefix="ps_jax_cache_")

    def server(serve) -> ServerSpec:
        return ServerSpec(model=mspec, serve=serve, compilation_cache_dir=cache_dir,
                          transfer_timeout_s=float(spec.transfer_timeout_s))

    records, agree, transfer = [], {}, {}
    for c in concs:
        serve = dataclasses.replace(base, max_batch=c)
        engine = Engine(model_cfg, params, serve)
        warm = requests("w", c, prompt, new, model_cfg.vocab_size, seed=c)
        with Router(server(serve), server(serve)) as router:
            gen = {"one process": engine.generate,
                   "two processes": lambda r, rt=router: rt.generate(r, timeout_s=float(spec.timeout_s))}
            for arm in ARMS:
                gen[arm](warm)
            toks: dict[str, dict] = {}
            for rep in range(repeats):
                reqs = requests(f"q{rep}-", c, prompt, new, model_cfg.vocab_size, seed=100 * (rep + 1) + c)
                for order, arm in enumerate(rotated(ARMS, rep)):
                    rec, toks[arm] = _timed(gen[arm], reqs)
                    rec.update(arm=arm, point=c, repeat=rep, order=order, load_1m=round(os.getloadavg()[0], 2))
                    records.append(rec)
                    log(f"concurrency {c} repeat {rep + 1}/{repeats} {arm}: {rec['tok_per_s']:.1f} tok/s")
                agree.setdefault(c, []).append(float(np.mean([np.mean(np.equal(toks[ARMS[0]][k], toks[ARMS[1]][k]))
                                                              for k in toks[ARMS[0]]])))
            dec = router.stats("decode")
            transfer[c] = {"transfers": dec["transfers"], "mean_s": dec["transfer_time"] / max(dec["transfers"], 1)}
    wire = [wire_bytes(cfg, model_cfg, params, base, server, canonical_dtype(str(kv)), float(spec.timeout_s))
            for kv in as_list(spec.wire_kv)]
    agg = aggregate(records, ["tok_per_s", "wall_s"])
    ratio = paired(records, "two processes", "one process", "tok_per_s")
    results = {"experiment": "multiprocess", "environment": env,
               "settings": {"model": to_container(cfg.model), "quant": to_container(cfg.quant),
                            "concurrency": concs, "prompt_len": prompt, "new_tokens": new, "repeats": repeats,
                            "wire_lengths": WIRE_LENGTHS, "page_size": base.cache.page_size},
               "records": records, "aggregate": agg, "ratio_tok_per_s": ratio, "greedy_agreement": agree,
               "transfer": transfer, "wire": wire}
    plots = _plots(out_dir, agg, ratio, concs)
    rp.write_outputs(out_dir, cfg, results, _markdown(results, plots))
    return results


def wire_bytes(cfg: DictConfig, model_cfg: Any, params: Any, base: Any, server, kv: str, timeout_s: float) -> dict:
    """Bytes the decode server pulled per prompt token for prompts of :data:`WIRE_LENGTHS` tokens in ``kv``."""
    from phaseserve.serving import Router

    serve = dataclasses.replace(base, max_batch=len(WIRE_LENGTHS), quant=dataclasses.replace(base.quant, kv_dtype=kv))
    reqs = [Request(id=f"b{i}", prompt=list(range(1, n + 1)), max_tokens=2, ignore_eos=True)
            for i, n in enumerate(WIRE_LENGTHS)]
    with Router(server(serve), server(serve)) as router:
        router.generate(reqs, timeout_s=timeout_s)
        dec = router.stats("decode")
    engine = Engine(model_cfg, params, serve)
    engine.generate(reqs)
    n = sum(WIRE_LENGTHS)
    return {"kv": kv, "wire_bytes_per_prompt_token": dec["bytes_pulled"] / n,
            "valid_kv_tokens": dec["valid_kv_tokens"], "kv_bytes_per_token": kv_bytes_per_token(model_cfg, kv),
            "handoff_bytes_per_prompt_token": engine.handoff.bytes_moved / n}


def verdict_lines(results: dict) -> list[str]:
    """Two or three lines of numbers with ranges: the experiment's last words on the console."""
    r, wire = results["ratio_tok_per_s"], results["wire"]
    parts = [f"concurrency {c}: {fmt(x['median'])}x [{fmt(x['min'])}, {fmt(x['max'])}]" for c, x in r.items()]
    lines = [f"two processes / one process tokens/s (median [range] of {results['settings']['repeats']} paired "
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
                 xlabel="concurrency", ylabel="output tokens/s", title="one process vs two processes (CPU)")
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
        "# Multi-process disaggregated serving (CPU)", "",
        *[f"- {line}" for line in verdict_lines(res)], "",
        f"Model: `{s['model'].get('name')}`; representations {s['quant']}; prompts of {s['prompt_len']} random "
        f"tokens, {s['new_tokens']} new tokens, greedy; {s['repeats']} repeats per concurrency, arms back to back "
        "with the order rotated, each warmed up on a batch of the same shapes first; medians with [min, max]. "
        "One process: `ps.Engine` in disaggregated mode. Two processes: a prefill server and a decode server "
        "process plus the router, KV over `jax.experimental.transfer` (loopback). On this CPU both processes share "
        "the same cores.", "",
        rp.markdown_table(["concurrency", "one process tok/s", "two processes tok/s", "ratio (paired)",
                           "greedy agreement (min)", "mean grant+pull+land s"], rows), "",
        f"Bytes per prompt token (prompts of {s['wire_lengths']} tokens, page size {s['page_size']}): the wire "
        "count covers whole staging pages (a prompt's last page is padded); the in-process handoff moves the "
        "prefill batch's padded arrays.", "",
        rp.markdown_table(["KV dtype", "wire bytes / prompt token", "kv_bytes_per_token",
                           "in-process handoff bytes / prompt token"], wire), "",
        *[f"![{p}]({p})" for p in plots], "", f"Plot: median per concurrency; {band}.", "",
        rp.environment_section(res["environment"]),
    ])
