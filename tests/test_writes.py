"""Which blocks may write into the forward (``worker/writes.py``): read from the
source at admission, so that only a block that certainly cannot write goes on
through a preemption's recompute."""

from __future__ import annotations

import pytest
import torch

from vllm_nnsight_plugin.worker.writes import may_write


class Tracer:
    pass


MODEL = object()
SCOPE = {"model": MODEL, "tracer": Tracer(), "torch": torch, "vector": torch.zeros(3), "rows": []}

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
}
WRITES = {
    "a subscript write": "model.x.output[0][:] = 0",
    "an augmented subscript": "model.x.output[0][:, 1] += vector",
    "a replacement": "model.x.output = (vector, vector)",
    "a name augmented": "h = model.x.output[0]\nh += 1",
    "an in-place method": "model.x.output[0].add_(vector)",
    "a dunder": "model.x.output[0].__setitem__(0, 1)",
    "out=": "torch.add(vector, 1, out=model.x.output[0])",
    "a skip": "model.x.skip(vector)",
    ".data": "model.x.output[0].data.zero()",
    ".numpy()": "a = model.x.output[0].numpy()",
    "a captured function": "helper(model.x.output[0])",
    "getattr": "getattr(model, 'x')",
    "an import": "import os",
    "logits through another name": "logits = model.logits\nlogits[:, 1] = 0",
    "a module's attribute set": "model.x.weight = vector",
    "a starred target": "a, *model.x.output[0][:2] = [1, 2, 3]",
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
