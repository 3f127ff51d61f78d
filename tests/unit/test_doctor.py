"""``vllm-nnsight doctor``'s findings under the settings an operator sets, read in
this process (``report()`` and ``main()``, what the command prints); the command
itself runs once, as a user runs it, in ``tests/engine/test_cli.py``."""

from __future__ import annotations

import pytest

from vllm_nnsight_plugin import doctor
from vllm_nnsight_plugin.settings import KEY, KEY_FILE, STEP_BUDGET_S


def findings() -> dict[str, str]:
    return dict(doctor.report())


@pytest.mark.parametrize(
    ("key", "said"),
    [
        (None, "no operator key (VLLM_NNSIGHT_KEY unset or empty)"),
        ("", "no operator key"),
        ("k" * 64, "an operator key is set: a server here runs blocks"),
        ("short", "a server here refuses every block"),
    ],
)
def test_the_trust_finding_says_what_the_operator_key_allows(monkeypatch, key, said):
    monkeypatch.delenv(KEY_FILE, raising=False)
    if key is None:
        monkeypatch.delenv(KEY, raising=False)
    else:
        monkeypatch.setenv(KEY, key)
    assert said in findings()["trust"]


def test_a_key_file_is_named_where_it_holds_no_key(monkeypatch, tmp_path):
    empty = tmp_path / "key"
    empty.write_text("\n")
    monkeypatch.delenv(KEY, raising=False)
    monkeypatch.setenv(KEY_FILE, str(empty))
    assert "no operator key (VLLM_NNSIGHT_KEY_FILE unset or empty)" in findings()["trust"]


@pytest.mark.parametrize(
    ("value", "said"), [(None, "vLLM chooses"), ("1", "VLLM_USE_V2_MODEL_RUNNER=1 chooses")]
)
def test_the_runner_finding_names_who_chooses(monkeypatch, value, said):
    if value is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    found = findings()["model runner"]
    assert said in found and "the plugin runs on each" in found


def test_a_setting_the_engine_cannot_use_is_wrong_and_the_command_fails(monkeypatch, capsys):
    monkeypatch.setenv(STEP_BUDGET_S, "-1")
    assert doctor.main() == 1
    printed = capsys.readouterr().out
    assert "wrong: blocks are off on this engine" in printed and STEP_BUDGET_S in printed


def test_usable_settings_pass(monkeypatch, capsys):
    monkeypatch.delenv(STEP_BUDGET_S, raising=False)
    monkeypatch.setenv(KEY, "k" * 64)
    status, printed = doctor.main(), capsys.readouterr().out
    assert status == 0, printed
    assert "every VLLM_NNSIGHT_* value is usable" in printed
