"""``NNSIGHT_VLLM_CLONE_READS`` on a tapped engine: every read a block makes is a
copy, so an in-place edit changes the copy and never the model (nnsight's
documented meaning). The steering loop must then not be lowered (the tap would
apply it); the capture loop, whose copies hold the same values either way,
still is. A tiny random Qwen3 with layer 1 tapped, built with the variable set."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from tests.conftest import start_llm, stop_llm
from vllm_nnsight_plugin import VLLM

PROMPT = [5, 17, 29, 41, 53, 65, 77]


@pytest.fixture(scope="module")
def copied(tiny_qwen3_path):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("NNSIGHT_VLLM_CLONE_READS", "1")  # read by the engine's processes
        llm = start_llm(tiny_qwen3_path, additional_config={"nnsight_taps": ["model.layers.1.output"]})
    yield llm, VLLM(llm)
    stop_llm(llm)


def stats(llm) -> dict:
    (found,) = llm.collective_rpc("nnsight_stats")
    return found


def steer_in_place(model, vector):
    with model.trace(PROMPT, temperature=0.0, max_tokens=4, logprobs=3) as tracer:
        for _ in tracer.iter[:4]:
            model.model.layers[1].output[0][:] += vector
        out = tracer.result.save()
    return out


def steer_assigned(model, vector):
    with model.trace(PROMPT, temperature=0.0, max_tokens=4, logprobs=3) as tracer:
        for _ in tracer.iter[:4]:
            hidden, residual = model.model.layers[1].output
            model.model.layers[1].output = (hidden + vector, residual)
        out = tracer.result.save()
    return out


def keep_rows(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        rows = list().save()
        for _ in tracer.iter[:3]:
            rows.append(model.model.layers[1].output[0].clone())
    return rows


def keep_rows_python(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        rows = list().save()
        for _ in tracer.iter[:3]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            hidden = model.model.layers[1].output[0]
            rows.append(hidden.clone())
    return rows


def logprobs(output) -> list[dict[int, float]]:
    return [{t: p.logprob for t, p in step.items()} for step in output.outputs[0].logprobs]


def test_an_in_place_edit_of_a_copy_is_lost_lowered_or_not_and_an_assignment_lands(copied):
    llm, model = copied
    vector = 4.0 * torch.ones(llm.llm_engine.model_config.get_hidden_size())
    (plain,) = llm.generate(
        [{"prompt_token_ids": PROMPT}],
        SamplingParams(temperature=0.0, max_tokens=4, logprobs=3),
        use_tqdm=False,
    )
    before = stats(llm)["lowered"]
    lost = steer_in_place(model, vector)
    assert stats(llm)["lowered"] == before  # the steering form ran as Python
    assert list(lost.outputs[0].token_ids) == list(plain.outputs[0].token_ids)
    for got, want in zip(logprobs(lost), logprobs(plain), strict=True):
        assert got.keys() == want.keys() and all(abs(got[t] - want[t]) < 1e-5 for t in got)
    landed = steer_assigned(model, vector)  # the documented way to edit under copies
    assert logprobs(landed) != logprobs(plain)


def test_the_capture_loop_is_still_lowered_and_keeps_the_same_rows(copied):
    llm, model = copied
    before = stats(llm)["lowered"]
    lowered = keep_rows(model)
    assert stats(llm)["lowered"] - before == 1
    python = keep_rows_python(model)
    assert stats(llm)["lowered"] - before == 1
    assert [tuple(r.shape) for r in lowered] == [(len(PROMPT), 128), (1, 128), (1, 128)]
    for a, b in zip(lowered, python, strict=True):
        assert torch.equal(a, b)
    assert stats(llm)["tracked"] == 0
