"""Capacity planner tables for the model presets (thin Hydra entry point; settings in ``configs/capacity.yaml``).

    python experiments/capacity.py                                   # the tables in benchmarks/capacity/README.md
    python experiments/capacity.py gpus=[h200,b200] +assumptions.reserve_gib=8

Writes ``capacity.json``, ``capacity.md`` and ``kv_tokens.png`` (resident KV tokens per configuration, the ones
that do not fit marked) into the Hydra run directory, then prints the verdict lines and the directory. All logic
lives in ``phaseserve.planner`` (``capacity_report``, ``capacity_verdicts``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lab import planner
from lab.bench.report import kv_tokens_plot


@hydra.main(config_path="../configs", config_name="capacity", version_base=None)
def main(cfg: DictConfig) -> None:
    c = OmegaConf.to_container(cfg, resolve=True)
    data, md = planner.capacity_report(
        c["models"], c["gpus"], c["num_gpus"], c["weights"], c["kv"], c["workload"]["prompt_len"],
        c["workload"]["output_len"], c["concurrencies"], c["compare_models"], c["compare_gpus"],
        **(c["assumptions"] or {}))
    out = Path(HydraConfig.get().runtime.output_dir)
    (out / "capacity.json").write_text(json.dumps({"config": c, **data}, indent=1))
    kv_tokens_plot(out / "kv_tokens.png", data["capacity"], title="Resident KV tokens per configuration")
    md += "\n![resident KV tokens per configuration](kv_tokens.png)\n"
    (out / "capacity.md").write_text(md)
    if c.get("write_to"):
        path = Path(hydra.utils.get_original_cwd()) / c["write_to"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(md)
    for line in planner.capacity_verdicts(data):
        print(line)
    print(f"run directory: {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
