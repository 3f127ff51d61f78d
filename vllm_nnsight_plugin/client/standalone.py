"""The client without vLLM installed: stand-ins for the few vLLM names it uses.

A client that only traces against a server never runs an engine, but nnsight's
``VLLM`` front imports a handful of vLLM names as it builds requests:
``SamplingParams`` (each invoke's settings), ``TokensPrompt`` (a token-id
prompt), and the parallel layer classes its envoys are keyed on. Where vLLM is
installed nothing here is used. Where it is not, :func:`vllm_stand_ins` puts
small stand-ins under those names in ``sys.modules`` for the duration of one of
the client's own calls into nnsight, and takes them out again, so ``import vllm``
anywhere else in the process keeps failing the way it should.

The stand-in ``SamplingParams`` takes exactly the fields a served request
carries (``remote.SAMPLING_FIELDS``), with vLLM's defaults (checked against the
real class by ``tests/unit/test_standalone.py``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

#: vLLM's ``SamplingParams`` defaults for the fields a served request carries.
DEFAULTS: dict[str, Any] = {
    "n": 1,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "max_tokens": 16,
    "min_tokens": 0,
    "stop": [],
    "stop_token_ids": [],
    "ignore_eos": False,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logprobs": None,
    "prompt_logprobs": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "bad_words": [],
    "allowed_token_ids": None,
}


@functools.cache
def vllm_installed() -> bool:
    """Whether vLLM itself can be imported here (asked once, before any stand-in)."""
    if "vllm" in _MADE:
        return False
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


class SamplingParams:
    """A served request's sampling settings, where vLLM is not installed."""

    def __init__(self, **fields: Any) -> None:
        unknown = sorted(set(fields) - set(DEFAULTS) - {"extra_args"})
        if unknown:
            raise TypeError(
                f"{unknown[0]!r} is not a sampling setting a served request carries; "
                f"those are: {', '.join(DEFAULTS)}."
            )
        for name, default in DEFAULTS.items():
            value = fields.get(name, default)
            setattr(self, name, list(value) if isinstance(value, (list, tuple)) else value)
        self.extra_args: dict | None = fields.get("extra_args")

    def __repr__(self) -> str:
        changed = {k: v for k, v in vars(self).items() if k in DEFAULTS and v != DEFAULTS[k]}
        return f"SamplingParams({', '.join(f'{k}={v!r}' for k, v in changed.items())})"


def TokensPrompt(**fields: Any) -> dict:  # noqa: N802 - vLLM's name for a TypedDict
    return dict(fields)


class _Layer:
    """Stands in for vLLM's parallel layer classes: no served module is one."""


def _modules() -> dict[str, types.ModuleType]:
    made = {}
    for name in (
        "vllm",
        "vllm.inputs",
        "vllm.model_executor",
        "vllm.model_executor.layers",
        "vllm.model_executor.layers.linear",
        "vllm.model_executor.layers.vocab_parallel_embedding",
    ):
        made[name] = types.ModuleType(name, "a stand-in: vLLM is not installed here")
    made["vllm"].SamplingParams = SamplingParams
    made["vllm.inputs"].TokensPrompt = TokensPrompt
    linear = made["vllm.model_executor.layers.linear"]
    linear.ColumnParallelLinear = type("ColumnParallelLinear", (_Layer,), {})
    linear.RowParallelLinear = type("RowParallelLinear", (_Layer,), {})
    embedding = made["vllm.model_executor.layers.vocab_parallel_embedding"]
    embedding.VocabParallelEmbedding = type("VocabParallelEmbedding", (_Layer,), {})
    return made


_LOCK = threading.Lock()
_USERS = 0
_MADE: dict[str, types.ModuleType] = {}


@contextlib.contextmanager
def vllm_stand_ins() -> Iterator[None]:
    """Within: vLLM's names resolve to the stand-ins, if vLLM is not installed."""
    global _USERS
    if vllm_installed():
        yield
        return
    with _LOCK:
        if not _MADE:
            _MADE.update(_modules())
        if _USERS == 0:
            sys.modules.update(_MADE)
        _USERS += 1
    try:
        yield
    finally:
        with _LOCK:
            _USERS -= 1
            if _USERS == 0:
                for name, module in _MADE.items():
                    if sys.modules.get(name) is module:
                        del sys.modules[name]
