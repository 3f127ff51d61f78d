#!/usr/bin/env bash
# Install, lint, and run the whole test suite against real vLLM engines.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
ruff check .
ruff format --check .
# The embedded model, converted once before the test workers share it.
python -m vllm_nnsight_plugin.models.smollm2 > /dev/null
# The unit tests first (no engine: about a minute), then the engine tests. Two
# workers, a module each at a time, each one's engines on a core of their own
# (tests/conftest.py); TEST_WORKERS=0 runs each part in this one process.
python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder tests/unit "$@"
python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder tests/engine "$@"
