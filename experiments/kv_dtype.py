"""Experiment entry point: kv_dtype.

Logic in lab/bench/kv_dtype.py, settings in configs/experiment/kv_dtype.yaml.

    python experiments/kv_dtype.py                       # the side-by-side sweep, into outputs/kv_dtype/<date>/
    python experiments/kv_dtype.py hydra.run.dir=benchmarks/kv_dtype
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.bench import kv_dtype, setup_jax


@hydra.main(config_path="../configs", config_name="experiment/kv_dtype", version_base="1.3")
def main(cfg: DictConfig) -> None:
    setup_jax(cfg)
    kv_dtype.run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
