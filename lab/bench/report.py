"""Writing results: JSON, markdown tables, matplotlib PNG plots, and the environment block of every report.

Every experiment writes into its output directory (the Hydra run directory by default)::

    results.json   settings, environment, every raw record, the aggregates and the headline numbers
    README.md      the report: headline, tables, notes on where the CPU differs from the published shape
    config.yaml    the fully composed config the run used
    *.png          plots (matplotlib, Agg backend)
"""

from __future__ import annotations

import collections
import json
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from lab.markdown import fmt, table
from phaseserve.kernel_mesh import provenance_rows


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return None if not np.isfinite(x) else float(x)
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (DictConfig,)):
        return OmegaConf.to_container(x, resolve=True)
    if isinstance(x, Exception):
        return f"{type(x).__name__}: {x}"
    return x


def kernel_rows(*sources: Any) -> list[dict]:
    """The kernel provenance a result's ``environment.kernels`` carries: each op the measured engines' steps traced,
    with the implementation and layout it built, rows of equal keys summed over ``sources``: engines (each counted
    once; ``Engine.summary()["kernels"]``, the tables their workers own) or row lists taken earlier."""
    keys = ("phase", "op", "platform", "impl", "reason", "layout")
    log: collections.Counter = collections.Counter()
    for src in {id(s): s for s in sources}.values():
        for row in src if isinstance(src, list) else src.summary()["kernels"]:
            log[tuple(row[k] for k in keys)] += row["count"]
    return provenance_rows(log)


def write_json(path: Path, obj: Any) -> Path:
    """Write ``obj`` as JSON (a result's ``environment.kernels``, when it has one, is :func:`kernel_rows` of the
    engines it measured, set by the experiment)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(obj), indent=2, sort_keys=False) + "\n")
    return path


def write_config(out_dir: Path, cfg: DictConfig) -> Path:
    path = Path(out_dir) / "config.yaml"
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))
    return path


def pct(ratio: float | None, digits: int = 1) -> str:
    """A ratio as a signed percentage change (1.41 -> '+41.0%')."""
    if ratio is None:
        return "–"
    return f"{(ratio - 1) * 100:+.{digits}f}%"


def spread(st: dict, unit: str = "") -> str:
    """``median [min, max]`` of a stats dict (the median alone for one value)."""
    if not st or st.get("median") is None:
        return "–"
    if st.get("n", 0) <= 1:
        return f"{fmt(st['median'])}{unit}"
    return f"{fmt(st['median'])}{unit} [{fmt(st['min'])}, {fmt(st['max'])}]"


def pct_spread(st: dict) -> str:
    """A ratio stats dict as ``+x% [lo, hi]``."""
    if not st or st.get("median") is None:
        return "–"
    if st.get("n", 0) <= 1:
        return pct(st["median"])
    return f"{pct(st['median'])} [{pct(st['min'])}, {pct(st['max'])}]"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """:func:`lab.markdown.table` with the headers first (the one writer; cells through :func:`fmt`)."""
    return table(rows, headers)


def environment_section(env: dict) -> str:
    acc = env.get("accelerator") or "none (CPU)"
    return "\n".join([
        "## Environment", "",
        f"- date: {env.get('date')}",
        f"- machine: {env.get('machine')}"
        + (f" ({env['cpu_detail']})" if env.get("cpu_detail") else "")
        + f", {env.get('cpu_cores')} cores; accelerator: {acc}",
        f"- load average at start (1m, 5m, 15m): {env.get('load_average_1m_5m_15m')} on {env.get('cpu_cores')} cores "
        "(the machine is shared with other work: absolute times are noisy, paired ratios less so; every record in "
        "results.json carries the 1-minute load average when it ran)",
        f"- jax {env.get('jax')} (jaxlib {env.get('jaxlib')}), numpy {env.get('numpy')}, hydra {env.get('hydra')}, "
        f"python {env.get('python')}; backend {env.get('backend')}, devices {len(env.get('devices', []))}",
        f"- git commit: {env.get('git_commit')}" + _modified(env.get("git_modified")),
    ])


def _modified(names: list[str] | None) -> str:
    """The run's uncommitted changes to tracked files, if any (their paths, ``git diff --name-only HEAD``)."""
    if not names:
        return ""
    return f", with uncommitted changes to {len(names)} tracked file(s): {', '.join(names)}"


