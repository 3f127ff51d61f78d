"""Rows of the prompt patched with values saved from another trace (activation
patching), on the taps: which blocks are read so, the tables and the tensor
operations against the block's own assignments, and on the session engine (eager,
fp32; tapped at layers 10 and 20) the patched request against the same block run
as Python, bit for bit."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from vllm import SamplingParams

from tests.engine.test_taps import PROMPT, bounds, same_generation, steering
from vllm_nnsight_plugin.taps import ops
from vllm_nnsight_plugin.taps.forms import Index
from vllm_nnsight_plugin.taps.install import TapTables
from vllm_nnsight_plugin.taps.lower import read_form

LAYER = "model.model.layers[index]"


@pytest.mark.parametrize(
    ("source", "patch", "select"),
    [
        # the patching page's: both halves of the stream at one position
        (
            f"out = {LAYER}.output\nout[0][position] = hidden_row\nout[1][position] = residual_row\n",
            ("hidden_row", "residual_row"),
            Index("position"),
        ),
        (f"{LAYER}.output[0][3] = row\n", ("row", None), 3),
        (f"hidden, residual = {LAYER}.output\nhidden[p] = a\nresidual[p] = b\n", ("a", "b"), Index("p")),
        (f"out = {LAYER}.output\nout[1][-2] = row\n", (None, "row"), -2),
        # one statement on the last row: a patch or a fill, told apart at admission
        (f"{LAYER}.output[0][-1] = row\n", None, -1),
    ],
)
def test_rows_set_to_captured_values_are_read_as_a_patch(source, patch, select):
    form = read_form(source)
    assert form is not None and form.patch == patch and form.select == select
    assert form.start == 0 and form.stop == 1  # the prompt's rows: the first step


@pytest.mark.parametrize(
    "source",
    [
        f"out = {LAYER}.output\nout[0][p] = a\nout[1][q] = b\n",  # two rows
        f"out = {LAYER}.output\nout[0][p] = a\nout[0][p] = b\n",  # the same half twice
        f"out = {LAYER}.output\nout[0][p] = a.to(x)\n",  # not a captured name
        f"out = {LAYER}.output\nout[0][p] = out[1][p]\n",  # from the tap itself
        f"for _ in tracer.iter[:3]:\n    out = {LAYER}.output\n    out[0][p] = a\n",  # every step
        f"out = {LAYER}.output\nout[0][index] = a\n",  # the layer's own name as the row
        f"hidden, residual = {LAYER}.output\nhidden[p] = residual\n",  # a half from the other
        f"hidden, hidden2 = {LAYER}.output\nhidden[p] = a\nhidden[p] = b\n",
    ],
)
def test_other_assignments_of_rows_run_as_python(source):
    form = read_form(source)
    assert form is None or form.patch is None


def test_a_patch_points_its_row_of_the_first_step_at_its_entry():
    tables = TapTables(("model.layers.0",), max_tokens=16, hidden=4, entries=4, device="cpu")
    third, second_last = steering(0, 0, 1), steering(0, 0, 1)
    third.select, second_last.select = 2, -2
    how = (float(ops.PATCH), 1.0, 1.0)
    assert tables.add("third", third, torch.ones(4), how=how, residual=torch.full((4,), 2.0))
    assert tables.add("second last", second_last, torch.full((4,), 3.0), how=(float(ops.PATCH), 1.0, -1.0))
    assert len(tables.bank_free) == tables.bank.shape[0] - 3  # a row for each value
    tables.fill(["third", "second last"], bounds([0, 5], [5, 4]))
    want = torch.full((1, 16), -1, dtype=torch.int32)
    want[0, 2], want[0, 7] = third.slot, second_last.slot  # the bank row of each (its how)
    assert torch.equal(tables.slots, want)
    hidden, residual = torch.zeros(9, 4), torch.zeros(9, 4)
    out = torch.ops.vllm_nnsight.steer_pair(hidden, residual, tables.slots, tables.bank, tables.how, 0)
    assert torch.equal(out[2], torch.ones(4)) and torch.equal(out[7], torch.full((4,), 3.0))
    assert torch.equal(residual[2], torch.full((4,), 2.0)) and int(residual.count_nonzero()) == 4
    assert int(out.count_nonzero()) == 8
    tables.fill(["third", "second last"], bounds([0, 1], [1, 1]))  # the next step: nothing
    assert bool((tables.slots == -1).all())
    tables.forget("third")
    assert len(tables.bank_free) == tables.bank.shape[0] - 1  # both its rows back


def test_patched_rows_on_the_tensor_operations_are_the_blocks_assignments_bit_for_bit():
    generator = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        hidden = torch.randn(7, 16, generator=generator).to(dtype)
        residual = torch.randn(7, 16, generator=generator).to(dtype)
        a, b = torch.randn(16, generator=generator), torch.randn(16, generator=generator).to(dtype)
        bank = torch.zeros(3, 16)
        bank[1], bank[2] = a, b.float()
        how = torch.zeros(3, 4)
        how[1] = torch.tensor([ops.PATCH, 1.0, 2.0, 0.0])
        slots = torch.full((1, 8), -1, dtype=torch.int32)
        slots[0, 4] = 1
        patched = residual.clone()
        got = ops.steer_pair(hidden, patched, slots, bank, how, 0)
        want_hidden, want_residual = hidden.clone(), residual.clone()
        want_hidden[4], want_residual[4] = a, b  # the block's own assignments
        assert torch.equal(got, want_hidden) and torch.equal(patched, want_residual), dtype
        alone = residual.clone()
        ops.steer(hidden, alone, slots, bank, how, 0)  # not a pair: the residual is never written
        assert torch.equal(alone, residual)


def test_a_patch_beside_other_edits_reads_only_its_own_rows_of_the_bank():
    """A scale by 100 and a clamp to infinity keep numbers where a patch keeps rows
    of the bank: in one step with a patch, none of them is taken for a row."""
    hidden, residual = torch.ones(3, 4), torch.ones(3, 4)
    bank = torch.zeros(3, 4)
    bank[1] = 7.0
    how = torch.tensor(
        [[ops.SCALE, 100.0, 0.0, 4.0], [ops.PATCH, 1.0, -1.0, 0.0], [ops.PROJECT, 0.0, float("inf"), 0.0]]
    )
    slots = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    got = ops.steer_pair(hidden, residual, slots, bank, how, 0)
    assert torch.equal(got[0], torch.full((4,), 100.0)) and torch.equal(got[1], torch.full((4,), 7.0))
    assert torch.equal(residual, torch.ones(3, 4))


def patched(model, rows, position):
    hidden_row, residual_row = rows
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        out = model.model.layers[10].output
        out[0][position] = hidden_row
        out[1][position] = residual_row
        result = tracer.result.save()
    return result


def patched_python(model, rows, position):
    hidden_row, residual_row = rows
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
        out = model.model.layers[10].output
        out[0][position] = hidden_row
        out[1][position] = residual_row
        result = tracer.result.save()
    return result


def lowered_like_python(llm, lowered, python):
    """Run a patching block lowered, then its Python twin: the first took the form
    ``patch`` (counted once), the second ran as Python, and both generated alike."""
    (before,) = llm.collective_rpc("nnsight_stats")
    got = lowered()
    (middle,) = llm.collective_rpc("nnsight_stats")
    want = python()
    assert got.nnsight_path["form"] == "patch", got.nnsight_path
    assert middle["lowered_by"]["patch"] - before["lowered_by"]["patch"] == 1
    assert not want.nnsight_path["lowered"]
    same_generation([got], [want])
    return got


def moved_from_plain(llm, got) -> None:
    """The patched request's first logprobs differ from a plain request's: it patched."""
    (plain,) = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=3, logprobs=3), use_tqdm=False
    )
    edited = {t: p.logprob for t, p in got.outputs[0].logprobs[0].items()}
    assert edited != {t: p.logprob for t, p in plain.outputs[0].logprobs[0].items()}


def test_a_patch_is_lowered_and_equals_the_python_path_bit_for_bit(smollm2_llm, smol):
    """Layer 10's stream at one prompt position replaced by another prompt's, as
    the patching page does, lowered (``patch``) and as Python."""
    with smol.trace("The capital of Italy is", temperature=0.0, max_tokens=1):
        clean = smol.model.layers[10].output
        hidden_row, residual_row = clean[0][2].clone().save(), clean[1][2].clone().save()
    rows = (hidden_row, residual_row)
    for position in (2, -1):
        got = lowered_like_python(
            smollm2_llm,
            partial(patched, smol, rows, position),
            partial(patched_python, smol, rows, position),
        )
    moved_from_plain(smollm2_llm, got)


def test_a_patch_of_some_columns_sets_only_those_bit_for_bit():
    """``x[p, a:b] = v`` (a head's output put back): those columns of the row, from
    the bank's row, rounded once as the assignment rounds ``v``; the rest as it was."""
    generator = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        hidden = torch.randn(5, 16, generator=generator).to(dtype)
        value = torch.randn(4, generator=generator)
        bank = torch.zeros(2, 16)
        bank[1, 8:12] = value
        how = torch.tensor([[0.0, 0.0, 0.0, 0.0], [ops.PATCH_COLUMNS, 1.0, 8.0, 12.0]])
        slots = torch.full((1, 8), -1, dtype=torch.int32)
        slots[0, 3] = 1
        got = ops.steer(hidden, hidden, slots, bank, how, 0)
        want = hidden.clone()
        want[3, 8:12] = value  # the block's own assignment
        assert torch.equal(got, want), dtype


def heads_patched(model, row, head: int, python: bool):
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        if python:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
        model.model.layers[10].self_attn.o_proj.input[-1, head * 64 : (head + 1) * 64] = row
        result = tracer.result.save()
    return result


def test_a_heads_output_put_back_is_lowered_and_equals_the_python_path_bit_for_bit(smollm2_llm, smol):
    """The patching page's per-head patch: one head's slice of what ``o_proj`` is
    handed at the last position, from another prompt, lowered onto the attention's
    tap and as Python."""
    with smol.trace("The capital of Italy is", temperature=0.0, max_tokens=1):
        heads = smol.model.layers[10].self_attn.o_proj.input[-1].clone().save()
    for head in (0, 3):
        row = heads[head * 64 : (head + 1) * 64]
        got = lowered_like_python(
            smollm2_llm,
            partial(heads_patched, smol, row, head, python=False),
            partial(heads_patched, smol, row, head, python=True),
        )
    moved_from_plain(smollm2_llm, got)
