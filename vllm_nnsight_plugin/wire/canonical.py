"""A captured tensor's bytes as a function of its value alone.

A block's bytes salt the KV of the requests that make the same edit (``prefix.py``):
the same bytes, the same edit. A tensor the block captured is pickled by torch as
a legacy ``torch.save`` of its storage, which names the storage by its address in
this process (``str(storage._cdata)``). Two traces steering with equal vectors that
are not the same object (``-vector`` written in each, a vector loaded again, or
another client's process) would then send different bytes and share nothing.

:func:`canonical_storage` renames those keys ``0``, ``1``, ... in the order the save
lists them; nothing else changes, and torch reads the result exactly as the
original (the keys only pair each storage's record with its data). Anything that
is not the layout expected is returned as it came: a request then shares less,
never wrongly.

A tensor that owns its whole storage need not go through torch's save at all
(torch's pickle gives each pickled tensor a storage of its own anyway, so nothing
shared is lost): :func:`tensor_args` reads its bytes,
dtype, shape and device, which are a function of its value, and
:func:`rebuild_tensor` makes it again in the worker. That skips the save and the
renaming, most of a small captured tensor's pickling (activation patching
captures two rows per request).

Nothing here imports nnsight or unpickles: it walks the pickles' opcodes.
"""

from __future__ import annotations

import io
import pickletools
import struct
from typing import Any

#: A legacy save is five pickles (torch's magic number, its protocol version, the
#: saving system's sizes, the object with its storages as persistent ids, the
#: storages' keys), then each storage's data.
_PICKLES = 5
_OBJECT, _KEYS = 3, 4
_STRINGS = frozenset({"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE"})


def tensor_args(tensor: Any) -> tuple | None:
    """What :func:`rebuild_tensor` needs to make ``tensor`` again, for a plain,
    contiguous CPU or CUDA tensor that owns its whole storage and needs no grad;
    None for any other (it is pickled by torch)."""
    import torch

    if (
        type(tensor) is not torch.Tensor
        or tensor.layout is not torch.strided
        or tensor.device.type not in ("cpu", "cuda")
        or tensor.is_quantized
        or tensor.requires_grad
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.numel() == 0
        or tensor.storage_offset() != 0
        or not tensor.is_contiguous()
        or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()
        or tensor.__dict__
        or any(name is not None for name in getattr(tensor, "names", ()))  # where torch has names
    ):
        return None
    flat = tensor.detach().reshape(-1).view(torch.uint8).cpu()
    return flat.numpy().tobytes(), tensor.dtype, tuple(tensor.shape), str(tensor.device)


def rebuild_tensor(data: bytes, dtype: Any, shape: tuple, device: str) -> Any:
    """The tensor :func:`tensor_args` read: a storage of its own on ``device``."""
    import torch

    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)
    return tensor if device == "cpu" else tensor.to(device)


def canonical_storage(blob: bytes) -> bytes:
    """``blob`` (torch's legacy save of a storage) with its storage keys renamed in
    order; ``blob`` itself where it is not laid out as expected."""
    try:
        return _renamed(blob)
    except Exception:  # noqa: BLE001 - any doubt: the bytes as they came
        return blob


#: The first three pickles, the same in every save of this process (learned from the
#: first): a save that starts with them is read from its fourth.
_head: list[bytes] = []


def _renamed(blob: bytes) -> bytes:
    stream = io.BytesIO(blob)
    pickles: list = [None] * _OBJECT if _head and blob.startswith(_head[0]) else []
    stream.seek(len(_head[0]) if pickles else 0)
    while len(pickles) < _PICKLES:
        start = stream.tell()
        ops = [(op.name, arg, pos) for op, arg, pos in pickletools.genops(stream)]
        pickles.append((start, stream.tell(), ops))
    if not _head:
        _head.append(blob[: pickles[_OBJECT][0]])
    keys = [arg for name, arg, _ in pickles[_KEYS][2] if name in _STRINGS]
    names = {key: str(number) for number, key in enumerate(keys)}
    if len(names) != len(keys) or not keys:
        return blob
    found = [arg for name, arg, _ in pickles[_OBJECT][2] if name in _STRINGS and arg in names]
    if set(found) != set(names):  # a key the object does not name: not the layout expected
        return blob
    out = io.BytesIO()
    out.write(blob[: pickles[_OBJECT][0]])
    for index in (_OBJECT, _KEYS):
        start, end, ops = pickles[index]
        bounds = [pos for _, _, pos in ops] + [end]
        for (name, arg, pos), following in zip(ops, bounds[1:], strict=True):
            if name in _STRINGS and arg in names:
                text = names[arg].encode("utf-8")
                out.write(b"X" + struct.pack("<I", len(text)) + text)
            else:
                out.write(blob[pos:following])
    out.write(blob[pickles[_KEYS][1] :])
    return out.getvalue()
