"""Preemption: an engine whose KV cache holds fewer tokens than its running
requests need, so vLLM's scheduler preempts a request and later recomputes it
(in chunks: the step budget is smaller than a recompute).
A plain request gives way before a traced one; a block that only reads goes on
through the recompute, seeing the rows an ordinary step gives, and its request
makes the tokens it makes alone; a block that writes ends its request with a
clear error; a lowered steering block from the first step continues, exactly;
an installed edit that reads goes on too."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

import vllm_nnsight_plugin
from tests.conftest import start_llm, stop_llm
from vllm_nnsight_plugin import VLLM

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = ["The capital of France is", "Paris is in", "Water boils at", "One, two, three,"]
TOKENS = 64
# SmolLM2 in fp32 keeps 46,080 bytes of K and V per token: seven blocks of 32
# tokens, one of them vLLM's null block, so two requests (about 70 tokens, three
# blocks each) run side by side and four (twelve blocks) make vLLM preempt.
KV_BYTES = 7 * 32 * 46_080


@pytest.fixture(scope="module")
def small_kv(smollm2_path):
    llm = start_llm(
        smollm2_path,
        kv_cache_memory_bytes=KV_BYTES,
        block_size=32,  # the CPU attention backend takes multiples of 32
        max_model_len=160,
        max_num_seqs=4,
        # A step budget under the longest recompute: a recompute is then split into
        # chunks, whose samples vLLM throws away but the last one's.
        max_num_batched_tokens=24,
        enable_prefix_caching=False,
        additional_config={"nnsight_taps": ["model.layers.10.output"]},
    )
    yield llm
    stop_llm(llm)


def stats(llm) -> dict:
    (found,) = llm.collective_rpc("nnsight_stats")
    return found


def read_blocks(model, prompts):
    with model.requests(temperature=0.0, max_tokens=TOKENS, ignore_eos=True) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                rows = list().save()
                shapes = list().save()
                for _ in tracer.iter[:TOKENS]:
                    hidden = model.model.layers[3].output[0]
                    shapes.append(tuple(hidden.shape))
                    rows.append(hidden[-1].clone())
    return tracer.prepared


def served_blocks(model, prompts):
    """:func:`read_blocks` at the tapped layer, computing from what it reads: each
    is served the tap's rows at the sampler (``taps/replay.py``)."""
    with model.requests(temperature=0.0, max_tokens=TOKENS, ignore_eos=True) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                rows = list().save()
                shapes = list().save()
                for _ in tracer.iter[:TOKENS]:
                    hidden = model.model.layers[10].output[0]
                    shapes.append(tuple(hidden.shape))
                    rows.append(hidden[-1] * 1.0)
    return tracer.prepared


def write_blocks(model, prompts):
    """Blocks that write at a layer with no tap (so they run as Python): a write
    that changes nothing, which a recompute could still not be trusted to replay."""
    with model.requests(temperature=0.0, max_tokens=TOKENS, ignore_eos=True) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                rows = list().save()
                for _ in tracer.iter[:TOKENS]:
                    model.model.layers[3].output[0][:] *= 1.0
                    rows.append(model.model.layers[3].output[0][-1].clone())
    return tracer.prepared


def steer_blocks(model, prompts, vector):
    with model.requests(temperature=0.0, max_tokens=TOKENS, ignore_eos=True) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                for _ in tracer.all():
                    model.model.layers[10].output[0][:] += vector
    return tracer.prepared


PLAIN = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)


_ALONE: dict[tuple[int, str], list[int]] = {}


def alone(llm, prompt):
    """The tokens ``prompt`` makes alone, plain (no preemption): greedy, so once per
    engine and prompt serves every test here."""
    key = (id(llm), prompt)
    if key not in _ALONE:
        _ALONE[key] = list(llm.generate([prompt], PLAIN, use_tqdm=False)[0].outputs[0].token_ids)
    return _ALONE[key]


