"""Experiment entry point: soak.

Logic in lab/bench/soak.py, settings in configs/experiment/soak.yaml.

    python experiments/soak.py                                  # into outputs/soak/<date>/
    python experiments/soak.py hydra.run.dir=benchmarks/soak    # the committed report
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.bench import setup_jax, soak


@hydra.main(config_path="../configs", config_name="experiment/soak", version_base="1.3")
def main(cfg: DictConfig) -> None:
    setup_jax(cfg)
    soak.run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
