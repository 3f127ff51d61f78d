"""Preemption: an engine whose KV cache holds fewer tokens than its running
requests need, so vLLM's scheduler preempts a request and later recomputes it
in one step. A block that ran before the preemption ends its request with a
clear error; a lowered steering block from the first step continues, exactly;
plain requests beside them are untouched."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

import vllm_nnsight_plugin
from tests.conftest import start_llm, stop_llm
from vllm_nnsight_plugin import VLLM

PROMPTS = ["The capital of France is", "Paris is in", "Water boils at", "One, two, three,"]
TOKENS = 120
# SmolLM2 in fp32 keeps 46,080 bytes of K and V per token: six blocks of 32 tokens
# (192 tokens) for four requests that need about 500.
KV_BYTES = 6 * 32 * 46_080


@pytest.fixture(scope="module")
def small_kv(smollm2_path):
    llm = start_llm(
        smollm2_path,
        kv_cache_memory_bytes=KV_BYTES,
        block_size=32,  # the CPU attention backend takes multiples of 32
        max_model_len=160,
        max_num_seqs=4,
        enable_prefix_caching=False,
        additional_config={"nnsight_taps": ["model.layers.10.output"]},
    )
    yield llm
    stop_llm(llm)


def stats(llm) -> dict:
    (found,) = llm.collective_rpc("nnsight_stats")
    return found


def read_block(model):
    with model.requests(PROMPTS[-1], temperature=0.0, max_tokens=TOKENS, ignore_eos=True) as tracer:
        rows = list().save()
        for _ in tracer.iter[:TOKENS]:
            rows.append(model.model.layers[3].output[0][-1].clone())
    return tracer.prepared


def steer_block(model, vector):
    with model.requests(PROMPTS[-1], temperature=0.0, max_tokens=TOKENS, ignore_eos=True) as tracer:
        for _ in tracer.all():
            model.model.layers[10].output[0][:] += vector
    return tracer.prepared


def run_last(llm, prepared):
    """Three plain requests, then the traced one: the last added is preempted first."""
    plain = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    outputs = llm.generate(
        [*PROMPTS[:3], prepared.prompts[0]], [plain, plain, plain, prepared.params[0]], use_tqdm=False
    )
    return outputs


def alone(llm, prompt):
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)


def test_a_block_that_ran_before_a_preemption_ends_with_a_clear_error(small_kv):
    model = VLLM(small_kv)
    before = stats(small_kv)
    outputs = run_last(small_kv, read_block(model))
    after = stats(small_kv)
    assert after["resumed"] > before["resumed"]  # the scheduler did preempt
    assert after["preempted_blocks"] - before["preempted_blocks"] == 1
    with pytest.raises(Exception, match="PreemptedError.*preempted by vLLM's scheduler"):
        vllm_nnsight_plugin.saves(outputs[3])
    for output, prompt in zip(outputs[:3], PROMPTS):
        assert list(output.outputs[0].token_ids) == alone(small_kv, prompt)
    assert after["tracked"] == 0


def test_lowered_steering_from_the_first_step_continues_through_a_preemption(small_kv):
    model = VLLM(small_kv)
    torch.manual_seed(0)
    vector = torch.randn(576)
    vector = 8.0 * vector / vector.norm()
    before = stats(small_kv)
    outputs = run_last(small_kv, steer_block(model, vector))
    after = stats(small_kv)
    assert after["resumed"] > before["resumed"] and after["lowered"] - before["lowered"] == 1
    assert after["preempted_blocks"] == before["preempted_blocks"]
    vllm_nnsight_plugin.saves(outputs[3])  # no error
    want = alone_steered(model, vector)
    assert list(outputs[3].outputs[0].token_ids) == want
    assert list(outputs[3].outputs[0].token_ids) != alone(small_kv, PROMPTS[-1])


def alone_steered(model, vector):
    prepared = steer_block(model, vector)
    output = model.vllm_entrypoint.generate(prepared.prompts, prepared.params, use_tqdm=False)[0]
    return list(output.outputs[0].token_ids)
