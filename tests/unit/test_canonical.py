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
