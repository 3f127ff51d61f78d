"""A tap's value scaled or filled, on all its columns or some (an MLP zeroed, a
head's columns silenced, a layer damped): which blocks are read so and which
stay Python, the tensor operations against the block's own arithmetic, and on
the session engine (eager, fp32; tapped at layers 10 and 20 and at layer 12's
MLP) each lowered block against the same block run as Python, bit for bit."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from tests.engine.test_taps import PROMPT, same_generation
from vllm_nnsight_plugin.taps import ops
from vllm_nnsight_plugin.taps.lower import Unlowered, _change, read_form

MLP = "model.model.layers[12].mlp"


@pytest.mark.parametrize(
    ("source", "kind", "columns", "select", "whole"),
    [
        (f"{MLP}.output[:] = 0\n", "fill", None, None, True),
        (f"for _ in tracer.all():\n    {MLP}.output[:] *= 0.5\n", "scale", None, None, True),
        ("hidden = model.model.layers[10].output[0]\nhidden *= 2\n", "scale", None, None, False),
        ("model.model.layers[10].output[0][:, 64:128] = 0\n", "fill", "slice", None, False),
        ("model.model.layers[10].output[0][-1, head * 64 :] *= 1.5\n", "scale", "slice", -1, False),
        (
            "for _ in tracer.iter[:3]:\n    h = model.model.layers[10].output[0]\n    h[:, n] = 0.0\n",
            "fill",
            "index",
            None,
            False,
        ),
        # what a module is handed (an operation's value, where it is a tap)
        ("model.model.layers[10].self_attn.o_proj.input[:, 64:128] = 0\n", "fill", "slice", None, True),
        # the module's tensor replaced by itself scaled
        (f"out = {MLP}.output\n{MLP}.output = out * 0.5\n", "scale", None, None, True),
        (
            f"for _ in tracer.iter[:2]:\n    out = {MLP}.output\n    {MLP}.output = s * out\n",
            "scale",
            None,
            None,
            True,
        ),
        # over several layers
        (
            "for _ in tracer.all():\n    for i in range(20, 24):\n        model.model.layers[i].mlp.output[:] = 0\n",
            "fill",
            None,
            None,
            True,
        ),
    ],
)
def test_a_value_scaled_or_filled_is_read_as_such(source, kind, columns, select, whole):
    form = read_form(source)
    assert form is not None and form.change is not None
    assert form.change[0] == kind
    assert (form.change[1] and form.change[1][0]) == columns
    assert form.select == select and form.whole == whole


@pytest.mark.parametrize(
    "source",
    [
        # an assignment of anything but a number: Python (and the tests' way of asking for it)
        "hidden = model.model.layers[10].output[0]\nhidden[:] = hidden + v\n",
        "hidden = model.model.layers[10].output[0]\nhidden[:] *= hidden.norm()\n",
        "model.model.layers[10].output[0][:] = model.model.layers[10].output[0] * 2\n",
        "model.model.layers[10].output[0][:, 3:5] = v.to(x)\n",
        "hidden = model.model.layers[10].output[0]\nhidden[:] = 2.0 * hidden\n",
        # rows other steps do not have, columns with a step or a list, a rebinding
        "model.model.layers[10].output[0][3, :5] = 0\n",
        "model.model.layers[10].output[0][:, ::2] = 0\n",
        "model.model.layers[10].output[0][:, [1, 2]] = 0\n",
        "hidden = model.model.layers[10].output[0]\nhidden = 0\n",
        # another module's output, or a sum
        f"out = {MLP}.output\nmodel.model.layers[13].mlp.output = out * 0.5\n",
        f"out = {MLP}.output\n{MLP}.output = out + 0.5\n",
        "model.model.layers[10].output[0][:] -= 0.5\n",
    ],
)
def test_other_assignments_run_as_python(source):
    form = read_form(source)
    assert form is None or form.change is None


def _how(source: str, scope: dict, width: int = 576, dtype: torch.dtype = torch.float32):
    return _change(read_form(source), scope, width, dtype)


def test_the_number_and_the_columns_are_read_at_admission():
    head = "model.model.layers[10].output[0][:, head * 64 : (head + 1) * 64] = 0\n"
    assert _how(head, {"head": 3}) == (float(ops.FILL), 0.0, 192.0, 256.0)
    assert _how(head, {"head": 20}) == (float(ops.FILL), 0.0, 576.0, 576.0)  # clipped as Python clips
    one = "model.model.layers[10].output[0][:, n] = 1.5\n"
    assert _how(one, {"n": -1}) == (float(ops.FILL), 1.5, 575.0, 576.0)
    assert isinstance(_how(one, {"n": 576}), Unlowered)  # Python raises
    assert isinstance(_how(one, {"n": 1.0}), Unlowered)
    scale = "model.model.layers[10].output[0][:] *= s * 2\n"
    assert _how(scale, {"s": 0.1}) == (float(ops.SCALE), 0.2, 0.0, 576.0)
    assert isinstance(_how(scale, {"s": torch.tensor(0.1)}), Unlowered)
    assert isinstance(_how(scale, {"s": True}), Unlowered)
    # a fill rounds its number straight to the dtype: only numbers float32 holds exactly
    assert isinstance(_how("model.model.layers[10].output[0][:] = 0.1\n", {}), Unlowered)
    assert _how("model.model.layers[10].output[0][:] = 0.25\n", {})[1] == 0.25


def test_scaled_and_filled_rows_on_the_tensor_operations_are_what_the_block_computes_bit_for_bit():
    generator = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        hidden = torch.randn(10, 64, generator=generator).to(dtype)
        bank = torch.zeros(5, 64)
        how = torch.zeros(5, 4)
        how[1] = torch.tensor([ops.SCALE, 0.1, 0.0, 64.0])  # every column times 0.1
        how[2] = torch.tensor([ops.SCALE, -1.7, 16.0, 32.0])  # some columns
        how[3] = torch.tensor([ops.FILL, 0.0, 0.0, 64.0])  # zeroed
        how[4] = torch.tensor([ops.FILL, 2.5, 7.0, 8.0])  # one column set
        slots = torch.full((1, 12), -1, dtype=torch.int32)
        slots[0, :2], slots[0, 2:4], slots[0, 4:6], slots[0, 6:8] = 1, 2, 3, 4
        got = ops.steer(hidden, hidden, slots, bank, how, 0)
        want = hidden.clone()
        want[:2] *= 0.1
        want[2:4, 16:32] *= -1.7
        want[4:6] = 0
        want[6:8, 7] = 2.5
        assert torch.equal(got, want), dtype
        assert not torch.equal(got, hidden)


def damped(model):
    """Layer 10's hidden scaled on a head's columns every step."""
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        for _ in tracer.iter[:3]:
            hidden = model.model.layers[10].output[0]
            hidden[:, 64:128] *= 1.5
        out = tracer.result.save()
    return out


def damped_python(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        for _ in tracer.iter[:3]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            hidden = model.model.layers[10].output[0]
            hidden[:, 64:128] *= 1.5
        out = tracer.result.save()
    return out


def mlp_zeroed(model):
    """Layer 12's MLP zeroed on the first step (the prompt) only."""
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        model.model.layers[12].mlp.output[:] = 0
        out = tracer.result.save()
    return out


