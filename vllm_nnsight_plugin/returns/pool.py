"""The saved tensors of one collect, travelling together: one flat tensor per dtype
and device, and where each request's tensors sit in it.

The worker swaps each request's poolable tensors for references (:class:`Pooler`),
the flat tensors go home pickled or, when large, through shared memory
(``shared.py``), and the front end gives each request a copy of its own part
(:class:`Resolver`), so no request's saves share storage with another's.

Nothing here imports nnsight: the front end of a server runs this too.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from .cached import CachedSteps, cache_view
from .lent import LentFlat
from .lent import lend as lent_flat
from .lent import opened as open_lent
from .shared import SharedFlat, discard, large, opened, share
from .stacked import SAVE_KEYS, Stacked, entry_values, poolable
from .staging import to_device

#: The front end copies a shared pool back to its GPU a window at a time: one
#: transfer serves the requests side by side in it (each then copied into its own
#: storage on the device), and the window bounds the extra device memory.
WINDOW_BYTES = 256 << 20
#: A saved tensor this large travels as a flat tensor of its own where joining the
#: saves would crowd the device (:meth:`Pooler.pool`).
OWN_FLAT_BYTES = 16 << 20


@dataclass(frozen=True)
class Pooled:
    """A saved tensor that travelled inside its collect's :class:`Pool`."""

    pool: str
    index: int


