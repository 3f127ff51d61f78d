#!/usr/bin/env bash
# Install, lint, and run the whole test suite against a real vLLM engine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
ruff check .
ruff format --check .
python -m pytest "$@"
