"""Hydra callback that collects the jobs of a multirun sweep into one table.

``configs/config.yaml`` registers :class:`MultirunSummary` under ``hydra.callbacks``; at the end of a multirun
(``python experiments/kv_dtype.py -m quant.kv_dtype=bf16,fp8 workload.concurrency=1,8``) it reads every job's
``results.json`` and writes ``README.md`` and ``summary.json`` into the sweep directory: one row per job, arm and
point with its overrides and medians.

Each job ran in its own process, one after the other, so the table has no ratios: by the measured-side-by-side
rule ratios come only from arms interleaved in one process (give the axis as a list instead:
``quant.kv_dtype=[bf16,fp8]``). The summary says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lab.bench import report as rp

COLUMNS = [("steady_tok_per_s", "sustained tok/s"), ("output_tok_per_s", "end-to-end tok/s"),
           ("decode_tok_per_s", "decode-step tok/s"), ("prefill_tok_per_s", "prefill tok/s"),
           ("tpot.p50", "TPOT p50 (s)"), ("e2e.p95", "e2e p95 (s)"), ("peak_concurrency", "admitted")]


def collect(sweep_dir: str | Path) -> dict[str, Any]:
    """Rows of every ``<sweep_dir>/<job>/results.json`` (jobs in numeric order)."""
    sweep_dir = Path(sweep_dir)
    jobs = sorted((p for p in sweep_dir.iterdir() if (p / "results.json").exists()),
                  key=lambda p: (int(p.name.split("_")[0]) if p.name.split("_")[0].isdigit() else 1 << 30, p.name))
    rows = []
    for job in jobs:
        res = json.loads((job / "results.json").read_text())
        ov = job / ".hydra" / "overrides.yaml"
        overrides = [ln[2:].strip() for ln in ov.read_text().splitlines() if ln.startswith("- ")] if ov.exists() else []
        for arm, by_point in ((res.get("summary") or {}).get("aggregate") or res.get("aggregate") or {}).items():
            for point, metrics in by_point.items():
                rows.append({"job": job.name, "experiment": res.get("experiment"), "overrides": overrides,
                             "arm": arm, "point": point,
                             **{k: (metrics.get(k) or {}).get("median") for k, _ in COLUMNS}})
    return {"sweep_dir": str(sweep_dir), "jobs": [j.name for j in jobs], "rows": rows}


def summary_markdown(data: dict) -> str:
    keep = [(k, h) for k, h in COLUMNS if any(r.get(k) is not None for r in data["rows"])]
    rows = data["rows"]
    common = [o for o in (rows[0]["overrides"] if rows else []) if all(o in r["overrides"] for r in rows)]
    table = rp.markdown_table(["job", "swept overrides", "arm", "point"] + [h for _, h in keep],
                              [[r["job"], " ".join(o for o in r["overrides"] if o not in common) or "–", r["arm"],
                                str(r["point"])] + [rp.fmt(r[k]) for k, _ in keep] for r in rows])
    return "\n".join([
        f"# Multirun summary: {len(data['jobs'])} jobs", "",
        "Medians per job. Every job ran in its own process, one after another: compare them with care and take "
        "no ratios from this table; ratios come from a list-valued axis swept inside one process "
        "(e.g. `quant.kv_dtype=[bf16,fp8]`), where the arms are interleaved.", "",
        f"Overrides common to every job: `{' '.join(common) or '–'}`", "", table, ""])


class MultirunSummary(Callback):
    """Writes ``README.md`` and ``summary.json`` into the sweep directory when a multirun ends."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_absolute():
            sweep_dir = Path.cwd() / sweep_dir
        if not sweep_dir.exists():
            return
        data = collect(sweep_dir)
        if not data["rows"]:
            return
        rp.write_json(sweep_dir / "summary.json", data)
        (sweep_dir / "README.md").write_text(summary_markdown(data))
