"""Experiment entry point: operating_point (decode step vs batch, machine rates, the operating-point rule).

Logic in lab/bench/operating_point.py, settings in configs/experiment/operating_point.yaml.

    python experiments/operating_point.py hydra.run.dir=benchmarks/operating_point
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.bench import operating_point, setup_jax


@hydra.main(config_path="../configs", config_name="experiment/operating_point", version_base="1.3")
def main(cfg: DictConfig) -> None:
    setup_jax(cfg)
    operating_point.run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
