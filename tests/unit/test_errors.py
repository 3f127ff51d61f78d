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

#: Exceptions that never leave the plugin: control flow inside one module.
#: (Warnings, and the ``BaseException`` a budget raises into a block, are not errors.)
INTERNAL = {"_Hazard", "_Unfollowed"}
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


def _answered() -> set[tuple[int, str]]:
    """The (status, kind) pairs the errors a server answers with declare (those
    that say their own, not the root's default)."""
    return {
        (error.http_status, error.kind)
        for error in ERRORS
        if (error.http_status, error.kind) != (PluginError.http_status, PluginError.kind)
    }


def test_each_answered_error_says_a_real_status_and_a_kind_of_ours():
    from http import HTTPStatus

    answered = _answered()
    assert ("NNsightBlocksDisabled" in {kind for _, kind in answered}) and len(answered) >= 9
    for status, kind in answered:
        assert 400 <= HTTPStatus(status).value < 600 and kind.startswith("NNsight"), (status, kind)


def test_the_docs_list_every_status_and_kind_a_server_answers():
    """The security page's tables (block requests and operator commands) are the
    one list users read; a class that answers otherwise fails here."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    documented = {(int(s), k) for s, k in re.findall(r"^\|\s*(\d{3})\s*\|\s*`(NNsight\w+)`", page, re.M)}
    assert _answered() == documented


def test_an_answer_is_the_class_s_status_kind_and_the_message_unchanged():
    from vllm_nnsight_plugin.errors import BlocksOffError, http_answer
    from vllm_nnsight_plugin.server.gate import Refusal
    from vllm_nnsight_plugin.wire.envelope import EnvelopeError, EnvelopeExpired, EnvelopeTooLarge

    message = "x" * 5000
    status, body = http_answer(EnvelopeTooLarge(message))
    assert status == 413 and body == {
        "error": {"message": message, "type": "NNsightPayloadTooLarge", "code": 413}
    }
    assert http_answer(EnvelopeExpired("late"))[0] == 403  # a subclass says its own
    assert http_answer(EnvelopeError("bad"))[1]["error"]["type"] == "NNsightBadEnvelope"
    refusal = Refusal.of(BlocksOffError("off"))
    assert (refusal.status, refusal.kind, refusal.message) == (403, "NNsightBlocksDisabled", "off")
