"""Experiment entry point: engine (phaseserve against transformers generate, and the engine's host overhead).

Logic in lab/bench/engine_speed.py, settings in configs/experiment/engine.yaml. Needs the test extra
(torch, transformers).

    python experiments/engine.py                          # into outputs/engine/<date>/
    python experiments/engine.py hydra.run.dir=benchmarks/engine
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.bench import engine_speed, setup_jax


@hydra.main(config_path="../configs", config_name="experiment/engine", version_base="1.3")
def main(cfg: DictConfig) -> None:
    setup_jax(cfg)
    out = HydraConfig.get().runtime.output_dir
    results = engine_speed.run(cfg, out, log=print if cfg.progress else lambda *_: None)
    print("\n".join(engine_speed.verdict_lines(results)))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
