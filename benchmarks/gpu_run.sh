#!/usr/bin/env bash
# Every GPU check in one prepared command, for a lent GPU machine as it comes (Python 3.12, its own torch, no
# network, none of hydra-core, omegaconf, antlr4, submitit or torchdata): benchmarks/gpu_check.py's checks, one JSON
# and one log under $OUT, within GPU_RUN_BUDGET_S (default 480 s: a failure leaves time to fix and rerun once).
#
#   bash benchmarks/gpu_run.sh --fetch   # here, once: the pure-Python wheels that machine lacks, into .whl/ (ignored)
#   bash benchmarks/gpu_run.sh           # there: the device tool's run, with carry [".whl"]
#   bash benchmarks/gpu_run.sh --cpu     # the rehearsal: the same steps in CPU mode (gloo), from a venv with torch only
#
# The project is never pip-installed there (`pip install -e .` would ask the index for torch): the wheels go into a
# folder of their own (--target) and PYTHONPATH names it and the checkout, which the launcher's ranks inherit.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
# Pure-Python, pinned to what CI tests; antlr4's 4.9.3 (what omegaconf 2.3 needs) is an sdist only: built here.
WHEELS=(hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 submitit==1.5.4 torchdata==0.11.0)

if [ "${1:-}" = "--fetch" ]; then
  mkdir -p .whl && rm -f .whl/*.whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  python3 -m pip wheel --no-deps -q -w .whl "${WHEELS[@]}" || exit
  ls .whl
  exit 0
fi

MODE=()
[ "${1:-}" = "--cpu" ] && MODE=(--cpu)
[ -n "${GPU_RUN_ONLY:-}" ] && MODE+=(--only "$GPU_RUN_ONLY")  # a part of the checks (the tests' rehearsal)
OUT=${OUT:-$REPO/gpu-run-out}
mkdir -p "$OUT"
LOG=$OUT/gpu_run.log
SITE=${GPU_RUN_SITE:-/tmp/gpu-run-site}
{
  echo "gpu_run: $(date -u +%FT%TZ) on $(hostname); python $(python3 -V 2>&1)"
  ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run 'bash benchmarks/gpu_run.sh --fetch' here first, and carry .whl"; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 3
  export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  python3 -c 'import torch, hydra, omegaconf, submitit, torchdata; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(), "hydra from", hydra.__file__)' || exit 3
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  timeout "${GPU_RUN_BUDGET_S:-480}" python3 -m benchmarks.gpu_check "${MODE[@]}" --out "$OUT/gpu_check.json" \
    --budget-s "$(( ${GPU_RUN_BUDGET_S:-480} - 20 ))"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
