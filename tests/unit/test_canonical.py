"""A storage's legacy save with its keys named by value (``wire/canonical.py``)."""

from __future__ import annotations

import io

import torch

from vllm_nnsight_plugin.wire.canonical import canonical_storage


def _saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    # as a pickled tensor saves its storage (``TypedStorage.__reduce__``)
    torch.save(tensor._typed_storage(), buffer, _use_new_zipfile_serialization=False)
    return buffer.getvalue()


def test_equal_storages_save_alike_once_renamed_and_load_unchanged():
    torch.manual_seed(0)
    for tensor in (
        torch.randn(576),
        torch.arange(7, dtype=torch.int64),
        torch.randn(3, 4).to(torch.bfloat16),
    ):
        one, other = tensor.clone(), tensor.clone()
        raw = (_saved(one), _saved(other))
        assert raw[0] != raw[1]  # torch names each storage by its address
        renamed = tuple(canonical_storage(blob) for blob in raw)
        assert renamed[0] == renamed[1] and renamed[0] != raw[0]
        loaded = torch.storage._load_from_bytes(renamed[0])
        assert loaded.dtype == tensor.dtype and loaded.tolist() == tensor.flatten().tolist()
    assert canonical_storage(_saved(torch.ones(3))) != canonical_storage(_saved(torch.zeros(3)))


def test_anything_else_comes_back_as_it_came():
    for blob in (b"", b"not a pickle", _saved(torch.ones(2))[:40], b"\\x80\\x02K\\x01."):
        assert canonical_storage(blob) == blob


def test_a_tensor_that_owns_its_storage_travels_as_its_bytes():
    """``tensor_args`` reads what ``rebuild_tensor`` makes again: the same values,
    dtype, shape and device, in a storage of its own; equal values read alike."""
    from vllm_nnsight_plugin.wire.canonical import rebuild_tensor, tensor_args

    torch.manual_seed(0)
    for tensor in (
        torch.randn(3, 576),
        torch.randn(576).to(torch.bfloat16),
        torch.arange(7, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.tensor(2.5),  # no dimensions
        torch.randn(2, 3, 4).half(),
    ):
        args = tensor_args(tensor)
        assert args is not None and args == tensor_args(tensor.clone())
        again = rebuild_tensor(*args)
        assert again.dtype == tensor.dtype and again.shape == tensor.shape and again.device == tensor.device
        assert torch.equal(again, tensor) and again.stride() == tensor.stride()
        assert again.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    assert tensor_args(torch.ones(3)) != tensor_args(torch.zeros(3))


def test_anything_but_a_plain_tensor_owning_its_storage_is_left_to_torch():
    from vllm_nnsight_plugin.wire.canonical import tensor_args

    base = torch.randn(4, 8)
    tagged = torch.randn(3)
    tagged.note = "kept"  # an attribute torch's pickle keeps
    for tensor in (
        base[1],  # a view inside a larger storage
        base[:2],  # the start of one
        base.t(),  # not contiguous
        torch.randn(3, requires_grad=True),
        torch.nn.Parameter(torch.randn(3)),  # a subclass
        torch.empty(0),
        tagged,
        torch.eye(3).to_sparse(),
    ):
        assert tensor_args(tensor) is None
