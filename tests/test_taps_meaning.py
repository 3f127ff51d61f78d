"""Blocks spelled otherwise than the forms, lowered by what they compute
(``taps/meaning.py``): which spellings are brought to a form and which are left
to Python, then, on the session engine (eager, fp32, tapped at layers 10 and 20),
each lowered spelling against the same block run as Python, bit for bit."""

from __future__ import annotations

import ast

import pytest
import torch
from vllm import SamplingParams

from tests.test_taps import PROMPT, same_generation
from vllm_nnsight_plugin.taps.forms import block_form
from vllm_nnsight_plugin.taps.lower import read_form
from vllm_nnsight_plugin.taps.meaning import VALUE, canonical


@pytest.mark.parametrize(
    ("source", "same_as", "unpacks"),
    [
        # unpacked, then subtracted
        (
            "for _ in tracer.iter[:3]:\n    hidden, residual = layer.output\n    hidden[:] -= 2.0 * v.to(hidden)\n",
            "for _ in tracer.iter[:3]:\n    hidden = layer.output[0]\n    hidden[:] += -(2.0 * v.to(hidden))\n",
            True,
        ),
        # through the output itself, one row
        (
            "for _ in tracer.iter[:3]:\n    out = layer.output\n    out[0][-1] += v\n",
            "for _ in tracer.iter[:3]:\n    layer.output[0][-1] += v\n",
            False,
        ),
        # methods
        (
            "for _ in tracer.all():\n    hidden = layer.output[0]\n    hidden.add_(v)\n",
            "for _ in tracer.all():\n    layer.output[0][:] += v\n",
            False,
        ),
        (
            "for _ in tracer.iter[:3]:\n    hidden = layer.output[0]\n    hidden[-1].sub_(v)\n",
            "for _ in tracer.iter[:3]:\n    layer.output[0][-1] += -v\n",
            False,
        ),
        # the vector named first, in the loop or before it; moved to the value
        (
            "for _ in tracer.iter[:3]:\n    hidden = layer.output[0]\n    push = s * v.to(hidden)\n"
            "    hidden += push\n",
            "for _ in tracer.iter[:3]:\n    hidden = layer.output[0]\n    hidden[:] += s * v.to(hidden)\n",
            False,
        ),
        (
            "push = s * v\nfor _ in tracer.iter[:3]:\n    model.model.layers[4].output[0][:] += push\n"
            "out = tracer.result.save()\n",
            "for _ in tracer.iter[:3]:\n    model.model.layers[4].output[0][:] += s * v\n"
            "out = tracer.result.save()\n",
            False,
        ),
        # several layers, ``_`` for what is not used
        (
            "for _ in tracer.iter[:3]:\n    for i in (8, 10):\n        hidden, _ = model.model.layers[i].output\n"
            "        hidden[:] -= v.to(hidden)\n",
            "for _ in tracer.iter[:3]:\n    for i in (8, 10):\n        hidden = model.model.layers[i].output[0]\n"
            "        hidden[:] += -v.to(hidden)\n",
            True,
        ),
        # keeping through names
        (
            "rows = list().save()\nfor _ in tracer.iter[:3]:\n    hidden, residual = layer.output\n"
            "    rows.append((hidden + residual)[-1])\n",
            "rows = list().save()\nfor _ in tracer.iter[:3]:\n    rows.append((layer.output[0] + layer.output[1])[-1])\n",
            True,
        ),
        (
            "rows = list().save()\nfor _ in tracer.all():\n    for i in (3, 5):\n"
            "        out = model.model.layers[i].output\n        rows.append(out[0][-1].clone())\n",
            "rows = list().save()\nfor _ in tracer.all():\n    for i in (3, 5):\n"
            "        rows.append(model.model.layers[i].output[0][-1].clone())\n",
            False,
        ),
        (
            "hidden, residual = layer.output\nlast = (hidden + residual)[-1].save()\n",
            "last = (layer.output[0] + layer.output[1])[-1].save()\n",
            True,
        ),
    ],
)
def test_a_block_spelled_otherwise_is_read_as_the_form_it_computes(source, same_as, unpacks):
    assert block_form(source) is None  # not a form as written
    form, want = read_form(source), block_form(same_as)
    assert form is not None and want is not None
    assert form.unpacks == unpacks
    for field in ("tracer", "start", "stop", "tap", "result", "code", "select", "single", "whole", "over"):
        assert getattr(form, field) == getattr(want, field), field
    if want.vector is not None:  # the same arithmetic, the edited value under the form's name
        assert ast.unparse(form.vector).replace(VALUE, "hidden") == ast.unparse(want.vector)


