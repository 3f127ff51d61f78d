"""Blocks spelled otherwise than the forms, lowered by what they compute
(``taps/meaning.py``): which spellings are brought to a form and which are left
to Python, then, on the session engine (eager, fp32, tapped at layers 10 and 20),
each lowered spelling against the same block run as Python, bit for bit."""

from __future__ import annotations

import ast

import pytest
import torch
from vllm import SamplingParams

from tests.engine.test_taps import PROMPT, same_generation
from vllm_nnsight_plugin.taps.forms import block_form
from vllm_nnsight_plugin.taps.lower import read_form
from vllm_nnsight_plugin.taps.meaning import VALUE, canonical, inlined


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


def steer_number(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=5, logprobs=3) as tracer:
        for _ in tracer.iter[:5]:
            hidden = model.model.layers[10].output[0]
            hidden[:] += 0.37 * 3  # a number: float32 holds neither exactly
        result = tracer.result.save()
    return result


def steer_number_python(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=5, logprobs=3) as tracer:
        for _ in tracer.iter[:5]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            hidden = model.model.layers[10].output[0]
            hidden[:] += 0.37 * 3
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
        (lambda model, _: steer_number(model), lambda model, _: steer_number_python(model)),
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


# ---------------------------------------------------------------- directions
@pytest.mark.parametrize(
    ("source", "project"),
    [
        # the steering page's removal, inline
        (
            "hidden, residual = layer.output\nu_ = u.to(hidden)\n"
            "hidden[:] -= ((hidden + residual) @ u_)[:, None] * u_\n",
            (True, None, None, False),
        ),
        # its clamp, every step, bounds captured
        (
            "for _ in tracer.iter[:3]:\n    hidden, residual = layer.output\n    u_ = u.to(hidden)\n"
            "    coefficient = (hidden + residual) @ u_\n"
            "    hidden[:] -= (coefficient - coefficient.clamp(min=least, max=most))[:, None] * u_\n",
            (True, "least", "most", True),
        ),
        # the value alone, and a tensor's tap with one number as the bound
        ("for _ in tracer.all():\n    hidden = layer.output[0]\n    hidden -= (hidden @ u)[:, None] * u\n",
         (False, None, None, False)),
        ("for _ in tracer.all():\n    h = layer.mlp.output\n    c = h @ u\n    h[:] -= (c - c.clamp(2.0))[:, None] * u\n",
         (False, "2.0", None, True)),
    ],
)  # fmt: skip
def test_a_direction_removed_or_clamped_is_read_as_such(source, project):
    form = read_form(source)
    assert form is not None and form.project is not None
    stream, low, high, clamped = form.project
    written = tuple(None if b is None else ast.unparse(b) for b in (low, high))
    assert (stream, *written, clamped) == project


@pytest.mark.parametrize(
    "source",
    [
        # measured on one vector, removed along another; from one row; added back
        "for _ in tracer.all():\n    hidden = layer.output[0]\n    hidden -= (hidden @ u)[:, None] * w\n",
        "for _ in tracer.all():\n    hidden = layer.output[0]\n    hidden[-1] -= (hidden @ u)[:, None] * u\n",
        "for _ in tracer.all():\n    hidden, residual = layer.output\n    hidden += ((hidden + residual) @ u)[:, None] * u\n",
        # clamped against another coefficient; a bound the block computes; no column
        "for _ in tracer.all():\n    hidden, residual = layer.output\n    c = (hidden + residual) @ u\n"
        "    d = hidden @ u\n    hidden -= (c - d.clamp(min=1.0))[:, None] * u\n",
        "for _ in tracer.all():\n    hidden = layer.output[0]\n    b = 2 * k\n    c = hidden @ u\n"
        "    hidden -= (c - c.clamp(min=b))[:, None] * u\n",
        "for _ in tracer.all():\n    hidden = layer.output[0]\n    hidden -= (hidden @ u) * u\n",
        # measured on the residual alone, or on another layer
        "for _ in tracer.all():\n    hidden, residual = layer.output\n    hidden -= (residual @ u)[:, None] * u\n",
        "for _ in tracer.all():\n    hidden = layer.output[0]\n    hidden -= (other.output[0] @ u)[:, None] * u\n",
    ],
)
def test_other_arithmetic_on_a_direction_runs_as_python(source):
    assert read_form(source) is None, canonical(source)


