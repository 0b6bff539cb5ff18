#!/bin/bash
# The prepared GPU check (issue 39 item 6), for a bare GPU machine without registry access, run from the
# checkout's root with the wheels of ../shared/tools/device-wheels.sh in ./.whl (carried along: .whl is
# git-ignored). Two parts, each about 6-7 minutes on one H100 with the default budgets below, so both fit
# one 15-minute device allowance with the machine's start (docs/gpu.md, "The prepared check"):
#
#   RELPOS_COMMIT=<sha> bash scripts/gpu_check.sh --part 1     # training tokens/s, then the CUDA tests
#   RELPOS_COMMIT=<sha> bash scripts/gpu_check.sh --part 2     # evaluation time and memory
#   bash scripts/gpu_check.sh --dry-run                         # both parts on CPU, tiny shapes (no wheels needed)
#
# Each part merges into docs/results/gpu.json (part 2 adds to what part 1 wrote there: copy part 1's
# $OUT/gpu.json into docs/results/ of the checkout the device copies before running part 2), regenerates
# docs/results/gpu.md, and copies both to $OUT when it is set. RELPOS_COMMIT names the commit when
# the copy has no .git. Budgets (seconds, whole part): GPU_CHECK_TRAIN_S, GPU_CHECK_TESTS_S,
# GPU_CHECK_EVAL_S; the part stops cleanly before them, keeping what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
part=all dry=""
while [ $# -gt 0 ]; do
  case "$1" in
    --part) part="$2"; shift 2 ;;
    --part=*) part="${1#--part=}"; shift ;;
    --dry-run) dry="--dry-run"; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (--part 1|2|all, --dry-run)" >&2; exit 2 ;;
  esac
done
case "$part" in 1|2|all) ;; *) echo "gpu_check.sh: --part 1, 2 or all" >&2; exit 2 ;; esac
start=$(date +%s)
json=docs/results/gpu.json
[ -n "$dry" ] && json="${OUT:-/tmp}/gpu-dry.json"   # a dry run never writes docs/results/gpu.json

# what the image lacks (hydra, omegaconf, datasets, x-transformers, ...), from the wheels brought along
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "$dry" ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    if [ ! -f /tmp/site/.relpos-wheels ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && touch /tmp/site/.relpos-wheels
    fi
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
  else
    echo "gpu_check.sh: no .whl/*.whl (run ../shared/tools/device-wheels.sh here and carry .whl); using what is installed" >&2
  fi
  python3 -c "import hydra, omegaconf, x_transformers" 2>/dev/null || echo "gpu_check.sh: hydra/omegaconf/x_transformers missing: those items will be recorded as errors" >&2
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader 2>/dev/null || true
fi
# a fresh compile cache: first calls are what a user's first run meets
export RELPOS_CACHE="$(mktemp -d /tmp/relpos-gpu-check.XXXXXX)"
unset TORCHINDUCTOR_CACHE_DIR

check() { python3 scripts/gpu_check.py $dry --json "$json" "$@"; }
status=0
if [ "$part" = 1 ] || [ "$part" = all ]; then
  check --part train --deadline-s "${GPU_CHECK_TRAIN_S:-220}" || status=$?
  check --part tests --deadline-s "${GPU_CHECK_TESTS_S:-140}" || status=$?
fi
if [ "$part" = 2 ] || [ "$part" = all ]; then
  check --part eval --deadline-s "${GPU_CHECK_EVAL_S:-330}" || status=$?
fi
md="${json%.json}.md"
python3 scripts/gpu_report.py "$json" --out "$md" || status=$?
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  cp "$json" "$OUT/gpu.json" 2>/dev/null; cp "$md" "$OUT/gpu.md" 2>/dev/null
fi
echo "gpu_check.sh --part $part: $(( $(date +%s) - start )) s, exit $status; $json, $md"
exit $status
