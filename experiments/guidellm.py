"""Experiment entry point: guidellm (a concurrency sweep against the HTTP server, per representation).

Logic in lab/bench/guidellm_sweep.py, settings in configs/experiment/guidellm.yaml.

    python experiments/guidellm.py tools.guidellm=/path/to/bin/guidellm                 # into outputs/guidellm/<date>/
    python experiments/guidellm.py tools.guidellm=/path/to/bin/guidellm hydra.run.dir=benchmarks/guidellm
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lab.bench import guidellm_sweep


@hydra.main(config_path="../configs", config_name="experiment/guidellm", version_base="1.3")
def main(cfg: DictConfig) -> None:
    guidellm_sweep.run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
