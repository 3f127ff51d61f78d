#!/usr/bin/env bash
# The engine tests that depend on the model runner and the engine core, on vLLM
# 0.34.0: the release with no V1 runner, whose CPU engines run its standalone CPU
# runner (V2 family). The package index has 0.34.0 only for CUDA, so this takes a
# CPU build of it (../shared/vllm-cpu, or VLLM_034_WHEEL) into ./.venv-v034;
# everything else comes from the index. Extra arguments go to pytest; with
# --prepare alone it builds that environment and stops (.ci/run does that while the
# main tests run).
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=vllm-0.34.0+cpu-cp311-cp311-linux_x86_64.whl
WHEEL=${VLLM_034_WHEEL:-}
for found in ../shared/vllm-cpu/$NAME /work/shared/vllm-cpu/$NAME; do
  [ -n "$WHEEL" ] || { [ -e "$found" ] && WHEEL=$found; }
done
[ -n "$WHEEL" ] || { echo "vLLM 0.34.0 for CPU not found: set VLLM_034_WHEEL to $NAME" >&2; exit 2; }
PY=${PYTHON:-python3.11}
[ -x .venv-v034/bin/python ] || "$PY" -m venv .venv-v034
. .venv-v034/bin/activate
. scripts/installing.sh
if ! python -c "import vllm, nnsight, vllm_nnsight_plugin, pytest, xdist, transformers, openai" 2>/dev/null; then
  pip_install python "$WHEEL"
  pip_install python -e . --no-deps
  pip_install python "nnsight==0.8.1" "pytest>=8" "pytest-xdist>=3.6" "openai>=1" "transformers>=4.50" gguf accelerate safetensors tokenizers httpx
fi
python - <<'PY'
import nnsight, torch, vllm
print(f"installed: vllm {vllm.__version__}, torch {torch.__version__}, nnsight {nnsight.__version__}")
PY
# Every test engine sizes its KV cache (kv_cache_memory_bytes); this variable
# would override that on vLLM 0.34's CPU platform.
unset VLLM_CPU_KVCACHE_SPACE
python -m vllm_nnsight_plugin.models.smollm2 > /dev/null
[ "${1:-}" != --prepare ] || exit 0
python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  tests/unit/test_runners.py tests/engine/test_seams.py tests/engine/test_behaviour.py tests/engine/test_preemption.py \
  tests/engine/test_chunked_prefill.py tests/engine/test_taps.py tests/engine/test_taps_keep.py tests/engine/test_taps_source.py \
  tests/engine/test_taps_replay.py tests/engine/test_prefix.py \
  tests/engine/test_edits.py tests/engine/test_edits_lowered.py tests/engine/test_serve.py "$@"
