"""Traced requests whose blocks read only the last rows share the prefix cache
(``prefix.py``): which blocks qualify (read from the source, no engine), and on the
session's engine that such a request reads the cache and sees what it sees with
the cache cold, that any other block still computes its whole prompt, and that a
claim its block does not bear out fails that request only."""

from __future__ import annotations

import nnsight
import pytest
import torch
from vllm import SamplingParams

import vllm_nnsight_plugin
from vllm_nnsight_plugin.prefix import CLAIM_KEY, LAST_ROWS, SAME_EDIT, last_rows_only, one_edit_every_step

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


# ---------------------------------------------------------------- the same edit
def _prefix(subject: str) -> str:
    """Over two KV blocks of the CPU engine, and used by no other test (a plain
    request that ran it earlier would have cached it)."""
    return " ".join(f"Line {i} of the {subject} repeats a prefix of its own." for i in range(24))


def _edits_alike(model, source: str, **scope) -> bool:
    from nnsight.intervention.tracer import InterleavingTracer

    tracer = object.__new__(InterleavingTracer)  # a tracer's type is all the test reads of it
    meta = model._module
    return one_edit_every_step(
        source, {"model": model, "tracer": tracer, **scope}, model, meta.get_submodule, InterleavingTracer
    )


#: The steering page's loop, and other spellings of one edit of every row at every step.
ALIKE = [
    "drawn = list().save()\nfor _ in tracer.all():\n    hidden = layer.output[0]\n"
    "    hidden[:] += sign * 4.0 * direction.to(hidden)\n    drawn.append(model.samples.item())",
    "for _ in tracer.all():\n    layer.output[0][:] += direction",
    "for _ in tracer.iter[:]:\n    model.model.layers[3].output[0][:] *= 0.5",
    "for _ in tracer.all():\n    model.model.layers[3].output[1][:, 0:10] = 0",
    "for step in tracer.all():\n    h = layer.output[0]\n    h[:] -= sign * direction.to(h)\n"
    "    last = model.model.layers[12].output[0][-1].save()",
    "for _ in tracer.all():\n    if sign > 0:\n        layer.output[0][:] += direction",  # decided once
    "for _ in tracer.all():\n    layer.output[0][:] += sign",  # a captured number
]

NOT_ALIKE = [
    "for _ in tracer.iter[:8]:\n    layer.output[0][:] += direction",  # bounded: prompt and drawn rows differ
    "for _ in tracer.iter[1:]:\n    layer.output[0][:] += direction",
    "layer.output[0][:] += direction",  # the prompt's step only
    "for _ in tracer.all():\n    layer.output[0][-1] += direction",  # the last row: where depends on the prompt
    "for _ in tracer.all():\n    layer.output[0][:] += layer.output[0][-1]",  # another row's value
    "for _ in tracer.all():\n    hidden = layer.output[0]\n    hidden[:] += direction.to(hidden)\n    hidden.save()",
    "for _ in tracer.all():\n    hidden = layer.output[0]\n    hidden[:] += torch.randn(576).to(hidden)",
    "for _ in tracer.all():\n    layer.output[0][:] += direction\n    rows = model.model.layers[5].output[0].save()",
    "for _ in tracer.all():\n    layer.output[0][:] += direction\n    break",
    "for i in tracer.all():\n    layer.output[0][:] += i",  # the step's number
    "for _ in tracer.all():\n    layer.mlp.output[:] = 0",  # a module returning a tensor
    "for _ in tracer.all():\n    layer.output[0][:] += direction\n    layer.output[0].mul_(2)",
    "for _ in tracer.all():\n    hidden = layer.output[0]\n    hidden = layer.output[1]\n    hidden[:] += direction",
    "for _ in tracer.all():\n    layer.output[0][:] += direction.to(layer.output[1])",
    "for _ in tracer.all():\n    layer.output[0][:] += direction\nrows = layer.output[0].save()",
    "for _ in tracer.all():\n    layer.output[0][:] += helper(direction)",  # a function of the user's
    "for _ in tracer.all():\n    layer.output[0][:] += per_row",  # a tensor of rows: by position
]


