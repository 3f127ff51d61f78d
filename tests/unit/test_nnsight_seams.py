"""The private nnsight names the worker uses, checked against the installed nnsight.

``worker/_nnsight.py`` is the one place the worker touches nnsight's internals;
when an nnsight release moves one, these fail by name (no engine needed)."""

from __future__ import annotations

import importlib

import pytest
import torch
from nnsight.intervention.serialization import dumps, loads

from vllm_nnsight_plugin import VLLM
from vllm_nnsight_plugin.client import _nnsight as client_nns
from vllm_nnsight_plugin.client import edits as client_edits
from vllm_nnsight_plugin.client import skip as client_skip
from vllm_nnsight_plugin.returns import cached
from vllm_nnsight_plugin.taps import source
from vllm_nnsight_plugin.versions import SUPPORTED_NNSIGHT
from vllm_nnsight_plugin.wire.references import envoy_references, envoys_by_reference
from vllm_nnsight_plugin.worker import _nnsight as nns


def test_installed_nnsight_is_the_supported_one():
    import nnsight

    assert nnsight.__version__ == SUPPORTED_NNSIGHT


TOUCHES = (
    nns.TOUCHES
    + client_nns.TOUCHES
    + client_nns.OVERRIDES
    + client_edits.TOUCHES
    + client_skip.TOUCHES
    + cached.TOUCHES
    + source.TOUCHES
)


def test_the_skip_is_looked_up_where_the_client_replaces_it():
    """``client/skip.py`` replaces nnsight's module-level ``skip_context``: a tracer
    that called it by any other route would keep nnsight's, silently, and hand
    back a displaced trace function nnsight no longer reads."""
    import inspect

    from nnsight.tracing.tracer import ExitTracingException, Tracer

    assert "skip_context" in Tracer.__enter__.__code__.co_names
    assert ExitTracingException(print).displaced is print
    assert "exc_value.displaced" in inspect.getsource(Tracer.__exit__)


@pytest.mark.parametrize("module, path", TOUCHES, ids=[f"{m}:{p}" for m, p in TOUCHES])
def test_every_nnsight_name_resolves(module, path):
    found = importlib.import_module(module)
    for part in path.split("."):
        assert hasattr(found, part), f"{module}.{path} is gone"
        found = getattr(found, part)


def test_the_client_overrides_exactly_the_private_methods_it_lists():
    """Each listed override is defined by the client's class and still nnsight's
    (above); a private method of nnsight's that the client overrides unlisted fails
    here, so the list is the whole of it."""
    from vllm_nnsight_plugin.client.model import _AsyncBackend

    listed = {path.rsplit(".", 1)[1] for _, path in client_nns.OVERRIDES}
    found = set()
    for ours in (VLLM, _AsyncBackend):
        for name in vars(ours):
            if name.startswith("_") and not name.startswith("__"):
                if any(
                    name in vars(base) for base in ours.__mro__[1:] if base.__module__.startswith("nnsight")
                ):
                    found.add(name)
    assert found == listed


def test_instance_state_the_worker_reads_exists():
    mediator = nns.Mediator(compile("x = 1", "<t>", "exec"), {}, {})
    request = nns.Request("abc-0123abcd")
    requests = nns.new_requests()
    import torch
    from nnsight.intervention.envoy import Envoy

    from vllm_nnsight_plugin.worker.batching import CheckedBatcher
    from vllm_nnsight_plugin.worker.fragments import FusedFragments

    batcher = CheckedBatcher(None)
    pairs = (
        (mediator, "Mediator"),
        (request, "Request"),
        (requests, "Requests"),
        (batcher, "VLLMBatcher"),
        (FusedFragments(), "VLLMFragments"),
        (Envoy(torch.nn.Linear(1, 1)), "Envoy"),
    )
    for obj, name in pairs:
        for attribute in nns.INSTANCE_TOUCHES[name]:
            assert hasattr(obj, attribute), f"{name}.{attribute} is gone"
    assert (request.engine_id, request.stem) == ("abc", "abc")


@pytest.fixture(scope="module")
def trees(smollm2_path):
    return VLLM(smollm2_path), VLLM(smollm2_path)  # module trees on meta, no engine


