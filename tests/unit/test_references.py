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


def test_threads_serializing_at_once_each_send_references(trees):
    """Two traces built at once on one client: the first to finish must not take
    the references away from the other mid-pickle (it then sent the whole tree as
    copies, with ids the server does not hold)."""
    import threading
    import time

    here, there = trees
    barrier, failures = threading.Barrier(8), []

    def serialize(layer: int) -> None:
        try:
            barrier.wait()
            for turn in range(20):
                with envoys_by_reference(here):
                    time.sleep(0.001 * (turn % 3))  # the threads' pickles overlap, in every order
                    data = dumps({"layer": here.model.layers[layer]})
                assert len(data) < 2_000, len(data)  # a reference, not the tree
                assert (
                    loads(data, persistent_objects=envoy_references(there))["layer"]
                    is there.model.layers[layer]
                )
        except BaseException as error:  # noqa: BLE001
            failures.append(error)

    threads = [threading.Thread(target=serialize, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert not any("_persistent_id" in envoy.__dict__ for envoy in here.modules())


def test_the_plugins_pickler_sends_references_without_tagging_an_envoy(trees):
    """A trace's blocks go through the plugin's pickler, which asks the context for
    references: the same bytes as tagged envoys give, and no envoy is touched."""
    from vllm_nnsight_plugin.client._nnsight import canonical_dumps
    from vllm_nnsight_plugin.wire.references import envoys_as_references, reference_of

    here, there = trees
    value = {"layer": here.model.layers[3], "root": here, "again": here.model.layers[3]}
    with envoys_as_references(here):
        assert reference_of(here.model.layers[3]) == "Envoy:model.model.layers.3"
        assert not any("_persistent_id" in envoy.__dict__ for envoy in here.modules())
        data = canonical_dumps(value)
    with envoys_by_reference(here):
        assert canonical_dumps(value) == data
    assert reference_of(here.model.layers[3]) is None  # outside the context: as it is
    assert reference_of(there.model.layers[3]) is None
    found = loads(data, persistent_objects=envoy_references(there))
    assert found["layer"] is there.model.layers[3] is found["again"]
    assert found["root"] is there
    with envoys_as_references(there):  # another model's envoys are not this one's
        assert reference_of(here.model.layers[3]) is None
        assert len(canonical_dumps({"layer": here.model.layers[3]})) > 2_000  # a copy, as nnsight sends it


def test_references_belong_to_the_context_that_asked(trees):
    """Another thread pickling at the same time is not in this thread's context."""
    import threading

    from vllm_nnsight_plugin.client._nnsight import canonical_dumps
    from vllm_nnsight_plugin.wire.references import envoys_as_references

    here, _ = trees
    inside, outside = threading.Event(), threading.Event()
    sizes = {}

    def elsewhere() -> None:
        inside.wait()
        sizes["elsewhere"] = len(canonical_dumps({"layer": here.model.layers[2]}))
        outside.set()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    with envoys_as_references(here):
        inside.set()
        outside.wait()
        sizes["here"] = len(canonical_dumps({"layer": here.model.layers[2]}))
    thread.join()
    assert sizes["here"] < 2_000 < sizes["elsewhere"]