def test_the_scheduler_preempts_a_plain_request_before_a_traced_one(small_kv):
    model = VLLM(small_kv)
    prepared = read_blocks(model, PROMPTS[-1:])
    before = stats(small_kv)
    # The traced request is added last: first-come-first-served would preempt it first.
    outputs = small_kv.generate(
        [*PROMPTS[:3], prepared.prompts[0]], [PLAIN, PLAIN, PLAIN, prepared.params[0]], use_tqdm=False
    )
    after = stats(small_kv)
    assert after["resumed"] > before["resumed"]  # the scheduler did preempt
    assert after["preempted_blocks"] == before["preempted_blocks"]
    rows = vllm_nnsight_plugin.saves(outputs[3])["rows"]
    assert len(rows) == TOKENS and all(tuple(r.shape) == (576,) for r in rows)
    for output, prompt in zip(outputs[:3], PROMPTS):  # recomputed by vLLM, exactly
        assert list(output.outputs[0].token_ids) == alone(small_kv, prompt)
    assert after["tracked"] == 0


def side_by_side(llm, build, prompts) -> list:
    """Each prompt's traced request (``build(model_prompts)``) run without
    preemption, two at a time (what the KV cache holds)."""
    before = stats(llm)["resumed"]
    outputs = []
    for start in range(0, len(prompts), 2):
        prepared = build(prompts[start : start + 2])
        outputs += llm.generate(prepared.prompts, prepared.params, use_tqdm=False)
    assert stats(llm)["resumed"] == before  # none was preempted
    return outputs


def prompt_rows(llm, prompt) -> int:
    return len(llm.get_tokenizer().encode(prompt))


def test_a_reading_block_goes_on_through_a_recompute_as_if_alone(small_kv):
    model = VLLM(small_kv)
    prepared = read_blocks(model, PROMPTS)  # every request traced: one must give way
    before = stats(small_kv)
    outputs = small_kv.generate(prepared.prompts, prepared.params, use_tqdm=False)
    after = stats(small_kv)
    assert after["resumed"] > before["resumed"]  # the scheduler did preempt
    assert after["continued_blocks"] - before["continued_blocks"] >= 1
    assert after["recompute_chunks_sat_out"] > before["recompute_chunks_sat_out"]  # a chunked recompute
    assert after["preempted_blocks"] == before["preempted_blocks"]
    wanted = side_by_side(small_kv, lambda prompts: read_blocks(model, prompts), PROMPTS)
    for output, prompt, want in zip(outputs, PROMPTS, wanted):
        saves = vllm_nnsight_plugin.saves(output)
        # The whole prompt on the first step, then one row a step, each step once.
        assert saves["shapes"] == [(prompt_rows(small_kv, prompt), 576)] + [(1, 576)] * (TOKENS - 1)
        assert list(output.outputs[0].token_ids) == alone(small_kv, prompt)
        got, expected = torch.stack(saves["rows"]), torch.stack(vllm_nnsight_plugin.saves(want)["rows"])
        # The recompute's last row against the decode step's: equal up to the
        # kernels' own rounding (about 1e-7 relative on a CPU, 1e-4 on a GPU).
        assert (got - expected).norm() / expected.norm() < 1e-3
    assert stats(small_kv)["tracked"] == 0


