#!/bin/bash
# The prepared GPU check (issue 39 item 6), for a bare GPU machine without registry access, run from the
# checkout's root with the wheels of ../shared/tools/device-wheels.sh in ./.whl (carried along: .whl is
# git-ignored). Everything in one call of about 9 minutes on one H100 with the default budgets below, so it
# fits one 15-minute device allowance with the machine's start (docs/gpu.md, "The prepared check"):
#
#   RELPOS_COMMIT=<sha> bash scripts/gpu_check.sh               # all: parts 1, 3 and 2, in that order
#   RELPOS_COMMIT=<sha> bash scripts/gpu_check.sh --part 1      # the CUDA tests, training tokens/s, then its profile
#   RELPOS_COMMIT=<sha> bash scripts/gpu_check.sh --part 4      # the profile alone: where a training step's time goes
#   RELPOS_COMMIT=<sha> bash scripts/gpu_check.sh --part 5      # train.compile against eager (not in all: minutes of compiles)
#   RELPOS_COMMIT=<sha> bash scripts/gpu_check.sh --part 2      # evaluation time and memory
#   RELPOS_COMMIT=<sha> bash scripts/gpu_check.sh --part 3      # the fused kernels over launch settings (bench_kernels.py)
#   RELPOS_COMMIT=<sha> bash scripts/gpu_check.sh --part 6      # the host's time per fused-kernel call (seconds)
#   RELPOS_COMMIT=<sha> bash scripts/gpu_check.sh --part 3,2    # several, in the order given
#   bash scripts/gpu_check.sh --dry-run                         # every part on CPU, tiny shapes (no wheels needed)
#
# Each part merges into docs/results/gpu.json, or, when $OUT is set, into $OUT/gpu.json (started from
# docs/results/gpu.json, or from what an earlier call in the same $OUT wrote), written after every measurement so that a call cut off still returns what it
# measured; docs/results/gpu.md (or $OUT/gpu.md) is regenerated from it. Copy both into docs/results/.
# RELPOS_COMMIT names the commit when the copy has no .git. Budgets (seconds, whole part):
# GPU_CHECK_TESTS_S, GPU_CHECK_TRAIN_S, GPU_CHECK_PROFILE_S, GPU_CHECK_COMPILE_S, GPU_CHECK_KERNELS_S, GPU_CHECK_LAUNCH_S,
# GPU_CHECK_EVAL_S; the part stops cleanly before them, keeping what it measured. GPU_CHECK_TOTAL_S (575)
# bounds the whole call, the wheels' install included: a part gets less than its budget when less is left
# (run it with the device's timeout_s 585 or more). GPU_CHECK_SCHEMES=t5,rope times NoPE and those schemes only.
# GPU_CHECK_COMPILE_MODES=cudagraphs: the compile part times only those of eager, compiled, cudagraphs.
set -uo pipefail
cd "$(dirname "$0")/.."
part=all dry=""
while [ $# -gt 0 ]; do
  case "$1" in
    --part) part="$2"; shift 2 ;;
    --part=*) part="${1#--part=}"; shift ;;
    --dry-run) dry="--dry-run"; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (--part 1|2|3|4|5|6|all or a comma-separated list, --dry-run)" >&2; exit 2 ;;
  esac
done
[ "$part" = all ] && part=1,3,2
for p in ${part//,/ }; do
  case "$p" in 1|2|3|4|5|6) ;; *) echo "gpu_check.sh: --part takes 1, 2, 3, 4, 5, 6, all or a comma-separated list of them; got $part" >&2; exit 2 ;; esac
done
start=$(date +%s)
json=docs/results/gpu.json
if [ -n "$dry" ]; then
  json="${OUT:-/tmp}/gpu-dry.json"   # a dry run never writes docs/results/gpu.json
elif [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  # started from the committed one, unless an earlier call of this command wrote it: calls merge
  [ -f "$json" ] && [ ! -f "$OUT/gpu.json" ] && cp "$json" "$OUT/gpu.json"
  json="$OUT/gpu.json"
fi

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
# a fresh compile cache: first calls are what a user's first run meets; removed on exit (under $TMPDIR)
export RELPOS_CACHE="$(mktemp -d -t relpos-gpu-check.XXXXXX)"
trap 'rm -rf "$RELPOS_CACHE"' EXIT
unset TORCHINDUCTOR_CACHE_DIR

# each part with an empty Triton cache on disk too: its first fused call compiles, as a user's first run does
# GPU_CHECK_SCHEMES (comma-separated): every part times NoPE and those schemes only (gpu_check.py --schemes)
check() {
  local triton_cache code=0
  triton_cache="$(mktemp -d -t relpos-gpu-triton.XXXXXX)"
  TRITON_CACHE_DIR="$triton_cache" python3 scripts/gpu_check.py $dry --json "$json" \
    ${GPU_CHECK_SCHEMES:+--schemes "$GPU_CHECK_SCHEMES"} "$@" || code=$?
  rm -rf "$triton_cache"
  return $code
}
# a part's deadline: its budget, or less when the call's total (GPU_CHECK_TOTAL_S, inside the device command's
# limit) has less left after a part's start (torch, CUDA: ~10 s outside its own clock) and the report
total=${GPU_CHECK_TOTAL_S:-575}
budget() { local left=$(( total - ($(date +%s) - start) - 15 )); echo $(( left < $1 ? (left > 0 ? left : 0) : $1 )); }
md="${json%.json}.md"
# the page after every part, so that a call killed later still returns it
report() { python3 scripts/gpu_report.py "$json" --out "$md" >/dev/null || status=$?; }
status=0
for p in ${part//,/ }; do
  case "$p" in
    1)  # the tests first: they say whether the fused kernels' figures below count
        check --part tests --deadline-s "$(budget "${GPU_CHECK_TESTS_S:-140}")" || status=$?; report
        check --part train --deadline-s "$(budget "${GPU_CHECK_TRAIN_S:-150}")" || status=$?; report
        # GPU_CHECK_PROFILE_S=0 leaves the profile out (part 4 runs it alone)
        if [ "${GPU_CHECK_PROFILE_S:-90}" -gt 0 ]; then
          check --part profile --deadline-s "$(budget "${GPU_CHECK_PROFILE_S:-90}")" || status=$?; report
        fi
        ;;
    2)  check --part eval --deadline-s "$(budget "${GPU_CHECK_EVAL_S:-150}")" || status=$?; report ;;
    3)  check --part kernels --deadline-s "$(budget "${GPU_CHECK_KERNELS_S:-90}")" || status=$?; report ;;
    4)  check --part profile --deadline-s "$(budget "${GPU_CHECK_PROFILE_S:-90}")" || status=$?; report ;;
    5)  check --part compile --deadline-s "$(budget "${GPU_CHECK_COMPILE_S:-240}")" \
          ${GPU_CHECK_COMPILE_MODES:+--compile-modes "$GPU_CHECK_COMPILE_MODES"} || status=$?; report ;;
    6)  check --part launch --deadline-s "$(budget "${GPU_CHECK_LAUNCH_S:-60}")" || status=$?; report ;;
  esac
done
echo "gpu_check.sh --part $part: $(( $(date +%s) - start )) s, exit $status; $json, $md"
exit $status
