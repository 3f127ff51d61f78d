#!/usr/bin/env bash
# CPU side. Lay what a GPU run needs beside the vLLM 0.25.1 kit in .vllmkit/
# (ignored by git): SmolLM2's GGUF in 20 MiB pieces, and the pure-Python wheels
# the GPU image lacks (pytest, gguf). A run carries at most 64 MiB per command,
# so the pieces travel next to the kit's chunks; scripts/gpu/README.md has the
# command sequence.
set -euo pipefail
cd "$(dirname "$0")/../.."
K=.vllmkit
[ -f "$K/vllm-kit.tar.xz.00" ] || { echo "no vLLM kit in $K: build it first"; exit 2; }
PY=${PYTHON:-python3}
GGUF=$($PY - <<'PY'
import tempfile
from pathlib import Path
from vllm_nnsight_plugin.models.smollm2 import _find_gguf, cache_root
keep = cache_root() / "gguf"
keep.mkdir(parents=True, exist_ok=True)
found = _find_gguf(keep)
print(found)
PY
)
rm -f "$K"/smollm2.gguf.*
split -b 20M -d -a 2 "$GGUF" "$K/smollm2.gguf."
(cd "$K" && sha256sum "$GGUF" | awk '{print $1"  smollm2.gguf"}' > smollm2.gguf.sha256)
mkdir -p "$K/wheels"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d "$K/wheels" pytest pluggy iniconfig packaging pygments gguf
ls -la "$K"/smollm2.gguf.* "$K/wheels"
