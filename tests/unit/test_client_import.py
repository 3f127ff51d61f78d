"""A program that imports the client can still use an async HTTP client
(``httpx``, ``openai``): nnsight's ``.save`` on every object would otherwise
break anyio's classes, defined on first use (``client/__init__.py``)."""

from __future__ import annotations

import subprocess
import sys

PROGRAM = """
import asyncio
import httpx
from vllm_nnsight_plugin import VLLM  # imports nnsight

async def main():
    async with httpx.AsyncClient() as client:
        try:
            await client.get("http://127.0.0.1:9/")
        except httpx.HTTPError as error:
            print("refused", type(error).__name__)

asyncio.run(main())
"""


def test_an_async_http_client_works_after_the_client_is_imported():
    ran = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "refused ConnectError" in ran.stdout