def remove(u):
    def edit(hidden, residual):
        u_ = u.to(hidden)
        hidden[:] -= ((hidden + residual) @ u_)[:, None] * u_

    return edit


def clamp(u, least=None, most=None):
    def edit(hidden, residual):
        u_ = u.to(hidden)
        coefficient = (hidden + residual) @ u_
        hidden[:] -= (coefficient - coefficient.clamp(min=least, max=most))[:, None] * u_

    return edit


def test_a_function_called_on_the_tap_is_read_by_its_body():
    """The steering page's helpers: their bodies in the block, their names renamed
    apart, the values they capture handed to the scope."""
    u = torch.randn(8)
    for change in (remove(u), clamp(u, least=2.0)):
        source, scope = inlined("change(layer.output[0], layer.output[1])\n", {"change": change})
        form = read_form(source)
        assert form is not None and form.project is not None and form.project[0]
        assert any(value is u for value in scope.values())
        if change.__code__.co_freevars == ("least", "most", "u"):
            assert scope[ast.unparse(form.project[1])] == 2.0 and scope[ast.unparse(form.project[2])] is None

    def writes_elsewhere(hidden, residual):
        global leaked
        leaked = hidden

    def returns(hidden, residual):
        return hidden

    clash = {"change": remove(u), "u__edit0": u}  # a name of the renamed spelling, captured
    assert inlined("change(layer.output[0], layer.output[1])\n", clash) is None
    for function in (writes_elsewhere, returns, lambda hidden, residual: None, print):
        assert inlined("change(layer.output[0], layer.output[1])\n", {"change": function}) is None


def test_a_direction_removed_on_the_tensor_operations_is_what_the_block_computes_bit_for_bit():
    """``ops.steer`` on a step of three requests (a removal, a clamp, a plain one)
    against each request's rows run through the block's own expression: the same
    product on the same rows, so the same bits, in float32 and bfloat16."""
    from vllm_nnsight_plugin.taps import ops

    generator = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(9, 64, generator=generator).to(dtype)
        residual = torch.randn(9, 64, generator=generator).to(dtype)
        u = torch.randn(64, generator=generator)
        u = (u / u.norm()).to(dtype)
        bank = torch.zeros(4, 64)
        bank[1] = bank[2] = u.float()
        how = torch.zeros(4, 4)
        how[1, :3] = torch.tensor([2.0, 0.0, 0.0])  # removed from the stream
        least = torch.tensor(0.3, dtype=dtype).item()  # as clamp rounds it
        how[2, :3] = torch.tensor([2.0, least, float("inf")])  # held at 0.3 or more
        slots = torch.full((1, 12), -1, dtype=torch.int32)
        slots[0, :4], slots[0, 4:7] = 1, 2  # rows 7 and 8: nobody's
        got = ops.steer(hidden, residual, slots, bank, how, 0)

        def removed(h, r, u=u):
            h = h.clone()
            h[:] -= ((h + r) @ u)[:, None] * u
            return h

        def clamped(h, r, u=u):
            h = h.clone()
            c = (h + r) @ u
            h[:] -= (c - c.clamp(min=0.3))[:, None] * u
            return h

        assert torch.equal(got[:4], removed(hidden[:4], residual[:4])), dtype
        assert torch.equal(got[4:7], clamped(hidden[4:7], residual[4:7])), dtype
        assert torch.equal(got[7:], hidden[7:])
        assert float(((got[:4] + residual[:4]).float() @ u.float()).abs().max()) < 0.05  # it is gone