@pytest.mark.parametrize("source", ALIKE)
def test_blocks_editing_every_row_alike_at_every_step_qualify(meta_model, source):
    layer = meta_model.model.layers[10]
    assert _edits_alike(meta_model, source, layer=layer, direction=torch.ones(576), sign=1)
    assert not _claims(meta_model, source, layer=layer, direction=torch.ones(576), sign=1, tracer=None)


@pytest.mark.parametrize("source", NOT_ALIKE)
def test_other_edits_do_not(meta_model, source):
    layer = meta_model.model.layers[10]
    scope = {"layer": layer, "direction": torch.ones(576), "sign": 1, "torch": torch, "helper": abs}
    assert not _edits_alike(meta_model, source, per_row=torch.ones(3, 576), **scope)


def test_a_claim_leaves_a_request_asking_for_prompt_logprobs_computing_its_prompt(smol):
    """vLLM gives prompt log-probabilities only for rows it computes: such a request
    keeps skipping cache reads (its KV is still salted by its block)."""
    vector = torch.ones(576)
    for logprobs, skips in ((None, False), (1, True)):
        with smol.requests(PREFIX, temperature=0.0, max_tokens=1, prompt_logprobs=logprobs) as tracer:
            for _ in tracer.all():
                hidden = smol.model.layers[10].output[0]
                hidden[:] += vector.to(hidden)
        (params,) = tracer.prepared.params
        assert params.extra_args[CLAIM_KEY] == SAME_EDIT and params.skip_reading_prefix_cache is skips


def _steered(model, llm, prompt: str, vector, tokens: int = 4):
    """The steering page's loop over every step: its finished output, what it
    drew, and a later layer's last row at each step."""
    with model.requests(prompt, temperature=0.0, max_tokens=tokens) as tracer:
        drawn, rows = list().save(), list().save()  # noqa: F841 - read from the output
        for _ in tracer.all():
            hidden = model.model.layers[10].output[0]
            hidden[:] += 8.0 * vector.to(hidden)
            rows.append(model.model.layers[20].output[0][-1].clone())
            drawn.append(model.samples.item())
    prepared = tracer.prepared
    assert prepared.params[0].extra_args.get(CLAIM_KEY) == SAME_EDIT
    (output,) = llm.generate(prepared.prompts, prepared.params, use_tqdm=False)
    saves = vllm_nnsight_plugin.saves(output)
    return output, list(saves["drawn"]), torch.stack(list(saves["rows"]))


def test_requests_making_the_same_edit_share_its_kv_and_see_what_they_see_cold(smol, smollm2_llm):
    torch.manual_seed(1)
    vector = torch.randn(576)
    prompt = _prefix("steered log") + " The steered log ends with"
    cold, drawn_cold, rows_cold = _steered(smol, smollm2_llm, prompt, vector)
    hit, drawn_hit, rows_hit = _steered(smol, smollm2_llm, prompt, vector)
    assert cold.num_cached_tokens == 0 and hit.num_cached_tokens >= 128
    assert drawn_hit == drawn_cold and list(hit.outputs[0].token_ids) == list(cold.outputs[0].token_ids)
    assert torch.equal(rows_hit, rows_cold)
    plain = smollm2_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert plain.num_cached_tokens == 0  # the steered KV is no plain request's
    assert list(plain.outputs[0].token_ids) != drawn_cold  # (the edit changes them)
    other, _, _ = _steered(smol, smollm2_llm, prompt, -vector)
    assert other.num_cached_tokens == 0  # nor another edit's


