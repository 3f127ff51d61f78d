"""Installed edits (``model.edit()``) on the tap tables: where one block of a traced
request needs the forward (its copy of an edit, the request's own block reading
only the sampler's values), that block is lowered or served at the sampler as a
trace's would be, and what it keeps comes back as the edit's saves. Each is
checked bit for bit against its Python twin: the same request with one more read
of a location that is not a tap in its own block (two blocks then need the
forward, and all run as Python). Session engine: layers 10 and 20 are taps."""

from __future__ import annotations

import pytest
import torch

PROMPT = "The capital of France is"


@pytest.fixture(autouse=True)
def no_edit_outlives_its_test(smol):
    yield
    smol.clear_edits()
    assert smol.installed_edits() == {}


def stats(llm) -> dict:
    (found,) = llm.collective_rpc("nnsight_stats")
    return found


def traced(smol, twin: bool, edits=None, max_tokens=3):
    """A request whose own block reads only the logits (and, for the twin, layer 3)."""
    choice = {} if edits is None else {"edits": edits}
    with smol.trace(PROMPT, temperature=0.0, max_tokens=max_tokens, logprobs=3, **choice) as tracer:
        if twin:
            smol.model.layers[3].output[0].clone()  # no tap: the request runs as Python
        token = smol.logits.argmax(-1).item().save()
        result = tracer.result.save()
    return token, result


def test_an_edit_keeping_a_row_is_lowered_and_saves_as_the_python_path(smol, smollm2_llm):
    with smol.edit() as (tracer, edit):
        out = smol.model.layers[10].output
        stream = (out[0] + out[1])[-1].clone().save()  # noqa: F841
    before = stats(smollm2_llm)
    token, result = traced(smol, twin=False)
    after = stats(smollm2_llm)
    want_token, want = traced(smol, twin=True)
    assert result.nnsight_path["lowered"] is True, result.nnsight_path
    assert after["lowered"] - before["lowered"] == 1 and after["python_blocks"] == before["python_blocks"]
    assert want.nnsight_path["lowered"] is False
    assert want.nnsight_path["reason"].startswith("two or more of its blocks")
    assert sorted(result.saves) == sorted(want.saves) == ["stream"] and token == want_token
    assert tuple(result.saves["stream"].shape) == (576,)
    assert torch.equal(result.saves["stream"], want.saves["stream"])
    # a plain request alone is what it was: its edit runs as Python on it, as before
    (plain,) = smol.generate(PROMPT, temperature=0.0, max_tokens=3)
    assert torch.equal(plain.saves["stream"], want.saves["stream"])


def test_an_edits_rows_of_every_step_come_back_as_its_list(smol, smollm2_llm):
    with smol.edit() as (tracer, edit):
        rows = list().save()
        for _ in tracer.all():
            rows.append(smol.model.layers[20].output[0][-1].clone())
    with smol.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        result = tracer.result.save()
        kinds = [type(value).__name__ for value in result.saves.values()].save()  # as its block sees them
    _, want = traced(smol, twin=True)
    assert result.nnsight_path["lowered"] is True and want.nnsight_path["lowered"] is False
    assert kinds == ["list"] and len(result.saves["rows"]) == 3
    assert all(torch.equal(a, b) for a, b in zip(result.saves["rows"], want.saves["rows"]))


def pushed_tokens(smol, twin: bool):
    _, result = traced(smol, twin, edits=["push"], max_tokens=4)
    return result


def test_a_steering_edit_is_lowered_and_steers_as_the_python_path(smol, smollm2_llm):
    push = torch.zeros(576)
    push[11] = 30.0
    (plain,) = smol.generate(PROMPT, temperature=0.0, max_tokens=4, logprobs=3)
    with smol.edit(name="push") as (tracer, edit):
        for _ in tracer.all():
            smol.model.layers[10].output[0][:] += push
    got = pushed_tokens(smol, twin=False)
    want = pushed_tokens(smol, twin=True)
    assert got.nnsight_path["lowered"] is True and got.nnsight_path["form"] == "steer"
    assert want.nnsight_path["lowered"] is False
    assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
    for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
        assert {t: p.logprob for t, p in a.items()} == {t: p.logprob for t, p in b.items()}
    assert got.outputs[0].logprobs[0] != plain.outputs[0].logprobs[0]  # it steered


def test_a_steering_edit_on_plain_requests_is_lowered_and_steers_as_the_python_path(smol, smollm2_llm):
    """A stock call with no block: its copy of the edit is the one block that needs
    the forward, so it is lowered (the batch stays in the graphs on a GPU). Its
    twin runs a second edit reading a location that is no tap: two blocks then
    need the forward, and both run as Python."""
    from vllm import SamplingParams

    vector = torch.zeros(576)
    vector[11] = 30.0
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3)
    (plain,) = smollm2_llm.generate([PROMPT], params, use_tqdm=False)
    with smol.edit(name="push") as (tracer, edit):
        for _ in tracer.all():
            hidden = smol.model.layers[10].output[0]
            hidden[:] += vector.to(hidden)
    before = stats(smollm2_llm)["lowered_by"]["steer"]
    (got,) = smollm2_llm.generate([PROMPT], params, use_tqdm=False)
    assert stats(smollm2_llm)["lowered_by"]["steer"] - before == 1
    with smol.edit() as (tracer, reader):
        smol.model.layers[3].output[0].clone()  # no tap
    (want,) = smollm2_llm.generate([PROMPT], params, use_tqdm=False)
    assert got.nnsight_path["lowered"] is True and got.nnsight_path["form"] == "steer"
    assert want.nnsight_path["lowered"] is False
    assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
    for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        assert {t: p.logprob for t, p in a.items()} == {t: p.logprob for t, p in b.items()}
    assert got.outputs[0].logprobs[0] != plain.outputs[0].logprobs[0]  # it steered
    assert smollm2_llm.collective_rpc("nnsight_tracked") == [0]


def test_an_edit_that_only_reads_is_served_at_the_sampler(smol, smollm2_llm):
    with smol.edit(name="probe") as (tracer, probe):
        norms = list().save()
        for _ in tracer.all():
            norms.append(smol.model.layers[20].output[1][-1].norm().item())
    with smol.edit() as (tracer, always):
        seen = [True].save()  # noqa: F841 (needs no forward)
    before = stats(smollm2_llm)["lowered_by"]["replay"]
    _, got = traced(smol, twin=False, edits=["probe"])
    assert stats(smollm2_llm)["lowered_by"]["replay"] - before == 1
    _, want = traced(smol, twin=True, edits=["probe"])
    assert got.nnsight_path["form"] == "replay" and want.nnsight_path["lowered"] is False
    assert sorted(got.saves) == sorted(want.saves) == ["norms", "seen"]
    assert len(got.saves["norms"]) == 3 and got.saves["norms"] == want.saves["norms"]
    # no edit but the one that needs no forward: nothing to lower
    _, alone = traced(smol, twin=False, edits=[])
    assert sorted(alone.saves) == ["seen"] and alone.nnsight_path["reason"].startswith("it reads only")


def test_two_blocks_needing_the_forward_run_as_python(smol, smollm2_llm):
    with smol.edit() as (tracer, a):
        ten = smol.model.layers[10].output[0][-1].clone().save()  # noqa: F841
    with smol.edit() as (tracer, b):
        twenty = smol.model.layers[20].output[0][-1].clone().save()  # noqa: F841
    _, result = traced(smol, twin=False)
    assert result.nnsight_path["lowered"] is False
    assert result.nnsight_path["reason"].startswith("two or more of its blocks")
