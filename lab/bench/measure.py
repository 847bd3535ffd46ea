"""Side-by-side measurement: arms built in one process, runs interleaved, ratios paired within a repeat.

The rule every experiment follows: a ratio between two representations is computed from runs made *in the same
process*, one right after the other on the same requests, with the arm order rotated from point to point and
repeat to repeat (so drift and background load hit every arm alike), and it is reported with its
repeat-to-repeat spread. Absolute times are machine facts, not results.

- :class:`Arm`: a name and the dotted config overrides that make it (``{"quant.kv_dtype": "float8_e4m3fn"}``).
- :func:`build_engines`: one engine per arm from one set of weights, each warmed up (every shape compiled).
- :func:`interleaved`: the sweep loop (repeats x points x rotated arms) with a progress bar; a timed run in which
  JAX compiled anything is run once more (the shape is compiled now) and a second compile raises
  :class:`CompileInTimedRun`: no timed window contains a compilation.
- :func:`aggregate` / :func:`paired`: medians with min/max per (arm, point), and per-repeat paired ratios with a
  bootstrap confidence interval of their median (``scipy.stats.bootstrap``).
- :func:`environment`: date, machine, load, versions, git commit; stored with every result.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from omegaconf import DictConfig

from lab.bench.schema import with_overrides
from lab.bench.workload import check_fits, warmup
from phaseserve.config_hydra import REPO_ROOT, serve_config
from phaseserve.engine import Engine


class CompileInTimedRun(RuntimeError):
    """JAX compiled during a timed run even after that run was repeated (a shape the warm-up missed)."""


@dataclass
class Arm:
    name: str
    overrides: dict[str, Any] = field(default_factory=dict)


# ---- compilation counter ----------------------------------------------------------------------------------
class CompileCounter:
    """Counts JAX lowerings (each a new compilation or a persistent-cache load) and persistent compilation cache
    hits and misses through ``jax.monitoring``."""

    _counts = {"lowerings": 0, "cache_hits": 0, "cache_misses": 0}
    _installed = False

    @classmethod
    def install(cls) -> None:
        if cls._installed:
            return
        import jax

        def on_duration(event: str, duration: float, **_: Any) -> None:
            if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
                cls._counts["lowerings"] += 1

        def on_event(event: str, **_: Any) -> None:
            if event == "/jax/compilation_cache/cache_hits":
                cls._counts["cache_hits"] += 1
            elif event == "/jax/compilation_cache/cache_misses":
                cls._counts["cache_misses"] += 1

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)
        cls._installed = True

    @classmethod
    def count(cls) -> int:
        """Lowerings so far."""
        cls.install()
        return cls._counts["lowerings"]

    @classmethod
    def snapshot(cls) -> dict[str, int]:
        cls.install()
        return dict(cls._counts)


# ---- engines ----------------------------------------------------------------------------------------------
def build_engines(cfg: DictConfig, model_cfg: Any, params: Any, arms: list[Arm], *, max_concurrency: int,
                  workloads: Iterable[Any] = (), log: Callable[[str], None] = print) -> dict[str, Engine]:
    """One engine per arm (same weights), each warmed up on every workload it will serve."""
    engines = {}
    for arm in arms:
        t0 = time.perf_counter()
        arm_cfg = with_overrides(cfg, arm.overrides)
        serve = serve_config(arm_cfg, model_cfg)
        eng = Engine(model_cfg, params, serve, attn_impl=str(cfg.engine.attn_impl),
                     matmul_impl=str(cfg.engine.get("matmul_impl", "auto")))
        runs = 0
        for w in list(workloads) or [cfg.workload]:
            check_fits(w, eng)
            runs += warmup(eng, w, max_concurrency, model_cfg.vocab_size)
        engines[arm.name] = eng
        log(f"[{arm.name}] engine built and warmed up ({runs} warm-up runs, {eng.num_pages} pages) "
            f"in {time.perf_counter() - t0:.1f}s")
    return engines


def rotated(names: list[str], k: int) -> list[str]:
    k %= max(len(names), 1)
    return names[k:] + names[:k]


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=True)


def interleaved(engines: dict[str, Engine], points: list[Any], repeats: int,
                run: Callable[[Engine, str, Any, int], dict], *, desc: str, progress: bool = True) -> list[dict]:
    """For each repeat and point, run every arm once (order rotated); ``run(engine, arm, point, repeat)`` returns
    a record dict. Adds ``arm``, ``point``, ``repeat``, ``order``, ``compiles`` (0: asserted), ``reruns`` (timed runs
    discarded because JAX compiled inside them) and the machine's 1-minute load average (``load_1m``: other
    processes on a shared machine are the main source of noise) to each record."""
    names = list(engines)
    records = []
    with progress_bar(repeats * len(points) * len(names), desc, progress) as bar:
        for rep in range(repeats):
            for j, point in enumerate(points):
                for order, name in enumerate(rotated(names, rep + j)):
                    bar.set_postfix_str(f"{name} @ {point} (repeat {rep + 1}/{repeats})")
                    rec, reruns = compile_free(lambda n=name, p=point, r=rep: run(engines[n], n, p, r),
                                               f"{name} @ {point}, repeat {rep}")
                    rec.update(arm=name, point=point, repeat=rep, order=order, compiles=0, reruns=reruns,
                               load_1m=round(os.getloadavg()[0], 2))
                    records.append(rec)
                    bar.update(1)
    return records


def compile_free(timed: Callable[[], dict], what: str) -> tuple[dict, int]:
    """``(timed(), reruns)``: a run during which JAX compiled is discarded and run again once (its shapes are
    compiled now); a compile in the second run raises :class:`CompileInTimedRun`."""
    for attempt in range(2):
        before = CompileCounter.count()
        rec = timed()
        compiled = CompileCounter.count() - before
        if not compiled:
            return rec, attempt
    raise CompileInTimedRun(f"{what}: {compiled} compilation(s) inside the timed run, twice in a row (the warm-up "
                            "does not cover a shape this run reaches)")


# ---- statistics -------------------------------------------------------------------------------------------
def dig(record: dict, metric: str) -> float | None:
    """``record["tpot"]["p95"]`` for ``metric="tpot.p95"``."""
    v: Any = record
    for part in metric.split("."):
        if not isinstance(v, dict) or part not in v:
            return None
        v = v[part]
    return None if v is None else float(v)


def stats(values: list[float | None], ci: bool = False) -> dict:
    """Median, min, max, count and relative spread of the non-None values; with ``ci`` also the 95% bootstrap
    confidence interval of the median (``ci_low`` / ``ci_high``; None below 3 values)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "rel_spread": None}
    med = float(np.median(vals))
    out = {"median": med, "min": float(min(vals)), "max": float(max(vals)), "n": len(vals),
           "rel_spread": (max(vals) - min(vals)) / med if med else None}
    if ci:
        out["ci_low"], out["ci_high"] = median_ci(vals)
    return out


