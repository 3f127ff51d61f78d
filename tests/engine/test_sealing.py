"""A trace's invokes are sealed as vLLM reads their requests (``client/model._Sealing``):
the first requests go before the last invokes are sealed, what is wrong with the
whole trace is raised before any request goes, and a block that fails to pickle
part way ends the call as it would have before, the engine serving on."""

from __future__ import annotations

import threading

import pytest
import torch

from vllm_nnsight_plugin.client import model as client

PROMPT = "The capital of France is"


def stats(llm) -> dict:
    (found,) = llm.collective_rpc("nnsight_stats")
    return found


def sweep(smol, prompts):
    """One trace, one invoke per prompt, each keeping layer 10's last row (a name
    saved in every invoke comes back as a list, one value per invoke, in order)."""
    with smol.trace(temperature=0.0, max_tokens=1) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                last = smol.model.layers[10].output[0][-1].clone().save()
    return last


def sweep_capturing(smol, prompts, captured):
    """The same, each block capturing a value of its own (``captured[i]``, else 0)."""
    with smol.trace(temperature=0.0, max_tokens=1) as tracer:
        for i, prompt in enumerate(prompts):
            thing = captured.get(i, 0)
            with tracer.invoke(prompt):
                last = (smol.model.layers[10].output[0][-1] + 0 * thing).clone().save()
    return last


def test_the_first_requests_go_before_the_last_invokes_are_sealed(smollm2_llm, smol, monkeypatch):
    events = []
    engine = smollm2_llm.llm_engine
    add, part = engine.add_request, client.VLLM._attach_part

    def added(*args, **kwargs):
        events.append("add")
        return add(*args, **kwargs)

    def sealed(self, mediators, params, *args, **kwargs):
        events.append(f"part of {len(params)}")
        return part(self, mediators, params, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", added)
    monkeypatch.setattr(client.VLLM, "_attach_part", sealed)
    prompts = [f"{PROMPT} {i}" for i in range(40)]
    rows = sweep(smol, prompts)
    assert events.count("add") == 40
    parts = [e for e in events if e != "add"]
    assert parts == ["part of 16", "part of 24"], events  # 16 before anything goes, then what vLLM asks
    assert events.index("add") < events.index("part of 24")  # sent before the rest was sealed
    monkeypatch.undo()
    want = [sweep(smol, [prompt]) for prompt in prompts[:3] + prompts[-2:]]
    for got, one in zip(rows[:3] + rows[-2:], want, strict=True):
        assert torch.allclose(got, one, atol=1e-5, rtol=0)


def test_a_block_that_cannot_be_sent_part_way_ends_the_call_as_before(smollm2_llm, smol, monkeypatch):
    prompts = [f"{PROMPT} {i}" for i in range(40)]
    captured = {30: threading.Lock()}  # no pickle: the 31st invoke's block cannot be sent
    with pytest.raises(Exception) as late:
        sweep_capturing(smol, prompts, captured)
    monkeypatch.setattr(client._Sealing, "FIRST", 1000)  # all sealed before anything goes
    with pytest.raises(Exception) as early:
        sweep_capturing(smol, prompts, captured)
    monkeypatch.undo()
    assert type(late.value) is type(early.value) and str(late.value) == str(early.value)
    assert "lock" in str(late.value)
    assert stats(smollm2_llm)["tracked"] == 0  # the requests sent before it were wound up
    rows = sweep(smol, prompts[:2])  # the engine serves on
    assert len(rows) == 2 and rows[0].shape == (576,)
    assert stats(smollm2_llm)["tracked"] == 0


def test_a_misspelled_setting_is_raised_before_any_request_goes(smollm2_llm, smol, monkeypatch):
    sent = []
    engine = smollm2_llm.llm_engine
    add = engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda *a, **k: sent.append(1) or add(*a, **k))
    with pytest.raises(TypeError, match="temprature"):
        with smol.trace(temprature=0.0, max_tokens=1) as tracer:
            for i in range(40):
                with tracer.invoke(f"{PROMPT} {i}"):
                    smol.model.layers[10].output[0][-1].clone().save()
    assert sent == []
