"""Experiment: the engine against Hugging Face transformers ``generate`` on the same weights, and the engine's host
overhead. Settings in ``configs/experiment/engine.yaml``; entry point ``experiments/engine.py``.

Both sides run in one process on the same checkpoint (a checkpoint directory, or random weights drawn in torch and
saved as one, so both read identical float32 tensors), on the same prompts (held-out text for the shipped model,
random ids otherwise), greedy, ``new_tokens`` per request, ``ignore_eos``. For every batch size and repeat the two
arms run back to back, their order rotated per repeat; each (arm, batch) is warmed up on the same shapes first, and
an engine run during which JAX compiled is discarded and run again (:func:`~lab.bench.measure.compile_free`).

What is timed, per run:

- **phaseserve**: ``engine.generate(requests)`` on one engine whose page pool comes from the ``cache`` config (sized
  for the largest batch, as a server would be) -- tokens/s is output tokens over the call's wall time; TTFT and
  TPOT are the engine's per-request p50s; ``host_fraction`` is the share of the decode part of the loop that is not
  the decode device call (``schedule()``, page tables, integrity bookkeeping, token emission all count).
- **phaseserve, pool sized to the batch**: the same on an engine per batch whose pool holds exactly that batch's
  pages (plus the null page), which shows what the pool's size costs the decode step at each batch.
- **phaseserve, replicas** (``experiment.replicas`` > 1; default 2, with ``mesh.host_devices: 2`` simulated CPU
  devices): :class:`~phaseserve.engine.ReplicatedEngine`, that many data-parallel engines (each with the shared
  arm's cache config) on their own devices, the batch split between them by load -- how the engine uses a second
  core (on XLA:CPU one engine's decode step keeps about one busy), as transformers uses a second torch thread.
- **transformers**: ``model.generate`` of the whole batch (tokens/s); TTFT (prefill plus the first token) and TPOT
  ((last token - first token) / (new_tokens - 1)) from the times that same call streamed each step; torch runs with
  ``experiment.torch_threads`` threads (default null: at each batch, whichever count that batch's thread check
  found faster).

Threads: on a machine whose cores are shared with other work, torch's OpenMP threads wait on each other when a core
is taken, and ``generate`` with as many threads as cores can run several times slower than with one; and which
count is faster depends on the batch (one thread can win at batch 1 and run 2x slower at batch 32). The run
therefore first measures transformers at *every* batch with one thread and with every core (:func:`thread_check`,
alternated, reported), then uses ``experiment.torch_threads``, or at each batch the faster count of that batch's
check (the baseline is given its best setting at every point); the engine uses XLA's default thread pool.

Outputs: ``results.json`` (every record, medians with ranges, paired ratios), ``README.md``, ``tokens_per_s.png``,
``tpot.png``. Greedy agreement is the fraction of generated positions where the two sides chose the same token.
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
from lab.bench.measure import CompileCounter, aggregate, compile_free, environment, paired, rotated, stats
from lab.markdown import fmt
from phaseserve.config_hydra import as_list, hf_dict, repo_path, serve_config, to_container
from phaseserve.engine import Engine, ReplicatedEngine, Request

HF = "transformers"
SHARED, SIZED, REPLICAS = "phaseserve", "phaseserve, pool sized to the batch", "phaseserve, replicas"
ARMS = [SHARED, SIZED, REPLICAS, HF]  # REPLICAS runs where experiment.replicas > 1
METRICS = ["tok_per_s", "ttft_s", "tpot_s", "host_fraction"]


def load_models(cfg: DictConfig, workdir: Path) -> tuple[Any, Any, Any]:
    """``(ModelConfig, params, torch model)`` with identical float32 weights on both sides."""
    import torch
    import transformers as T

    from phaseserve.quant.loader import load_checkpoint

    T.utils.logging.disable_progress_bar()
    m = cfg.model
    if m.get("checkpoint"):
        path = repo_path(m.checkpoint)
    else:
        hf = hf_dict(m)
        torch.manual_seed(int(m.get("seed") or 0))
        conf = T.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
        model = T.AutoModelForCausalLM.from_config(conf).float().eval()
        path = workdir / "checkpoint"
        model.save_pretrained(path)
    model_cfg, params = load_checkpoint(path, "float32")
    torch_model = T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model_cfg, params, torch_model


def prompts(cfg: DictConfig, vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens: held-out text windows for a checkpoint of the shipped tokenizer (its
    logits are not near-tied), random ids otherwise."""
    if cfg.model.get("checkpoint") and vocab == 264:
        from lab.data.corpus import eval_windows

        w = eval_windows("heldout", length, num=n + seed)[seed:, :length]
        return [list(map(int, r)) for r in w]
    return np.random.default_rng(seed).integers(1, vocab, (n, length)).tolist()