def median_ci(values: list[float], confidence: float = 0.95, seed: int = 0) -> tuple[float | None, float | None]:
    """Percentile-bootstrap confidence interval of the median (``scipy.stats.bootstrap``); (None, None) below 3
    values. Identical values give a zero-width interval."""
    return bootstrap_ci((values,), np.median, confidence, seed)


def bootstrap_ci(samples: tuple, statistic: Callable, confidence: float = 0.95, seed: int = 0,
                 paired: bool = False) -> tuple[float | None, float | None]:
    """Percentile-bootstrap confidence interval of ``statistic(*samples, axis=-1)`` (``scipy.stats.bootstrap``;
    ``paired``: the samples are resampled together, e.g. two representations scored on the same requests);
    (None, None) below 3 values. When every resample gives the same value the interval has zero width."""
    from scipy.stats import bootstrap

    xs = tuple(np.asarray(x, float) for x in samples)
    if xs[0].size < 3:
        return None, None
    stat = float(statistic(*xs, axis=-1))
    if all(np.all(x == x[0]) for x in xs):
        return stat, stat
    res = bootstrap(xs, statistic, confidence_level=confidence, method="percentile", n_resamples=2000,
                    paired=paired, random_state=np.random.default_rng(seed))
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return (lo, hi) if np.isfinite(lo) and np.isfinite(hi) else (stat, stat)


