"""``vllm-nnsight``: the demo prints its two results and little else, ``doctor``
reports this install without starting an engine (its findings under other
settings: ``tests/unit/test_doctor.py``)."""

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
    assert "no operator key" in result.stdout
    assert "vLLM chooses which an engine builds, and the plugin runs on each" in result.stdout


def test_help_lists_the_commands():
    result = cli("--help", timeout=60)
    assert result.returncode == 0 and all(word in result.stdout for word in ("demo", "doctor", "bench"))


def test_the_demo_prints_its_results_and_little_else():
    # vLLM's CPU setting for the KV cache: the demo's default is a share of the machine
    result = cli("demo", "--max-model-len", "512", env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(out) <= 8, out
    assert "next token from the logits: ' Paris'" in result.stdout
    assert "steered:" in result.stdout
    assert not [line for line in result.stderr.splitlines() if " INFO " in line or "%|" in line]


def test_a_bad_security_setting_turns_blocks_off_and_vllm_serves_plain(tiny_qwen3_path, tmp_path):
    """A value the engine cannot use never stops vLLM: the server starts and serves
    plain requests, says once in its log why blocks are off, and refuses every
    block and operator command with that reason (a key's value is never shown).
    Settings only a client or the demo reads, and ``VLLM_NNSIGHT_DISABLE`` before
    any of them, are started with in ``test_serve.py``'s two servers."""
    import httpx

    from tests.servers import start_server
    from vllm_nnsight_plugin.wire.edits import sign_command

    key = "k" * 64
    env = {"VLLM_NNSIGHT_MAX_SAVE_BYTES": "lots", "VLLM_NNSIGHT_KEY": key}
    log = tmp_path / "server.log"
    server = start_server(tiny_qwen3_path, str(log), env=env)
    try:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0.0}
        plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert plain.status_code == 200 and plain.json()["choices"][0]["text"]
        said = "VLLM_NNSIGHT_MAX_SAVE_BYTES ('lots') must be a whole number of bytes"
        block = httpx.post(
            f"{server.url}/v1/completions",
            json={**body, "vllm_xargs": {"nnsight": "nns2:e30.x"}},
            timeout=120,
        )
        assert block.status_code == 403, block.text
        assert (
            block.json()["error"]["type"] == "NNsightBlocksDisabled"
            and said in block.json()["error"]["message"]
        )
        command = httpx.get(
            f"{server.url}/v1/nnsight/model",
            headers={"x-nnsight-signature": sign_command(key, "GET", "/v1/nnsight/model", b"")},
            timeout=60,
        )
        assert command.status_code == 403 and said in command.json()["error"]["message"]
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code == 200
    finally:
        server.stop()
    text = log.read_text()
    lines = [line for line in text.splitlines() if "blocks are off on this engine" in line]
    assert len(lines) == 1 and said in lines[0], lines
    assert key not in text