def test_a_block_served_at_the_sampler_goes_on_through_a_recompute_as_if_alone(small_kv):
    model = VLLM(small_kv)
    prepared = served_blocks(model, PROMPTS)
    before = stats(small_kv)
    outputs = small_kv.generate(prepared.prompts, prepared.params, use_tqdm=False)
    after = stats(small_kv)
    assert after["lowered_by"]["replay"] - before["lowered_by"]["replay"] == len(PROMPTS)
    assert after["resumed"] > before["resumed"]  # the scheduler did preempt
    assert after["continued_blocks"] - before["continued_blocks"] >= 1
    assert after["preempted_blocks"] == before["preempted_blocks"]
    wanted = side_by_side(small_kv, lambda prompts: served_blocks(model, prompts), PROMPTS)
    for output, prompt, want in zip(outputs, PROMPTS, wanted):
        saves = vllm_nnsight_plugin.saves(output)
        assert saves["shapes"] == [(prompt_rows(small_kv, prompt), 576)] + [(1, 576)] * (TOKENS - 1)
        assert list(output.outputs[0].token_ids) == alone(small_kv, prompt)
        got, expected = torch.stack(saves["rows"]), torch.stack(vllm_nnsight_plugin.saves(want)["rows"])
        assert (got - expected).norm() / expected.norm() < 1e-3  # as for the Python path above
    assert stats(small_kv)["tracked"] == 0 and stats(small_kv)["lowered_now"] == 0


def test_a_block_that_writes_ends_with_a_clear_error_when_preempted(small_kv):
    model = VLLM(small_kv)
    prepared = write_blocks(model, PROMPTS)
    before = stats(small_kv)
    outputs = small_kv.generate(prepared.prompts, prepared.params, use_tqdm=False)
    after = stats(small_kv)
    assert after["resumed"] > before["resumed"]
    ended = after["preempted_blocks"] - before["preempted_blocks"]
    failed = []
    for output in outputs:
        try:
            assert len(vllm_nnsight_plugin.saves(output)["rows"]) == TOKENS
        except Exception as error:
            failed.append(error)
    assert ended >= 1 and len(failed) == ended
    assert all("PreemptedError" in str(e) and "preempted by vLLM's scheduler" in str(e) for e in failed)
    assert stats(small_kv)["tracked"] == 0
    paris = small_kv.get_tokenizer().encode(" Paris")[0]
    served = small_kv.generate([PROMPTS[0]], PLAIN, use_tqdm=False)[0]  # the engine serves on
    assert served.outputs[0].token_ids[0] == paris


def test_lowered_steering_from_the_first_step_continues_through_a_preemption(small_kv):
    model = VLLM(small_kv)
    torch.manual_seed(0)
    vector = torch.randn(576)
    vector = (8.0 * vector / vector.norm()).to(DEVICE)  # where the engine's activations are
    prepared = steer_blocks(model, PROMPTS, vector)
    before = stats(small_kv)
    outputs = small_kv.generate(prepared.prompts, prepared.params, use_tqdm=False)
    after = stats(small_kv)
    assert after["resumed"] > before["resumed"] and after["lowered"] - before["lowered"] == 4
    assert after["preempted_blocks"] == before["preempted_blocks"]
    wanted = side_by_side(small_kv, lambda prompts: steer_blocks(model, prompts, vector), PROMPTS)
    for output, prompt, want in zip(outputs, PROMPTS, wanted):
        vllm_nnsight_plugin.saves(output)  # no error
        assert list(output.outputs[0].token_ids) == list(want.outputs[0].token_ids)
        assert list(output.outputs[0].token_ids) != alone(small_kv, prompt)


def test_an_installed_edit_that_reads_goes_on_through_a_recompute(small_kv):
    model = VLLM(small_kv)
    with model.edit() as (tracer, edit):
        rows = list().save()
        for _ in tracer.iter[:TOKENS]:
            rows.append(model.model.layers[3].output[0][-1].clone())
    try:
        before = stats(small_kv)
        outputs = small_kv.generate(PROMPTS, PLAIN, use_tqdm=False)  # plain requests, each edited
        after = stats(small_kv)
    finally:
        edit.clear()
    assert after["resumed"] > before["resumed"] and after["continued_blocks"] > before["continued_blocks"]
    for output, prompt in zip(outputs, PROMPTS):
        assert len(vllm_nnsight_plugin.saves(output)["rows"]) == TOKENS
        assert list(output.outputs[0].token_ids) == alone(small_kv, prompt)
    assert stats(small_kv)["tracked"] == 0 and stats(small_kv)["edits"] == 0