def aggregate(records: list[dict], metrics: list[str]) -> dict[str, dict[Any, dict[str, dict]]]:
    """``{arm: {point: {metric: stats}}}`` over repeats."""
    out: dict[str, dict[Any, dict[str, dict]]] = {}
    for rec in records:
        out.setdefault(rec["arm"], {}).setdefault(rec["point"], {})
    for arm, by_point in out.items():
        for point in by_point:
            rs = [r for r in records if r["arm"] == arm and r["point"] == point]
            by_point[point] = {m: stats([dig(r, m) for r in rs]) for m in metrics}
    return out


def paired(records: list[dict], num: str, den: str, metric: str) -> dict[Any, dict]:
    """Per point: stats of ``metric[num] / metric[den]`` computed within each repeat (adjacent runs), with the
    bootstrap confidence interval of their median."""
    out = {}
    for point in dict.fromkeys(r["point"] for r in records):
        ratios = []
        for rep in sorted({r["repeat"] for r in records}):
            a = [dig(r, metric) for r in records if (r["arm"], r["point"], r["repeat"]) == (num, point, rep)]
            b = [dig(r, metric) for r in records if (r["arm"], r["point"], r["repeat"]) == (den, point, rep)]
            if a and b and a[0] is not None and b[0]:
                ratios.append(a[0] / b[0])
        out[point] = stats(ratios, ci=True) | {"values": ratios}
    return out


# ---- environment ------------------------------------------------------------------------------------------
def _cmd(args: list[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=10, cwd=REPO_ROOT).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_model() -> str:
    for line in _cmd(["lscpu"]).splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # the vector / matrix extensions a CPU report names


def cpu_detail() -> str:
    """What tells two CPUs of the same model name apart (cloud machines all say "Intel(R) Xeon(R) Processor"):
    family / model / stepping, the L3 cache and which of :data:`ISA_FLAGS` it has, from ``lscpu``; "" if unknown."""
    info = {}
    for line in _cmd(["lscpu"]).splitlines():
        key, _, value = line.partition(":")
        info[key.strip().lower()] = value.strip()
    if not info:
        return ""
    flags = set(info.get("flags", "").split())
    family, model, stepping = (info.get(k, "?") for k in ("cpu family", "model", "stepping"))
    parts = [f"family {family} model {model} stepping {stepping}"]
    if info.get("l3 cache"):
        parts.append(f"L3 {info['l3 cache']}")
    parts.append(" ".join(f for f in ISA_FLAGS if f in flags) or "no AVX2")
    return ", ".join(parts)


def environment() -> dict:
    """Where and when a result was measured."""
    import hydra
    import jax
    import jaxlib

    devices = jax.devices()
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "machine": cpu_model(),
        "cpu_detail": cpu_detail(),
        "cpu_cores": os.cpu_count(),
        "load_average_1m_5m_15m": [round(x, 2) for x in os.getloadavg()],
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
        "hydra": hydra.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "accelerator": devices[0].device_kind if jax.default_backend() != "cpu" else None,
        "git_commit": _cmd(["git", "rev-parse", "--short", "HEAD"]),
        # tracked files that differ from that commit (staged or not): the run's code is the commit plus these
        "git_modified": _cmd(["git", "diff", "--name-only", "HEAD"]).splitlines(),
    }
