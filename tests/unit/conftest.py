"""Unit tests start no engine: each one runs with vLLM's engine configuration
refused (every engine, offline or async, builds one first), so a test that needs
an engine fails here and belongs in ``tests/engine/``."""

from __future__ import annotations

import pytest


class EngineInUnitTest(AssertionError):
    pass


def _refuse(*args, **kwargs):
    raise EngineInUnitTest("a unit test started a vLLM engine; move it to tests/engine/")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.__dict__["create_engine_config"]
    EngineArgs.create_engine_config = _refuse
    try:
        return (yield)
    finally:
        EngineArgs.create_engine_config = original