def run_engine(engine: Engine | ReplicatedEngine, toks: list[list[int]], new: int, tag: str) -> dict:
    """One timed ``generate`` of the batch (the engine's cap is the batch size)."""
    engine.reset_metrics()
    engine.max_batch = len(toks)
    outs = engine.generate([Request(id=f"{tag}{i}", prompt=p, max_tokens=new, ignore_eos=True)
                            for i, p in enumerate(toks)])
    s = engine.summary()
    return {"tok_per_s": s["output_tok_per_s"], "ttft_s": s["ttft"]["p50"], "tpot_s": s["tpot"]["p50"],
            "host_fraction": s["host_fraction_of_decode"], "decode_steps": s["decode_steps"],
            "tokens": [list(o.tokens) for o in outs]}


class _TokenClock:
    """A transformers streamer that only records when each ``put`` arrives: the prompt first, then one ``[B]``
    tensor of new tokens per step, so the first token's and the last token's times come from the same call."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf(model: Any, toks: list[list[int]], new: int) -> dict:
    """One timed ``generate`` of the whole batch; TTFT (prefill plus the first token) and TPOT come from the times
    at which that same call handed each step's tokens to a streamer (no second call to subtract)."""
    import torch

    ids = torch.tensor(toks)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    clock = _TokenClock()
    with torch.no_grad():
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, streamer=clock, **kw)
        whole = time.perf_counter() - t
    gen = out[:, ids.shape[1]:].tolist()
    steps = clock.times[1:]  # clock.times[0]: the prompt, handed over before prefill
    if len(steps) != new:
        raise RuntimeError(f"transformers streamed {len(steps)} steps for max_new_tokens={new}")
    return {"tok_per_s": sum(map(len, gen)) / whole, "ttft_s": steps[0] - t,
            "tpot_s": (steps[-1] - steps[0]) / (new - 1) if new > 1 else None, "host_fraction": None,
            "tokens": gen}


def thread_check(model: Any, toks: list[list[int]], new: int, rounds: int = 2) -> dict[int, list[float]]:
    """transformers tokens/s on the batch ``toks`` with one torch thread and with every core, alternated ``rounds``
    times."""
    import torch

    counts = sorted({1, os.cpu_count() or 1})
    out: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(rounds):
        for n in counts:
            torch.set_num_threads(n)
            run_hf(model, toks, new)  # warm at this thread count
            out[n].append(run_hf(model, toks, new)["tok_per_s"])
    return out


def fastest_threads(check: dict[int, list[float]]) -> int:
    """The thread count with the highest median tokens/s in a :func:`thread_check`."""
    return max(check, key=lambda n: float(np.median(check[n])))


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    return float(np.mean([x == y for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]))


