"""Every ``VLLM_NNSIGHT_*`` variable is read in one place; a bad value is named
with its form and never stops vLLM: one the engine reads turns blocks off, one
only a client or the demo reads is theirs to fail on (real servers started with
each kind are in ``test_cli.py``)."""

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
    assert (
        settings.value("VLLM_NNSIGHT_MAX_SAVE_BYTES", {"VLLM_NNSIGHT_MAX_SAVE_BYTES": "8_388_608"}) == 8 << 20
    )
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
        ("VLLM_NNSIGHT_SMOLLM2_GGUF", "/no/such/file", "readable file"),
        ("VLLM_NNSIGHT_TAPS", "[1, 2]", "module patterns"),
    ],
)
def test_a_bad_value_is_named_with_its_form(name, raw, says):
    with pytest.raises(settings.SettingError, match=f"{name}.*must be .*{re.escape(says)}"):
        settings.check({name: raw})


def test_a_key_is_never_shown():
    problems = settings.problems({"VLLM_NNSIGHT_MAX_TTL_S": "s3cret", "VLLM_NNSIGHT_KEY": "s3cret"})
    assert problems and not any("s3cret" in p for p in problems if "KEY" in p)
    assert settings.blocks_off({"VLLM_NNSIGHT_KEY": "s3cret" * 10}) is None


def test_a_bad_engine_setting_turns_blocks_off_and_reads_as_its_default():
    """Fail closed for blocks, not for the server: the engine's machinery keeps
    its default, and every block is refused with the reason."""
    environ = {"VLLM_NNSIGHT_MAX_SAVE_BYTES": "lots", "VLLM_NNSIGHT_STEP_BUDGET_S": "-1"}
    off = settings.blocks_off(environ)
    assert off.startswith("blocks are off on this engine")
    assert "VLLM_NNSIGHT_MAX_SAVE_BYTES ('lots') must be a whole number of bytes" in off
    assert "VLLM_NNSIGHT_STEP_BUDGET_S ('-1') must be" in off
    assert settings.value("VLLM_NNSIGHT_MAX_SAVE_BYTES", environ) == 1 << 30
    assert settings.blocks_off({}) is None


def test_settings_only_a_client_or_the_demo_reads_leave_blocks_on_and_fail_where_read():
    environ = {
        "VLLM_NNSIGHT_SMOLLM2_GGUF": "/no/such/file",
        "VLLM_NNSIGHT_MEMORY": "0.5x",
        "VLLM_NNSIGHT_TRUST_SERVER": "maybe",
    }
    assert settings.blocks_off(environ) is None
    assert len(settings.problems(environ, settings.CLIENT)) == 3
    for name in environ:
        with pytest.raises(settings.SettingError, match=name):
            settings.value(name, environ)


def test_a_key_file_is_a_path_read_when_used():
    """Not there yet at start (a secret mounted later): no problem, blocks off until it is."""
    assert settings.problems({"VLLM_NNSIGHT_KEY_FILE": "/no/such/file"}) == []


@pytest.mark.parametrize(
    "raw, off",
    [
        ("1", True),
        ("yes", True),
        ("maybe", True),
        ("2", True),
        ("0", False),
        ("off", False),
        ("", False),
        ("FALSE", False),
    ],
)
def test_disable_means_off_for_anything_but_an_off_value(raw, off):
    assert settings.disabled({"VLLM_NNSIGHT_DISABLE": raw}) is off


def test_register_never_raises_whatever_the_settings(monkeypatch, caplog):
    """vLLM calls ``register`` in every process and does not catch what it raises."""
    import logging

    from vllm_nnsight_plugin import plugin

    for name, raw in [
        ("VLLM_NNSIGHT_MAX_SAVE_BYTES", "lots"),
        ("VLLM_NNSIGHT_SMOLLM2_GGUF", "/no/such"),
        ("VLLM_NNSIGHT_MEMORY", "0.5x"),
        ("VLLM_NNSIGHT_KEY_FILE", "/no/such"),
    ]:
        monkeypatch.setenv(name, raw)
    monkeypatch.setenv("VLLM_NNSIGHT_DISABLE", "1")
    monkeypatch.setattr(plugin, "_DONE", False)
    plugin.register()
    monkeypatch.setenv("VLLM_NNSIGHT_DISABLE", "0")
    monkeypatch.setattr(plugin, "_DONE", False)
    with caplog.at_level(logging.WARNING, logger="vllm_nnsight_plugin"):
        plugin._report_settings()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(errors) == 1 and "VLLM_NNSIGHT_MAX_SAVE_BYTES ('lots')" in errors[0]
    assert any("VLLM_NNSIGHT_SMOLLM2_GGUF" in w and "not by this engine" in w for w in warnings)
    assert any("VLLM_NNSIGHT_KEY_FILE names /no/such" in w for w in warnings)


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


def test_blocks_off_follows_the_environment_it_is_asked_about(monkeypatch):
    """Kept per set of raw values (the front end asks on every request): a value
    changed in the process's environment is read again."""
    monkeypatch.delenv("VLLM_NNSIGHT_STEP_BUDGET_S", raising=False)
    assert settings.blocks_off() is None
    monkeypatch.setenv("VLLM_NNSIGHT_STEP_BUDGET_S", "soon")
    assert "VLLM_NNSIGHT_STEP_BUDGET_S" in settings.blocks_off()
    monkeypatch.delenv("VLLM_NNSIGHT_STEP_BUDGET_S")
    assert settings.blocks_off() is None
