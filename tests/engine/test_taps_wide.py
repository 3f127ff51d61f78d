"""A tap whose value is wider than the hidden state: an MLP's neurons (layer 12's
``act_fn``, 1,536 wide beside a hidden state of 576, on the session engine). A
block that reads them is served them at the sampler, each row over three rows of
the store; a block that scales or fills some of their columns runs in the
forward. Each is checked bit for bit against its Python twin (the same block with
one more read of a location that is not a tap)."""

from __future__ import annotations

import torch

from tests.engine.test_taps import PROMPT, same_generation

NEURONS = 1536


def stats(llm) -> dict:
    (found,) = llm.collective_rpc("nnsight_stats")
    return found


def neurons_each_step(model, twin: bool):
    """The last row of layer 12's neurons at each of three steps, and their top neuron."""
    with model.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        rows, top = list().save(), list().save()
        for _ in tracer.iter[:3]:
            if twin:
                model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            neurons = model.model.layers[12].mlp.act_fn.output
            rows.append(neurons[-1].clone())
            top.append(neurons[-1].abs().argmax().item())
        result = tracer.result.save()
    return rows, top, result


def test_an_mlps_neurons_are_served_at_the_sampler_bit_for_bit(smollm2_llm, smol):
    smol.generate(PROMPT, max_tokens=1)  # a tap's width is known once a forward ran through it
    before = stats(smollm2_llm)["taps_served_at_sampler"]
    rows, top, result = neurons_each_step(smol, twin=False)
    assert result.nnsight_path["form"] == "replay", result.nnsight_path
    assert stats(smollm2_llm)["taps_served_at_sampler"] - before == 3
    want_rows, want_top, want_result = neurons_each_step(smol, twin=True)
    assert want_result.nnsight_path["lowered"] is False
    assert len(rows) == len(want_rows) == 3 and tuple(rows[0].shape) == (NEURONS,)
    for got, want in zip(rows, want_rows):
        assert torch.equal(got, want)
    assert top == want_top
    assert list(result.outputs[0].token_ids) == list(want_result.outputs[0].token_ids)


def silenced(model, edit: str, twin: bool):
    """Layer 12's neurons edited as ``edit`` says, on the prompt and two more steps."""
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        for _ in tracer.iter[:3]:
            if twin:
                model.model.embed_tokens.output.clone()
            neurons = model.model.layers[12].mlp.act_fn.output
            if edit == "one":
                neurons[:, 894] = 0
            elif edit == "some":
                neurons[:, :100] = 0.0
            else:
                neurons[:] *= 0.5
        result = tracer.result.save()
    return result


def test_an_mlps_neurons_scaled_or_filled_run_in_the_forward_bit_for_bit(smollm2_llm, smol):
    (plain,) = smol.generate(PROMPT, temperature=0.0, max_tokens=3, logprobs=3)
    for edit in ("one", "some", "half"):
        (before,) = smollm2_llm.collective_rpc("nnsight_stats")
        got = silenced(smol, edit, twin=False)
        (after,) = smollm2_llm.collective_rpc("nnsight_stats")
        want = silenced(smol, edit, twin=True)
        assert got.nnsight_path["lowered"] is True, (edit, got.nnsight_path)
        assert after["lowered"] - before["lowered"] == 1 and after["python_blocks"] == before["python_blocks"]
        assert want.nnsight_path["lowered"] is False
        same_generation([got], [want])
        moved = {t: p.logprob for t, p in got.outputs[0].logprobs[0].items()}
        assert moved != {t: p.logprob for t, p in plain.outputs[0].logprobs[0].items()}, edit
