"""Every ``VLLM_NNSIGHT_*`` variable is read in one place, and a bad value stops
a start with the variable's name (a real vLLM process refusing it is in
``test_cli.py``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from vllm_nnsight_plugin import settings

PACKAGE = Path(settings.__file__).parent


def test_defaults_and_forms():
    assert settings.value("VLLM_NNSIGHT_MAX_TTL_S", {}) == 900.0
    assert settings.value("VLLM_NNSIGHT_STEP_BUDGET_S", {"VLLM_NNSIGHT_STEP_BUDGET_S": "0"}) == 0
    assert settings.value("VLLM_NNSIGHT_MAX_SAVE_BYTES", {"VLLM_NNSIGHT_MAX_SAVE_BYTES": "8_388_608"}) == 8 << 20
    assert settings.value("VLLM_NNSIGHT_EAGER_STEPS", {"VLLM_NNSIGHT_EAGER_STEPS": ""}) is True
    assert settings.value("VLLM_NNSIGHT_EAGER_STEPS", {"VLLM_NNSIGHT_EAGER_STEPS": "off"}) is False
    assert settings.value("VLLM_NNSIGHT_TAPS", {"VLLM_NNSIGHT_TAPS": "a.b, c"}) == ("a.b", "c")
    assert settings.problems({}) == []


@pytest.mark.parametrize(
    "name, raw, says",
    [
        ("VLLM_NNSIGHT_MAX_SAVE_BYTES", "lots", "a whole number of bytes"),
        ("VLLM_NNSIGHT_MAX_PAYLOAD_BYTES", "0", "at least 1"),
        ("VLLM_NNSIGHT_MAX_TTL_S", "-5", "seconds above 0"),
        ("VLLM_NNSIGHT_STEP_BUDGET_S", "nan", "seconds above 0 (0: no limit)"),
        ("VLLM_NNSIGHT_DISABLE", "maybe", "1 or 0"),
        ("VLLM_NNSIGHT_MEMORY", "2", "a fraction"),
        ("VLLM_NNSIGHT_KEY_FILE", "/no/such/file", "readable file"),
        ("VLLM_NNSIGHT_TAPS", "[1, 2]", "module patterns"),
    ],
)
def test_a_bad_value_is_named_with_its_form(name, raw, says):
    with pytest.raises(settings.SettingError, match=f"{name}.*must be .*{re.escape(says)}"):
        settings.check({name: raw})


def test_a_key_is_never_shown():
    problems = settings.problems({"VLLM_NNSIGHT_KEY_FILE": "/no/such/file", "VLLM_NNSIGHT_KEY": "s3cret"})
    assert problems and not any("s3cret" in p for p in problems)


def test_every_variable_the_package_names_is_listed_and_read_here():
    """A ``VLLM_NNSIGHT_*`` string anywhere in the package is a listed setting, and
    only this module reads the environment for one."""
    named, readers = set(), []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith("VLLM_NNSIGHT_") and node.value.isupper():
                    named.add(node.value)
            if path.name != "settings.py" and isinstance(node, ast.Call):
                text = ast.unparse(node.func)
                if text in ("os.environ.get", "os.getenv") and node.args:
                    argument = ast.unparse(node.args[0])
                    if "NNSIGHT" in argument or argument.endswith("_ENV") or argument == "ENV":
                        readers.append(f"{path.relative_to(PACKAGE)}: {ast.unparse(node)}")
    assert named <= set(settings.ENVIRONMENT), sorted(named - set(settings.ENVIRONMENT))
    assert readers == []


def test_the_operators_table_is_the_one_in_the_docs():
    docs = (PACKAGE.parent / "docs" / "security.md").read_text()
    assert settings.table() in docs