def test_shared_code_blocks_load_like_nnsights_own(trees):
    """Many invokes of one block: the code is compiled once, each keeps its own values."""
    client, worker = trees
    with client.requests(temperature=0.0, max_tokens=2) as tracer:
        for scale in (1.0, 2.0, 3.0):
            with tracer.invoke("The capital of France is"):
                hidden = client.model.layers[3].output[0]
                hidden[:] *= scale
    blocks = [params.extra_args["nnsight"] for params in tracer.prepared.params]
    from vllm_nnsight_plugin.wire.envelope import open_envelope

    persistent = {**nns.persistent_objects(worker), **envoy_references(worker)}
    payloads = [
        open_envelope(b, nnsight_version=SUPPORTED_NNSIGHT, plugin_version="x").block_bytes() for b in blocks
    ]
    ours = [nns.load_block(p, persistent) for p in payloads]
    theirs = [loads(p, persistent_objects=persistent) for p in payloads]
    assert len({id(m.code) for m in ours}) == 1  # one compiled code object for all three
    for mine, nnsights in zip(ours, theirs):
        assert isinstance(mine, nns.Mediator)
        assert mine.code.co_code == nnsights.code.co_code
        assert set(mine.lcls.keys()) == set(nnsights.lcls.keys())
        assert mine.presaved == nnsights.presaved and mine.copy == nnsights.copy
    assert [m.lcls["scale"] for m in ours] == [1.0, 2.0, 3.0]  # each invoke its own values
    assert ours[0].lcls["client"] is worker  # the tree resolves to the worker's own


def test_a_payload_that_is_not_a_block_is_refused(trees):
    _, worker = trees
    with envoys_by_reference(worker):
        data = dumps({"not": torch.zeros(1)})
    with pytest.raises(TypeError, match="not an nnsight block"):
        nns.load_block(data, envoy_references(worker))


def test_the_clients_memoized_reduction_gives_nnsights_result():
    import ast

    import nnsight.intervention.serialization as serialization

    client_nns.reduce_once()
    client_nns.reduce_once()  # idempotent
    assert serialization.reduce_block is client_nns._reduce_block
    source = (
        "\n\nwith tracer.invoke(x):\n    h = layer.output[0]\n    h[:] += scale * v\n"
        "    rows.append(h.clone())\n    f = lambda t: t * k\n"
    )
    node = ast.parse(source).body[0]
    glbls = {"torch": torch, "k": 2, "unused": object()}
    for lcls in (
        {"layer": 1, "scale": 2.0, "v": 3, "rows": []},
        {"layer": 4, "scale": 5.0, "v": 6, "rows": [1]},
    ):
        ours = serialization.reduce_block(node, glbls, lcls)
        again = serialization.reduce_block(node, glbls, lcls)  # from the memo
        theirs = client_nns.ORIGINALS["reduce_block"](node, glbls, lcls)
        assert ours == again == theirs
        assert ours[2] == {k: lcls[k] for k in ("layer", "scale", "v", "rows")}
    names = serialization._function_referenced_names("def g(a):\n    return a + b\n")
    assert names == client_nns.ORIGINALS["_function_referenced_names"]("def g(a):\n    return a + b\n")


def test_a_traces_invokes_share_a_pickle_only_where_their_own_would_be_the_same(trees, monkeypatch):
    """Within one attach, an invoke gets an earlier invoke's bytes only when it has
    the same source and captures the same objects, all of kinds whose pickle is the
    value's alone; every invoke's bytes equal what nnsight's own pickling gives."""
    import nnsight.modeling.vllm.vllm as nnsight_vllm

    client, _ = trees
    client_nns.reduce_once()
    memoized = nnsight_vllm.dumps
    made: list[tuple[bytes, bytes]] = []

    def recording(mediator):
        data = memoized(mediator)
        made.append((data, client_nns.canonical_dumps(mediator)))  # its own pickle, in the same attach
        return data

    monkeypatch.setattr(nnsight_vllm, "dumps", recording)
    vector, box = torch.randn(576), [1.0]
    with client.requests(temperature=0.0, max_tokens=2) as tracer:
        for scale in (1.0, 1.0, 2.0):
            with tracer.invoke("The capital of France is"):
                client.model.layers[3].output[0][:] += vector
                client.model.layers[4].output[0][:] *= scale
        for _ in range(2):
            with tracer.invoke("Water boils at"):
                client.model.layers[3].output[0][:] *= box[0]  # a list: pickled each time
    assert len(made) == 5 and all(ours == theirs for ours, theirs in made)
    ours = [data for data, _ in made]
    assert ours[0] is ours[1]  # the same objects: one pickle
    assert ours[2] is not ours[0] and ours[2] != ours[0]  # its own scale
    assert ours[3] is not ours[4]  # a list's pickle is never shared
    envelopes = [params.extra_args["nnsight"] for params in tracer.prepared.params]
    assert envelopes[0] is envelopes[1] and envelopes[2] != envelopes[0]  # one envelope per block
    assert client_nns._PICKLES.get() is None  # outside an attach, nothing is memoized
    with client.requests(temperature=0.0, max_tokens=2, key="k" * 40) as tracer:
        for _ in range(2):
            with tracer.invoke("The capital of France is"):
                client.model.layers[3].output[0][:] += vector
    signed = [params.extra_args["nnsight"] for params in tracer.prepared.params]
    assert signed[0] != signed[1]  # a signed envelope is good once: each has its own nonce


