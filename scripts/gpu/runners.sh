#!/usr/bin/env bash
# One pytest command under each of vLLM's model runners in turn: V2 (stock's
# choice on 0.25.1) and V1 (VLLM_USE_V2_MODEL_RUNNER=0, an operator's choice).
# In turn, not at once: vLLM's memory profiling at start-up fails when another
# engine on the GPU allocates or frees meanwhile. After `device.sh setup`:
#   RUNNERS="v2 v1" bash scripts/gpu/runners.sh $OUT -o addopts= tests/engine/test_taps.py ...
# writes $OUT/v2.log and $OUT/v1.log and prints their failures and last lines.
set -uo pipefail
out=$1
shift
. /tmp/site/plugin_env.sh
for runner in ${RUNNERS:-v2 v1}; do
  (
    [ "$runner" = v1 ] && export VLLM_USE_V2_MODEL_RUNNER=0
    start=$(date +%s)
    python3 -m pytest "$@" -p no:cacheprovider -q -rf > "$out/$runner.log" 2>&1
    echo "runner=$runner rc=$? wall_s=$(( $(date +%s) - start ))" >> "$out/$runner.log"
  )
  echo "== $runner"
  grep -E "^(FAILED|ERROR)" "$out/$runner.log" | head -20
  tail -2 "$out/$runner.log"
done
