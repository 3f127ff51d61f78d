"""The worker extension: what the front end can call on each worker by name.

vLLM refuses an extension whose ``dir()`` shares a name with its ``Worker``.
nnsight mounts ``save`` on every object, so once nnsight is imported in the
process (a worker forked from a front end that uses the client, for one) both
classes "have" ``save``. The metaclass below lists only the names our classes
define, which is what the check means to compare. Nothing here imports nnsight
at module level either: it loads with the first request that carries a block.

vLLM mixes this class into its ``Worker`` (``worker_extension_cls``), so its
methods are reachable through ``collective_rpc``. Importing this module happens
in the worker processes only, when vLLM resolves that class, which makes it the
place where the runner seams are installed (``seams.runners.patch_model_runners``:
every runner this vLLM has, whichever the engine builds).

vLLM has one extension slot. When the user already set a class of their own, the
front end configures ``With_<hex>`` instead (the naming rule is
``seams.composed_name``), a name this module answers by building a class that
derives from both, so neither is lost.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

from .. import seams
from ..seams import composed_name as composed_name  # where it always was, too
from ..seams import composed_user
from ..seams.runners import patch_model_runners
from ..seams.worker import StepHooks
from ..taps.install import install
from ..taps.spec import RUNNER_ATTR as _TAPS
from ..wire.tree import TREE_VERSION, describe, tokenizer_files
from ..wire.trust import local_key
from .edits import clear, install_on, listed
from .runtime import WorkerRuntime

_RUNTIME = "_vllm_nnsight_runtime"


def runtime_of(runner: Any) -> WorkerRuntime:
    runtime = runner.__dict__.get(_RUNTIME)
    if runtime is None:
        runtime = runner.__dict__[_RUNTIME] = WorkerRuntime(runner)
    return runtime


def _on_step(runner: Any, scheduler_output: Any) -> None:
    runtime_of(runner).begin_step(scheduler_output)


def _on_step_failed(runner: Any) -> None:
    runtime_of(runner).abandon_step()


def _on_loaded(runner: Any) -> None:
    """Taps go on the model before vLLM compiles it (``taps/install.py``)."""
    if _TAPS in runner.__dict__:
        return  # a runner whose load_model calls its parent's

    runner.__dict__[_TAPS] = install(runner, runner.get_model())


def _on_layout(runner: Any) -> None:
    if runner.__dict__.get(_TAPS) is not None:
        runtime_of(runner).fill_taps()


def _on_replay(runner: Any) -> None:
    runtime_of(runner).forward_replayed()


patch_model_runners(StepHooks(_on_step, _on_step_failed, _on_loaded, _on_layout, _on_replay))
# Read the local key now, as the worker starts: a later change to this process's
# environment (vLLM's development RPC route can make one) cannot forge it.
local_key()


class _OwnNames(type):
    """``dir()`` of the class: the names its own classes define, not ``object``'s."""

    def __dir__(cls) -> list[str]:
        names: set[str] = set()
        for klass in cls.__mro__:
            if klass is not object:
                names.update(vars(klass))
        return sorted(names)


class NNsightWorkerExtension(metaclass=_OwnNames):
    """RPC endpoints; names are prefixed so they cannot clash with ``Worker``'s."""

    def nnsight_collect(self, request_ids: list[str], outputs: bytes | None = None) -> list[bytes] | None:
        # Only the front end's own call passes bytes; vLLM's development RPC route
        # passes strings, which must never reach the unpickler.
        if (
            not isinstance(outputs, bytes | None)
            or not isinstance(request_ids, list | tuple)
            or not all(isinstance(i, str) for i in request_ids)
        ):
            raise TypeError("nnsight_collect takes request ids and pickled outputs from the front end")
        return runtime_of(self.model_runner).collect(list(request_ids), outputs)

    # Edits: only the front end's own calls pass bytes (the envelope and its local
    # signature; the ids to clear as JSON); vLLM's development RPC route passes
    # strings, which are refused, and could not sign an envelope anyway.
    def nnsight_edit_install(
        self, edit_id: str, envelope: bytes, signature: bytes, name: str | None = None
    ) -> str | dict[str, str | None]:
        if not (
            isinstance(edit_id, str)
            and isinstance(envelope, bytes)
            and isinstance(signature, bytes)
            and (name is None or isinstance(name, str))
        ):
            raise TypeError("nnsight_edit_install takes an envelope and its signature from the front end")

        return install_on(
            runtime_of(self.model_runner),
            edit_id,
            envelope.decode("ascii", "replace"),
            signature.decode("ascii", "replace"),
            name,
        )

    def nnsight_edit_clear(self, edit_ids: bytes) -> list[str]:
        if not isinstance(edit_ids, bytes):
            raise TypeError("nnsight_edit_clear takes the ids to clear from the front end")
        ids = json.loads(edit_ids)
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            raise TypeError("nnsight_edit_clear takes a list of edit ids, or null for all")

        return clear(runtime_of(self.model_runner).requests, ids)

    def nnsight_edits(self) -> list[dict]:
        return listed(runtime_of(self.model_runner).requests)

    def nnsight_tree(self) -> dict:
        """The live model's module tree and the tokenizer's files, for a client
        with no vLLM (``wire/tree.py``)."""
        runner = self.model_runner
        return {
            "version": TREE_VERSION,
            "modules": describe(seams.model_of(runner)),
            "tokenizer": tokenizer_files(seams.tokenizer_of(runner)),
        }

    def nnsight_tracked(self) -> int:
        return runtime_of(self.model_runner).tracked()

    def nnsight_stats(self) -> dict:
        return runtime_of(self.model_runner).stats()


def __getattr__(name: str) -> Any:
    qualname = composed_user(name)  # the ``With_<hex>`` names ``composed_name`` makes
    if qualname is None:
        raise AttributeError(name)
    module_name, _, class_name = qualname.rpartition(".")
    user = getattr(importlib.import_module(module_name), class_name)
    composed = type(name, (user, NNsightWorkerExtension), {"__module__": __name__})
    globals()[name] = composed
    return composed
