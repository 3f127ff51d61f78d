"""A number added to a tap's value (``hidden[:] += 4.0``) is lowered as the bank
row that adds the same (``taps/lower._number_added``), and only where every
device's rounding agrees with it."""

from __future__ import annotations

import ast
import types

import pytest
import torch

from vllm_nnsight_plugin.taps.lower import _number_added


def form(expression: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(vector=ast.Expression(ast.parse(expression, mode="eval").body), project=None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("expression", ["60.0", "3", "0.37 * s", "-2 ** 3", "0.1"])
def test_the_row_adds_what_python_adds_on_this_cpu(dtype, expression):
    hidden = (torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    row = _number_added(form(expression), {"s": 3}, 64, dtype, torch.device("cpu"))
    if row is None:  # refused: a number the dtype does not hold, where devices differ
        assert dtype != torch.float32 and expression in ("0.37 * s", "0.1")
        return
    python = hidden.clone()
    python[:] += eval(expression, {"s": 3})
    assert row.dtype == torch.float32 and row.shape == (64,)
    assert torch.equal((hidden.float() + row).to(dtype), python)


def test_only_numbers_make_a_row():
    cpu = torch.device("cpu")
    assert _number_added(form("s"), {"s": True}, 4, torch.float32, cpu) is None  # a bool is no number here
    assert _number_added(form("s"), {"s": "4"}, 4, torch.float32, cpu) is None
    assert _number_added(form("1 / 0"), {}, 4, torch.float32, cpu) is None  # Python raises on the request
    assert _number_added(form("2"), {}, 4, torch.float64, cpu) is None
    assert _number_added(form("10 ** 400"), {}, 4, torch.float32, cpu) is None  # no float holds it
    projected = types.SimpleNamespace(vector=form("2").vector, project=(False, None, None, False))
    assert _number_added(projected, {}, 4, torch.float32, cpu) is None
