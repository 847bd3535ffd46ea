"""``python -m phaseserve.server [hydra overrides]``: serve ``configs/server.yaml`` (see :mod:`phaseserve.server`)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # CPU: prefill + decode devices

import phaseserve.quiet  # noqa: E402, F401  (no backend-probe INFO lines)
from phaseserve.config import ConfigError  # noqa: E402
from phaseserve.server.launch import compose, serve  # noqa: E402


def main(argv: list[str]) -> None:
    try:
        serve(compose(argv))
    except ConfigError as e:
        raise SystemExit(f"error: ConfigError: {e}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