def run(cfg: DictConfig, out_dir: str | Path, log=print) -> dict:
    """The sweep (batches x repeats x rotated arms); writes the outputs into ``out_dir`` and returns the results."""
    import torch

    spec, out_dir = cfg.experiment, Path(out_dir)
    env = environment()
    batches = [int(b) for b in as_list(spec.batches)]
    plen, new, repeats = int(spec.prompt_len), int(spec.new_tokens), int(spec.repeats)
    CompileCounter.install()
    with tempfile.TemporaryDirectory() as d:
        model_cfg, params, hf = load_models(cfg, Path(d))
    serve = serve_config(cfg, model_cfg)
    shared = Engine(model_cfg, params, serve)
    per_req = -(-(plen + new) // serve.cache.page_size)
    engines = {(SHARED, b): shared for b in batches} | {
        (SIZED, b): Engine(model_cfg, params, dataclasses.replace(
            serve, max_batch=b, cache=dataclasses.replace(serve.cache, num_pages=b * per_req + 1,
                                                          kv_budget_bytes=None))) for b in batches}
    n_rep = int(spec.get("replicas") or 1)
    if n_rep > 1:
        replicas = ReplicatedEngine(model_cfg, params, serve, replicas=n_rep)
        engines |= {(REPLICAS, b): replicas for b in batches}
    engine_arms = [SHARED, SIZED] + ([REPLICAS] if n_rep > 1 else [])
    arms = [*engine_arms, HF]
    data = {b: prompts(cfg, model_cfg.vocab_size, b, plen, seed=b) for b in batches}
    checks = {b: thread_check(hf, data[b], new) for b in batches}
    hf_threads = {b: int(spec.torch_threads or fastest_threads(checks[b])) for b in batches}
    for b in batches:  # warm-up: every shape of every timed run, every arm
        for arm in engine_arms:
            run_engine(engines[(arm, b)], data[b], new, f"warm{b}-")
        torch.set_num_threads(hf_threads[b])
        run_hf(hf, data[b], new)
    records, tokens = [], {}
    for rep in range(repeats):
        for j, b in enumerate(batches):
            for order, arm in enumerate(rotated(arms, rep + j)):
                if arm == HF:
                    torch.set_num_threads(hf_threads[b])
                    rec, reruns = run_hf(hf, data[b], new), 0
                else:
                    rec, reruns = compile_free(lambda e=engines[(arm, b)], b=b, rep=rep: run_engine(
                        e, data[b], new, f"r{rep}b{b}-"), f"{arm} @ batch {b}, repeat {rep}")
                tokens[(arm, b)] = rec.pop("tokens")
                rec.update(arm=arm, point=b, repeat=rep, order=order, reruns=reruns,
                           load_1m=round(os.getloadavg()[0], 2))
                records.append(rec)
                log(f"repeat {rep + 1}/{repeats} batch {b} {arm}: {rec['tok_per_s']:.1f} tok/s")
    env["kernels"] = rp.kernel_rows(*engines.values())
    agg = aggregate(records, METRICS)
    ratio = {arm: paired(records, arm, HF, "tok_per_s") for arm in engine_arms}
    agree = {b: agreement(tokens[(SHARED, b)], tokens[(HF, b)]) for b in batches}
    agree_rep = {b: agreement(tokens[(REPLICAS, b)], tokens[(HF, b)]) for b in batches} if n_rep > 1 else {}
    over_one = paired(records, REPLICAS, SHARED, "tok_per_s") if n_rep > 1 else {}
    threads = {str(b): n for b, n in hf_threads.items()}
    results = {"experiment": "engine", "environment": env | {"torch": torch.__version__, "torch_threads": threads},
               "settings": {"model": to_container(cfg.model), "quant": to_container(cfg.quant), "batches": batches,
                            "prompt_len": plen, "new_tokens": new, "repeats": repeats, "arms": arms,
                            "replicas": n_rep,
                            "pool_pages": shared.num_pages, "sized_pool_pages": {b: b * per_req + 1 for b in batches},
                            "num_params": int(sum(np.size(x) for x in _leaves(params)))},
               "thread_check": {str(b): {str(n): stats(v) for n, v in c.items()} for b, c in checks.items()},
               "records": records, "aggregate": agg, "ratio_tok_per_s": ratio, "greedy_agreement": agree,
               "greedy_agreement_replicas": agree_rep, "ratio_replicas_over_one_engine": over_one,
               "headline": headline(agg, ratio, agree, batches)}
    plots = _plots(out_dir, agg, batches, arms)
    rp.write_outputs(out_dir, cfg, results, _markdown(results, plots))
    return results


def _leaves(params: Any) -> list:
    import jax

    return jax.tree.leaves(params)


def headline(agg: dict, ratio: dict, agree: dict, batches: list[int]) -> dict:
    """Per batch: the paired tokens/s ratios of the engine arms over transformers (median, min, max; the replicas'
    where that arm ran), the shared engine's host fraction median and greedy agreement."""
    keep = ("median", "min", "max", "n")
    keys = {"ratio": SHARED, "ratio_sized": SIZED, "ratio_replicas": REPLICAS}
    return {str(b): {key: {k: ratio[arm][b][k] for k in keep} for key, arm in keys.items() if arm in ratio}
            | {"host_fraction": agg[SHARED][b]["host_fraction"]["median"], "agreement": agree[b]} for b in batches}


def verdict_lines(results: dict) -> list[str]:
    """Two or three lines of numbers with ranges: the experiment's last words on the console."""
    h = results["headline"]

    def parts(key: str) -> str:
        return "; ".join(f"batch {b}: {_ratio(x[key])}" for b, x in h.items())

    host = ", ".join(f"{fmt(100 * x['host_fraction'])}% at batch {b}" for b, x in h.items())
    agree = ", ".join(f"{fmt(x['agreement'])}" for x in h.values())
    first = next(iter(h.values()))
    reps = (f"; {results['settings']['replicas']} data-parallel replicas: {parts('ratio_replicas')}"
            if "ratio_replicas" in first else "")
    return [f"phaseserve / transformers generate tokens/s (median [range] of {first['ratio']['n']} paired repeats): "
            f"{parts('ratio')}; with the pool sized to the batch: {parts('ratio_sized')}{reps}",
            f"engine host overhead (schedule() included) as a share of the decode loop: {host}",
            f"greedy token agreement per batch: {agree}"]


def _plots(out_dir: Path, agg: dict, batches: list[int], arms: list[str]) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rp.line_plot(out_dir / "tokens_per_s.png", rp.metric_series(agg, "tok_per_s", arms, batches),
                 xlabel="batch (concurrent requests)", ylabel="output tokens/s",
                 title="phaseserve vs transformers generate (same weights, one process)")
    tpot = {a: (xs, [None if y is None else 1e3 * y for y in ys], [None if y is None else 1e3 * y for y in lo],
                [None if y is None else 1e3 * y for y in hi])
            for a, (xs, ys, lo, hi) in rp.metric_series(agg, "tpot_s", arms, batches).items()}
    rp.line_plot(out_dir / "tpot.png", tpot, xlabel="batch (concurrent requests)", ylabel="TPOT p50 (ms)",
                 title="time per output token")
    return ["tokens_per_s.png", "tpot.png"]


def _markdown(res: dict, plots: list[str]) -> str:
    s, agg, env = res["settings"], res["aggregate"], res["environment"]
    rows = []
    for b in s["batches"]:
        e, z, h = agg[SHARED][b], agg[SIZED][b], agg[HF][b]
        r, rz = res["ratio_tok_per_s"][SHARED][b], res["ratio_tok_per_s"][SIZED][b]
        rows.append([b, rp.spread(e["tok_per_s"]), rp.spread(z["tok_per_s"]), rp.spread(h["tok_per_s"]),
                     _ratio(r), _ratio(rz),
                     rp.spread(_ms(e["ttft_s"])), rp.spread(_ms(h["ttft_s"])), rp.spread(_ms(e["tpot_s"])),
                     rp.spread(_ms(z["tpot_s"])), rp.spread(_ms(h["tpot_s"])), rp.spread(_pc(e["host_fraction"])),
                     res["greedy_agreement"][b], env["torch_threads"][str(b)]])
    rep_rows = [[b, rp.spread(agg[REPLICAS][b]["tok_per_s"]), _ratio(res["ratio_tok_per_s"][REPLICAS][b]),
                 _ratio(res["ratio_replicas_over_one_engine"][b]),
                 rp.spread(_ms(agg[REPLICAS][b]["ttft_s"])), rp.spread(_ms(agg[REPLICAS][b]["tpot_s"])),
                 rp.spread(_pc(agg[REPLICAS][b]["host_fraction"])), res["greedy_agreement_replicas"][b]]
                for b in s["batches"]] if REPLICAS in res["ratio_tok_per_s"] else []
    replicas = [] if not rep_rows else [
        f"Data-parallel replicas: `ReplicatedEngine` with {s['replicas']} engines, one per device "
        f"({len(env.get('devices', []))} in this process), each with the `phaseserve` arm's cache config and the "
        "batch split between them by load (at batch 1 one replica serves alone); ratios paired within a repeat with "
        "transformers and with the `phaseserve` arm (one engine, one device); host %: the mean over the replicas "
        "that served requests.", "",
        rp.markdown_table(["batch", "replicas tok/s", "ratio (paired)", "over one engine (paired)", "TTFT ms",
                           "TPOT ms", "host % of decode loop", "greedy agreement"], rep_rows), ""]
    spread_note = ("a band is drawn where there are two or more repeats (min to max)" if s["repeats"] > 1
                   else "one repeat: no band")
    return "\n".join([
        "# Engine against transformers generate (CPU)", "",
        *[f"- {line}" for line in verdict_lines(res)], "",
        f"Model: `{s['model'].get('name')}` ({s['num_params']:,} parameters), float32 weights on both sides; engine "
        f"representations {s['quant']}; prompts of {s['prompt_len']} tokens, {s['new_tokens']} new tokens, greedy, "
        f"`ignore_eos`; {s['repeats']} repeats, arms interleaved with the order rotated; medians with [min, max]. "
        f"transformers runs with the torch thread count of the `transformers threads` column (torch {env['torch']}); "
        "each side warmed up on the same shapes before timing; engine runs with a JIT compile inside the timed window "
        "are rerun.", "",
        "Thread check (transformers at each batch, same prompts and length, alternated; tokens/s median [range]): "
        + "; ".join(f"batch {b}: " + ", ".join(f"{n} thread(s) {rp.spread(st)}" for n, st in c.items())
                    for b, c in res["thread_check"].items())
        + f". Load average at start: {env.get('load_average_1m_5m_15m')} on {env.get('cpu_cores')} cores.", "",
        rp.markdown_table(["batch", "phaseserve tok/s", "sized pool tok/s", "transformers tok/s", "ratio (paired)",
                           "sized pool ratio", "phaseserve TTFT ms", "transformers TTFT ms", "phaseserve TPOT ms",
                           "sized pool TPOT ms", "transformers TPOT ms", "engine host % of decode loop",
                           "greedy agreement", "transformers threads"], rows), "",
        *replicas,
        f"Pools: `phaseserve` has {s['pool_pages']} pages (the `cache` config, for the largest batch); the sized "
        f"pool has exactly each batch's pages plus the null page ({s['sized_pool_pages']} by batch). Ratios are "
        "each engine arm's tokens/s over transformers', paired within a repeat.", "",
        "Timed: phaseserve `engine.generate` of the batch (TTFT/TPOT: per-request p50s from `engine.summary()`); "
        "transformers `generate` of the batch (TTFT and TPOT from the times the same call streamed each step: "
        "first token; last minus first over `new_tokens - 1`). Host %: decode-loop wall time minus the decode device "
        "call, over the decode-loop wall time (scheduling included).", "",
        *[f"![{p}]({p})" for p in plots], "", f"Plots: median per batch; {spread_note}.", "",
        rp.environment_section(env),
    ])


def _ratio(r: dict) -> str:
    return f"{fmt(r['median'])}x [{fmt(r['min'])}, {fmt(r['max'])}]"


def _ms(st: dict) -> dict:
    return {k: (v * 1e3 if k in ("median", "min", "max") and v is not None else v) for k, v in st.items()}


def _pc(st: dict) -> dict:
    return {k: (v * 1e2 if k in ("median", "min", "max") and v is not None else v) for k, v in st.items()}
