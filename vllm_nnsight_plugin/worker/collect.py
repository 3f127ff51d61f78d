"""Collection: finished requests' blocks wound up, their saves packed to go home.

The front end asks (``nnsight_collect``) for every request that finished in a
step at once. All of them are wound up first, then the device is synchronised
once, then each request is packed on its own: a save that cannot be sent, or
that is over the limit, fails that request and no other collected with it.
Lists of tensors travel stacked, and every saved tensor of the collect travels
in one pool per dtype and device (``returns/stacked.py``).
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from .. import seams
from ..returns.pool import Pooler, tensor_bytes
from ..returns.stacked import poolable, shared_tensors, stack_entry
from ..wire.envelope import Limits
from ..wire.reply import request_reply
from . import _nnsight as nns
from .admit import RequestIndex
from .budget import BudgetError, Watchdog
from .errors import CompiledForwardError, SaveLimitError, UnsendableSaveError

#: An uncollected block is dropped once its request has been finished this many
#: steps *and* ``VLLM_NNSIGHT_UNCOLLECTED_S`` seconds (default 30): long enough
#: for a busy front end's collect to arrive, short enough not to hold memory.
UNCOLLECTED_STEPS = 8


def wind_up(
    requests: Any,
    model: Any,
    index: RequestIndex,
    request_ids: list[str],
    outputs: dict | None,
    reporting: bool,
) -> dict[str, dict]:
    """Per asked id, its reply entry; every block named is wound up and forgotten.

    One request's failure to wind up becomes that request's error.
    """
    entries: dict[str, dict] = {}
    for request_id in request_ids:
        answering = index.answering(request_id)
        try:
            entries.update(nns.collect_entries(requests, model, request_id, answering, outputs, reporting))
        except Exception as error:
            for internal in answering:
                requests.requests.pop(internal, None)
            entries[request_id] = {**request_reply(), "error": nns.capture_exception(error)}
        for internal in answering:
            if internal not in requests.requests:
                index.remove(internal)
    return entries


def pack_all(
    request_ids: list[str],
    entries: dict[str, dict],
    limits: Limits,
    compiled_miss: str | None,
    pooler: Pooler,
    watch: Watchdog | None = None,
) -> list[bytes]:
    """The collect's reply parts: each request packed by :func:`pack`, except the
    replies of tensors alone (:func:`_only_tensors`, clear of the save limit by a
    margin), which share one part: their pickles run no code of a block's, so
    none can fail on its own, and one pickle of many costs less than many."""
    parts: list[bytes] = []
    together: dict[str, dict] = {}
    for request_id in request_ids:
        entry = entries.get(request_id)
        if entry is None or not _short(entry, limits):
            parts.append(pack(request_id, entry, limits, compiled_miss, pooler, watch))
            continue
        together[request_id], taken = pooler.swap_plain(entry)
        pooler.add(taken)
    if together:
        parts.append(nns.dumps_compact(together))
    return parts


#: What a reply of tensors alone may hold besides its tensors, at most, to share a
#: part (:func:`pack_all`): within this of the save limit, it is packed on its own,
#: where the limit counts its pickle's bytes too.
_MARGIN_BYTES = 1 << 16


def _short(entry: dict, limits: Limits) -> bool:
    """Whether ``entry`` may share the collect's part of replies of tensors alone."""
    if not _only_tensors(entry):
        return False
    saves = entry["saves"]
    size = sum(tensor_bytes(tensor) + len(name) for name, tensor in saves.items())
    return size + _MARGIN_BYTES <= limits.max_save_bytes


def pack(
    request_id: str,
    entry: dict | None,
    limits: Limits,
    compiled_miss: str | None,
    pooler: Pooler,
    watch: Watchdog | None = None,
) -> bytes:
    """One request's reply, pickled as the front end reads it; its tensors go to
    ``pooler`` (one pool per collect, sent as the last part: :func:`pool_part`).

    ``compiled_miss`` (on a compiled engine) replaces nnsight's "location never
    reached" with the reason it was not reached there.
    """
    if entry is None:
        return pickle.dumps({})
    if compiled_miss is not None and nns.is_out_of_order(entry.get("error")):
        entry["error"] = nns.capture_exception(CompiledForwardError(compiled_miss))
    try:
        if _only_tensors(entry):  # nothing of the block's own to pickle: no budget needed
            taken, part = _packed(request_id, entry, pooler, plain=True)
        elif watch is None:
            taken, part = _packed(request_id, entry, pooler)
        else:
            taken, part = watch.run(entry, _packed, request_id, entry, pooler)
    except BudgetError as error:
        return pickle.dumps({request_id: {**request_reply(), "error": nns.capture_exception(error)}})
    except Exception as error:  # the block's state is already wound up
        unsent = UnsendableSaveError(
            f"a value request {request_id} saved could not be sent back from the "
            f"engine ({error}). Save tensors (.detach().clone()) and plain Python "
            "values, not modules, parameters or objects holding them."
        )
        return pickle.dumps({request_id: {**request_reply(), "error": nns.capture_exception(unsent)}})
    size = len(part) + sum(tensor_bytes(tensor) for tensor in taken.values())
    if size > limits.max_save_bytes:
        over = SaveLimitError(
            f"request {request_id} saved {size} bytes, over this engine's limit "
            f"of {limits.max_save_bytes} (VLLM_NNSIGHT_MAX_SAVE_BYTES). Save "
            "less (a slice, a reduction), or split the work over several traces."
        )
        return pickle.dumps({request_id: {**request_reply(), "error": nns.capture_exception(over)}})
    pooler.add(taken)
    return part


