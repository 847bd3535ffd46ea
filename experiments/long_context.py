"""Experiment entry point: long-context prefill memory and efficiency.

Logic in lab/bench/long_context.py, settings in configs/experiment/long_context.yaml.

    python experiments/long_context.py                                        # into outputs/bench/<date>/
    python experiments/long_context.py hydra.run.dir=benchmarks/long_context  # the committed report
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.bench import long_context


@hydra.main(config_path="../configs", config_name="experiment/long_context", version_base="1.3")
def main(cfg: DictConfig) -> None:
    long_context.run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
