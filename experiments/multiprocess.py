"""Experiment entry point: multiprocess (disaggregated serving on Ray -- prefill and decode actors driven by the one
engine -- against the single-process engine, and the KV bytes on the wire).

Logic in lab/bench/multiprocess.py, settings in configs/experiment/multiprocess.yaml. Starts a local Ray cluster
(or joins ``RAY_ADDRESS``) and two actors per run (they share the CPU cores here).

    python experiments/multiprocess.py                    # into outputs/multiprocess/<date>/
    python experiments/multiprocess.py hydra.run.dir=benchmarks/multiprocess
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.bench import multiprocess, setup_jax


@hydra.main(config_path="../configs", config_name="experiment/multiprocess", version_base="1.3")
def main(cfg: DictConfig) -> None:
    setup_jax(cfg)
    out = HydraConfig.get().runtime.output_dir
    results = multiprocess.run(cfg, out, log=print if cfg.progress else lambda *_: None)
    print("\n".join(multiprocess.verdict_lines(results)))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
