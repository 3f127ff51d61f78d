"""Which blocks may write into the forward (``worker/writes.py``): read from the
source at admission, so that only a block that certainly cannot write goes on
through a preemption's recompute."""

from __future__ import annotations

import pytest
import torch

from vllm_nnsight_plugin.worker.writes import may_write, reads_only


class Tracer:
    pass


MODEL = object()
SCOPE = {
    "model": MODEL,
    "tracer": Tracer(),
    "torch": torch,
    "vector": torch.zeros(3),
    "rows": [],
    "maker": MODEL,
}

READS = {
    "a read": "h = model.model.layers[3].output[0].clone().save()",
    "a loop of reads": "rows = list().save()\nfor _ in tracer.iter[:4]:\n    rows.append(model.x.output[0][-1].clone())",
    "a captured list": "rows.append(model.x.output[0].norm().item())",
    "torch functions": "s = torch.stack([model.x.output[0], model.y.output[0]]).mean().save()",
    "a sampled token forced": "model.samples[0] = 5",
    "the logits masked": "model.logits[:, 7] = float('-inf')",
    "logits replaced": "model.logits = model.logits * 0",
    "a function the block defines": "def f(x):\n    return x.norm()\nn = f(model.x.output[0]).save()",
    "a tuple bound": "hidden, residual = model.x.output",
    "into a tensor it made": (
        "h = model.x.output[0]\nfor i in range(3):\n    alone = torch.zeros_like(h)\n"
        "    alone[:, i] = h[:, i]\n    alone += 1\n    alone.mul_(2)\n    rows.append(model.y(alone))"
    ),
}
WRITES = {
    "a subscript write": "model.x.output[0][:] = 0",
    "an augmented subscript": "model.x.output[0][:, 1] += vector",
    "a replacement": "model.x.output = (vector, vector)",
    "a name augmented": "h = model.x.output[0]\nh += 1",
    "an in-place method": "model.x.output[0].add_(vector)",
    "a private in-place kernel": "torch._foreach_add_([model.x.output[0]], 1)",
    "a dunder": "model.x.output[0].__setitem__(0, 1)",
    "an attribute set by its dunder": "object.__setattr__(model.x, 'forward', print)",
    "out=": "torch.add(vector, 1, out=model.x.output[0])",
    "inplace=": "torch.nn.functional.relu(model.x.output[0], inplace=True)",
    "a skip": "model.x.skip(vector)",
    ".data": "model.x.output[0].data.zero()",
    ".numpy()": "a = model.x.output[0].numpy()",
    "a captured function": "helper(model.x.output[0])",
    "getattr": "getattr(model, 'x')",
    "an import": "import os",
    "logits through another name": "logits = model.logits\nlogits[:, 1] = 0",
    "a module's attribute set": "model.x.weight = vector",
    "a starred target": "a, *model.x.output[0][:2] = [1, 2, 3]",
    "into a tensor it made, then rebound": "alone = torch.zeros(3)\nalone = model.x.output[0]\nalone[:] = 0",
    "into a tensor it made, as a loop target": "alone = torch.zeros(3)\nfor alone in [model.x.output[0]]:\n    alone[0] = 1",
    "into a tensor it made, as an argument": "alone = torch.zeros(3)\nf = lambda alone: alone.zero_()\nf(model.x.output[0])",
    "into a tensor made by a function that is not torch's": "alone = maker.zeros_like(vector)\nalone[:] = 0",
    "through an attribute of a tensor it made": "alone = torch.zeros(3)\nalone.grad[:] = 0",
}


@pytest.mark.parametrize("source", READS.values(), ids=READS.keys())
def test_a_reader_is_known_to_read(source):
    assert not may_write(source, SCOPE, MODEL, Tracer)


@pytest.mark.parametrize("source", WRITES.values(), ids=WRITES.keys())
def test_a_possible_writer_is_taken_to_write(source):
    scope = {**SCOPE, "helper": lambda h: h.zero_()}
    assert may_write(source, scope, MODEL, Tracer)


def test_no_source_or_one_that_does_not_parse_may_write():
    assert may_write(None, SCOPE, MODEL, Tracer)
    assert may_write("for for", SCOPE, MODEL, Tracer)


# Helpers a block calls: read on the worker from their source (nnsight rebuilds a
# captured function from it), so a block calling one that only computes reads.
WEIGHTS = {"encoder": torch.ones(3, 2), "bias": torch.zeros(2)}


def encode(stream, sae):
    weights = sae["encoder"].to(stream.device)
    return torch.relu(stream.float() @ weights + sae["bias"].to(stream.device))


def top_features(stream):
    return encode(stream, WEIGHTS).topk(1, dim=-1).indices


def scaled(stream, by=2.0):
    return stream * by


def writes_its_argument(h):
    h[:] = 0
    return h


def zeroes_in_place(h):
    return h.zero_()


def reaches_the_model(h):
    return MODEL


def reads_a_location(envoy):
    return envoy.output[0].clone()


def activates_in_place(h):
    return torch.nn.functional.relu(h, inplace=True)


def counts(h):
    total = 0
    total += h.sum()
    return total


def calls_a_writer(h):
    return writes_its_argument(h.clone())


def _closure(value):
    def inner(h):
        return h + value

    return inner


@pytest.mark.parametrize(
    "helper",
    [encode, top_features, scaled, _closure(torch.ones(3)), _closure(1.5), lambda hidden, residual: None],
    ids=[
        "torch and data",
        "another helper",
        "a default",
        "a closure of a tensor",
        "a closure of a number",
        "a placeholder lambda",  # no readable source: its bytecode returns a constant
    ],
)
def test_a_helper_that_only_computes_reads(helper):
    assert reads_only(helper, [10_000])
    scope = {**SCOPE, "helper": helper}
    assert not may_write("acts = helper(model.x.output[0] + model.x.output[1]).save()", scope, MODEL, Tracer)


@pytest.mark.parametrize(
    "helper",
    [
        writes_its_argument,
        zeroes_in_place,
        activates_in_place,
        reaches_the_model,
        reads_a_location,
        counts,
        calls_a_writer,
        _closure(MODEL),
        lambda h: h,
        print,
        torch.nn.Linear(3, 3),
    ],
    ids=[
        "a subscript write",
        "an in-place method",
        "inplace=",
        "the model in its globals",
        "a location",
        "a name augmented",
        "a helper that writes",
        "the model in its closure",
        "a lambda",
        "a builtin",
        "a module",
    ],
)
def test_a_helper_that_may_write_or_reach_the_model_is_taken_to_write(helper):
    assert not reads_only(helper, [10_000])
    assert may_write("helper(model.x.output[0])", {**SCOPE, "helper": helper}, MODEL, Tracer)


def test_a_module_of_the_model_the_block_captured_reads_as_the_model_does():
    from nnsight.intervention.envoy import Envoy

    scope = {**SCOPE, "attention": Envoy(torch.nn.Linear(2, 2))}
    assert not may_write("z = attention.o_proj.input.clone().save()", scope, MODEL, Tracer)
    assert not may_write("n = attention.output.norm().item().save()", scope, MODEL, Tracer)
    assert may_write("attention.o_proj.output[0][:] = 0", scope, MODEL, Tracer)
    assert may_write("attention.output.add_(1)", scope, MODEL, Tracer)
    assert may_write("attention.logits[:, 1] = 0", scope, MODEL, Tracer)  # the sampler's are the model's
    assert may_write("z = other.output.clone()", {**scope, "other": torch.nn.Linear(2, 2)}, MODEL, Tracer)
