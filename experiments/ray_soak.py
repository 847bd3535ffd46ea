"""Experiment entry point: the hostile Ray soak.

Logic in lab/bench/ray_soak.py, settings in configs/experiment/ray_soak.yaml.

    python experiments/ray_soak.py                                      # into outputs/ray_soak/<date>/
    python experiments/ray_soak.py hydra.run.dir=benchmarks/ray_soak    # the committed report
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.bench import ray_soak, setup_jax


@hydra.main(config_path="../configs", config_name="experiment/ray_soak", version_base="1.3")
def main(cfg: DictConfig) -> None:
    setup_jax(cfg)
    ray_soak.run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
