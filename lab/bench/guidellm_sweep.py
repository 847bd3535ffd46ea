"""Experiment: a concurrency sweep with guidellm against the HTTP server, per representation.
Settings in ``configs/experiment/guidellm.yaml``; entry point ``experiments/guidellm.py``.

For each representation (Hydra overrides of ``configs/server.yaml``) the server is started in its own process
(:class:`lab.bench.served.Served`, with JAX logging each compilation) and guidellm runs one scenario (written here as
guidellm's scenario JSON, :func:`scenario`): ``/v1/completions``, streamed, guidellm's synthetic text at
``prompt_tokens`` / ``output_tokens`` counted with the shipped tokenizer (``models/default``, loaded by guidellm's
``AutoTokenizer``), the ``concurrent`` profile at each of ``streams``, ``max_requests`` requests per level, and the
SLOs (``ttft_ms``, ``tpot_ms``: guidellm's goodput objectives, vLLM's names). The report reads guidellm's JSON: TTFT,
ITL and TPOT percentiles per level, requests and output tokens per second, the fraction of requests meeting every SLO
and the goodput (those requests per second of the level's duration). The server's compilation count is read before
and after the timed sweep: every compilation inside it is a request that waited on the compiler. With
``warmup_requests`` the same scenario runs once untimed first (``warmup_requests`` per level), so that the shapes it
reaches compile there (on a CPU the server compiles shapes as they come unless ``experiment.warmup=all``, which
compiles every shape before ``/health``: minutes per shape set on a 2-core CPU).

The guidellm executable is ``tools.guidellm`` from the config: nothing is installed here.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from lab.bench import report as rp
from lab.bench.measure import environment
from lab.bench.schema import experiment_spec
from lab.bench.served import REPO, Served, run_tool

LATENCIES = {"ttft_ms": "time_to_first_token_ms", "itl_ms": "inter_token_latency_ms",
             "tpot_ms": "time_per_output_token_ms"}
PCTS = ("p50", "p95", "p99")


@dataclass
class GuidellmSpec:
    name: str = "guidellm"
    representations: dict[str, list[str]] = field(default_factory=dict)  # name -> server overrides
    server_overrides: list[str] = field(default_factory=list)
    streams: list[int] = field(default_factory=lambda: [1, 8])  # concurrent requests per level
    max_requests: int = 16  # requests per level
    warmup_requests: int = 16  # per level in an untimed run of the same scenario first (0: none); its shapes compile
    prompt_tokens: int = 128
    output_tokens: int = 64
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 100.0
    model_name: str = "phaseserve-default"
    tokenizer: str = "models/default"
    seed: int = 0
    startup_timeout_s: float = 900.0
    tool_timeout_s: float = 1800.0


def scenario(spec: GuidellmSpec, base_url: str, out_json: Path) -> dict:
    """guidellm's scenario (``guidellm run --scenario FILE``) for one server."""
    return {"metadata": {"name": "phaseserve-concurrency-sweep",
                         "description": "phaseserve: /v1/completions at each concurrency (lab/bench/guidellm_sweep)"},
            "spec": {"backend": {"kind": "openai_http", "target": base_url, "model": spec.model_name,
                                 "request_format": "/v1/completions"},
                     "profile": {"kind": "concurrent", "streams": list(spec.streams)},
                     "tokenizer": {"kind": "huggingface_auto", "model": spec.tokenizer},
                     "data": [{"kind": "synthetic_text", "prompt_tokens": spec.prompt_tokens,
                               "output_tokens": spec.output_tokens}],
                     "constraints": [{"kind": "max_requests", "count": spec.max_requests}],
                     "seed": {"kind": "static", "value": spec.seed},
                     "metrics": {"kind": "generative", "slo": {"ttft_ms": spec.slo_ttft_ms,
                                                                "tpot_ms": spec.slo_tpot_ms}},
                     "outputs": [{"kind": "json", "path": str(out_json)}]}}


