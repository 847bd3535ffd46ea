"""Writing an experiment's outputs from its raw results, and re-rendering them later from ``results.json``.

Every experiment module (``kv_dtype``, ``weight_dtype``, ``integrity``, ``reproduce``) keeps two things apart:

- ``run(cfg, out_dir)`` measures and returns the *raw* results (settings, environment, engine facts, every record);
- ``summarize(results)`` derives everything else from them (aggregates, paired ratios with bootstrap intervals,
  headline, :class:`~lab.bench.verdict.Verdict` list), ``plots(out_dir, results, summary)`` draws, and
  ``markdown(results, summary, plots)`` writes the report.

:func:`publish` writes ``results.json`` (raw + ``summary``), ``README.md``, ``config.yaml`` and the plots, and
logs the verdict lines and the run directory last. :func:`render` does the same from a committed
``results.json`` without measuring anything: a change of wording, of a verdict rule or of a plot reruns nothing
(``python -m lab.bench.publish benchmarks/kv_dtype benchmarks/weight_dtype benchmarks/integrity
 benchmarks/reproduce``).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import DictConfig

from lab.bench import report as rp
from lab.bench.verdict import final_lines


def publish(out_dir: str | Path, results: dict, module: ModuleType, cfg: DictConfig | None = None,
            log=print) -> dict[str, Any]:
    """Summarize, write every output into ``out_dir``, log the verdicts and the directory; returns the summary."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = {k: v for k, v in results.items() if k != "summary"}
    rp.write_json(out_dir / "results.json", raw)  # first: a failing report never loses a measurement
    if cfg is not None:
        rp.write_config(out_dir, cfg)
    summary = module.summarize(raw, out_dir)
    plots = module.plots(out_dir, raw, summary)
    rp.write_json(out_dir / "results.json", {**raw, "summary": summary})
    (out_dir / "README.md").write_text(module.markdown(raw, summary, plots).rstrip() + "\n")
    for line in final_lines(summary["verdicts"], out_dir):
        log(line)
    return summary


def render(out_dir: str | Path, module: ModuleType, log=print) -> dict[str, Any]:
    """Rewrite ``README.md``, the plots and the summary from ``out_dir/results.json`` (nothing is measured)."""
    out_dir = Path(out_dir)
    return publish(out_dir, json.loads((out_dir / "results.json").read_text()), module, None, log)


def main(argv: list[str] | None = None) -> None:
    """``python -m lab.bench.publish DIR [DIR ...]``: re-render each experiment directory from its JSON."""
    import argparse
    import importlib

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("dirs", nargs="+", help="directories holding an experiment's results.json")
    for d in ap.parse_args(argv).dirs:
        name = json.loads((Path(d) / "results.json").read_text())["experiment"]
        render(d, importlib.import_module(f"lab.bench.{name}"))


if __name__ == "__main__":
    main()