@pytest.mark.parametrize(
    "source",
    [
        # an assignment (the way to write an edit that runs as Python)
        "for _ in tracer.iter[:3]:\n    hidden = layer.output[0]\n    hidden[:] = hidden + v\n",
        # moved to another value than the one edited: Python reads that value
        "for _ in tracer.iter[:3]:\n    hidden, residual = layer.output\n    hidden[:] -= v.to(residual)\n",
        "for _ in tracer.iter[:3]:\n    hidden = layer.output[0]\n    w = v.to(other.output[0])\n    hidden += w\n",
        # a vector never used (its arithmetic could raise on the Python path)
        "for _ in tracer.iter[:3]:\n    hidden = layer.output[0]\n    push = 2 * v\n    hidden += v\n",
        # a name bound twice; a value named outside the loop (the first step's)
        "for _ in tracer.iter[:3]:\n    hidden = layer.output[0]\n    hidden = layer.output[0]\n    hidden += v\n",
        "hidden = layer.output[0]\nfor _ in tracer.iter[:3]:\n    hidden += v\n",
        # the residual edited; the value read into the vector; more after the effect
        "for _ in tracer.iter[:3]:\n    hidden, residual = layer.output\n    residual += v\n",
        "for _ in tracer.iter[:3]:\n    hidden = layer.output[0]\n    hidden += hidden.norm() * v\n",
        "for _ in tracer.iter[:3]:\n    hidden = layer.output[0]\n    hidden += v\n    x = 1\n",
        # two effects: a read then an edit
        "rows = list().save()\nfor _ in tracer.iter[:3]:\n    hidden = layer.output[0]\n"
        "    rows.append(hidden[-1].clone())\n    hidden += v\n",
        # a view kept, not a copy; a call on the value
        "rows = list().save()\nfor _ in tracer.iter[:3]:\n    hidden, residual = layer.output\n    rows.append(hidden)\n",
        "for _ in tracer.iter[:3]:\n    hidden = layer.output[0]\n    f(hidden)\n",
        # ``_`` read, then bound again; the form's own name for the value
        "for _ in tracer.iter[:3]:\n    hidden, _ = layer.output\n    hidden += _.mean() * v\n",
        f"for _ in tracer.iter[:3]:\n    hidden, {VALUE} = layer.output\n    hidden -= v\n",
    ],
)
def test_what_it_cannot_follow_runs_as_python(source):
    assert read_form(source) is None, canonical(source)


# ---------------------------------------------------------------- on the engine
def steer_unpacked(model, vector):
    with model.trace(PROMPT, temperature=0.0, max_tokens=5, logprobs=3) as tracer:
        for _ in tracer.iter[:5]:
            hidden, residual = model.model.layers[10].output
            push = 6.0 * vector.to(hidden)
            hidden -= push
        out = tracer.result.save()
    return out


def steer_unpacked_python(model, vector):
    with model.trace(PROMPT, temperature=0.0, max_tokens=5, logprobs=3) as tracer:
        for _ in tracer.iter[:5]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            hidden, residual = model.model.layers[10].output
            hidden -= 6.0 * vector.to(hidden)
        out = tracer.result.save()
    return out


def steer_last_row(model, vector):
    with model.trace(PROMPT, temperature=0.0, max_tokens=5, logprobs=3) as tracer:
        for _ in tracer.iter[:5]:
            out = model.model.layers[20].output
            out[0][-1].add_(8.0 * vector.to(out[0]))
        result = tracer.result.save()
    return result


def steer_last_row_python(model, vector):
    with model.trace(PROMPT, temperature=0.0, max_tokens=5, logprobs=3) as tracer:
        for _ in tracer.iter[:5]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            out = model.model.layers[20].output
            out[0][-1] += 8.0 * vector.to(out[0])
        result = tracer.result.save()
    return result


def keep_unpacked(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=4) as tracer:
        rows = list().save()
        for _ in tracer.iter[:4]:
            for i in (10, 20):
                hidden, residual = model.model.layers[i].output
                rows.append((hidden + residual)[-1])
    return rows


def keep_unpacked_python(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=4) as tracer:
        rows = list().save()
        for _ in tracer.iter[:4]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            for i in (10, 20):
                hidden, residual = model.model.layers[i].output
                rows.append((hidden + residual)[-1])
    return rows


def test_blocks_spelled_otherwise_are_lowered_and_equal_the_python_path_bit_for_bit(smollm2_llm, smol):
    torch.manual_seed(11)
    vector = torch.randn(576)  # on the client, moved by the block
    for lowered, python in (
        (steer_unpacked, steer_unpacked_python),
        (steer_last_row, steer_last_row_python),
    ):
        (before,) = smollm2_llm.collective_rpc("nnsight_stats")
        got = lowered(smol, vector)
        (middle,) = smollm2_llm.collective_rpc("nnsight_stats")
        want = python(smol, vector)
        (after,) = smollm2_llm.collective_rpc("nnsight_stats")
        assert middle["lowered"] - before["lowered"] == 1, lowered.__name__
        assert got.nnsight_path["lowered"] and got.nnsight_path["form"] == "steer"
        assert after["lowered"] == middle["lowered"] and not want.nnsight_path["lowered"]
        same_generation([got], [want])
    plain = smollm2_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert list(plain[0].outputs[0].token_ids) != list(got.outputs[0].token_ids)  # it steered

    (before,) = smollm2_llm.collective_rpc("nnsight_stats")
    kept, kept_python = keep_unpacked(smol), keep_unpacked_python(smol)
    (after,) = smollm2_llm.collective_rpc("nnsight_stats")
    assert after["lowered_by"]["keep"] - before["lowered_by"]["keep"] == 1
    assert len(kept) == len(kept_python) == 8
    for a, b in zip(kept, kept_python, strict=True):
        assert a.shape == b.shape == (576,) and torch.equal(a.cpu(), b.cpu())