def _dist(metric: dict) -> dict:
    s = (metric or {}).get("successful") or {}
    pct = s.get("percentiles") or {}
    return {"mean": s.get("mean"), "count": s.get("count"), **{p: pct.get(p) for p in PCTS}}


def read_report(path: Path) -> list[dict]:
    """One row per benchmark (concurrency level) of guidellm's JSON report."""
    data = json.loads(Path(path).read_text())
    rows = []
    for b in data["benchmarks"]:
        m = b["metrics"]
        totals = m["request_totals"]
        duration = float(b["duration"])
        attainment = m.get("slo_attainment")
        rows.append({
            "streams": int(b["config"]["strategy"]["streams"]),
            "successful": int(totals["successful"]), "errored": int(totals["errored"]),
            "incomplete": int(totals["incomplete"]), "duration_s": duration,
            "requests_per_s": totals["successful"] / duration if duration > 0 else None,
            "output_tok_per_s": (m["output_token_count"]["successful"].get("total_sum") or 0) / duration
            if duration > 0 else None,
            "prompt_tokens_p50": _dist(m["prompt_token_count"])["p50"],
            "output_tokens_p50": _dist(m["output_token_count"])["p50"],
            **{name: _dist(m[key]) for name, key in LATENCIES.items()},
            "slo_attainment": attainment,
            "goodput_rps": attainment * totals["successful"] / duration
            if attainment is not None and duration > 0 else None,
        })
    return sorted(rows, key=lambda r: r["streams"])


