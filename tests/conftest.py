"""Shared engines: starting one costs about a minute on this CPU, so each model's
engine is started once per test session (or per module, where a test needs
different engine settings) and shut down when it is no longer needed."""

from __future__ import annotations

import gc
import os

import pytest

from tests.engines import CORE_BIND, ENGINE_DEFAULTS, core_of

# An engine computes on one core (two workers: one each); keep the client's torch to one thread beside it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# How long a worker keeps a block nobody collected (default 30 s); short here so
# the test of that expiry does not wait.
UNCOLLECTED_S = 1.0
os.environ.setdefault("VLLM_NNSIGHT_UNCOLLECTED_S", str(UNCOLLECTED_S))
# Pools of saves over 16 KiB go home through shared memory (default 16 MiB), so the
# engine tests that keep rows run that path and the smaller ones the pickled one.
os.environ.setdefault("VLLM_NNSIGHT_SHARED_SAVES_BYTES", str(16 << 10))


def _worker_index() -> int | None:
    """This process's place among ``pytest -n N``'s workers (None: a serial run)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else None


# With two test workers on a CPU, each one's engines compute on a core of their own.
if core_of(_worker_index()) is not None:
    os.environ.setdefault(CORE_BIND, core_of(_worker_index()))

#: The modules that take longest (engines of their own, or many requests), run
#: first: with several workers (``--dist loadfile --no-loadscope-reorder``, which
#: keeps this order; xdist's own puts the modules with most tests first) the short
#: ones then fill in around them instead of one long module finishing last.
LONGEST_FIRST = (
    "test_docs.py",
    "test_compiled.py",
    "test_preemption.py",
    "test_cli.py",
    "test_serve.py",
    "test_async.py",
    "test_clone_reads.py",
    "test_seams.py",
    "test_tensor_parallel.py",
    "test_budget.py",
    "test_data_parallel.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-module order kept


def start_llm(path: str, **overrides):
    """A stock ``vllm.LLM``: nothing plugin-specific is passed."""
    from vllm import LLM

    return LLM(path, **{**ENGINE_DEFAULTS, **overrides})


def stop_llm(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from vllm_nnsight_plugin.models.smollm2 import smollm2_path

    return smollm2_path()


#: The session engine is tapped: every test that runs on it also checks that a
#: tap passes through whatever it is not asked to steer, and the user docs'
#: steering loop at these layers runs lowered (``taps/``). Beside the decoder
#: layers, an operation inside layer 10's attention (the attention's output,
#: before ``o_proj``) and a module that returns a tensor (layer 12's MLP).
SESSION_TAPS = [
    "model.layers.10.output",
    "model.layers.20.output",
    "model.layers.10.self_attn.source.self_attn_0.output",
    "model.layers.12.mlp.output",
    "model.layers.12.mlp.act_fn.output",  # 1536 neurons: wider than the hidden state
    "model.layers.4.self_attn.qkv_proj.output",  # (qkv, None): a linear layer without its bias
    "model.norm.output",  # (hidden, residual): the final norm, handed the residual
    "model.layers.10.self_attn.attn.inputs",  # the query, key and value attention is handed
]
#: The sites those patterns resolve to, in model order.
SESSION_SITES = [
    "model.layers.4.self_attn.qkv_proj",
    "model.layers.10",
    "model.layers.10.self_attn.source.self_attn_0",
    "model.layers.10.self_attn.attn.inputs.0",
    "model.layers.10.self_attn.attn.inputs.1",
    "model.layers.10.self_attn.attn.inputs.2",
    "model.layers.12.mlp",
    "model.layers.12.mlp.act_fn",
    "model.layers.20",
    "model.norm",
]


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    llm = start_llm(smollm2_path, additional_config={"nnsight_taps": SESSION_TAPS})
    yield llm
    stop_llm(llm)


@pytest.fixture(scope="session")
def smol(smollm2_llm):
    """The client, wrapping the stock LLM above."""
    from vllm_nnsight_plugin import VLLM

    return VLLM(smollm2_llm)


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory) -> str:
    from vllm_nnsight_plugin.models.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))