def test_equal_captured_tensors_pickle_alike_and_load_as_they_were(trees):
    """torch names a pickled storage by its address; the client's pickle names it by
    value, so two blocks capturing equal vectors that are different objects have the
    same bytes (and the same salt, ``prefix.py``), and torch loads them unchanged."""
    import pickle

    import nnsight.modeling.vllm.vllm as nnsight_vllm

    from vllm_nnsight_plugin.wire.envelope import payload_of

    client, _ = trees
    client_nns.reduce_once()
    torch.manual_seed(0)
    vector = torch.randn(576)
    payloads = []
    for copy in (vector.clone(), vector.clone(), vector + 1):
        with client.requests(temperature=0.0, max_tokens=2) as tracer:
            with tracer.invoke("The capital of France is"):
                client.model.layers[3].output[0][:] += copy
        payloads.append(payload_of(tracer.prepared.params[0].extra_args["nnsight"]))
    assert payloads[0] == payloads[1] != payloads[2]  # (the envelopes differ: a time, a nonce)
    storage = vector._typed_storage()  # torch's own pickle names the storage's address
    assert str(storage._cdata).encode() in storage.__reduce__()[1][0]
    assert pickle.loads(client_nns.canonical_dumps(vector)).equal(vector)
    assert nnsight_vllm.dumps is not client_nns.ORIGINALS["dumps"]


def test_a_captured_view_of_a_larger_tensor_travels_as_a_copy_of_its_own():
    """A row of a saved activation goes as the row: the same values, shape, strides
    and dtype, a storage of its own. A view whose storage something else the block
    captures reaches, a saved one, one that needs grad, a strided one, or any view
    beside a captured value this cannot see into, goes as it is."""
    from nnsight.tracing.tracer import _saves

    clean = torch.randn(64, 576)
    row, column = clean[5], clean[:, 3]
    (scope,) = client_nns.compacted({"row": row, "n": 3, "torch": torch})
    assert scope["row"] is not row and torch.equal(scope["row"], row)
    assert scope["row"].shape == row.shape and scope["row"].stride() == row.stride()
    assert scope["row"].untyped_storage().nbytes() == 576 * 4 and scope["n"] == 3
    both = torch.randn(2, 32, 576)  # a save's hidden state and residual, come home in one storage
    hidden_row, residual_row = both[0][5], both[1][5]
    scope = client_nns.compacted({"h": hidden_row, "r": residual_row})[0]
    assert scope["h"] is not hidden_row and scope["r"] is not residual_row  # they do not overlap
    assert torch.equal(scope["h"], hidden_row) and torch.equal(scope["r"], residual_row)
    for kept in (
        {"row": row, "clean": clean},  # the activation itself
        {"row": row, "again": [row]},  # the same row twice
        {"row": row, "block": clean[4:8]},  # rows around it
        {"row": row, "rows": [clean[0], (clean[5],)]},  # a list holding the same row again
        {"row": row, "other": object()},  # something it cannot see into
        {"column": column},  # strided
        {"row": torch.randn(64, 576, requires_grad=True)[5]},
        {"small": torch.randn(4, 8)[1]},  # its storage is no larger by much
        {"row": row, "sparse": torch.eye(3).to_sparse()},  # storage it does not read
    ):
        assert all(a is b for a, b in zip(client_nns.compacted(kept)[0].values(), kept.values()))
    _saves().add(id(row))
    try:
        assert client_nns.compacted({"row": row})[0]["row"] is row  # saved: its name travels
    finally:
        _saves().discard(id(row))


