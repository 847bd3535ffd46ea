#!/usr/bin/env bash
# One-GPU (H200) recipe, for one call of the lent device (10 minutes). Stages, each time-boxed with `timeout` so a
# failure or hang in one still leaves the others' output, all written under $OUT (default ./gpu_out):
#   1. kernel checks: every Pallas kernel compiled (impl="pallas", not interpret) against its reference
#      (python -m lab.kernels.device_check)                                     -> $OUT/kernel_checks.{txt,json}
#   2. kernel benchmark against the measured copy bandwidth / matmul rate       -> $OUT/kernels.{md,txt}
#   3. the experiments on the shipped model, engine kernels chosen for the platform (reproduce.py: kv_dtype,
#      integrity, capacity; EXPERIMENTS / EXP_OVERRIDES_USER replace the selection / overrides)
#                                                                                -> $OUT/reproduce/, reproduce.txt
# $OUT/stages.txt gets one line per stage: name, exit status (124 = timed out), seconds.
# SMOKE=1: the same stages at tiny sizes on whatever backend is present (the CPU smoke test in
# tests/kernels/test_gpu_recipe.py); stage limits STAGE1_S / STAGE2_S / STAGE3_S override the defaults.
# Works with jax 0.10.x and 0.11.x (Python 3.11/3.12). Hydra is not installed on the device machine: carry the
# wheels as /work/shared/device-wheels/README says (.whl/ in the checkout); they are installed to /tmp/site.
# Python: $PYTHON, else the checkout's .venv if there is one, else python3. The script stops at once (status 2) if
# that Python cannot import jax, and exits 1 if any stage failed or timed out (0 only when every stage passed).
set -uo pipefail
OUT=${OUT:-gpu_out}
SMOKE=${SMOKE:-0}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
if ! "$PY" -c "import jax" 2>/dev/null; then
  echo "run_h200.sh: $PY cannot import jax; install the project (README) or set PYTHON" >&2
  exit 2
fi
mkdir -p "$OUT"
if [ -d .whl ] && ! "$PY" -c "import hydra" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
if [ "$SMOKE" = 1 ]; then
  S1=${STAGE1_S:-300}; S2=${STAGE2_S:-300}; S3=${STAGE3_S:-300}; SMOKE_FLAG=--smoke
  EXP_OVERRIDES='experiment.overrides=[]'; EXPERIMENTS='experiment.experiments=[capacity]'
else
  S1=${STAGE1_S:-150}; S2=${STAGE2_S:-150}; S3=${STAGE3_S:-240}; SMOKE_FLAG=
  # the shipped model through the engine with the platform's kernels. Moonlight shapes
  # (EXP_OVERRIDES_USER='experiment.overrides=["model=moonlight",...]') did not finish kv_dtype's first engine
  # in 150 s on the H200 (2026-12-04)
  EXP_OVERRIDES='experiment.overrides=["mesh=single","engine.attn_impl=auto"]'
  EXPERIMENTS=${EXPERIMENTS:-'experiment.experiments=[kv_dtype,integrity,capacity]'}
fi
: > "$OUT/stages.txt"
stage() {  # stage NAME LIMIT_S LOGFILE CMD...
  local name=$1 limit=$2 log=$3; shift 3
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$OUT/stages.txt"
  tail -25 "$log"
  [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
}
FAILED=0
{ date -u; command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PY" -c "import sys, jax; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())"; } 2>&1 \
  | tee "$OUT/machine.txt"
stage kernel_checks "$S1" "$OUT/kernel_checks.txt" \
  "$PY" -m lab.kernels.device_check $SMOKE_FLAG --out "$OUT/kernel_checks.json"
stage kernel_bench "$S2" "$OUT/kernels.txt" "$PY" -m lab.kernels.bench $SMOKE_FLAG --out "$OUT/kernels.md"
stage experiments "$S3" "$OUT/reproduce.txt" "$PY" experiments/reproduce.py hydra.run.dir="$OUT/reproduce" \
  "$EXPERIMENTS" "${EXP_OVERRIDES_USER:-$EXP_OVERRIDES}"
echo "done: $(tr '\n' ';' < "$OUT/stages.txt") failed stages: $FAILED"
[ "$FAILED" = 0 ]
