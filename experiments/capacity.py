"""Capacity planner tables for the model presets (thin Hydra entry point; settings in ``configs/capacity.yaml``).

    python experiments/capacity.py                                   # the tables in benchmarks/capacity/README.md
    python experiments/capacity.py gpus=[h200,b200] +assumptions.reserve_gib=8

Prints the markdown and writes ``capacity.json`` and ``capacity.md`` into the Hydra run directory: published
capacity figures vs the planner, capacity and admitted concurrency per model x weights x KV, roofline decode
tok/s vs concurrency, roofline prefill, published throughput beside the roofline, KV tokens by hardware, the
hardware specs and every assumption used. All logic lives in ``phaseserve.planner.capacity_report``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from phaseserve import planner


@hydra.main(config_path="../configs", config_name="capacity", version_base=None)
def main(cfg: DictConfig) -> None:
    c = OmegaConf.to_container(cfg, resolve=True)
    data, md = planner.capacity_report(
        c["models"], c["gpus"], c["num_gpus"], c["weights"], c["kv"], c["workload"]["prompt_len"],
        c["workload"]["output_len"], c["concurrencies"], c["compare_models"], c["compare_gpus"],
        **(c["assumptions"] or {}))
    out = Path(HydraConfig.get().runtime.output_dir)
    (out / "capacity.json").write_text(json.dumps({"config": c, **data}, indent=1))
    (out / "capacity.md").write_text(md)
    if c.get("write_to"):
        path = Path(hydra.utils.get_original_cwd()) / c["write_to"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(md)
    print(md)
    print(f"written to {os.path.relpath(out)}")


if __name__ == "__main__":
    main()
