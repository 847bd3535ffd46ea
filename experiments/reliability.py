"""Experiment entry point: reliability (the HTTP server's soak under sustained mixed load).

Logic in lab/bench/reliability.py, settings in configs/experiment/reliability.yaml.

    python experiments/reliability.py                                         # into outputs/reliability/<date>/
    python experiments/reliability.py hydra.run.dir=benchmarks/reliability    # the committed report
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.bench import reliability, setup_jax


@hydra.main(config_path="../configs", config_name="experiment/reliability", version_base="1.3")
def main(cfg: DictConfig) -> None:
    setup_jax(cfg)
    reliability.run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
