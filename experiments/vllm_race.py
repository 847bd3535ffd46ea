"""Experiment entry point: vllm_race (phaseserve against vLLM, same model and load generator).

Logic in lab/bench/vllm_race.py, settings in configs/experiment/vllm_race.yaml.

    python experiments/vllm_race.py                          # into outputs/vllm_race/<date>/
    python experiments/vllm_race.py experiment.vllm=/work/venv-vllm/bin/vllm hydra.run.dir=benchmarks/vllm_race
    python experiments/vllm_race.py experiment.profile=true     # phaseserve's phases timed (profile.md)
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # as python -m phaseserve.server

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import phaseserve.quiet  # noqa: E402, F401  (no backend-probe INFO lines)
from lab.bench import vllm_race  # noqa: E402


@hydra.main(config_path="../configs", config_name="experiment/vllm_race", version_base="1.3")
def main(cfg: DictConfig) -> None:
    vllm_race.run(cfg, HydraConfig.get().runtime.output_dir, log=print if cfg.progress else lambda *_: None)


if __name__ == "__main__":
    main()
