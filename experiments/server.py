"""Entry point: the OpenAI-compatible HTTP server (settings in ``configs/server.yaml``; logic in
``phaseserve/server``). Same as ``python -m phaseserve.server``.

    python experiments/server.py                                   # default model, http://127.0.0.1:8000/v1
    python experiments/server.py experiment.port=8001 engine.mode=colocated quant=f32 mesh=single
    python experiments/server.py experiment.backend=ray             # prefill + decode Ray actors
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # CPU: prefill + decode devices

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import phaseserve.quiet  # noqa: E402, F401  (no backend-probe INFO lines)
from phaseserve.config import ConfigError  # noqa: E402
from phaseserve.server.launch import serve  # noqa: E402


@hydra.main(config_path="../configs", config_name="server", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        serve(cfg)
    except ConfigError as e:
        raise SystemExit(f"error: ConfigError: {e}") from None


if __name__ == "__main__":
    main()
