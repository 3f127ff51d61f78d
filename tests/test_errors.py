"""One error root: every exception class the package defines for users to see
derives from ``PluginError`` and keeps its built-in base (no engine needed)."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil

import pytest

import vllm_nnsight_plugin
from vllm_nnsight_plugin import PluginError

#: Exceptions that never leave the plugin: control flow inside one module, and the
#: server's own carrier of an HTTP reply. (Warnings, and the ``BaseException`` a
#: budget raises into a block, are not errors.)
INTERNAL = {"_Hazard", "_Unfollowed", "Refused"}
#: What an error is made with, where that is not one message.
ARGUMENTS = {"ServeError": (422, "NNsightBlockError", "a message")}


def _defined_errors() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(vllm_nnsight_plugin.__path__, "vllm_nnsight_plugin."):
        if ".models." in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and issubclass(value, Exception)
                and not issubclass(value, Warning)
                and value.__module__ == module.__name__
                and name not in INTERNAL
            ):
                found.append(value)
    return found


ERRORS = _defined_errors()


def test_the_package_defines_its_errors():
    names = {error.__name__ for error in ERRORS}
    assert {"EnvelopeError", "PreemptedError", "SettingError", "PrefixClaimError"} <= names


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: f"{error.__module__}.{error.__name__}")
def test_every_error_derives_from_the_root_and_travels(error):
    assert issubclass(error, PluginError), f"{error.__module__}.{error.__name__} is not a PluginError"
    raised = error(*ARGUMENTS.get(error.__name__, ("a message",)))
    back = pickle.loads(pickle.dumps(raised))  # worker errors cross processes
    assert type(back) is error and str(back) == str(raised)


def test_each_keeps_its_built_in_base():
    from vllm_nnsight_plugin.folders import UnsafeFolderError
    from vllm_nnsight_plugin.wire.envelope import EnvelopeError
    from vllm_nnsight_plugin.worker.errors import PreemptedError

    assert issubclass(EnvelopeError, ValueError) and issubclass(UnsafeFolderError, PermissionError)
    assert issubclass(PreemptedError, RuntimeError)