def test_invokes_patching_rows_of_one_activation_each_carry_their_row(trees):
    """Activation patching as people write it: each invoke captures one row of a
    saved activation. Each envelope carries that row, not the activation; the block
    loads with the row's values; invokes capturing the very same view share a pickle."""
    from vllm_nnsight_plugin.wire.envelope import open_envelope

    client, worker = trees
    client_nns.reduce_once()
    clean = torch.randn(2, 128, 576)  # hidden state and residual, in one storage as saves come home
    views = {3: (clean[0][3], clean[1][3]), 4: (clean[0][4], clean[1][4])}
    with client.requests(temperature=0.0, max_tokens=2) as tracer:
        for position in (3, 4, 4):
            row, residual_row = views[position]
            with tracer.invoke("The capital of France is"):
                out = client.model.layers[3].output
                out[0][position] = row
                out[1][position] = residual_row
    blocks = [params.extra_args["nnsight"] for params in tracer.prepared.params]
    payloads = [
        open_envelope(b, nnsight_version=SUPPORTED_NNSIGHT, plugin_version="x").block_bytes() for b in blocks
    ]
    assert all(len(p) < 32 * 576 for p in payloads)  # the activations are 2 x 128 x 576 floats
    assert blocks[1] is blocks[2] and blocks[0] != blocks[1]  # the same view: one pickle
    persistent = {**nns.persistent_objects(worker), **envoy_references(worker)}
    for payload, position in zip(payloads, (3, 4, 4)):
        block = nns.load_block(payload, persistent)
        assert torch.equal(block.lcls["row"], clean[0][position])
        assert torch.equal(block.lcls["residual_row"], clean[1][position])


def test_a_captured_tensor_owning_its_storage_travels_as_its_bytes(trees):
    """A captured tensor that owns its storage goes as its bytes (no torch save in
    the payload) and loads as torch's pickle loads it: the same values, dtype and
    shape, a storage of its own; a view inside a larger storage goes as torch
    pickles it."""
    import pickle
    import pickletools

    from vllm_nnsight_plugin.wire.envelope import open_envelope

    client, worker = trees
    client_nns.reduce_once()
    vector = torch.randn(576)
    whole = torch.randn(2, 576)
    both = whole.view(2 * 576)  # the same storage, whole, under another shape
    column = whole[:, 5]  # not contiguous: torch's pickle
    with client.requests(temperature=0.0, max_tokens=2) as tracer:
        with tracer.invoke("The capital of France is"):
            client.model.layers[3].output[0][:] += vector
        with tracer.invoke("The capital of France is"):
            client.model.layers[3].output[0][:] += whole[0] + both[:576] + column.sum()
    payloads = []
    for params in tracer.prepared.params:
        envelope = open_envelope(
            params.extra_args["nnsight"], nnsight_version=SUPPORTED_NNSIGHT, plugin_version="x"
        )
        payloads.append(envelope.block_bytes())
    named = [
        {str(arg) for op, arg, _ in pickletools.genops(p) if op.name == "SHORT_BINUNICODE"} for p in payloads
    ]
    assert "rebuild_tensor" in named[0] and "_load_from_bytes" not in named[0]
    assert {"rebuild_tensor", "_load_from_bytes"} <= named[1]
    persistent = {**nns.persistent_objects(worker), **envoy_references(worker)}
    alone = nns.load_block(payloads[0], persistent)
    assert torch.equal(alone.lcls["vector"], vector) and alone.lcls["vector"].dtype == vector.dtype
    loaded = nns.load_block(payloads[1], persistent).lcls
    theirs = pickle.loads(pickle.dumps((whole, both, column)))  # torch's own
    for ours, reference in zip((loaded["whole"], loaded["both"], loaded["column"]), theirs, strict=True):
        assert torch.equal(ours, reference) and ours.stride() == reference.stride()
    loaded["both"][0] = 123.0
    theirs[1][0] = 123.0
    assert loaded["whole"][0, 0].item() == theirs[0][0, 0].item() != 123.0  # no storage shared, as torch's


def test_the_attach_reads_the_trace_off_its_interleaver_and_knows_prompted_invokes():
    """``client/model._Sealing`` attaches a trace in parts by narrowing the
    interleaver's mediators (``client/_nnsight.attaching_only``) and tells the
    invokes with a prompt by their batch group (``rides_a_request``)."""
    import inspect

    from nnsight.intervention.interleaver import Interleaver, Mediator
    from nnsight.modeling.vllm.vllm import VLLM as NNsightVLLM

    assert "self.interleaver.mediators" in inspect.getsource(NNsightVLLM._attach_mediators)
    assert "mediator.batch_group is not None" in inspect.getsource(NNsightVLLM._attach_mediators)
    assert "self.batch_group" in inspect.getsource(Mediator.__init__)
    assert "self.mediators" in inspect.getsource(Interleaver.__init__)