def mlp_zeroed_python(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        model.model.embed_tokens.output.clone()
        model.model.layers[12].mlp.output[:] = 0
        out = tracer.result.save()
    return out


def mlp_halved(model):
    """Layer 12's MLP output replaced by itself halved, every step."""
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        for _ in tracer.iter[:3]:
            out = model.model.layers[12].mlp.output
            model.model.layers[12].mlp.output = out * 0.5
        result = tracer.result.save()
    return result


def mlp_halved_python(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        for _ in tracer.iter[:3]:
            model.model.embed_tokens.output.clone()
            out = model.model.layers[12].mlp.output
            model.model.layers[12].mlp.output = out * 0.5
        result = tracer.result.save()
    return result


def head_silenced(model):
    """One head of layer 10 zeroed where ``o_proj`` takes it, every step (the
    session engine taps the attention's output before ``o_proj``)."""
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        for _ in tracer.iter[:3]:
            model.model.layers[10].self_attn.o_proj.input[:, 2 * 64 : 3 * 64] = 0
        out = tracer.result.save()
    return out


def head_silenced_python(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        for _ in tracer.iter[:3]:
            model.model.embed_tokens.output.clone()
            model.model.layers[10].self_attn.o_proj.input[:, 2 * 64 : 3 * 64] = 0
        out = tracer.result.save()
    return out


COLUMN = 7


def one_column_set(model):
    """One column of layer 20's newest row set, every step."""
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        for _ in tracer.iter[:3]:
            model.model.layers[20].output[0][-1, COLUMN] = 40.0
        out = tracer.result.save()
    return out


def one_column_set_python(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        for _ in tracer.iter[:3]:
            model.model.embed_tokens.output.clone()
            model.model.layers[20].output[0][-1, COLUMN] = 40.0
        out = tracer.result.save()
    return out


@pytest.mark.parametrize(
    ("block", "form"),
    [
        ((damped, damped_python), "scale"),
        ((mlp_zeroed, mlp_zeroed_python), "fill"),
        ((mlp_halved, mlp_halved_python), "scale"),
        ((one_column_set, one_column_set_python), "fill"),
        ((head_silenced, head_silenced_python), "fill"),
    ],
    ids=["columns scaled", "an MLP zeroed", "an MLP replaced by itself halved", "one column set", "a head"],
)
def test_a_value_scaled_or_filled_is_lowered_and_equals_the_python_path_bit_for_bit(
    smollm2_llm, smol, block, form
):
    (before,) = smollm2_llm.collective_rpc("nnsight_stats")
    lowered = block[0](smol)
    (middle,) = smollm2_llm.collective_rpc("nnsight_stats")
    python = block[1](smol)
    assert lowered.nnsight_path["form"] == form, lowered.nnsight_path
    assert middle["lowered_by"][form] - before["lowered_by"][form] == 1
    assert not python.nnsight_path["lowered"]
    same_generation([lowered], [python])  # each traced alone: bit for bit
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=3)
    (plain,) = smollm2_llm.generate([PROMPT], params, use_tqdm=False)
    edited = {t: p.logprob for t, p in lowered.outputs[0].logprobs[0].items()}
    assert edited != {t: p.logprob for t, p in plain.outputs[0].logprobs[0].items()}  # it edited
