#!/usr/bin/env bash
# One-GPU (H200) recipe, meant for one call of the lent device (10 minutes): kernels against the measured copy
# bandwidth and matrix rate, then the three experiments at Moonlight-16B-A3B shapes (Kimi's architecture at one-GPU
# size, random BF16 weights). Everything it prints and writes lands in $OUT (or ./gpu_out).
# Not yet run: no device was lent to the task that wrote it. Carry the Hydra wheels as ../shared/device-wheels says.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import jax; print(jax.__version__, jax.devices())"; } 2>&1 | tee "$OUT/machine.txt"
timeout 150 python3 -m pallas_kernels.bench --out "$OUT/kernels.md" 2>&1 | tail -40
timeout 360 python3 experiments/reproduce.py hydra.run.dir="$OUT/reproduce" \
  'experiment.overrides=["model=moonlight","mesh=single","engine.attn_impl=auto"]' 2>&1 | tail -60
