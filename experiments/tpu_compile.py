"""Experiment entry point: tpu_compile (every kernel and the engine's serving steps compiled for TPU without a TPU).

Logic in lab/kernels/tpu_compile.py (kernels) and lab/bench/tpu_compile.py (steps, planner comparison),
settings in configs/experiment/tpu_compile.yaml. Needs libtpu (``pip install -e '.[tpu]'``); runs on a CPU host.

    python experiments/tpu_compile.py                                   # into outputs/tpu_compile/<date>/
    python experiments/tpu_compile.py hydra.run.dir=benchmarks/tpu_compile
    python experiments/tpu_compile.py experiment.kernels=small experiment.models=[glm-5] \\
        experiment.step_generations=[v5p]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the compiles target deviceless TPU chips; the host stays on the CPU

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import phaseserve.quiet  # noqa: E402, F401  (no backend-probe INFO lines)
from lab.bench import tpu_compile  # noqa: E402


@hydra.main(config_path="../configs", config_name="experiment/tpu_compile", version_base="1.3")
def main(cfg: DictConfig) -> None:
    tpu_compile.run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