def remove_and_clamp(model, u):
    """The steering page's helpers, one invoke each, then the clamp written inline."""
    with model.trace(temperature=0.0, max_tokens=4, logprobs=3) as tracer:
        for change in (remove(u), clamp(u, least=0.5)):
            with tracer.invoke(PROMPT):
                for _ in tracer.iter[:4]:
                    change(model.model.layers[10].output[0], model.model.layers[10].output[1])
                out = tracer.result.save()
        with tracer.invoke(PROMPT):
            for _ in tracer.iter[:4]:
                hidden, residual = model.model.layers[20].output
                coefficient = (hidden + residual) @ u
                hidden[:] -= (coefficient - coefficient.clamp(max=-1.0))[:, None] * u
            out = tracer.result.save()
    return out


def remove_and_clamp_python(model, u):
    with model.trace(temperature=0.0, max_tokens=4, logprobs=3) as tracer:
        for change in (remove(u), clamp(u, least=0.5)):
            with tracer.invoke(PROMPT):
                for _ in tracer.iter[:4]:
                    model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
                    change(model.model.layers[10].output[0], model.model.layers[10].output[1])
                out = tracer.result.save()
        with tracer.invoke(PROMPT):
            for _ in tracer.iter[:4]:
                model.model.embed_tokens.output.clone()
                hidden, residual = model.model.layers[20].output
                coefficient = (hidden + residual) @ u
                hidden[:] -= (coefficient - coefficient.clamp(max=-1.0))[:, None] * u
            out = tracer.result.save()
    return out


def removed_alone(model, u):
    change = remove(u)
    with model.trace(PROMPT, temperature=0.0, max_tokens=4, logprobs=3) as tracer:
        for _ in tracer.iter[:4]:
            change(model.model.layers[10].output[0], model.model.layers[10].output[1])
        out = tracer.result.save()
    return out


def removed_alone_python(model, u):
    change = remove(u)
    with model.trace(PROMPT, temperature=0.0, max_tokens=4, logprobs=3) as tracer:
        for _ in tracer.iter[:4]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            change(model.model.layers[10].output[0], model.model.layers[10].output[1])
        out = tracer.result.save()
    return out


def test_a_direction_removed_or_clamped_is_lowered_and_equals_the_python_path_bit_for_bit(smollm2_llm, smol):
    torch.manual_seed(5)
    u = torch.randn(576)
    u = u / u.norm()
    (before,) = smollm2_llm.collective_rpc("nnsight_stats")
    lowered = remove_and_clamp(smol, u)
    (middle,) = smollm2_llm.collective_rpc("nnsight_stats")
    python = remove_and_clamp_python(smol, u)
    (after,) = smollm2_llm.collective_rpc("nnsight_stats")
    assert middle["lowered_by"]["project"] - before["lowered_by"]["project"] == 3
    assert [o.nnsight_path["form"] for o in lowered] == ["project"] * 3
    assert after["lowered"] == middle["lowered"]
    same_generation(lowered, python, exact=False)  # three requests of one trace: batched as vLLM likes
    alone, alone_python = removed_alone(smol, u), removed_alone_python(smol, u)
    assert alone.nnsight_path["form"] == "project" and not alone_python.nnsight_path["lowered"]
    same_generation([alone], [alone_python])  # traced alone: bit for bit
    plain = smollm2_llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3), use_tqdm=False
    )
    first = {t: p.logprob for t, p in plain[0].outputs[0].logprobs[1].items()}
    assert first != {t: p.logprob for t, p in lowered[0].outputs[0].logprobs[1].items()}  # it edited