# ---- plots ------------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, path: Path, title: str, *, grid_axis: str, legend: dict | None = None) -> Path:
    """Title (wrapped), grid, legend, layout; write ``path`` and close the figure."""
    ax.set_title("\n".join(textwrap.wrap(title, 64)), fontsize=9)
    ax.grid(True, axis=grid_axis, alpha=0.3)
    ax.legend(**(legend or dict(fontsize=8)))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def line_plot(path: Path, series: dict[str, tuple[list, list, list | None, list | None]], *, xlabel: str,
              ylabel: str, title: str, logx: bool = True, hlines: dict[str, float] | None = None,
              styles: dict[str, dict] | None = None) -> Path:
    """``series[name] = (xs, medians, lows, highs)``; lows/highs (may be None) draw the repeat spread;
    ``styles[name]`` are extra ``ax.plot`` keyword arguments."""
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    all_x: set = set()
    for name, (xs, ys, lo, hi) in series.items():
        pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        if not pts:
            continue
        all_x.update(p[0] for p in pts)
        kw = {"marker": "o", **(styles or {}).get(name, {})}
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **kw)
        if lo is not None and hi is not None:
            band = [(x, a, b) for x, a, b in zip(xs, lo, hi, strict=True) if a is not None and b is not None]
            if band:
                ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band],
                                color=line.get_color(), alpha=0.2, linewidth=0)
    for name, y in (hlines or {}).items():
        ax.axhline(y, linestyle="--", color="gray", linewidth=1)
        ax.text(0.01, y, name, transform=ax.get_yaxis_transform(), fontsize=8, color="gray", va="bottom")
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(all_x))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _save(plt, fig, ax, path, title, grid_axis="both")


def bar_plot(path: Path, groups: list[str], bars: dict[str, tuple[list, list | None, list | None]], *,
             ylabel: str, title: str) -> Path:
    """Grouped bars: ``bars[name] = (values per group, lows, highs)`` (error bars from the spread)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    width = 0.8 / max(len(bars), 1)
    xs = np.arange(len(groups))
    for i, (name, (vals, lo, hi)) in enumerate(bars.items()):
        v = np.array([np.nan if x is None else x for x in vals], float)
        err = None
        if lo is not None and hi is not None:
            err = np.array([[0 if a is None else max(m - a, 0) for m, a in zip(v, lo, strict=True)],
                            [0 if b is None else max(b - m, 0) for m, b in zip(v, hi, strict=True)]])
        ax.bar(xs + (i - (len(bars) - 1) / 2) * width, v, width, yerr=err, capsize=3, label=name)
    ax.set_xticks(xs, groups)
    ax.set_ylabel(ylabel)
    return _save(plt, fig, ax, path, title, grid_axis="y")


def metric_series(agg: dict, metric: str, arms: list[str], points: list) -> dict:
    """Line-plot series of one metric from :func:`~lab.bench.measure.aggregate` output."""
    out = {}
    for arm in arms:
        sts = [agg.get(arm, {}).get(p, {}).get(metric, {}) for p in points]
        out[arm] = (points, [s.get("median") for s in sts], [s.get("min") for s in sts], [s.get("max") for s in sts])
    return out


def write_outputs(out_dir: Path, cfg: DictConfig, results: dict, markdown: str) -> dict[str, Path]:
    """``results.json``, ``README.md`` and ``config.yaml`` into ``out_dir`` (plots are written by the caller)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return {"json": write_json(out_dir / "results.json", results),
            "markdown": _write_text(out_dir / "README.md", markdown),
            "config": write_config(out_dir, cfg)}


def _write_text(path: Path, text: str) -> Path:
    path.write_text(text.rstrip() + "\n")
    return path


def kv_tokens_plot(path: Path, rows: list[dict], *, title: str) -> Path:
    """Resident KV tokens per configuration (``rows`` of the capacity table: model, gpu, weights, kv, kv_tokens,
    fits) as horizontal bars; configurations that do not fit are marked with an x at 0 and labelled."""
    plt = _pyplot()
    labels = [f"{r['model']} {r['gpu']} {r['weights']} w / {r['kv']} KV" for r in rows]
    fig, ax = plt.subplots(figsize=(7.6, 0.32 * len(rows) + 1.4), dpi=110)
    ys = np.arange(len(rows))
    fit = [i for i, r in enumerate(rows) if r["fits"]]
    miss = [i for i, r in enumerate(rows) if not r["fits"]]
    if fit:
        ax.barh(ys[fit], [rows[i]["kv_tokens"] for i in fit], color="tab:blue", label="fits: resident KV tokens")
    if miss:
        ax.scatter([0] * len(miss), ys[miss], marker="x", color="tab:red", zorder=3,
                   label="does not fit (weights exceed the memory budget)")
        for i in miss:
            ax.text(0, ys[i], "  does not fit", va="center", fontsize=7, color="tab:red")
    ax.set_yticks(ys, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("resident KV tokens per replica")
    return _save(plt, fig, ax, path, title, grid_axis="x", legend=dict(fontsize=7, loc="lower right"))
