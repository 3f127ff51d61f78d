"""Saves that travel stacked: a list of tensors goes home as one tensor and its splits.

A block that keeps a value every step builds a Python list of tensors, one per
step (``rows.append(layer.output[0].clone())``). Pickled as it stands, each
element is its own storage: its own device-to-host copy and sync in the worker,
its own nested ``torch.save`` record, its own copy back in the front end. At a
thousand requests of 128 steps that is most of a capture's time.

So, in the worker, such a list is replaced by :class:`Stacked`: the elements
concatenated into one tensor, plus each element's length along the first
dimension. The front end turns it back into a list of views of that one tensor,
so the user reads exactly the list the block built: same length, same shapes,
dtypes, devices and values.

Only lists whose elements can be rebuilt exactly are stacked (see
:func:`stackable`): plain, contiguous tensors of one dtype and device, with the
same shape past the first dimension, none sharing storage with another (a
pickled list keeps such sharing; a stacked one could not). Anything else, a
ragged list or one holding Python objects, travels as it always did.

The tensors of all requests collected together then travel in one flat tensor
per dtype and device (``pool.py``).

Nothing here imports nnsight: the front end of a server runs this too.
"""

from __future__ import annotations

import contextlib
import gc
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: Shortest list worth stacking: below this the record costs more than it saves.
MIN_ELEMENTS = 2


@dataclass(frozen=True)
class Stacked:
    """A list of tensors, concatenated along dim 0 (``lengths`` set) or stacked
    along a new dim 0 (``lengths`` None, for 0-dimensional elements)."""

    data: Any
    lengths: tuple[int, ...] | None

    def unstack(self) -> list:
        with uncollected():
            if self.lengths is None:
                return list(self.data.unbind(0))
            return list(self.data.split(list(self.lengths), dim=0))


@contextlib.contextmanager
def uncollected() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a list's elements are made.

    Every tensor is an object the collector tracks, and each few hundred new ones
    start a collection, some of which walk every object of the process. A probe's
    list of 295,000 rows made in a front end holding a million objects took three
    times as long with the collector running (0.6-0.9 s against 0.2-0.3 s on this
    project's CPU machine). Nothing of the list can be garbage while it is made;
    the collector resumes, and counts the new objects, as it ends. The front end
    pauses it over a whole collect's replies (``outputs.merge_replies``), so it
    does not resume between one request's list and the next.
    """
    paused = gc.isenabled()
    try:  # (disabled inside: a budget's stop, raised between two bytecodes, still resumes it)
        if paused:
            gc.disable()
        yield
    finally:
        if paused:
            gc.enable()


def stackable(value: Any) -> bool:
    """Whether ``value`` is a list of tensors that :class:`Stacked` rebuilds exactly."""
    import torch

    if type(value) is not list or len(value) < MIN_ELEMENTS:
        return False
    first = value[0]
    if type(first) is not torch.Tensor:
        return False
    tail, dtype, device = first.shape[1:], first.dtype, first.device
    storages = set()
    for element in value:
        if (
            type(element) is not torch.Tensor
            or element.dtype != dtype
            or element.device != device
            or element.dim() != first.dim()
            or element.shape[1:] != tail
            or element.layout != torch.strided
            or element.requires_grad
            or element.is_conj()
            or element.is_neg()
            or not element.is_contiguous()
        ):
            return False
        storage = element.untyped_storage().data_ptr()
        if storage in storages and element.numel():
            return False
        storages.add(storage)
    return True


def stack(value: list) -> Stacked:
    import torch

    if value[0].dim() == 0:
        return Stacked(torch.stack(value), None)
    return Stacked(torch.cat(value, dim=0), tuple(int(element.shape[0]) for element in value))


class _TensorCounter(pickle.Pickler):
    """Counts each reference to a tensor while a structure is pickled (to a null
    sink; tensors themselves are not written), wherever it sits: in lists and
    dicts, or inside any object pickle would send."""

    def __init__(self) -> None:
        super().__init__(_Null(), pickle.HIGHEST_PROTOCOL)
        self.counts: dict[int, int] = {}
        self.storages: dict[int, set[int]] = {}

    def persistent_id(self, obj: Any) -> Any:
        import torch

        if isinstance(obj, torch.Tensor):
            self.counts[id(obj)] = self.counts.get(id(obj), 0) + 1
            self.storages.setdefault(obj.untyped_storage().data_ptr(), set()).add(id(obj))
            return id(obj)
        return None


class _Null:
    def write(self, data: bytes) -> int:
        return len(data)


def shared_tensors(entry: dict) -> set[int] | None:
    """Ids of the tensors an entry refers to more than once (the same tensor
    under two names, or also inside another value) or that share a storage with
    another saved tensor: the general path can keep those as one object or one
    storage, and a stacked or pooled copy would not. None if the entry cannot be
    read that way (it then travels as it is)."""
    if not any(poolable(value) or stackable(value) for value in entry_values(entry)):
        return set()  # nothing would be stacked or pooled: no need to look
    counter = _TensorCounter()
    try:
        counter.dump({key: entry.get(key) for key in ("saves", "edits", "sequences")})
    except Exception:
        return None
    shared = {found for found, count in counter.counts.items() if count > 1}
    for tensors in counter.storages.values():
        if len(tensors) > 1:  # views of one storage: a pickle may keep them sharing it
            shared |= tensors
    return shared


def stack_saves(saves: dict, shared: set[int] = frozenset()) -> dict:
    """``saves`` with every stackable list replaced by its :class:`Stacked` form
    (not a list holding a tensor that is referred to elsewhere too)."""
    return {
        name: stack(value) if stackable(value) and not any(id(e) in shared for e in value) else value
        for name, value in saves.items()
    }


#: The dicts of saved values in one reply entry, flat and per sequence: the
#: block's own, and those of the installed edits the request ran.
SAVE_KEYS = ("saves", "edits")


def stack_entry(entry: dict, shared: set[int] = frozenset()) -> dict:
    """One request's reply (``saves``, ``edits`` and per-sequence
    ``sequences``), stacked.

    The flat dicts are sequence 0's own in nnsight's reply; they stay one object
    here too.
    """
    done: dict[int, tuple[dict, dict]] = {}  # by the source dict, held while in use

    def once(saves: dict) -> dict:
        found = done.get(id(saves))
        if found is None:
            found = done[id(saves)] = (saves, stack_saves(saves, shared))
        return found[1]

    stacked = dict(entry)
    for key in SAVE_KEYS:
        stacked[key] = once(entry.get(key) or {})
    stacked["sequences"] = {
        index: {**sequence, **{key: once(sequence.get(key) or {}) for key in SAVE_KEYS}}
        for index, sequence in (entry.get("sequences") or {}).items()
    }
    return stacked


def poolable(value: Any) -> bool:
    """A plain contiguous tensor, which a view of a flat copy rebuilds exactly."""
    import torch

    return (
        type(value) is torch.Tensor
        and value.layout == torch.strided
        and value.numel() > 0
        and not value.requires_grad
        and not value.is_conj()
        and not value.is_neg()
        and value.is_contiguous()
    )


def entry_values(entry: dict) -> list:
    """Every saved value of one reply entry, flat and per sequence."""
    found = [value for key in SAVE_KEYS for value in (entry.get(key) or {}).values()]
    for sequence in (entry.get("sequences") or {}).values():
        for key in SAVE_KEYS:
            found.extend((sequence.get(key) or {}).values())
    return found
