"""Experiment entry point: http_load (the HTTP server under load against the same engine in-process).

Logic in lab/bench/http_load.py, settings in configs/experiment/http_load.yaml.

    python experiments/http_load.py                          # into outputs/http_load/<date>/
    python experiments/http_load.py hydra.run.dir=benchmarks/http
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.bench import http_load, setup_jax


@hydra.main(config_path="../configs", config_name="experiment/http_load", version_base="1.3")
def main(cfg: DictConfig) -> None:
    setup_jax(cfg)
    http_load.run(cfg, HydraConfig.get().runtime.output_dir, log=print if cfg.progress else lambda *_: None)


if __name__ == "__main__":
    main()
