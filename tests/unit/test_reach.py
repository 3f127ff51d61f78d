"""Which blocks may stay beside a compiled forward (``worker/reach.py``).

Blocks are built by the real client on the module tree (no engine) and loaded
the way the worker loads them; a block is kept off the compiled path only when
it may ask for a module location, and any doubt sends it to the Python forward."""

from __future__ import annotations

import pytest
import torch

from vllm_nnsight_plugin import VLLM
from vllm_nnsight_plugin.versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
from vllm_nnsight_plugin.wire.envelope import EXTRA_ARGS_KEY, Limits, open_envelope
from vllm_nnsight_plugin.wire.references import envoy_references
from vllm_nnsight_plugin.worker import _nnsight as nns
from vllm_nnsight_plugin.worker.reach import name_uses, needs_forward


@pytest.fixture(scope="module")
def tree(smollm2_path):
    return VLLM(smollm2_path)  # the module tree on meta: no engine


def loaded(model, prepared):
    """Each request's block as the worker loads it, with its ``needs_forward``."""
    persistent = {**nns.persistent_objects(model), **envoy_references(model)}
    answers = []
    for params in prepared.params:
        envelope = open_envelope(
            params.extra_args[EXTRA_ARGS_KEY],
            nnsight_version=SUPPORTED_NNSIGHT,
            plugin_version=PLUGIN_VERSION,
            limits=Limits.from_env(),
        )
        mediator = nns.load_block(envelope.block_bytes(), persistent)
        answers.append(
            needs_forward(
                nns.block_source(mediator), nns.block_scope(mediator), model, nns.InterleavingTracer
            )
        )
    return answers


def helper(x):
    return x * 2


def test_blocks_that_only_touch_logits_and_samples_stay_beside_the_compiled_forward(tree):
    model = tree
    scale = torch.tensor(2.0)
    with model.requests(temperature=0.0, max_tokens=3) as tracer:
        with tracer.invoke("a"):
            model.logits.save()
        with tracer.invoke("b"):
            tokens = list().save()
            for step in tracer.iter[:3]:
                probs = torch.softmax(model.logits * scale, -1)
                model.samples[:] = probs.argmax(-1)
                tokens.append((model.samples.item(), step))
        with tracer.invoke("c"):
            with tracer.all():
                model.tokenizer.decode(model.samples[0])
            tracer.result.save()
    assert loaded(model, tracer.prepared) == [False, False, False]


def test_any_block_that_may_reach_a_module_takes_the_python_forward(tree):
    model = tree
    layer = model.model.layers[3]
    with model.requests(temperature=0.0, max_tokens=2) as tracer:
        with tracer.invoke("a"):  # a module location through the model
            model.model.layers[0].output[0].save()
        with tracer.invoke("b"):  # a node of the tree it captured
            layer.output[0].save()
        with tracer.invoke("c"):  # a function that could reach anything
            helper(model.logits).save()
        with tracer.invoke("d"):  # the model itself handed on
            getattr(model, "logits").save()  # noqa: B009
        with tracer.invoke("e"):  # the root's own output is a module location
            model.output.save()
        with tracer.invoke("f"):  # the tracer's cache reads modules
            tracer.cache(modules=[model.model.norm])
    assert loaded(model, tracer.prepared) == [True] * 6


def test_name_uses_reads_attribute_paths_and_bare_uses():
    uses = name_uses("x = model.logits\ny = model\nfor _ in tracer.iter[:2]:\n    z = torch.ones(1)\n")
    assert uses["model"] == {"logits", ""}
    assert uses["tracer"] == {"iter"}
    assert uses["torch"] == {"ones"}
    assert name_uses("import os\nx = model.logits\n") is None
    assert name_uses("def f(:\n") is None


def test_a_loop_variable_is_the_blocks_own_not_the_callers():
    # ``step`` bound by the loop is all the block ever reads of that name: a
    # ``step`` in the caller's frame (any object) is never reached
    body = "for step in tracer.iter[:6]:\n    if step == 0:\n        model.samples = model.samples * 0\n"
    assert "step" not in name_uses(body)
    assert "row" not in name_uses("rows = [row for row in range(3)]\n")
    # read after the loop (no steps: the caller's), in its ``else``, or deleted: the caller's may be read
    assert "step" in name_uses("for step in tracer.iter[:2]:\n    pass\nx = step\n")
    assert "step" in name_uses("for step in tracer.iter[:2]:\n    pass\nelse:\n    x = step\n")
    assert "step" in name_uses("for step in tracer.iter[:2]:\n    del step\n    x = step\n")
    assert "a" in name_uses("x = [a for a in a]\n")


def test_captured_values_decide_too():
    class Tree:  # stands for the root envoy
        pass

    model = Tree()
    source = "out = model.logits * w\n"
    assert needs_forward(source, {"model": model, "w": torch.ones(3)}, model, type(None)) is False
    assert (
        needs_forward(source, {"model": model, "w": [1, 2.0, (torch.ones(1),)]}, model, type(None)) is False
    )
    assert needs_forward(source, {"model": model, "w": object()}, model, type(None)) is True
    assert needs_forward(source, {"model": model, "w": [model]}, model, type(None)) is True
    assert needs_forward(source, {"model": model, "w": torch.nn.Linear(1, 1)}, model, type(None)) is True
    assert needs_forward(None, {}, model, type(None)) is True
    assert needs_forward("out = eval('model').model\n", {"model": model}, model, type(None)) is True
    # the generation page's forced token: ``step`` of an earlier example is still in the frame
    forced = "for step in tracer.iter[:6]:\n    if step == 0:\n        model.samples = model.samples * 0\n"
    assert needs_forward(forced, {"model": model, "step": object()}, model, type(None)) is False