def test_an_if_on_captured_plain_values_takes_its_branch_at_admission():
    from vllm_nnsight_plugin.taps.meaning import folded

    block = (
        "if index is not None:\n"
        "    model.model.layers[index].mlp.output[:] = 0\n"
        "p = model.logits.float().softmax(-1)[0, paris].item().save()\n"
    )
    taken = folded(block, {"index": 3})
    assert taken.startswith("model.model.layers[index].mlp.output[:] = 0\n") and "if" not in taken
    assert folded(block, {"index": None}) == "p = model.logits.float().softmax(-1)[0, paris].item().save()\n"
    assert "b = 2" in folded("if flag and n == 2:\n    a = 1\nelse:\n    b = 2\n", {"flag": True, "n": 3})
    assert folded("for _ in x:\n    if a:\n        y()\n", {"a": False}) == "for _ in x:\n    pass\n"
    # a value that is not plain, a name the block rebinds, a call, an activation: undecided
    assert folded(block, {"index": [3]}) is None
    assert folded("if n > 0:\n    n = 1\n", {"n": 3}) is None
    assert folded("if len(xs) > 0:\n    a = 1\n", {"xs": (1,)}) is None
    assert folded("if h.norm() > 1:\n    h[:] *= 0.5\n", {"h": torch.ones(2)}) is None
    assert folded("if n > m:\n    a = 1\n", {"n": 3}) is None  # not captured


# ---------------------------------------------------------------- rows chosen by a mask
MASKED = (
    "for _ in tracer.iter[:8]:\n"
    "    for index in (8, 10, 12):\n"
    "        hidden = model.model.layers[index].output[0]\n"
    "        rows = torch.zeros(hidden.shape[0], dtype=torch.bool)\n"
    "        rows[-2:] = True\n"
    "        hidden[rows] += 1.5 * direction.to(hidden)\n"
)


def test_rows_chosen_by_a_mask_of_the_last_k_are_those_rows():
    form = read_form(MASKED)
    assert form is not None and form.select == slice(-2, None) and form.masks
    assert form.over == ("index", (8, 10, 12))
    for other in (
        MASKED.replace("rows[-2:] = True", "rows[:2] = True"),  # the first rows: not every step's
        MASKED.replace("rows[-2:] = True", "rows[-2:] = 1"),
        MASKED.replace("dtype=torch.bool", "dtype=torch.int64"),
        MASKED.replace("hidden.shape[0]", "hidden.shape[1]"),
        MASKED.replace("hidden[rows] +=", "kept = hidden[rows]\n        hidden[rows] +="),  # read too
        MASKED.replace("        rows[-2:] = True\n", ""),
    ):
        found = read_form(other)
        assert found is None or found.select != slice(-2, None), other


def masked_steer(model, direction):
    with model.trace(PROMPT, temperature=0.0, max_tokens=4, logprobs=3) as tracer:
        for _ in tracer.iter[:4]:
            hidden = model.model.layers[10].output[0]
            rows = torch.zeros(hidden.shape[0], dtype=torch.bool)
            rows[-2:] = True  # the prompt's last two rows, then each new row
            hidden[rows] += 6.0 * direction.to(hidden)
        out = tracer.result.save()
    return out


def masked_steer_python(model, direction):
    with model.trace(PROMPT, temperature=0.0, max_tokens=4, logprobs=3) as tracer:
        for _ in tracer.iter[:4]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            hidden = model.model.layers[10].output[0]
            rows = torch.zeros(hidden.shape[0], dtype=torch.bool)
            rows[-2:] = True
            hidden[rows] += 6.0 * direction.to(hidden)
        out = tracer.result.save()
    return out


def test_a_steer_of_the_last_rows_by_a_mask_is_lowered_and_equals_the_python_path_bit_for_bit(
    smollm2_llm, smol
):
    torch.manual_seed(12)
    direction = torch.randn(576)
    got, want = masked_steer(smol, direction), masked_steer_python(smol, direction)
    assert got.nnsight_path["form"] == "steer" and not want.nnsight_path["lowered"]
    same_generation([got], [want])
    plain = smollm2_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert list(plain[0].outputs[0].token_ids) != list(got.outputs[0].token_ids)  # it steered