def test_a_same_edit_claim_its_block_does_not_bear_out_fails_every_request_carrying_it(smol, smollm2_llm):
    """Every request under one salt carries the same block, so all of them fail
    before their blocks run: what they wrote there is read by no request that
    succeeds."""
    prompt = _prefix("forged edit") + " A forged edit"
    vector = torch.ones(576)
    with smol.requests(prompt, temperature=0.0, max_tokens=2) as tracer:
        for _ in tracer.all():
            hidden = smol.model.layers[10].output[0]
            hidden[-1] += vector.to(hidden)  # the last row: not every row alike
    prepared = tracer.prepared
    assert CLAIM_KEY not in prepared.params[0].extra_args
    prepared.params[0].extra_args[CLAIM_KEY] = SAME_EDIT  # as a client that lies would send it
    prepared.params[0].skip_reading_prefix_cache = False
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    for round in range(2):
        outs = smollm2_llm.generate([prompt, prompt], [plain, prepared.params[0]], use_tqdm=False)
        with pytest.raises(Exception, match="one edit of every row at every step"):
            vllm_nnsight_plugin.saves(outs[1])
        assert outs[1].num_cached_tokens == (
            0 if round == 0 else 128 * (len(outs[1].prompt_token_ids) // 128)
        )
    assert smollm2_llm.collective_rpc("nnsight_tracked") == [0]


def test_a_request_that_also_runs_an_installed_edit_reading_every_row_keeps_its_kv_to_itself(
    smol, smollm2_llm
):
    """An installed edit (``model.edit()``) is part of what computes a request's KV,
    and is not in its block: with one that reads every row, a request computes its
    whole prompt under a salt of its own, and once the edit is cleared the block's
    salt is back."""
    torch.manual_seed(2)
    vector = torch.randn(576)
    prompt = _prefix("edited log") + " The edited log ends with"
    first, _, _ = _steered(smol, smollm2_llm, prompt, vector)
    with smol.edit() as (tracer, edit):
        stream = smol.model.layers[20].output[0].clone().save()  # noqa: F841 - every row
    try:
        edited, _, _ = _steered(smol, smollm2_llm, prompt, vector)
    finally:
        edit.clear()
    after, _, _ = _steered(smol, smollm2_llm, prompt, vector)
    assert first.num_cached_tokens == 0 and edited.num_cached_tokens == 0
    assert edited.saves["stream"].shape[0] == len(edited.prompt_token_ids)
    assert after.num_cached_tokens >= 128


def test_requests_running_an_installed_edit_of_the_last_rows_share_with_plain_ones(smol, smollm2_llm):
    """An installed edit that reads only last rows and writes nothing leaves its
    requests' KV a plain request's: they read and write the cache as plain ones."""
    prompt = _prefix("probed log") + " The probed log ends with"
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    first = smollm2_llm.generate([prompt], plain, use_tqdm=False)[0]  # no edit yet: plain KV
    with smol.edit() as (tracer, edit):
        last = smol.model.layers[20].output[0][-1].clone().save()  # noqa: F841
    try:
        hit = smollm2_llm.generate([prompt], plain, use_tqdm=False)[0]
        smollm2_llm.reset_prefix_cache()
        cold = smollm2_llm.generate([prompt], plain, use_tqdm=False)[0]
    finally:
        edit.clear()
    assert hit.num_cached_tokens >= 128 and cold.num_cached_tokens == 0
    assert torch.equal(hit.saves["last"], cold.saves["last"])
    assert (
        list(hit.outputs[0].token_ids) == list(cold.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    )


def test_requests_running_one_installed_steering_edit_share_its_kv_and_see_what_they_see_cold(
    smol, smollm2_llm
):
    """An installed edit of every row at every step: its requests share the KV made
    under it, with each other only (not a plain request, not the same edit
    installed again after a clear), and a cache hit sees what a cold request sees.
    A traced request making an edit of its own too shares with the requests making
    both."""
    torch.manual_seed(4)
    vector = torch.randn(576)
    prompt = _prefix("installed steer") + " The installed steer ends with"
    plain = SamplingParams(temperature=0.0, max_tokens=4)

    def install():
        with smol.edit(name="steer") as (tracer, edit):
            rows = nnsight.save([])  # noqa: F841 - read from the output
            for _ in tracer.all():
                hidden = smol.model.layers[10].output[0]
                hidden[:] += 8.0 * vector.to(hidden)
                rows.append(smol.model.layers[20].output[0][-1].clone())
        return edit

    edit = install()
    try:
        cold = smollm2_llm.generate([prompt], plain, use_tqdm=False)[0]
        (before,) = smollm2_llm.collective_rpc("nnsight_stats")
        hit = smollm2_llm.generate([prompt], plain, use_tqdm=False)[0]
        (after,) = smollm2_llm.collective_rpc("nnsight_stats")
        (free,) = smol.generate(prompt, temperature=0.0, max_tokens=4, edits=[])  # runs no edit
        # (a tensor of its own each time: equal values pickle alike, ``wire/canonical.py``)
        both = [_steered(smol, smollm2_llm, prompt, -vector) for _ in range(2)]
    finally:
        edit.clear()
    assert cold.num_cached_tokens == 0 and hit.num_cached_tokens >= 128
    assert after["prompt_rows_cached"] - before["prompt_rows_cached"] == hit.num_cached_tokens
    assert list(hit.outputs[0].token_ids) == list(cold.outputs[0].token_ids)
    # The hit computes the prompt's last rows in a smaller batch than the cold request
    # did, and vLLM's CPU matmul is not batch-invariant on every CPU (AMD EPYC: the
    # last bits of a row move with the batch's row count), so the rows agree to
    # float32 rounding there; an edit missing from the cached rows moves them by
    # whole units (8 x the vector at layer 10).
    rows_hit, rows_cold = torch.stack(list(hit.saves["rows"])), torch.stack(list(cold.saves["rows"]))
    torch.testing.assert_close(rows_hit, rows_cold, rtol=1e-5, atol=1e-4)
    assert free.num_cached_tokens == 0  # the steered KV is no plain request's
    assert list(free.outputs[0].token_ids) != list(cold.outputs[0].token_ids)  # (the edit changes them)
    # its own edit and the installed one: a salt of their own, shared by the second
    assert both[0][0].num_cached_tokens == 0 and both[1][0].num_cached_tokens >= 128
    assert both[1][1] == both[0][1]
    torch.testing.assert_close(both[1][2], both[0][2], rtol=1e-5, atol=1e-4)  # (as above)
    edit = install()  # the same block, installed again: KV of its own
    try:
        again = smollm2_llm.generate([prompt], plain, use_tqdm=False)[0]
    finally:
        edit.clear()
    assert again.num_cached_tokens == 0
    assert list(again.outputs[0].token_ids) == list(cold.outputs[0].token_ids)


def test_invokes_of_one_trace_making_one_edit_share_its_prefix_and_see_what_they_see_cold(smol, smollm2_llm):
    torch.manual_seed(3)
    vector = torch.randn(576)
    prefix = _prefix("shared trace")
    prompts = [prefix + " The first entry reads", prefix + " The second entry reads"]
    (before,) = smollm2_llm.collective_rpc("nnsight_stats")
    with smol.trace(temperature=0.0, max_tokens=4) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                drawn, rows = list().save(), list().save()
                for _ in tracer.all():
                    hidden = smol.model.layers[10].output[0]
                    hidden[:] += 8.0 * vector.to(hidden)
                    rows.append(smol.model.layers[20].output[0][-1].clone())
                    drawn.append(smol.samples.item())
    (after,) = smollm2_llm.collective_rpc("nnsight_stats")
    assert after["prompt_rows_cached"] - before["prompt_rows_cached"] >= 128  # the second read the first's
    for index, prompt in enumerate(prompts):
        smollm2_llm.reset_prefix_cache()
        alone, drawn_alone, rows_alone = _steered(smol, smollm2_llm, prompt, vector)
        assert alone.num_cached_tokens == 0
        # the tokens the same; the rows to float32's rounding, since alone it runs in
        # a batch of its own (bit for bit in a batch alike: the test before)
        assert list(drawn[index]) == drawn_alone
        torch.testing.assert_close(torch.stack(list(rows[index])), rows_alone, rtol=1e-4, atol=1e-4)
