#!/usr/bin/env bash
# The main job: install, then read one activation and steer one layer on SmolLM2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/vllm-nnsight "$@"
