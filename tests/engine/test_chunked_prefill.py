"""Chunked prefill forced small (a 32-token step budget): traced prompts that fit
the budget are admitted whole, so their rows still equal HF; a traced prompt
longer than the budget is refused on its own request with a clear error. The same
engine checks a user's own worker extension beside the plugin's, and the save limit."""

from __future__ import annotations

import os

import pytest
import torch
from vllm import SamplingParams

from tests.conftest import start_llm, stop_llm
from tests.engine.test_fidelity import PROMPTS, check
from tests.reference import load_hf

BUDGET = 32
SAVE_LIMIT = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def chunky(smollm2_path):
    from vllm_nnsight_plugin import VLLM

    # This engine also carries a user's own worker extension (the plugin composes
    # with it) and a small save limit, which its worker processes inherit.
    os.environ["VLLM_NNSIGHT_MAX_SAVE_BYTES"] = str(SAVE_LIMIT)
    try:
        llm = start_llm(
            smollm2_path,
            max_num_batched_tokens=BUDGET,
            max_num_seqs=8,
            worker_extension_cls="tests.engine.test_seams.UserExtension",
        )
    finally:
        del os.environ["VLLM_NNSIGHT_MAX_SAVE_BYTES"]
    assert llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill
    yield VLLM(llm), llm
    stop_llm(llm)


def test_eight_traced_prompts_under_a_small_budget_match_hf(chunky, smollm2_path):
    model, _ = chunky
    lengths = [len(model.tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert sum(lengths) > BUDGET >= max(lengths)  # they cannot all share one step
    check(model, load_hf(smollm2_path), PROMPTS, 10, "smollm2/chunked-budget-32")


def test_traced_prompt_beside_a_chunked_plain_prompt(chunky):
    import vllm_nnsight_plugin

    model, llm = chunky
    long_plain = " ".join(PROMPTS[:5])  # longer than the budget: chunked over several steps
    plain = SamplingParams(temperature=0.0, max_tokens=4)
    reference = llm.generate([long_plain], plain, use_tqdm=False)
    with model.requests(PROMPTS[2], temperature=0.0, max_tokens=4) as tracer:
        rows = model.model.layers[3].output[0].clone().save()  # noqa: F841
    prepared = tracer.prepared
    outs = llm.generate([long_plain] + prepared.prompts, [plain] + prepared.params, use_tqdm=False)
    saved = vllm_nnsight_plugin.saves(outs[1])["rows"]
    assert tuple(saved.shape) == (len(model.tokenizer(PROMPTS[2])["input_ids"]), 576)
    assert list(outs[0].outputs[0].token_ids) == list(reference[0].outputs[0].token_ids)


def test_prompt_longer_than_the_budget_is_refused_clearly(chunky):
    model, llm = chunky
    too_long = " ".join(PROMPTS)
    assert len(model.tokenizer(too_long)["input_ids"]) > BUDGET
    with pytest.raises(Exception, match="split across engine steps by chunked prefill"):
        with model.trace(too_long, temperature=0.0, max_tokens=2):
            model.model.layers[3].output[0].save()
    after = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert after[0].outputs[0].text.startswith(" Paris")
    assert llm.collective_rpc("nnsight_tracked") == [0]


def test_users_worker_extension_still_works_beside_the_plugin(chunky):
    _, llm = chunky
    assert llm.collective_rpc("user_method") == ["mine"]
    assert llm.collective_rpc("nnsight_tracked") == [0]


def test_saves_over_the_limit_fail_that_request_only(chunky):
    model, llm = chunky
    with pytest.raises(Exception, match="over this engine's limit"):
        with model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
            big = model.model.layers[1].output[0].new_zeros(3_000_000).save()  # noqa: F841 - 12 MB
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
        small = model.model.layers[1].output[0].clone().save()
    assert isinstance(small, torch.Tensor) and small.shape[0] == len(model.tokenizer(PROMPTS[0])["input_ids"])
