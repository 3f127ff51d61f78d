"""A trace's prefix claim is worked out once per block and what it captured, and
again whenever a captured value could have changed (no engine needed)."""

from __future__ import annotations

import pytest
import torch

import vllm_nnsight_plugin.client.model as client_model
from vllm_nnsight_plugin import VLLM
from vllm_nnsight_plugin.prefix import CLAIM_KEY, LAST_ROWS


@pytest.fixture(scope="module")
def model(smollm2_path):
    return VLLM(smollm2_path)  # the module tree on meta, no engine


@pytest.fixture
def counted(monkeypatch):
    calls = []
    original = client_model.last_rows_only

    def last_rows_only(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(client_model, "last_rows_only", last_rows_only)
    return calls


def read_rows(model, whole):
    with model.requests("The capital of France is", max_tokens=2) as tracer:
        rows = list().save()
        for _ in tracer.iter[:]:
            if whole:  # a captured plain value picks the branch for the whole request
                rows.append(model.model.layers[3].output[0])
            else:
                rows.append(model.model.layers[3].output[0][-1])
    (params,) = tracer.prepared.params
    return params.extra_args.get(CLAIM_KEY)


def test_a_block_capturing_the_model_and_plain_values_is_worked_out_once(model, counted):
    first = read_rows(model, False)
    again = read_rows(model, False)
    assert first == again == LAST_ROWS
    assert len(counted) == 1  # the second trace's claim came from the first's
    # another value is another block: worked out anew, and its own answer
    assert read_rows(model, True) is None
    assert read_rows(model, 0) is None  # another value than False (its type counts): its own claim
    assert read_rows(model, False) == LAST_ROWS
    assert read_rows(model, True) is None
    assert len(counted) == 3


def test_a_block_capturing_a_tensor_is_worked_out_each_trace(model, counted):
    vector = torch.zeros(576)

    def steer():
        with model.requests("The capital of France is", max_tokens=2) as tracer:
            for _ in tracer.iter[:]:
                model.model.layers[3].output[0][:] += vector
        (params,) = tracer.prepared.params
        return params.extra_args.get(CLAIM_KEY)

    claims = [steer(), steer()]
    assert claims[0] == claims[1]
    assert len(counted) == 2  # a tensor can change between traces: no claim outlives its trace
