"""``vllm-nnsight``: the demo prints its two results and little else, ``doctor``
reports this install without starting an engine."""

from __future__ import annotations

import os
import subprocess
import sys


def cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_nnsight_plugin", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_doctor_reports_this_install_and_the_trust_mode():
    env = {"VLLM_NNSIGHT_KEY": "", "VLLM_NNSIGHT_KEY_FILE": ""}
    result = cli("doctor", env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    lines = dict(line.split(None, 1) for line in result.stdout.splitlines() if line.strip())
    assert lines["vllm"].endswith("(tested)")
    assert "vLLM loads the plugin" in result.stdout
    assert "the plugin relies on are in this vLLM's source" in result.stdout
    assert "no operator key" in result.stdout and "V1 runner" in result.stdout
    keyed = cli("doctor", env={"VLLM_NNSIGHT_KEY": "k" * 64}, timeout=120)
    assert "an operator key is set" in keyed.stdout
    short = cli("doctor", env={"VLLM_NNSIGHT_KEY": "short"}, timeout=120)
    assert "refuses every block" in short.stdout
    v2 = cli("doctor", env={"VLLM_USE_V2_MODEL_RUNNER": "1"}, timeout=120)
    assert v2.returncode == 1 and "V2 runner" in v2.stdout


def test_help_lists_the_commands():
    result = cli("--help", timeout=60)
    assert result.returncode == 0 and all(word in result.stdout for word in ("demo", "doctor", "bench"))


def test_the_demo_prints_its_results_and_little_else():
    result = cli("demo", "--max-model-len", "512")
    assert result.returncode == 0, result.stderr[-3000:]
    out = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(out) <= 8, out
    assert "next token from the logits: ' Paris'" in result.stdout
    assert "steered:" in result.stdout
    assert not [line for line in result.stderr.splitlines() if " INFO " in line or "%|" in line]


def test_a_bad_setting_stops_vllm_at_start_and_doctor_names_it(tiny_qwen3_path, tmp_path):
    """A value the plugin cannot use is refused where vLLM loads the plugin: the
    server does not start, and its log says which variable and what form it takes
    (a key's value is never shown)."""
    import pytest

    from tests.servers import start_server

    env = {"VLLM_NNSIGHT_MAX_SAVE_BYTES": "lots", "VLLM_NNSIGHT_KEY": "k" * 64}
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError, match="exited"):
        start_server(tiny_qwen3_path, str(log), env=env)
    text = log.read_text()
    assert "VLLM_NNSIGHT_MAX_SAVE_BYTES ('lots') must be a whole number of bytes" in text
    assert "k" * 64 not in text

    doctor = cli("doctor", env={"VLLM_NNSIGHT_STEP_BUDGET_S": "-1"}, timeout=120)
    assert doctor.returncode == 1
    assert "wrong (vLLM will not start): VLLM_NNSIGHT_STEP_BUDGET_S" in doctor.stdout
