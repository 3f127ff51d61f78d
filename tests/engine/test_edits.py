"""Edits: blocks installed on the engine with ``model.edit()`` and run by every
request it serves from then on, traced or plain, on the session's stock
``vllm.LLM`` (SmolLM2, real weights). Each edit's values are checked against
the same read made by a trace (the general path) on the same engine."""

from __future__ import annotations

import nnsight
import pytest
import torch
from vllm import SamplingParams

import vllm_nnsight_plugin
from tests.engines import BATCHED, DEVICE
from vllm_nnsight_plugin.wire.edits import EditChoiceError

PROMPT = "The capital of France is"
PROMPTS = [PROMPT, "Water boils at"]


@pytest.fixture(autouse=True)
def no_edit_outlives_its_test(smol, smollm2_llm):
    yield
    smol.clear_edits()
    assert smol.installed_edits() == {}
    ((worker,),) = [smollm2_llm.collective_rpc("nnsight_edits")]
    assert worker == []


def stats(llm) -> dict:
    (found,) = llm.collective_rpc("nnsight_stats")
    return found


def plain_tokens(llm, prompt, n=8, **extra):
    params = SamplingParams(temperature=0.0, max_tokens=n, extra_args=extra or None)
    return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)


def traced_stream(smol, prompt):
    """The residual stream at layer 5's last row, read by a trace."""
    with smol.trace(prompt, temperature=0.0, max_tokens=3):
        out = smol.model.layers[5].output
        stream = (out[0] + out[1])[-1].clone().save()
    return stream


def test_every_request_runs_its_own_copy_plain_or_stock(smol, smollm2_llm):
    with smol.edit() as (tracer, edit):
        out = smol.model.layers[5].output
        stream = (out[0] + out[1])[-1].clone().save()  # noqa: F841 (on every output)
    assert smol.installed_edits() == {edit.id: None} and edit.name is None
    through_client = smol.generate(PROMPTS, temperature=0.0, max_tokens=3)
    # A stock call that has never heard of nnsight gets the edit's values too.
    through_stock = smollm2_llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False
    )
    assert stats(smollm2_llm)["edits"] == 1
    edit.clear()
    assert edit.cleared and smol.installed_edits() == {}
    for prompt, a, b in zip(PROMPTS, through_client, through_stock):
        want = traced_stream(smol, prompt)
        assert sorted(a.saves) == ["stream"] and a.nnsight_saves == {} and a.nnsight_error is None
        torch.testing.assert_close(a.saves["stream"], want, **BATCHED)  # batched vs alone
        torch.testing.assert_close(b.saves["stream"], want, **BATCHED)
        assert vllm_nnsight_plugin.saves(b) == b.saves
    assert not torch.allclose(through_client[0].saves["stream"], through_client[1].saves["stream"])
    # Cleared: an output carries no saves at all, and nothing is left in the workers.
    after = smol.generate(PROMPT, temperature=0.0, max_tokens=1)[0]
    assert not hasattr(after, "saves")
    assert stats(smollm2_llm)["tracked"] == 0


def test_a_trace_reads_the_edit_on_its_result_and_keeps_its_own_names(smol, smollm2_llm):
    with smol.edit() as (tracer, edit):
        hidden = smol.model.layers[5].output[0][-1].clone().save()  # noqa: F841
        tag = nnsight.save(["edit"])  # noqa: F841
    with smol.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        token = smol.logits.argmax(-1).item().save()
        tag = nnsight.save(["trace"])
        result = tracer.result.save()
    assert smol.tokenizer.decode(token) == " Paris" and tag == ["trace"]
    assert sorted(result.saves) == ["hidden", "tag"] and result.saves["tag"] == ["edit"]
    assert not hasattr(result, "nnsight_saves")
    # A stock generate of a prepared request: the block's names win a clash on
    # output.saves; each side alone is kept too.
    with smol.requests(PROMPT, temperature=0.0, max_tokens=2) as tracer:
        tag = nnsight.save(["trace"])
    (output,) = smollm2_llm.generate(tracer.prepared.prompts, tracer.prepared.params, use_tqdm=False)
    assert output.saves["tag"] == ["trace"] and sorted(output.saves) == ["hidden", "tag"]
    assert output.nnsight_saves == {"tag": ["trace"]} and output.nnsight_edit_saves["tag"] == ["edit"]