@dataclass
class Pool:
    """Every poolable tensor saved by the requests of one collect, as one flat
    tensor per dtype and device, and where each saved tensor sits in it.

    A sweep of a thousand requests, each keeping one row, would otherwise send a
    thousand tensors (a device copy, a pickle record and a copy back each).
    """

    id: str
    flats: list  # tensors, or ``shared.SharedFlat`` for the large ones (``share``)
    #: index -> (which flat, offset, shape)
    places: dict[int, tuple[int, int, tuple[int, ...]]]
    #: per mapped flat, the part of it last copied to its device: (low, high, tensor)
    windows: dict[int, tuple[int, int, Any]] = field(default_factory=dict, repr=False)

    def __reduce__(self) -> tuple:
        """Pickled with each plain flat tensor as its values' bytes (:class:`_Bytes`):
        torch's own pickling of a tensor, a nested ``torch.save``, costs more than
        the copy itself, and it was the largest step of a one-token trace's saves
        on their way home."""
        return (_pool, (self.id, [_as_bytes(flat) for flat in self.flats], self.places))

    def share(self, lend: bool = False) -> None:
        """Leave each large flat tensor where the front end can read it without
        pickling (the worker, before sending): on its GPU when ``lend`` allows
        (``lent.py``), else in shared memory (``shared.py``)."""

        def away(flat: Any) -> Any:
            return (lend and large(flat) and lent_flat(flat)) or share(flat) or flat

        self.flats = [away(flat) for flat in self.flats]

    def _flat(self, number: int) -> Any:
        flat = self.flats[number]
        if isinstance(flat, SharedFlat):
            mapped = opened(flat)
            self.flats[number] = flat = _Mapped(mapped, flat.device)
        elif isinstance(flat, LentFlat):
            self.flats[number] = flat = open_lent(flat)
        return flat

    def _owned(self, number: int, low: int, high: int) -> Any:
        """A copy of ``flats[number][low:high]`` of its own, where the flat was saved."""
        flat = self._flat(number)
        if not isinstance(flat, _Mapped):
            return flat[low:high].clone()
        if flat.device == "cpu":
            return flat.tensor[low:high].clone()
        window = self.windows.get(number)
        if window is None or not window[0] <= low <= high <= window[1]:
            if window is not None and low < window[0]:  # asked out of order: just this part
                return to_device(flat.tensor[low:high], flat.device)
            top = min(flat.tensor.numel(), low + max(high - low, WINDOW_BYTES // flat.tensor.element_size()))
            window = self.windows[number] = (low, top, to_device(flat.tensor[low:top], flat.device))
        start, _, data = window
        return data[low - start : high - start].clone()

    def close(self) -> None:
        """Let go of the flat tensors (the front end, once merged): remove any
        shared-memory file no request read, and give back what was lent on the
        device (a lent tensor nobody opened is opened and dropped, which is how
        its lender learns it may free it)."""
        for flat in self.flats:
            if isinstance(flat, SharedFlat):
                discard(flat)
            elif isinstance(flat, LentFlat):
                try:
                    open_lent(flat)  # dropped at once
                except RuntimeError:
                    pass  # it cannot be opened here, so it was never counted here
        self.flats = [None] * len(self.flats)
        self.windows.clear()

    def _span(self, index: int) -> tuple[int, int, int, tuple[int, ...]]:
        flat, offset, shape = self.places[index]
        return flat, offset, offset + math.prod(shape), shape

    def own_views(self, indices: set[int]) -> dict[int, Any]:
        """The tensors at ``indices`` (one request's), as views of a copy of just
        their part of each flat tensor.

        One request's tensors sit side by side in each flat tensor, so this is one
        copy per dtype and device. A view of the shared flat tensor would keep
        every other request's tensors alive with it, and ``torch.save`` of it (a
        server's response) would write all of them.
        """
        if len(indices) == 1:  # (the most common: a request that saved one tensor)
            (index,) = indices
            flat, start, end, shape = self._span(index)
            return {index: self._owned(flat, start, end).view(shape)}
        spans = {index: self._span(index) for index in indices}
        bounds: dict[int, tuple[int, int]] = {}
        covered: dict[int, int] = {}
        for flat, start, end, _ in spans.values():
            low, high = bounds.get(flat, (start, end))
            bounds[flat] = (min(low, start), max(high, end))
            covered[flat] = covered.get(flat, 0) + end - start
        if any(high - low != covered[flat] for flat, (low, high) in bounds.items()):
            # Not side by side (never made so by ``Pooler``): copy one by one
            # rather than hand out anyone else's values.
            return {i: self._owned(f, a, b).view(shape) for i, (f, a, b, shape) in spans.items()}
        owned = {flat: self._owned(flat, low, high) for flat, (low, high) in bounds.items()}
        return {
            index: owned[flat][start - bounds[flat][0] : end - bounds[flat][0]].view(shape)
            for index, (flat, start, end, shape) in spans.items()
        }


@dataclass(frozen=True)
class _Bytes:
    """A flat tensor as a pickled :class:`Pool` carries it: its values' bytes, and
    the dtype and device it is rebuilt with (as ``shared.SharedFlat`` names them)."""

    data: bytes
    dtype: Any
    device: str


def _dtypes() -> frozenset:
    """The dtypes a flat tensor travels as bytes in (any other: as torch pickles it)."""
    import torch

    return frozenset(
        (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
        + (torch.int16, torch.int8, torch.uint8, torch.bool)
    )


def _as_bytes(flat: Any) -> Any:
    """A plain one-dimensional tensor as :class:`_Bytes`; anything else as it is."""
    import torch

    if not (
        type(flat) is torch.Tensor
        and flat.layout is torch.strided
        and flat.dim() == 1
        and flat.is_contiguous()
        and not flat.requires_grad
        and flat.dtype in _dtypes()
    ):
        return flat
    host = flat.detach().to("cpu")
    return _Bytes(host.view(torch.uint8).numpy().tobytes(), flat.dtype, str(flat.device))


def _from_bytes(flat: Any) -> Any:
    """:func:`_as_bytes` undone: a tensor of its own, writable, on its device."""
    import torch

    if not isinstance(flat, _Bytes):
        return flat
    if flat.dtype not in _dtypes():
        raise ValueError(f"a pooled tensor of dtype {flat.dtype!r}, which no pool sends")
    if flat.data:
        tensor = torch.frombuffer(bytearray(flat.data), dtype=flat.dtype)
    else:
        tensor = torch.empty(0, dtype=flat.dtype)
    return tensor if flat.device == "cpu" else tensor.to(flat.device)


def _pool(pool_id: str, flats: list, places: dict) -> Pool:
    """A :class:`Pool` as it was pickled (``Pool.__reduce__``)."""
    return Pool(pool_id, [_from_bytes(flat) for flat in flats], places)


@dataclass(frozen=True)
class _Mapped:
    """A flat tensor mapped from shared memory, and the device it was saved on."""

    tensor: Any
    device: str


class Pooler:
    """The worker's side of a :class:`Pool`: swaps saved tensors for references,
    request by request, and builds the pool once every request is packed."""

    def __init__(self) -> None:
        self.id = secrets.token_hex(8)
        self.tensors: dict[int, Any] = {}

    def swap(self, entry: dict, shared: set[int] = frozenset()) -> tuple[dict, dict[int, Any]]:
        """``entry`` with its poolable tensors replaced by :class:`Pooled`, and the
        tensors it would add (index -> tensor), not yet added (see :meth:`add`).
        A tensor in ``shared`` (see :func:`shared_tensors`) stays as it is."""
        taken: dict[int, Any] = {}
        by_tensor: dict[int, Pooled] = {}
        by_dict: dict[int, tuple[dict, dict]] = {}  # by the source dict, held

        def ref(tensor: Any) -> Pooled:
            found = by_tensor.get(id(tensor))
            if found is None:
                index = len(self.tensors) + len(taken)
                found = by_tensor[id(tensor)] = Pooled(self.id, index)
                taken[index] = tensor
            return found

        def swap_value(value: Any) -> Any:
            if poolable(value) and id(value) not in shared:
                return ref(value)
            if isinstance(value, Stacked) and poolable(value.data):
                return Stacked(ref(value.data), value.lengths)
            if isinstance(value, CachedSteps):
                return value.replaced(*(swap_value(part) for part in value.parts()))
            return value

        def swap_saves(saves: dict) -> dict:
            done = by_dict.get(id(saves))
            if done is None:
                done = by_dict[id(saves)] = (saves, {name: swap_value(v) for name, v in saves.items()})
            return done[1]

        swapped = dict(entry)
        for key in SAVE_KEYS:
            swapped[key] = swap_saves(entry.get(key) or {})
        swapped["sequences"] = {
            index: {**sequence, **{key: swap_saves(sequence.get(key) or {}) for key in SAVE_KEYS}}
            for index, sequence in (entry.get("sequences") or {}).items()
        }
        return swapped, taken

    def swap_plain(self, entry: dict) -> tuple[dict, dict[int, Any]]:
        """:meth:`swap` for an entry whose saves are distinct poolable tensors, with no
        edits' saves and at most sequence 0, whose dicts are the flat ones (the
        collect's short way, ``worker/collect._only_tensors``): the same result,
        without the general walk's memos."""
        taken: dict[int, Any] = {}
        saves: dict[str, Pooled] = {}
        start = len(self.tensors)
        for name, tensor in entry["saves"].items():
            index = start + len(taken)
            taken[index] = tensor
            saves[name] = Pooled(self.id, index)
        swapped = dict(entry)
        swapped["saves"], swapped["edits"] = saves, {}
        sequences = entry.get("sequences") or {}
        swapped["sequences"] = {0: {**sequences[0], "saves": saves, "edits": {}}} if sequences else {}
        return swapped, taken

    def add(self, taken: dict[int, Any]) -> None:
        self.tensors.update(taken)

    def pool(self) -> Pool | None:
        """The pool: the tensors joined in one flat tensor per dtype and device, one
        copy (and one hand-over to the front end) for all of them. Where joining
        them would need more than half the device's free memory (a probe's rows,
        gigabytes, on an engine holding most of its GPU), each of
        :data:`OWN_FLAT_BYTES` or more is a flat of its own instead, uncopied."""
        import torch

        if not self.tensors:
            return None
        groups: dict[tuple, list[int]] = {}
        for index, tensor in self.tensors.items():
            groups.setdefault((tensor.dtype, tensor.device), []).append(index)
        for key, indices in list(groups.items()):
            tensors = [self.tensors[index] for index in indices]
            if sum(tensor_bytes(t) for t in tensors) <= _room(key[1]) / 2:
                continue
            alone = {
                i
                for i, t in zip(indices, tensors, strict=True)
                if tensor_bytes(t) >= OWN_FLAT_BYTES and _whole(t)
            }
            groups[key] = [index for index in indices if index not in alone]
            groups.update({(index,): [index] for index in sorted(alone)})
        flats, places = [], {}
        for number, indices in enumerate(group for group in groups.values() if group):
            offset = 0
            for index in indices:
                tensor = self.tensors[index]
                places[index] = (number, offset, tuple(tensor.shape))
                offset += tensor.numel()
            parts = [self.tensors[index].reshape(-1) for index in indices]
            flats.append(parts[0] if len(parts) == 1 and _whole(parts[0]) else torch.cat(parts))
        return Pool(self.id, flats, places)


def tensor_bytes(tensor: Any) -> int:
    """The bytes of ``tensor``'s own values (not of the storage around it)."""
    return tensor.numel() * tensor.element_size()


def _room(device: Any) -> float:
    """Free memory on ``device`` (unbounded off a GPU)."""
    import torch

    if device.type != "cuda":
        return float("inf")
    return torch.cuda.mem_get_info(device)[0]


def _whole(tensor: Any) -> bool:
    """Whether ``tensor`` is all of its storage, so sending it sends nothing more."""
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor_bytes(tensor)


class Resolver:
    """The front end's side, for one request: :class:`Pooled` and :class:`Stacked`
    values back to tensors and lists, once each, so a value that came home under
    two keys (flat and sequence 0, or two names) stays one object. The request's
    pooled tensors become views of a copy of its own part of the pool."""

    def __init__(self, pools: dict[str, Pool], entry: dict) -> None:
        wanted: dict[str, set[int]] = {}
        for value in entry_values(entry):
            for part in value.parts() if isinstance(value, CachedSteps) else (value,):
                ref = part.data if isinstance(part, Stacked) else part
                if isinstance(ref, Pooled):
                    wanted.setdefault(ref.pool, set()).add(ref.index)
        self.tensors = {
            (pool, index): tensor
            for pool, indices in wanted.items()
            for index, tensor in pools[pool].own_views(indices).items()
        }
        self._done: dict[int, tuple[Any, Any]] = {}

    def __call__(self, value: Any) -> Any:
        if not isinstance(value, Pooled | Stacked | CachedSteps):
            return value
        kept = self._done.get(id(value))
        if kept is None:
            if isinstance(value, Pooled):
                resolved = self.tensors[(value.pool, value.index)]
            elif isinstance(value, CachedSteps):  # a cache's values live on the host
                resolved = cache_view(value.path, *(self._on_host(part) for part in value.parts()))
            else:
                data = self(value.data)
                resolved = Stacked(data, value.lengths).unstack()
            kept = self._done[id(value)] = (value, resolved)
        return kept[1]

    def _on_host(self, stacked: Stacked) -> list:
        """A stacked list's steps on the host: one copy of the whole, then views."""
        return Stacked(self(stacked.data).cpu(), stacked.lengths).unstack()
