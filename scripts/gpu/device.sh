#!/usr/bin/env bash
# GPU side, from the repository root (scripts/gpu/README.md). Three modes:
#   stash   keep the carried kit chunk / GGUF pieces in /tmp (one warm machine)
#   setup   install the vLLM kit, the wheels, the plugin's entry point, and
#           convert SmolLM2; then `. /tmp/site/plugin_env.sh` before python3
#   bench   the same without SmolLM2 (enough for benchmarks/gpu_bench.py on
#           the dummy Qwen3-8B: no GGUF pieces needed)
set -euo pipefail
K=$PWD/.vllmkit
STASH=/tmp/gpukit
mkdir -p "$STASH"
for f in "$K"/smollm2.gguf.[0-9][0-9]; do [ -e "$f" ] && cp -f "$f" "$STASH/"; done
[ -e "$K/smollm2.gguf.sha256" ] && cp -f "$K/smollm2.gguf.sha256" "$STASH/"
if ls "$K"/vllm-kit.tar.xz.[0-9][0-9] >/dev/null 2>&1; then
  bash "$K/install_vllm_kit.sh" stash
fi
echo "gguf pieces: $(cd "$STASH" && ls smollm2.gguf.[0-9][0-9] 2>/dev/null | tr '\n' ' ')"
[ "${1:-stash}" = stash ] && exit 0

bash "$K/install_vllm_kit.sh"
. /tmp/site/vllmkit_env.sh
if [ "$1" = setup ]; then
  cat "$STASH"/smollm2.gguf.[0-9][0-9] > "$STASH/SmolLM2-135M-Instruct.Q4_1.gguf"
  (cd "$STASH" && sed 's/smollm2.gguf$/SmolLM2-135M-Instruct.Q4_1.gguf/' smollm2.gguf.sha256 | sha256sum -c --quiet)
  python3 - "$K/wheels" <<'PY'
import glob, sys, zipfile
for wheel in glob.glob(sys.argv[1] + "/*.whl"):
    zipfile.ZipFile(wheel).extractall("/tmp/site")
PY
fi
D=/tmp/site/vllm_nnsight_plugin-0.1.0.dist-info
mkdir -p "$D"
printf 'Metadata-Version: 2.1\nName: vllm-nnsight-plugin\nVersion: 0.1.0\n' > "$D/METADATA"
printf '[vllm.general_plugins]\nnnsight = vllm_nnsight_plugin.plugin:register\n' > "$D/entry_points.txt"
cat > /tmp/site/plugin_env.sh <<ENV
. /tmp/site/vllmkit_env.sh
export PYTHONPATH=\$PYTHONPATH:$PWD PYTHONUNBUFFERED=1
export VLLM_NNSIGHT_CACHE=/tmp/nncache
ENV
# Only where setup joined it: a path to no file is a stale setting.
if [ -e "$STASH/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
  echo "export VLLM_NNSIGHT_SMOLLM2_GGUF=$STASH/SmolLM2-135M-Instruct.Q4_1.gguf" >> /tmp/site/plugin_env.sh
fi
. /tmp/site/plugin_env.sh
if [ "$1" = bench ]; then
  python3 -c "import vllm; print('GPU BENCH SETUP OK vllm', vllm.__version__)"
  exit 0
fi
python3 -m vllm_nnsight_plugin.models.smollm2
python3 -c "import pytest, gguf; print('GPU SETUP OK pytest', pytest.__version__)"
