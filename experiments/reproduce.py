"""Experiment entry point: run every experiment and write one report (logic in lab/bench/reproduce.py,
settings in configs/experiment/reproduce.yaml).

    python experiments/reproduce.py                  # everything at default settings, into outputs/reproduce/<date>/
    python experiments/reproduce.py hydra.run.dir=benchmarks/reproduce experiment.subdir_root=benchmarks
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.bench import reproduce, setup_jax


@hydra.main(config_path="../configs", config_name="experiment/reproduce", version_base="1.3")
def main(cfg: DictConfig) -> None:
    setup_jax(cfg)
    reproduce.run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
