"""What a lowered request's admission copies: its block, and its vector into the bank (no engine)."""

from __future__ import annotations


def test_a_blocks_copy_for_a_request_is_what_dataclasses_replace_gives():
    """``for_request`` copies the two instances' fields: equal to the constructor's
    copy, with a ``Lowered`` and an irregular-steps dict of its own, the vector
    shared. It relies on neither class computing anything at construction."""
    import dataclasses

    import torch

    from vllm_nnsight_plugin.taps.kept import Lowered
    from vllm_nnsight_plugin.taps.lower import LoweredBlock, for_request

    vector = torch.randn(8)
    block = LoweredBlock("model.layers.1", Lowered(1, 0, 4, "out", code=1, name="rows"), vector, also=(2,))
    block.lowered.irregular[0] = 5
    copy = for_request(block)
    assert copy == dataclasses.replace(block, lowered=dataclasses.replace(block.lowered, irregular={}))
    assert copy.lowered is not block.lowered and copy.lowered.irregular == {}
    assert block.lowered.irregular == {0: 5}  # the template's own, untouched
    assert copy.vector is vector and type(copy) is LoweredBlock and type(copy.lowered) is Lowered
    copy.lowered.entry = 3  # the request's own entry
    assert block.lowered.entry == -1
    for kind in (LoweredBlock, Lowered):
        assert not hasattr(kind, "__post_init__") and not hasattr(kind, "__slots__")


def test_a_requests_bank_row_is_written_through_its_pinned_copy_without_waiting():
    """``_put``: a vector from the host goes through the row's pinned copy (on a
    GPU, an upload that does not wait for the step in flight); one on the device
    is copied there. Either way the row holds the vector in float32, and no other
    row changes."""
    import torch

    from vllm_nnsight_plugin.taps.install import _put

    vector = torch.randn(16).to(torch.bfloat16)
    for host in (None, torch.zeros(4, 16)):
        rows = torch.zeros(4, 16)
        _put(rows, host, 2, vector)
        assert torch.equal(rows[2], vector.float())
        assert rows[[0, 1, 3]].abs().sum() == 0
        if host is not None:
            assert torch.equal(host[2], vector.float())
        _put(rows, host, 2, torch.ones(1, 16, dtype=torch.float64))  # the row taken again
        assert torch.equal(rows[2], torch.ones(16))
