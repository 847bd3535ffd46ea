"""Train the default model (Hydra entry point; the logic lives in ``lab.train``).

    nice -n 10 python experiments/train.py                       # the shipped run (configs/train.yaml)
    python experiments/train.py steps=20 export_dir=/tmp/m results_dir=/tmp/r ckpt_dir=/tmp/ck   # smoke run

Resumes from ``ckpt_dir`` when it holds an orbax checkpoint (``resume=false`` to start over).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig, OmegaConf

import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
from lab.train import TrainConfig, train


@hydra.main(config_path="../configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    c: TrainConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), cfg))
    train(c)


if __name__ == "__main__":
    main()
