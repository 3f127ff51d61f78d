"""Envoys travel as references to the far side's own tree (no engine needed)."""

from __future__ import annotations

import pytest
import torch
from nnsight.intervention.serialization import UnknownPersistentIdError, dumps, loads

from vllm_nnsight_plugin import VLLM
from vllm_nnsight_plugin.wire.references import envoy_references, envoys_by_reference


@pytest.fixture(scope="module")
def trees(smollm2_path):
    return VLLM(smollm2_path), VLLM(smollm2_path)  # module trees on meta, no engine


def test_an_envoy_resolves_to_the_far_sides_envoy_at_its_path(trees):
    here, there = trees
    with envoys_by_reference(here):
        data = dumps({"layer": here.model.layers[3], "root": here})
    found = loads(data, persistent_objects=envoy_references(there))
    assert found["layer"] is there.model.layers[3]
    assert found["root"] is there
    with pytest.raises(UnknownPersistentIdError):
        loads(data, persistent_objects={})  # nothing but the given map resolves


def test_a_block_no_longer_carries_the_tree(trees):
    model, _ = trees
    vector = torch.randn(576)
    with model.requests("The capital of France is", max_tokens=4) as tracer:
        for _ in tracer.iter[:4]:
            hidden = model.model.layers[10].output[0]
            hidden[:] += vector.to(hidden.device)
    (params,) = tracer.prepared.params
    assert len(params.extra_args["nnsight"]) < 16_000  # it was ~90 kB with the tree
    # The references exist only while blocks are serialized.
    assert not any("_persistent_id" in envoy.__dict__ for envoy in model.modules())
