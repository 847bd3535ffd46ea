"""Experiment entry point: integrity.

Logic in lab/bench/integrity.py, settings in configs/experiment/integrity.yaml.

    python experiments/integrity.py                       # the side-by-side sweep, into outputs/integrity/<date>/
    python experiments/integrity.py hydra.run.dir=benchmarks/integrity
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.bench import integrity, setup_jax


@hydra.main(config_path="../configs", config_name="experiment/integrity", version_base="1.3")
def main(cfg: DictConfig) -> None:
    setup_jax(cfg)
    integrity.run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
