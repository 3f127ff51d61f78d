"""Traced requests whose blocks read only the last rows share the prefix cache
(``prefix.py``): which blocks qualify (read from the source, no engine), and on the
session's engine that such a request reads the cache and sees what it sees with
the cache cold, that any other block still computes its whole prompt, and that a
claim its block does not bear out fails that request only."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

import vllm_nnsight_plugin
from vllm_nnsight_plugin.prefix import CLAIM_KEY, LAST_ROWS, last_rows_only

#: Over one KV block of the CPU engine (128 tokens), and used by no other test.
PREFIX = " ".join(f"Entry {i} of the ledger lists a cached prefix." for i in range(24))


@pytest.fixture(scope="module")
def meta_model(smollm2_path):
    from vllm_nnsight_plugin import VLLM

    return VLLM(smollm2_path, dtype="float32", max_model_len=512)


def _claims(model, source: str, **scope) -> bool:
    from nnsight.intervention.tracer import InterleavingTracer

    meta = model._module
    return last_rows_only(source, {"model": model, **scope}, model, meta.get_submodule, InterleavingTracer)


@pytest.mark.parametrize(
    "source",
    [
        "row = model.model.layers[5].output[0][-1].save()",
        "row = model.model.layers[5].output[1][-1, :10].norm().save()",
        "logits = model.logits.save()\nresult = tracer.result.save()",
        "rows = list().save()\nfor step in tracer.iter[:3]:\n    rows.append(model.model.layers[2].output[0][-1])",
        "layer = model.model.layers[7]\nrow = model.model.layers[7].output[0][-1].clone().save()",
    ],
)
def test_blocks_reading_only_the_last_row_of_a_tuple_qualify(meta_model, source):
    assert _claims(meta_model, source)


def test_a_module_the_block_captured_qualifies_too(meta_model):
    """The sweep of the benchmarks: the layer taken before the trace."""
    layer = meta_model.model.layers[7]
    assert _claims(meta_model, "last = layer.output[0][-1].clone().save()", layer=layer)
    assert not _claims(meta_model, "last = layer.output[0].clone().save()", layer=layer)


@pytest.mark.parametrize(
    "source",
    [
        "rows = model.model.layers[5].output[0].save()",  # every row
        "row = model.model.layers[5].output[0][0].save()",  # the first row
        "row = model.model.layers[5].output[-1].save()",  # the residual, every row
        "row = model.model.layers[5].mlp.output[-1].save()",  # a tensor: no tuple to index
        "row = model.model.layers[5].input.save()",
        "row = model.model.layers[5].self_attn.source.attn_0.output.save()",
        "for layer in model.model.layers:\n    layer.output[0][-1].save()",  # through a loop's name
        "row = model.model.layers[5].output[0][-1]\nrow[:] = 0",  # a write
        "model.model.layers[5].output[0][-1] += 1",
        "row = model.model.layers[5].output[0][-1]\nrow.mul_(2)",
        "out = model.model.layers[5].output\nrow = out[0][-1].save()",  # an alias of the whole value
        "cache = tracer.cache()",
        "row = model.model.layers[5].output[0][-1].save()\nhelper(row)",
    ],
)
def test_other_blocks_do_not(meta_model, source):
    def helper(row):
        row.zero_()

    assert not _claims(meta_model, source, helper=helper)


def _last_row_trace(model, prompt: str, tokens: int = 3):
    with model.trace(prompt, temperature=0.0, max_tokens=tokens) as tracer:
        row = model.model.layers[10].output[0][-1].save()
        logits = model.logits.save()
        result = tracer.result.save()
    return row, logits, result


def test_a_last_row_reader_shares_the_prefix_cache_and_sees_what_it_sees_cold(smol, smollm2_llm):
    prompt = PREFIX + " The ledger ends with"
    before = smollm2_llm.collective_rpc("nnsight_stats")[0]["prompt_rows_cached"]
    row_cold, logits_cold, cold = _last_row_trace(smol, prompt)
    row_hit, logits_hit, hit = _last_row_trace(smol, prompt)
    assert cold.num_cached_tokens == 0 and hit.num_cached_tokens >= 128
    stats = smollm2_llm.collective_rpc("nnsight_stats")[0]
    assert stats["prompt_rows_cached"] == before + hit.num_cached_tokens
    assert torch.equal(row_hit, row_cold) and torch.equal(logits_hit, logits_cold)
    assert list(hit.outputs[0].token_ids) == list(cold.outputs[0].token_ids)
    # what it wrote is a plain request's to read, and the plain request's tokens are its own
    plain = smollm2_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)[0]
    assert plain.num_cached_tokens >= 128
    assert list(plain.outputs[0].token_ids) == list(cold.outputs[0].token_ids)
    # a block reading every row computes the whole prompt, and its last row is the same
    with smol.trace(prompt, temperature=0.0, max_tokens=1) as tracer:
        rows = smol.model.layers[10].output[0].save()
        whole = tracer.result.save()
    assert whole.num_cached_tokens == 0 and rows.shape[0] == len(plain.prompt_token_ids)
    torch.testing.assert_close(rows[-1], row_cold, rtol=1e-5, atol=1e-5)


def test_a_claim_its_block_does_not_bear_out_fails_that_request_only(smol, smollm2_llm):
    prompt = PREFIX + " A forged claim"
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    alone = smollm2_llm.generate([prompt], plain, use_tqdm=False)[0]  # (and the cache filled)
    with smol.requests(prompt, temperature=0.0, max_tokens=2) as tracer:
        rows = smol.model.layers[10].output[0].save()  # noqa: F841 - every row
    prepared = tracer.prepared
    assert CLAIM_KEY not in prepared.params[0].extra_args
    prepared.params[0].extra_args[CLAIM_KEY] = LAST_ROWS  # as a client that lies would send it
    prepared.params[0].skip_reading_prefix_cache = False
    outs = smollm2_llm.generate([prompt, *prepared.prompts], [plain, *prepared.params], use_tqdm=False)
    with pytest.raises(Exception, match="reads each module only at the last row"):
        vllm_nnsight_plugin.saves(outs[1])
    assert outs[1].num_cached_tokens > 0  # it read the cache: its block never ran
    assert list(outs[0].outputs[0].token_ids) == list(alone.outputs[0].token_ids)
    assert smollm2_llm.collective_rpc("nnsight_tracked") == [0]


def test_a_trace_claims_only_where_every_invoke_qualifies_with_its_own_values(smol):
    """An ``if`` on a captured value decides what each invoke's block does: the
    claim is read per invoke with its own values, and made only if all qualify."""
    for order in ([None, 3], [3, None], [None, None]):
        with smol.requests(temperature=0.0, max_tokens=1) as tracer:
            for index in order:
                with tracer.invoke(PREFIX):
                    if index is not None:
                        smol.model.layers[index].output[0][:] = 0
                    p = smol.logits.save()  # noqa: F841
        claims = [param.extra_args.get(CLAIM_KEY) for param in tracer.prepared.params]
        assert claims == ([LAST_ROWS] * 2 if order == [None, None] else [None, None]), order
