"""Experiment entry point: weight_dtype.

Logic in lab/bench/weight_dtype.py, settings in configs/experiment/weight_dtype.yaml.

    python experiments/weight_dtype.py                       # the side-by-side sweep, into outputs/weight_dtype/<date>/
    python experiments/weight_dtype.py hydra.run.dir=benchmarks/weight_dtype
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.bench import setup_jax, weight_dtype


@hydra.main(config_path="../configs", config_name="experiment/weight_dtype", version_base="1.3")
def main(cfg: DictConfig) -> None:
    setup_jax(cfg)
    weight_dtype.run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
