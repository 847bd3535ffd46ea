"""``python -m phaseserve.server [--host H] [--port P] [--model PATH] [overrides]``: serve ``configs/server.yaml``.

The conventional flags are parsed here (argparse); every other argument is a Hydra override of the server config
(``engine.mode=colocated quant=f32 mesh=single``), composed as before. ``--model PATH`` serves the checkpoint
directory PATH (its own tokenizer; ``model.checkpoint``), under the name PATH unless ``--served-model-name`` says
otherwise, as vLLM names it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")  # CPU: prefill + decode devices

EPILOG = """\
other arguments are Hydra overrides of configs/server.yaml, e.g.
  engine.mode=colocated quant=f32 mesh=single     one mesh, float32 weights and KV
  experiment.backend=ray                          prefill + decode in two Ray actors
  mesh=single mesh.replicas=2 engine.mode=colocated
  mesh.replicas=2 mesh.replica_devices=shared     2 replicas on one device layout, compiled steps shared (CPU)
  cache.max_pages_per_seq=16                      cap the context (default: the model's)
(see docs/server.md)"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m phaseserve.server", epilog=EPILOG,
                                description="The OpenAI-compatible HTTP server (phaseserve).",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", help="address to bind (default: experiment.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default: experiment.port, 8000)")
    p.add_argument("--model", metavar="PATH", help="a checkpoint directory (Hugging Face layout: config.json, "
                                                   "*.safetensors, tokenizer files) instead of the shipped model")
    p.add_argument("--served-model-name", help="the name /v1/models lists and requests give as `model` "
                                               "(default: PATH with --model, else experiment.model_name)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides (key=value)")
    return p


def overrides_of(argv: list[str]) -> list[str]:
    """The Hydra overrides ``argv`` means: its key=value arguments plus the conventional flags translated."""
    args = parser().parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser().error(f"not a key=value override: {' '.join(bad)}")
    out = list(args.overrides)
    if args.host is not None:
        out.append(f"experiment.host={args.host}")
    if args.port is not None:
        out.append(f"experiment.port={args.port}")
    if args.model is not None:
        out += ["model=default", f"model.checkpoint={Path(args.model).resolve()}",
                f"model.name={Path(args.model).name}"]
    name = args.served_model_name or args.model
    if name is not None:
        out.append(f"experiment.model_name='{name}'")
    return out


def main(argv: list[str]) -> None:
    overrides = overrides_of(argv)  # --help and bad flags exit here, before JAX or Hydra load

    from hydra.errors import HydraException

    import phaseserve.quiet  # noqa: F401  (no backend-probe INFO lines)
    from phaseserve.config import ConfigError
    from phaseserve.server.launch import compose, serve

    try:
        cfg = compose(overrides)
    except HydraException as e:  # an unknown key or group, a malformed override
        raise SystemExit(f"error: {type(e).__name__}: {e}\n(python -m phaseserve.server --help)") from None
    try:
        serve(cfg)
    except ConfigError as e:
        raise SystemExit(f"error: ConfigError: {e}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