def test_an_edit_follows_generation_with_tracer_all(smol):
    with smol.edit() as (tracer, edit):
        norms = nnsight.save([])
        for _ in tracer.all():
            norms.append(smol.model.layers[16].output[1][-1].norm().item())
    edited = smol.generate("The three primary colors are", temperature=0.0, max_tokens=5)[0]
    edit.clear()
    with smol.trace("The three primary colors are", temperature=0.0, max_tokens=5) as tracer:
        want = list().save()
        for _ in tracer.all():
            want.append(smol.model.layers[16].output[1][-1].norm().item())
    assert len(edited.saves["norms"]) == 5
    assert edited.saves["norms"] == pytest.approx(want, rel=1e-5)


def test_named_edits_are_chosen_per_request(smol):
    with smol.edit(name="probe") as (tracer, probe):
        score = smol.model.layers[20].output[1][-1].norm().item().save()  # noqa: F841
    with smol.edit(name="steer") as (tracer, steer):
        smol.model.layers[8].output[0][:] += 60.0
    with smol.edit() as (tracer, always):
        seen = nnsight.save(True)  # noqa: F841
    assert smol.installed_edits() == {probe.id: "probe", steer.id: "steer", always.id: None}
    assert "probe" in repr(probe)
    plain = smol.generate(PROMPT, temperature=0.0, max_tokens=4, edits=[])[0]
    assert sorted(plain.saves) == ["seen"]
    ran = {}
    for edits in (None, ["probe"], ["steer"], []):
        kw = {} if edits is None else {"edits": edits}
        output = smol.generate(PROMPT, temperature=0.0, max_tokens=4, **kw)[0]
        ran[str(edits)] = (sorted(output.saves), list(output.outputs[0].token_ids))
    steered = ran["None"][1]
    assert ran["None"][0] == ["score", "seen"] and steered != plain.outputs[0].token_ids
    assert ran["['probe']"] == (["score", "seen"], list(plain.outputs[0].token_ids))
    assert ran["['steer']"] == (["seen"], steered)
    assert ran["[]"] == (["seen"], list(plain.outputs[0].token_ids))

    # The trace's choice; an invoke's own wins. Two invokes, one batch, each its own edits.
    with smol.trace(temperature=0.0, max_tokens=2, edits=["probe"]) as tracer:
        with tracer.invoke("The capital of Italy is"):
            first = tracer.result.save()
        with tracer.invoke("The capital of Spain is", edits=[]):
            second = tracer.result.save()
    assert sorted(first.saves) == ["score", "seen"] and sorted(second.saves) == ["seen"]

    with pytest.raises(ValueError, match=r"asks for \['nope'\].*installed: \['probe', 'steer'\]"):
        smol.generate(PROMPT, max_tokens=1, edits=["nope"])
    with pytest.raises(EditChoiceError):
        with smol.trace(PROMPT, max_tokens=1, edits=["nope"]):
            smol.logits.save()
    with pytest.raises(TypeError, match=r"write edits=\['probe'\]"):
        smol.generate(PROMPT, max_tokens=1, edits="probe")
    # A stock call that names an unknown edit is refused by the front end too.
    with pytest.raises(ValueError, match="no edit is installed under that name"):
        plain_tokens(smol.vllm_entrypoint, PROMPT, 1, nnsight_edits=["nope"])


def test_a_steering_edit_lands_and_leaves_no_trace_once_cleared(smol, smollm2_llm):
    before = plain_tokens(smollm2_llm, PROMPT, 10)
    torch.manual_seed(0)
    vector = torch.randn(576)
    vector = (40.0 * vector / vector.norm()).to(DEVICE)
    with smol.edit(name="steer") as (tracer, steer):
        for _ in tracer.all():
            smol.model.layers[10].output[0][:] += vector
    steered = plain_tokens(smollm2_llm, PROMPT, 10)
    # The same steering as a trace gives the same tokens; a neighbour that opts out
    # in the same batch is unchanged.
    with smol.trace(temperature=0.0, max_tokens=10) as tracer:
        with tracer.invoke(PROMPT, edits=[]):
            traced = list().save()
            for _ in tracer.all():
                smol.model.layers[10].output[0][:] += vector
                traced.append(smol.samples.item())
        with tracer.invoke(PROMPT, edits=[]):
            neighbour = tracer.result.save()
    steer.clear()
    assert steered != before
    assert traced == steered
    assert list(neighbour.outputs[0].token_ids) == before
    # Prefix caching is on: no edited KV was left under the plain prompt's blocks.
    assert plain_tokens(smollm2_llm, PROMPT, 10) == before