def run(cfg: DictConfig, out_dir: str | Path, log=print) -> dict:
    spec: GuidellmSpec = experiment_spec(cfg, GuidellmSpec)
    if not spec.representations:
        raise ValueError("experiment.representations is empty: name at least one server representation")
    exe = str(cfg.tools.guidellm)
    out_dir = Path(out_dir).resolve()
    raw = out_dir / "raw"
    reps: dict[str, dict] = {}
    for name, overrides in spec.representations.items():
        server_overrides = [*spec.server_overrides, *overrides]
        log(f"[{name}] starting the server: {shlex.join(server_overrides)}")
        (raw / name).mkdir(parents=True, exist_ok=True)
        report_json = raw / name / "guidellm.json"
        scen = raw / name / "scenario.json"
        with Served(server_overrides, raw / name / "server.log", spec.startup_timeout_s) as srv:
            scen.write_text(json.dumps(scenario(spec, srv.base_url, report_json), indent=1) + "\n")
            argv = [exe, "run", "--scenario", os.path.relpath(scen, REPO), "--disable-progress"]
            warm = 0
            if spec.warmup_requests:
                wscen = raw / name / "warmup_scenario.json"
                wspec = GuidellmSpec(**{**spec.__dict__, "max_requests": spec.warmup_requests})
                wscen.write_text(json.dumps(scenario(wspec, srv.base_url, raw / name / "warmup.json"), indent=1))
                startup = srv.compiles()
                run_tool([exe, "run", "--scenario", os.path.relpath(wscen, REPO), "--disable-progress"],
                         raw / name / "warmup.log", spec.tool_timeout_s)
                warm = srv.compiles() - startup
            before = srv.compiles()
            wall = run_tool(argv, raw / name / "guidellm.log", spec.tool_timeout_s)
            compiles = srv.compiles() - before
            command = shlex.join(["python", *srv.command[1:]])
        reps[name] = {"server_overrides": server_overrides, "server_command": command,
                      "command": shlex.join(["guidellm", *argv[1:]]), "wall_s": wall,
                      "compiles_before_sweep": before, "compiles_in_warmup_run": warm,
                      "compiles_during_sweep": compiles,
                      "levels": read_report(report_json)}
        log(f"[{name}] {compiles} compilations during the sweep; "
            + ", ".join(f"c={r['streams']}: {r['output_tok_per_s']:.0f} tok/s" for r in reps[name]["levels"]))
    results = {"experiment": "guidellm", "settings": spec.__dict__, "tools": {"guidellm": exe},
               "environment": environment(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "representations": reps}
    rp.write_outputs(out_dir, cfg, results, markdown(results))
    plots(out_dir, results)
    return results


def _ms(d: dict, p: str) -> str:
    v = (d or {}).get(p)
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def markdown(results: dict) -> str:
    s = results["settings"]
    lines = ["# guidellm concurrency sweep against the HTTP server, per representation", "",
             f"Measured {results['date']} with guidellm (`concurrent` profile, streams {s['streams']}, "
             f"{s['max_requests']} requests per level) against `/v1/completions`, streamed: synthetic text of "
             f"{s['prompt_tokens']} prompt tokens and {s['output_tokens']} output tokens counted with the shipped "
             f"tokenizer `{s['tokenizer']}`. SLOs: TTFT <= {s['slo_ttft_ms']:.0f} ms and ITL <= "
             f"{s['slo_tpot_ms']:.0f} ms (guidellm's `tpot` objective); goodput = requests meeting both per second. "
             "Latencies in ms; percentiles over the level's requests.", ""]
    header = ["representation", "concurrency", "requests ok / errored", "req/s", "output tok/s",
              *[f"{n.split('_')[0].upper()} {p}" for n in LATENCIES for p in PCTS], "SLO met", "goodput req/s"]
    rows = []
    for name, r in results["representations"].items():
        for lv in r["levels"]:
            rows.append([name, lv["streams"], f"{lv['successful']} / {lv['errored']}",
                         f"{lv['requests_per_s']:.2f}", f"{lv['output_tok_per_s']:.0f}",
                         *[_ms(lv[n], p) for n in LATENCIES for p in PCTS],
                         "-" if lv["slo_attainment"] is None else f"{100 * lv['slo_attainment']:.0f}%",
                         "-" if lv["goodput_rps"] is None else f"{lv['goodput_rps']:.2f}"])
    lines += [rp.markdown_table(header, rows), "", "## Compilations inside the sweep", "",
              "The server logs every JAX compilation (`JAX_LOG_COMPILES=1`); counted in its log before and after the "
              "timed sweep:", ""]
    lines += [rp.markdown_table(["representation", "compilations before the timed sweep (startup and warm-up run)",
                                 "of them in the untimed warm-up run", "during the timed sweep"],
                                [[n, r["compiles_before_sweep"], r.get("compiles_in_warmup_run", "-"),
                                  r["compiles_during_sweep"]] for n, r in results["representations"].items()]), ""]
    lines += ["## Commands", "", "```bash",
              f"python experiments/guidellm.py tools.guidellm={results['tools']['guidellm']}", "```", "",
              "Per representation (the scenario file is in `raw/<representation>/scenario.json`):", ""]
    for name, r in results["representations"].items():
        lines += [f"- {name}: `{r['server_command']}`, then `{r['command']}`"]
    lines += ["", rp.environment_section(results["environment"])]
    return "\n".join(lines)


def plots(out_dir: Path, results: dict) -> list[Path]:
    reps = results["representations"]

    def series(get) -> dict[str, Any]:
        return {n: ([lv["streams"] for lv in r["levels"]], [get(lv) for lv in r["levels"]], None, None)
                for n, r in reps.items()}

    s = results["settings"]
    return [rp.line_plot(out_dir / "ttft_p95.png", series(lambda lv: lv["ttft_ms"]["p95"]), xlabel="concurrency",
                         ylabel="TTFT p95 (ms)", title="guidellm: TTFT p95 per concurrency",
                         hlines={"SLO": s["slo_ttft_ms"]}),
            rp.line_plot(out_dir / "itl_p50.png", series(lambda lv: lv["itl_ms"]["p50"]), xlabel="concurrency",
                         ylabel="ITL p50 (ms)", title="guidellm: inter-token latency p50 per concurrency"),
            rp.line_plot(out_dir / "goodput.png", series(lambda lv: lv["goodput_rps"]), xlabel="concurrency",
                         ylabel="goodput (requests/s meeting the SLOs)", title="guidellm: goodput per concurrency")]
