"""Experiment entry point: lm_eval (quality per representation, lm-evaluation-harness through the HTTP server).

Logic in lab/bench/lm_eval_run.py, settings in configs/experiment/lm_eval.yaml.

    python experiments/lm_eval.py tools.lm_eval=/path/to/bin/lm_eval                 # into outputs/lm_eval/<date>/
    python experiments/lm_eval.py tools.lm_eval=/path/to/bin/lm_eval hydra.run.dir=benchmarks/lm_eval
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lab.bench import lm_eval_run


@hydra.main(config_path="../configs", config_name="experiment/lm_eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    lm_eval_run.run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