def test_an_edit_reading_every_row_keeps_its_requests_computing_their_whole_prompts(smol, smollm2_llm):
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)  # over a 128-token block
    rows = len(smollm2_llm.get_tokenizer().encode(prompt))
    plain_tokens(smollm2_llm, prompt, 1)  # its blocks are now in the prefix cache
    with smol.edit(name="rows") as (tracer, edit):
        seen = nnsight.save(smol.model.layers[3].output[0].shape[0])  # noqa: F841
    outputs = [smol.generate(prompt, temperature=0.0, max_tokens=1)[0] for _ in range(2)]
    assert [output.saves["seen"] for output in outputs] == [rows, rows]
    assert [output.num_cached_tokens for output in outputs] == [0, 0]
    # A request that runs no edit (only named ones are installed) reads the cache as before.
    opted_out = smol.generate(prompt, temperature=0.0, max_tokens=1, edits=[])[0]
    assert not hasattr(opted_out, "saves") and opted_out.num_cached_tokens > 0


def test_an_error_in_an_edit_is_that_requests_error_only(smol, smollm2_llm):
    with smol.edit(name="broken") as (tracer, edit):
        row = smol.model.layers[3].output[0][10_000].save()  # noqa: F841 (no such row)
    output = smol.generate(PROMPT, temperature=0.0, max_tokens=6)[0]
    assert output.nnsight_error is not None and len(output.outputs[0].token_ids) < 6
    with pytest.raises(RuntimeError, match="IndexError"):
        vllm_nnsight_plugin.saves(output)
    with pytest.raises(RuntimeError, match="IndexError"):
        with smol.trace(PROMPT, temperature=0.0, max_tokens=2):
            smol.logits.save()
    # A request that opts out (only a named edit is installed) runs none of it.
    assert len(smol.generate(PROMPT, temperature=0.0, max_tokens=6, edits=[])[0].outputs[0].token_ids) == 6
    edit.clear()
    assert plain_tokens(smollm2_llm, PROMPT, 3)[0] == smollm2_llm.get_tokenizer().encode(" Paris")[0]
    assert stats(smollm2_llm)["tracked"] == 0


def test_each_sequence_of_n_runs_its_own_copy(smol):
    with smol.edit() as (tracer, edit):
        drawn = nnsight.save([])
        for _ in tracer.iter[:3]:
            drawn.append(smol.samples.item())
    output = smol.generate(PROMPT, temperature=1.0, seed=0, n=2, max_tokens=3)[0]
    assert len(output.outputs) == 2
    for completion in output.outputs:
        assert completion.saves["drawn"] == list(completion.token_ids)


def test_a_request_beside_an_edit_that_needs_no_forward_is_lowered_and_lands_the_same(smol, smollm2_llm):
    torch.manual_seed(1)
    vector = torch.randn(576)
    vector = (40.0 * vector / vector.norm()).to(DEVICE)

    def steered() -> list[int]:
        with smol.requests(PROMPT, temperature=0.0, max_tokens=8) as tracer:
            for _ in tracer.all():
                smol.model.layers[10].output[0][:] += vector
        prepared = tracer.prepared
        (output,) = smollm2_llm.generate(prepared.prompts, prepared.params, use_tqdm=False)
        vllm_nnsight_plugin.saves(output)  # no error
        return list(output.outputs[0].token_ids)

    lowered = stats(smollm2_llm)["lowered"]
    want = steered()
    assert stats(smollm2_llm)["lowered"] == lowered + 1  # a tap at layer 10: lowered
    with smol.edit() as (tracer, edit):
        seen = nnsight.save(True)  # noqa: F841
    assert steered() == want
    assert stats(smollm2_llm)["lowered"] == lowered + 2  # the edit reads no module: still lowered
    with smol.edit() as (tracer, reading):
        kept = smol.model.layers[3].output[0][-1].clone().save()  # noqa: F841
    assert steered() == want
    assert stats(smollm2_llm)["lowered"] == lowered + 2  # two blocks on the forward: Python


def test_edit_arguments_are_checked(smol):
    with pytest.raises(ValueError, match="inplace=False"):
        smol.edit(inplace=False)
    with pytest.raises(TypeError, match="name is a non-empty string"):
        smol.edit(name=3)
    with pytest.raises(TypeError, match="unexpected arguments"):
        smol.edit(nme="probe")
    with pytest.raises(ValueError, match="must be signed"):
        smol.edit(serve="http://127.0.0.1:1")
