"""Experiment: quality per representation measured by lm-evaluation-harness through the HTTP server, as a user runs it.
Settings in ``configs/experiment/lm_eval.yaml``; entry point ``experiments/lm_eval.py``.

For each representation (Hydra overrides of ``configs/server.yaml``, e.g. ``quant=bf16`` vs ``quant=fp8_kv`` for the
KV cache, ``quant=fp8`` vs ``quant=int4`` for the weights) the server is started in its own process
(:class:`lab.bench.served.Served`) and lm-eval's ``local-completions`` model runs the project's local tasks
(``lab/eval/tasks``: ``ps_toolcalls``, ``ps_code_ppl``, ``ps_code_mc``) against ``/v1/completions``, with the shipped
Hugging Face tokenizer (``models/default``, ``tokenizer_backend=huggingface``, token-id requests). Two lm-eval
invocations per representation, because lm-eval's ``add_bos_token`` is one setting per model: the generation task
with ``add_bos_token=True`` (the prompt as trained, ``<bos>{request}\\n``), the loglikelihood tasks with
``add_bos_token=False`` (rolling windows already start from the ``<bos>`` prefix token; with it on, ``<bos>`` would be
scored after ``<bos>``; the multiple-choice contexts are mid-file windows, as the training windows are).

The scores and lm-eval's standard errors come from lm-eval's results file; every paired comparison (the same documents
under two representations, from ``--log_samples``) gets a paired bootstrap interval of the difference
(:func:`paired_differences`). The lm-eval executable is ``tools.lm_eval`` from the config: nothing is installed here.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from lab.bench import report as rp
from lab.bench.measure import bootstrap_ci, environment
from lab.bench.schema import experiment_spec
from lab.bench.served import REPO, Served, run_tool

# metric -> (label, higher is better); the first of each task is its headline
METRICS = {"ps_toolcalls": {"exact_match": ("exact match", True), "valid": ("schema-valid", True)},
           "ps_code_ppl": {"bits_per_byte": ("bits per byte", False), "byte_perplexity": ("byte perplexity", False),
                           "word_perplexity": ("word perplexity", False)},
           "ps_code_mc": {"acc": ("accuracy", True), "acc_norm": ("accuracy (length-normalized)", True)}}
FILTER = "none"  # lm-eval's filter name for tasks without filters


@dataclass
class LmEvalSpec:
    name: str = "lm_eval"
    representations: dict[str, list[str]] = field(default_factory=dict)  # name -> server overrides
    server_overrides: list[str] = field(default_factory=list)  # every representation's server also gets these
    comparisons: list[list[str]] = field(default_factory=list)  # [reference, test] pairs of representation names
    bos_tasks: list[str] = field(default_factory=lambda: ["ps_toolcalls"])  # run with add_bos_token=True
    plain_tasks: list[str] = field(default_factory=lambda: ["ps_code_ppl", "ps_code_mc"])  # add_bos_token=False
    limit: int | None = 20  # documents per task (None: all)
    num_concurrent: int = 8
    max_length: int = 1024  # the model's context
    model_name: str = "phaseserve-default"
    tokenizer: str = "models/default"
    seed: int = 0
    startup_timeout_s: float = 900.0
    tool_timeout_s: float = 1800.0


def lm_eval_command(exe: str, spec: LmEvalSpec, base_url: str, tasks: list[str], add_bos: bool, out: Path) -> list[str]:
    """The lm-eval command line for ``tasks`` against the server at ``base_url``."""
    model_args = ",".join([f"base_url={base_url}/v1/completions", f"model={spec.model_name}",
                           f"tokenizer={spec.tokenizer}", "tokenizer_backend=huggingface", "tokenized_requests=True",
                           f"max_length={spec.max_length}", f"num_concurrent={spec.num_concurrent}", "max_retries=1",
                           f"add_bos_token={add_bos}"])
    argv = [exe, "run", "--model", "local-completions", "--model_args", model_args, "--tasks", ",".join(tasks),
            "--include_path", "lab/eval/tasks", "--output_path", str(out), "--log_samples", "--seed", str(spec.seed)]
    return argv + (["--limit", str(spec.limit)] if spec.limit else [])


# ---- reading lm-eval's output ------------------------------------------------------------------------------
def read_results(out: Path) -> dict[str, dict[str, dict]]:
    """``{task: {metric: {"value", "stderr", "ci95": [lo, hi]}}}`` from the newest ``results_*.json`` under ``out``
    (lm-eval writes ``<out>/<model>/results_<time>.json``); the interval is value +- 1.96 stderr (None without a
    stderr)."""
    files = sorted(Path(out).rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no lm-eval results_*.json under {out}")
    raw = json.loads(files[-1].read_text())["results"]
    parsed: dict[str, dict[str, dict]] = {}
    for task, entries in raw.items():
        for key, value in entries.items():
            metric, _, filt = key.partition(",")
            if filt != FILTER or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            se = entries.get(f"{metric}_stderr,{filt}")
            se = float(se) if isinstance(se, (int, float)) and math.isfinite(se) else None
            ci = [value - 1.96 * se, value + 1.96 * se] if se is not None else None
            parsed.setdefault(task, {})[metric] = {"value": float(value), "stderr": se, "ci95": ci}
    return parsed


def read_samples(out: Path, task: str) -> dict[int, dict]:
    """``{doc_id: {metric: value}}`` from the newest ``samples_<task>_*.jsonl`` under ``out`` (``--log_samples``);
    a rolling metric's value is lm-eval's ``[loglikelihood, count]``."""
    files = sorted(Path(out).rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no lm-eval samples_{task}_*.jsonl under {out}")
    rows = {}
    for line in files[-1].read_text().splitlines():
        s = json.loads(line)
        rows[int(s["doc_id"])] = {m: s[m] for m in METRICS.get(task, {}) if m in s}
    return rows


def _bpb(ll, n, axis=-1):
    return -np.sum(ll, axis=axis) / np.sum(n, axis=axis) / math.log(2)


def paired_differences(ref: dict[int, dict], test: dict[int, dict], task: str, seed: int = 0) -> dict[str, dict]:
    """``{metric: {"diff", "ci95", "docs"}}``: test minus reference on the documents both scored, with a paired
    percentile-bootstrap 95% interval. Scalar metrics: the difference of means; ``bits_per_byte``: the difference
    of total bits per byte (resampling documents with their byte counts). Perplexities are left to bits per byte."""
    docs = sorted(set(ref) & set(test))
    out: dict[str, dict] = {}
    for metric in METRICS.get(task, {}):
        if not docs or metric not in ref[docs[0]] or metric in ("byte_perplexity", "word_perplexity"):
            continue
        if metric == "bits_per_byte":
            a = np.array([ref[d][metric] for d in docs], float)  # [docs, 2]: loglikelihood, bytes
            b = np.array([test[d][metric] for d in docs], float)

            def stat(ll_a, n_a, ll_b, n_b, axis=-1):
                return _bpb(ll_b, n_b, axis) - _bpb(ll_a, n_a, axis)

            samples = (a[:, 0], a[:, 1], b[:, 0], b[:, 1])
        else:
            samples = tuple(np.array([float(side[d][metric]) for d in docs]) for side in (ref, test))

            def stat(x, y, axis=-1):
                return np.mean(y, axis=axis) - np.mean(x, axis=axis)

        diff = float(stat(*samples))
        lo, hi = bootstrap_ci(samples, stat, paired=True, seed=seed)
        out[metric] = {"diff": diff, "ci95": None if lo is None else [lo, hi], "docs": len(docs)}
    return out


def fill_intervals(tasks: dict[str, dict], out: Path, seed: int = 0) -> dict[str, dict]:
    """Give ``bits_per_byte``, for which lm-eval reports no standard error, a percentile-bootstrap 95% interval over
    the documents (their loglikelihoods resampled with their byte counts), marked ``"interval": "bootstrap"``."""
    for task, metrics in tasks.items():
        m = metrics.get("bits_per_byte")
        if m is None or m["ci95"] is not None:
            continue
        rows = np.array([r["bits_per_byte"] for r in read_samples(out, task).values()], float)  # [docs, 2]
        lo, hi = bootstrap_ci((rows[:, 0], rows[:, 1]), _bpb, seed=seed)
        if lo is not None:
            m.update(ci95=[lo, hi], interval="bootstrap")
    return tasks


# ---- the run -----------------------------------------------------------------------------------------------
def run(cfg: DictConfig, out_dir: str | Path, log=print) -> dict:
    spec: LmEvalSpec = experiment_spec(cfg, LmEvalSpec)
    if not spec.representations:
        raise ValueError("experiment.representations is empty: name at least one server representation")
    exe = str(cfg.tools.lm_eval)
    out_dir = Path(out_dir).resolve()
    raw = out_dir / "raw"
    reps: dict[str, dict] = {}
    for name, overrides in spec.representations.items():
        server_overrides = [*spec.server_overrides, *overrides]
        log(f"[{name}] starting the server: {shlex.join(server_overrides)}")
        rec: dict[str, Any] = {"server_overrides": server_overrides, "commands": [], "tasks": {}, "wall_s": {}}
        with Served(server_overrides, raw / name / "server.log", spec.startup_timeout_s) as srv:
            rec["server_command"] = shlex.join(["python", *srv.command[1:]])
            before = srv.compiles()
            for group, tasks, bos in (("generate", spec.bos_tasks, True), ("loglikelihood", spec.plain_tasks, False)):
                if not tasks:
                    continue
                out = raw / name / group
                argv = lm_eval_command(exe, spec, srv.base_url, tasks, bos, Path(os.path.relpath(out, REPO)))
                rec["commands"].append(shlex.join(["lm_eval", *argv[1:]]))
                log(f"[{name}] {rec['commands'][-1]}")
                rec["wall_s"][group] = run_tool(argv, raw / name / f"lm_eval_{group}.log", spec.tool_timeout_s)
                rec["tasks"].update(fill_intervals(read_results(out), out, spec.seed))
            rec["compiles_during_eval"] = srv.compiles() - before
        reps[name] = rec
        log(f"[{name}] {json.dumps(rec['tasks'])}")
    comparisons = []
    for ref, test in spec.comparisons:
        if ref not in reps or test not in reps:
            raise ValueError(f"comparison {ref} vs {test}: both must be representations of this run")
        diffs = {}
        for task in [*spec.bos_tasks, *spec.plain_tasks]:
            group = "generate" if task in spec.bos_tasks else "loglikelihood"
            diffs[task] = paired_differences(read_samples(raw / ref / group, task),
                                             read_samples(raw / test / group, task), task, spec.seed)
        comparisons.append({"reference": ref, "test": test, "differences": diffs})
    results = {"experiment": "lm_eval", "settings": spec.__dict__, "tools": {"lm_eval": exe},
               "environment": environment(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "representations": reps, "comparisons": comparisons}
    rp.write_outputs(out_dir, cfg, results, markdown(results))
    plot(out_dir / "scores.png", results)
    return results


# ---- the report --------------------------------------------------------------------------------------------
def _score(m: dict | None) -> str:
    if not m:
        return "-"
    ci = m.get("ci95")
    return f"{m['value']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def _diff(d: dict | None) -> str:
    if not d:
        return "-"
    ci = d.get("ci95")
    return f"{d['diff']:+.4f}" + (f" [{ci[0]:+.4f}, {ci[1]:+.4f}]" if ci else "")


def markdown(results: dict) -> str:
    reps = results["representations"]
    s = results["settings"]
    lines = ["# lm-eval through the HTTP server, per representation", "",
             f"Measured {results['date']} with lm-evaluation-harness `local-completions` against `/v1/completions` "
             f"(tokenizer `{s['tokenizer']}`, token-id requests, {s['num_concurrent']} concurrent), "
             f"{s['limit'] or 'all'} documents per task; the project's local tasks (`lab/eval/tasks`, built from the "
             "default model's held-out data by `lab/eval/lm_eval_tasks.py`). Intervals (95%): value +- 1.96 x "
             "lm-eval's standard error; bits per byte, for which lm-eval gives none: bootstrap over the documents; "
             "differences: paired bootstrap over the same documents. Perplexities have no interval (lm-eval reports "
             "none).", ""]
    header = ["representation", "server overrides"]
    cols = [(t, m) for t in [*s["bos_tasks"], *s["plain_tasks"]] for m in METRICS.get(t, {})]
    header += [f"{t} {METRICS[t][m][0]}" for t, m in cols] + ["compiles during eval"]
    rows = [[name, f"`{' '.join(r['server_overrides'])}`", *[_score(r["tasks"].get(t, {}).get(m)) for t, m in cols],
             r.get("compiles_during_eval", "-")] for name, r in reps.items()]
    lines += ["## Scores", "", rp.markdown_table(header, rows), ""]
    if results["comparisons"]:
        lines += ["## Paired differences (test minus reference)", ""]
        dcols = [(t, m) for t, m in cols if m not in ("byte_perplexity", "word_perplexity")]
        drows = [[f"{c['test']} vs {c['reference']}",
                  *[_diff(c["differences"].get(t, {}).get(m)) for t, m in dcols]] for c in results["comparisons"]]
        lines += [rp.markdown_table(["comparison", *[f"{t} {METRICS[t][m][0]}" for t, m in dcols]], drows), ""]
    lines += ["## Commands", "", "```bash", "python experiments/lm_eval.py " + " ".join(
        f"tools.lm_eval={results['tools']['lm_eval']}".split()), "```", "", "Per representation:", ""]
    for name, r in reps.items():
        lines += [f"- {name}: `{r.get('server_command', '')}`, then", *[f"  - `{c}`" for c in r["commands"]]]
    lines += ["", rp.environment_section(results["environment"])]
    return "\n".join(lines)


def plot(path: Path, results: dict) -> Path:
    """The headline metric of each task per representation, with its interval."""
    reps = results["representations"]
    s = results["settings"]
    tasks = [t for t in [*s["bos_tasks"], *s["plain_tasks"]] if t in METRICS]
    groups = [f"{t}\n{next(iter(METRICS[t].values()))[0]}" for t in tasks]
    bars = {}
    for name, r in reps.items():
        ms = [r["tasks"].get(t, {}).get(next(iter(METRICS[t]))) or {} for t in tasks]
        bars[name] = ([m.get("value") for m in ms], [(m.get("ci95") or [None, None])[0] for m in ms],
                      [(m.get("ci95") or [None, None])[1] for m in ms])
    return rp.bar_plot(path, groups, bars, ylabel="score", title="lm-eval through the server, per representation")
