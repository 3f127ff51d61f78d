"""nnsight features the plugin inherits rather than builds, checked on the session
engine: ``.source`` operations (read and write), ``tracer.stop()``, other
``tracer.iter`` slices, log-probabilities, seeded sampling, token prompts."""

from __future__ import annotations

import pytest
import torch
from vllm.inputs import TokensPrompt

PROMPT = "The capital of France is"


def rotary_reads(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=1):
        attention = model.model.layers[3].self_attn
        q, k = attention.source.self_rotary_emb_0.output
        q, k = q.clone().save(), k.clone().save()
        kernel_q = attention.attn.inputs[0][0].clone().save()
    return q, k, kernel_q


def test_source_reads_the_rotated_query_the_attention_kernel_gets(smol):
    q, k, kernel_q = rotary_reads(smol)
    assert tuple(q.shape) == (5, 576) and tuple(k.shape) == (5, 192)
    assert torch.equal(q, kernel_q)  # test_fidelity checks that one against HF


def zeroed_through_source(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=1):
        model.model.layers[3].self_attn.source.self_o_proj_0.output[0][:] = 0
        logits = model.logits.save()
    return logits


def zeroed_at_the_module(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=1):
        model.model.layers[3].self_attn.o_proj.output[0][:] = 0
        logits = model.logits.save()
    return logits


def untouched(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=1):
        logits = model.logits.save()
    return logits


def test_an_edit_through_source_is_the_edit_at_the_module(smol):
    through, at_module, plain = zeroed_through_source(smol), zeroed_at_the_module(smol), untouched(smol)
    assert torch.equal(through, at_module)
    assert not torch.allclose(through, plain)


def stopped(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=8) as tracer:
        seen = list().save()
        for step in tracer.iter[:8]:
            seen.append(model.samples.item())
            if step == 1:
                tracer.stop()
            seen.append(-1)  # never reached on the step that stops
        out = tracer.result.save()
    try:
        return seen, out
    except UnboundLocalError:
        return seen, None


def test_stop_ends_the_block_and_the_engine_serves_on(smol):
    seen, out = stopped(smol)
    assert len(seen) == 3 and seen[1] == -1 and seen[2] != -1  # step 0 whole, step 1 up to stop
    assert smol.vllm_entrypoint.collective_rpc("nnsight_tracked") == [0]
    assert untouched(smol).shape[-1] == 49152  # the next trace runs


def middle_steps(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=5) as tracer:
        middle = list().save()
        for _ in tracer.iter[1:3]:
            middle.append(model.samples.item())
        out = tracer.result.save()
    return middle, out


def every_step(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=5) as tracer:
        every = list().save()
        for _ in tracer.iter[:]:  # open-ended: the lines after it never run
            every.append(model.samples.item())
    return every


def test_iter_slices_pick_the_steps_they_name(smol):
    middle, out = middle_steps(smol)
    tokens = list(out.outputs[0].token_ids)
    assert len(tokens) == 5 and middle == tokens[1:3]
    assert every_step(smol) == tokens


def one_step(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=4) as tracer:
        for _ in tracer.iter[2]:
            third = model.samples.item().save()
        out = tracer.result.save()
    return third, out


def test_iter_with_an_index_runs_that_step_only(smol):
    third, out = one_step(smol)
    assert third == out.outputs[0].token_ids[2]


def with_logprobs(model, **kwargs):
    with model.trace(PROMPT, max_tokens=4, logprobs=3, **kwargs) as tracer:
        drawn = list().save()
        for _ in tracer.iter[:4]:
            drawn.append(model.samples.item())
        out = tracer.result.save()
    return drawn, out


def test_logprobs_and_seeded_sampling_come_back_as_vllm_gives_them(smol):
    drawn, out = with_logprobs(smol, temperature=1.0, seed=7)
    again, out_again = with_logprobs(smol, temperature=1.0, seed=7)
    assert drawn == again == list(out.outputs[0].token_ids) == list(out_again.outputs[0].token_ids)
    steps = out.outputs[0].logprobs
    assert len(steps) == 4 and all(token in step for token, step in zip(drawn, steps))
    assert all(3 <= len(step) <= 4 for step in steps)  # the top 3, and the drawn token


@pytest.mark.parametrize("as_tokens", [False, True], ids=["text", "tokens"])
def test_a_token_prompt_reads_like_its_text(smol, as_tokens):
    ids = smol.tokenizer(PROMPT)["input_ids"]
    prompt = TokensPrompt(prompt_token_ids=ids) if as_tokens else PROMPT
    with smol.trace(prompt, temperature=0.0, max_tokens=1):
        hidden = smol.model.layers[5].output[0].clone().save()
    with smol.trace(PROMPT, temperature=0.0, max_tokens=1):
        want = smol.model.layers[5].output[0].clone().save()
    assert tuple(hidden.shape) == (len(ids), 576) and torch.equal(hidden, want)
