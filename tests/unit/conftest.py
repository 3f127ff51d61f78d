"""Unit tests start no engine: each one runs with vLLM's offline and async engines
refused, so a test that needs an engine fails here and belongs in ``tests/engine/``.
(Their constructors: the plugin wraps neither, so the refusal never meets a wrap.)"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


class EngineInUnitTest(AssertionError):
    pass


def _refuse(*args, **kwargs):
    raise EngineInUnitTest("a unit test started a vLLM engine; move it to tests/engine/")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if HERE not in Path(item.path).resolve().parents:  # this hook sees every module's tests
        return (yield)
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine

    originals = {owner: owner.__dict__["__init__"] for owner in (LLMEngine, AsyncLLM)}
    for owner in originals:
        owner.__init__ = _refuse
    try:
        return (yield)
    finally:
        for owner, original in originals.items():
            owner.__init__ = original
