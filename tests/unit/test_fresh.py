"""Names a block binds only to tensors it made (``taps/fresh.py``): writes into
them reach no activation, and a view assigned into them is copied, not kept."""

from __future__ import annotations

import types

import torch

from vllm_nnsight_plugin.taps.fresh import fresh_tensors
from vllm_nnsight_plugin.taps.replay import _aliasing

HEADS = """\
heads_in = attention.o_proj.input
each = []
for h in range(9):
    alone = torch.zeros_like(heads_in)
    alone[:, h * 64 : (h + 1) * 64] = heads_in[:, h * 64 : (h + 1) * 64]
    each.append(attention.o_proj(alone)[0])
contributions = torch.stack(each).save()
"""


def test_a_tensor_made_by_torch_is_fresh_only_where_torch_is_torch():
    assert fresh_tensors(HEADS, {"torch": torch}) == {"alone"}
    assert fresh_tensors(HEADS, {"torch": types.SimpleNamespace(zeros_like=torch.zeros_like)}) == set()
    assert fresh_tensors(HEADS, {}) == set()


def test_any_other_binding_of_the_name_makes_it_not_fresh():
    scope = {"torch": torch}
    for other in (
        "alone = heads_in",
        "alone, b = heads_in, 1",
        "for alone in [heads_in]: pass",
        "del alone",
        "with open('x') as alone: pass",
        "f = lambda alone: alone",
        "s = [alone for alone in rows]",
        "(alone := heads_in)",
        "torch = fake",  # torch rebound in the block: its zeros_like may be anything
        "import torch",
        "from numpy import zeros as torch",
        "def torch(): pass",
        "def alone(): pass",
        "global alone",
    ):
        assert fresh_tensors(HEADS + other + "\n", scope) == set(), other
    assert fresh_tensors(HEADS + "alone += 1\n", scope) == {"alone"}  # in place, into itself


def test_a_view_copied_into_a_made_tensor_is_not_kept():
    scope = {"torch": torch}
    assert _aliasing(HEADS, scope) is None
    kept = HEADS.replace("alone = torch.zeros_like(heads_in)", "alone = [0] * 9")
    assert _aliasing(kept, scope) is not None  # a list keeps what is assigned into it
    stale = HEADS + "extra = model.x.output\nrows = heads_in[0] + alone[0]\n"
    assert _aliasing(stale, scope) is not None  # a view used after a later read is still one
