"""Quality table of every representation on the shipped default model (logic: lab/eval/quality.py).

    python experiments/quality.py                              # into outputs/quality/<date>/
    python experiments/quality.py hydra.run.dir=benchmarks/quality
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.eval.demo import default_model_path
from lab.eval.quality import final_lines, run


@hydra.main(config_path="../configs", config_name="quality", version_base=None)
def main(cfg: DictConfig) -> None:
    out = HydraConfig.get().runtime.output_dir
    rows = run(cfg.checkpoint or default_model_path(), out, num_requests=cfg.num_requests, max_tokens=cfg.max_tokens,
               num_windows=cfg.num_windows, calib_sequences=cfg.calib_sequences, seed=cfg.seed,
               tool_mix=cfg.tool_mix, progress=print)
    for line in final_lines(rows, out):  # verdicts, then the run directory
        print(line)


if __name__ == "__main__":
    main()
