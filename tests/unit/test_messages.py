"""What the plugin's messages tell users to call exists: every ``model.<name>(``
and ``vllm_nnsight_plugin.<name>(`` written in a string of the package's source
(errors, warnings, docstrings a user reads) names an attribute of the client or
of the package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import vllm_nnsight_plugin
from vllm_nnsight_plugin import VLLM

PACKAGE = Path(vllm_nnsight_plugin.__file__).resolve().parent
CALL = re.compile(r"\b(model|vllm_nnsight_plugin)\.([A-Za-z_][A-Za-z_0-9]*)\(")


def told_to_call() -> set[tuple[str, str, str]]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for owner, name in CALL.findall(node.value):
                    found.add((owner, name, path.name))
    return found


def test_every_call_a_message_suggests_exists():
    calls = told_to_call()
    assert ("vllm_nnsight_plugin", "saves", "model.py") in calls  # the scan reads what it should
    missing = [
        f"{owner}.{name}( in {where}"
        for owner, name, where in sorted(calls)
        if not hasattr(vllm_nnsight_plugin if owner == "vllm_nnsight_plugin" else VLLM, name)
        and not (owner == "model" and name in _TORCH_MODULE_METHODS)
    ]
    assert not missing, missing


#: ``model`` in a few docstrings is a torch module, not the client.
_TORCH_MODULE_METHODS = {"named_modules", "get_submodule", "modules", "state_dict"}