def _packed(request_id: str, entry: dict, pooler: Pooler, plain: bool = False) -> tuple[dict, bytes]:
    """The tensors the pool takes from the entry, and the entry pickled without them;
    ``plain``: the entry is :func:`_only_tensors`'s (nothing to stack, nothing shared)."""
    if plain:
        swapped, taken = pooler.swap_plain(entry)
        return taken, nns.dumps_compact({request_id: swapped})
    shared = shared_tensors(entry)
    swapped, taken = (entry, {}) if shared is None else pooler.swap(stack_entry(entry, shared), shared)
    return taken, nns.dumps_compact({request_id: swapped})


#: What a reply entry holds besides its saves: the path is plain words and flags.
_PLAIN_KEYS = frozenset({"saves", "error", "edits", "sequences", "path"})


def _only_tensors(entry: dict) -> bool:
    """An entry whose saves are tensors the pool rebuilds exactly, each of a storage
    of its own, or none at all, and nothing else of the block's (no error, no
    edits' saves, one sequence, whose dicts are the flat ones): the most common
    replies (a lowered read's; a lowered edit's, which saves nothing), for which
    finding shared tensors and stacking lists would find none, and whose
    pickling runs no code of the block's. Anything else takes the general path."""
    saves = entry.get("saves")
    if (
        saves is None
        or entry.get("error") is not None
        or entry.get("edits")
        or not entry.keys() <= _PLAIN_KEYS
    ):
        return False
    sequences = entry.get("sequences") or {}
    if sequences and (
        list(sequences) != [0]  # one sequence, whose dicts are the flat ones themselves
        or any(value is not entry.get(key) for key, value in sequences[0].items())
    ):
        return False
    if not all(poolable(value) for value in saves.values()):
        return False
    if len(saves) < 2:  # (a lowered read's one save: nothing to share a storage with)
        return True
    return len({value.untyped_storage().data_ptr() for value in saves.values()}) == len(saves)


def pool_part(pooler: Pooler) -> list[bytes]:
    """The collect's pool of saved tensors as a reply part (none if nothing pooled).

    Large flats stay on the GPU, lent to the front end, where it is another
    process (``returns/lent.py``), else go by shared memory (``returns/shared.py``).
    """
    pool = pooler.pool()
    if pool is None:
        return []
    on_gpu = any(flat.device.type == "cuda" for flat in pool.flats)
    pool.share(lend=on_gpu and seams.front_end_elsewhere())
    return [pickle.dumps(pool)]


def synchronize_device() -> None:
    """Saves may still be device work in flight; they are about to be read."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Uncollected:
    """Requests that finished but were not collected, and when.

    The front end collects a request as soon as it finishes. One nobody collects
    (a caller that bypassed the plugin's front-end seams, a front end that died)
    is dropped a while after vLLM says it finished, so no state outlives it.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.steps = 0
        self.finished_at: dict[str, tuple[int, float]] = {}

    def step(self, finished: Any, tracked: dict) -> list[str]:
        """Count a step; note which tracked requests finished; return the stale ones.

        A sequence of an ``n > 1`` request is never stale while a sibling still
        runs: the front end collects them together, when the last one finishes.
        """
        self.steps += 1
        now = time.monotonic()
        for request_id in finished or ():
            if request_id in tracked:
                self.finished_at.setdefault(request_id, (self.steps, now))
        last: dict[str, tuple[int, float]] = {}  # per request, its last sequence's finish
        for rid, (step, at) in self.finished_at.items():
            seen = last.get(parent := _parent(rid, tracked), (step, at))
            last[parent] = (max(seen[0], step), max(seen[1], at))
        old = {
            p
            for p, (step, at) in last.items()
            if self.steps - step >= UNCOLLECTED_STEPS and now - at >= self.seconds
        }
        if old:
            old -= {_parent(rid, tracked) for rid in tracked if rid not in self.finished_at}  # still running
        stale = [rid for rid in self.finished_at if _parent(rid, tracked) in old]
        for request_id in stale:
            del self.finished_at[request_id]
        return [rid for rid in stale if rid in tracked]

    def forget(self, tracked: dict) -> None:
        """Drop the notes of requests no longer tracked (they were collected)."""
        for request_id in [rid for rid in self.finished_at if rid not in tracked]:
            del self.finished_at[request_id]


def _parent(request_id: str, tracked: dict) -> str:
    """The request a tracked sequence belongs to (its own id unless ``n > 1``)."""
    return getattr(tracked.get(request_id), "engine_id", request_id)
