"""Which runner adapter serves a live model runner: the registry of the runner
families (``runner_v1.py``, ``runner_v2.py``), kept apart from the interface they
implement (``worker.py``) so that each family depends on the interface only."""

from __future__ import annotations

from typing import Any

from .runner_v1 import V1Runner
from .runner_v2 import V2Runner
from .worker import Runner, StepHooks, runner_name

_ADAPTER = "_nnsight_runner"


def runners() -> tuple[type[Runner], ...]:
    return (V2Runner, V1Runner)


def patch_model_runners(hooks: StepHooks) -> None:
    """Wrap every runner this vLLM has: which one an engine builds is vLLM's choice."""
    for family in runners():
        family.patch(hooks)


def runner_of(runner: Any) -> Runner:
    """The adapter for a live runner (kept on it)."""
    found = runner.__dict__.get(_ADAPTER)
    if found is None:
        family = next((f for f in runners() if f.runs(runner)), None)
        if family is None:
            raise TypeError(f"vllm-nnsight-plugin does not know the model runner {runner_name(runner)}")
        found = runner.__dict__[_ADAPTER] = family()
    return found
