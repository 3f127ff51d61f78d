"""A request whose block cannot read ``tracer.result`` says so, and its finished
output is not sent back to the workers to collect it (``returns/outputs.RESULT_KEY``):
which blocks say it (read from the source, no engine), and on the session's engine
that such a block's saves still arrive, that a block reading the result still
gets it, and that a request saying it falsely fails alone."""

from __future__ import annotations

import pytest
import torch
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.tracer import InterleavingTracer
from vllm import SamplingParams

import vllm_nnsight_plugin
from vllm_nnsight_plugin.client.unread import reads_result
from vllm_nnsight_plugin.returns.outputs import RESULT_KEY, UNREAD


class _Tracer(InterleavingTracer):
    def __init__(self) -> None:  # a stand-in: only its type is read
        pass


def _reads(source: str, **scope) -> bool:
    return reads_result(source, {"tracer": _Tracer(), "torch": torch, **scope}, InterleavingTracer, Envoy)


@pytest.mark.parametrize(
    "source",
    [
        "row = model.model.layers[5].output[0][-1].save()",
        "rows = list().save()\nfor _ in tracer.iter[:3]:\n    rows.append(model.logits.argmax(-1))",
        "for _ in tracer.all():\n    model.model.layers[2].output[0][:] += torch.ones(4)",
        "with tracer.invoke('x'):\n    tracer.stop()",
    ],
)
def test_blocks_that_never_reach_the_result_say_so(source):
    assert not _reads(source)


def _helper(tracer):
    return tracer


class _Holder:
    def run(self) -> None:
        pass


@pytest.mark.parametrize(
    ("source", "scope"),
    [
        ("out = tracer.result.save()", {}),
        ("t = tracer\nx = 1", {}),  # the tracer handed on whole
        ("x = _helper(tracer)", {"_helper": _helper}),
        ("x = make()", {"make": _helper}),  # a captured function's code could hold a tracer
        ("holder.run()", {"holder": _Holder()}),
        ("name = 'result'", {}),  # the word, anywhere
        ("x = (", {}),  # does not parse
        ("", {}),
    ],
)
def test_any_doubt_is_a_read(source, scope):
    assert _reads(source, **scope)


def test_the_front_end_keeps_home_the_outputs_no_block_reads():
    import pickle
    from types import SimpleNamespace

    from vllm_nnsight_plugin.returns.outputs import finished_for_workers, forget_unread, note_result_unread

    engine = SimpleNamespace(input_processor=SimpleNamespace())
    said = SimpleNamespace(extra_args={RESULT_KEY: UNREAD})
    note_result_unread(engine, "a", said, edits_installed=False)
    note_result_unread(engine, "b", SimpleNamespace(extra_args={}), edits_installed=False)
    note_result_unread(engine, "c", said, edits_installed=True)  # an edit's copy may read it
    outputs = [SimpleNamespace(request_id=name) for name in "abc"]
    assert sorted(pickle.loads(finished_for_workers(engine, outputs))) == ["b", "c"]
    assert not engine._nnsight_unread  # forgotten once collected
    note_result_unread(engine, "d", said, edits_installed=False)
    forget_unread(engine, ["d"])  # aborted
    assert sorted(
        pickle.loads(finished_for_workers(engine, outputs[:1] + [SimpleNamespace(request_id="d")]))
    ) == ["a", "d"]
    # an edit installed after the request started marked it: its copies may read the result
    from vllm_nnsight_plugin.edits import BOOK_ATTR, EditBook

    book = engine.input_processor.__dict__[BOOK_ATTR] = EditBook()
    note_result_unread(engine, "e", said, edits_installed=False)
    book.mark("e")
    assert list(pickle.loads(finished_for_workers(engine, [SimpleNamespace(request_id="e")]))) == ["e"]


def test_a_trace_says_it_per_invoke(smol):
    with smol.requests(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke("One"):
            smol.model.layers[10].output[0][-1].save()
        with tracer.invoke("Two"):
            tracer.result.save()
    said = [param.extra_args.get(RESULT_KEY) for param in tracer.prepared.params]
    assert said == [UNREAD, None]


def test_saves_arrive_without_the_output_and_a_false_word_fails_alone(smol, smollm2_llm):
    with smol.trace("The capital of France is", temperature=0.0, max_tokens=2) as tracer:
        row = smol.model.layers[10].output[0][-1].save()
        logits = smol.logits.save()
    assert row.shape == (576,) and logits.shape[-1] > 0
    with smol.trace("The capital of France is", temperature=0.0, max_tokens=2) as tracer:
        out = tracer.result.save()
    assert list(out.outputs[0].token_ids)  # the output reached the block that reads it
    # a request that says its block reads no result, and reads it
    with smol.requests("The capital of France is", temperature=0.0, max_tokens=2) as tracer:
        tracer.result.save()
    prepared = tracer.prepared
    prepared.params[0].extra_args[RESULT_KEY] = UNREAD
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    outs = smollm2_llm.generate(
        ["The capital of France is", *prepared.prompts], [plain, *prepared.params], use_tqdm=False
    )
    with pytest.raises(Exception, match="result"):  # nnsight's words for a value never served
        vllm_nnsight_plugin.saves(outs[1])
    assert list(outs[0].outputs[0].token_ids) == list(out.outputs[0].token_ids)
    assert smollm2_llm.collective_rpc("nnsight_tracked") == [0]
