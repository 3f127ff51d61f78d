"""Lowered requests, and where the rows they keep are stored.

A lowered block that keeps a tap's rows (``rows.append(layer.output[0].clone())``,
or a read on the first step) gets, at admission, its own region of the store:
one device tensor, allocated with the tables, with room for every row the
request can produce (its prompt and ``max_tokens``). The operation inside the
forward writes each kept row straight to its place in the region (a per-row
destination table, filled before each step), so nothing runs after the forward
and nothing per request per step runs in Python. When the request is collected
its region is read in one copy, on the model's device as the Python path's
saves are, and given back. The store's size is ``VLLM_NNSIGHT_KEPT_BYTES``
(default on a GPU 3% of its memory and at least 1 GiB: a lowered request that
finds no room runs as Python, and a Python step leaves the graphs for the whole
batch, so a store too small for the requests a GPU holds at once costs them all;
128 MiB on a CPU).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..returns.cached import CachedSteps
from ..returns.stacked import Stacked
from ..settings import KEPT_BYTES, value
from .ops import KEEP_BOTH, chunks

KEPT_BYTES_ENV = KEPT_BYTES


#: The store's share of a GPU's memory by default (at least 1 GiB): on an H200
#: 4.2 GiB, room for every layer's row of 64 requests of 128 tokens on a model
#: of Qwen3-8B's shapes, or every row of 1,000 such requests at one layer.
STORE_SHARE = 0.03


def store_rows(row_bytes: int, cuda: bool, device_bytes: int = 0) -> int:
    """How many rows the store holds (row 0 takes the rows nobody keeps);
    ``device_bytes``: the GPU's memory."""
    default = max(1 << 30, int(device_bytes * STORE_SHARE)) if cuda else (128 << 20)

    return max(2, int(value(KEPT_BYTES_ENV) or default) // max(1, row_bytes))


@dataclass
class Lowered:
    """One request's lowered block: what it does at one tap, on which of its steps."""

    site: int
    start: int
    stop: int | None  # None: every step
    result: str | None  # the name ``tracer.result.save()`` was assigned to
    code: int = 0  # keeping: what ``ops.keep`` writes (0: this block steers)
    name: str | None = None  # keeping: the name the kept rows are saved under
    select: Any = None  # the index applied to a step's rows: a single read's, or each step's row
    single: bool = False  # one value (a read in the body), not a list of steps
    cache: str | None = None  # a ``tracer.cache`` of the tap: the module's path in it
    #: its block reads the tap at the sampler: each step's rows are kept at the
    #: start of its region, over the step before's (``replay.py``)
    replay: bool = False
    #: a keep over several taps: (site, base of its region) for each, in model order
    regions: tuple[tuple[int, int], ...] = ()
    #: served at the sampler: rows of the store a token row takes at its widest tap
    widest: int = 2
    entry: int = -1  # its row in the tables' per-request arrays
    slot: int = -1  # steering: its vector's row of the bank
    slot2: int = -1  # patching the residual too: the row of the bank its value is in
    #: once its request finished: (forwards, rows kept, rows of its first forward),
    #: its entries given back while its region waits to be read
    retired: tuple[int, int, int] | None = None
    base: int = 0  # keeping: its region of the store
    rows: int = 0
    #: steps whose row count was not the usual one (the prompt first, then one)
    irregular: dict[int, int] = field(default_factory=dict)
    #: the installed edit whose copy this is (``model.edit()``), whose saves its
    #: kept rows are; None: the request's own block
    edit: str | None = None

    @property
    def stride(self) -> int:
        """Rows of the store per kept token row: two for a cache (both outputs)."""
        return 2 if self.code == KEEP_BOTH else 1


def rows_kept(lowered: Lowered, steps: int, first: int) -> int:
    """How many rows a keeping block keeps in its first ``steps`` forwards."""
    return sum(_lengths(lowered, steps, first))


def _lengths(lowered: Lowered, steps: int, first: int) -> list[int]:
    """Rows kept at each step it keeps, of its first ``steps`` forwards."""
    stop = steps if lowered.stop is None else min(steps, lowered.stop)
    if picks_a_row(lowered):
        return [1] * max(0, stop - lowered.start)
    return [lowered.irregular.get(s, first if s == 0 else 1) for s in range(lowered.start, stop)]


def picks_a_row(lowered: Lowered) -> bool:
    """A keep of one row of each step (``<kept>[-1]``), not of all of them."""
    return lowered.select is not None and not lowered.single


def step_rows(base: int, store: Any, count: int, width: int) -> tuple[Any, Any]:
    """A replayed request's ``count`` rows of this step at one tap (its region
    starts at ``base``), as the tap's two outputs, ``width`` wide (each over
    ``ops.chunks`` rows of the store)."""
    k = chunks(width, store.shape[-1])
    pairs = store[base : base + 2 * k * count].view(count, 2, -1)[..., :width]
    return pairs[:, 0], pairs[:, 1]


def kept_saves(lowered: Lowered, store: Any, steps: int, done: int, first: int) -> dict[str, Any]:
    """What a keeping block saved, as the Python path would have it: the list of
    each step's rows (a :class:`Stacked`), or the one read.

    ``steps`` is how many forwards the request was in, ``done`` how many rows it
    kept, ``first`` how many rows its first forward had.
    """
    if not lowered.code or lowered.name is None:
        return {}
    if lowered.single:
        if done == 0:
            return {}
        rows = store[lowered.base : lowered.base + done]
        return {lowered.name: (rows if lowered.select is None else rows[lowered.select]).clone()}
    lengths = _lengths(lowered, steps, first)
    if sum(lengths) != done:  # cannot happen while the fill keeps its books
        raise RuntimeError(f"kept {done} rows, counted {sum(lengths)}")
    if picks_a_row(lowered):  # each step's element is one row: [width]
        data = store[lowered.base : lowered.base + done].clone()
        return {lowered.name: Stacked(data, None) if done >= 2 else list(data.unbind(0))}
    if lowered.cache is not None and lowered.code != KEEP_BOTH:  # a tensor's tap: its rows
        rows = Stacked(store[lowered.base : lowered.base + done].clone(), tuple(lengths))
        return {lowered.name: CachedSteps(lowered.cache, rows)}
    if lowered.cache is not None:  # rows in pairs: each token's two outputs
        pairs = store[lowered.base : lowered.base + 2 * done].view(done, 2, -1)
        hidden, residual = (Stacked(pairs[:, i].clone(), tuple(lengths)) for i in range(2))
        return {lowered.name: CachedSteps(lowered.cache, hidden, residual)}
    data = store[lowered.base : lowered.base + done].clone()
    if len(lengths) < 2:
        return {lowered.name: list(Stacked(data, tuple(lengths)).unstack()) if lengths else []}
    return {lowered.name: Stacked(data, tuple(lengths))}


def single_read(lowered: Lowered, done: int) -> bool:
    """Whether a request's saves are one read whose rows :func:`read_together` can
    gather with others': its index picks rows the way a NumPy index picks them
    (none, an integer within its ``done`` rows, or a slice forward)."""
    if not (lowered.code and lowered.name is not None and lowered.single and done > 0):
        return False
    select = lowered.select
    if select is None:
        return True
    if type(select) is int:
        return -done <= select < done
    return (
        type(select) is slice
        and all(bound is None or type(bound) is int for bound in (select.start, select.stop, select.step))
        and (select.step is None or select.step > 0)
    )


def read_together(store: Any, reads: list[tuple[Lowered, int]]) -> list[dict[str, Any]]:
    """:func:`kept_saves` of many single reads (``(lowered, done)``, each passing
    :func:`single_read`), gathered from the store in one copy.

    A sweep collects a thousand one-row reads at once; a copy each cost its
    engine's host a launch and an allocation per request (about 27 us a request
    on an H100's host). Each value here is a view of the one gathered tensor,
    equal to its own copy; the collect's pool joins them into its flat anyway
    (``returns/pool.py``), so no request's saves share storage once home. The
    index goes up from pinned memory without waiting: a collect beside the step
    in flight must not wait for it (``worker/ready.py``)."""
    import torch

    # The common read, one row by an integer (``[-1]``, the last), computed for all
    # at once; the others row by row.
    one = np.fromiter((type(lowered.select) is int for lowered, _ in reads), dtype=bool, count=len(reads))
    bases = np.fromiter((lowered.base for lowered, _ in reads), dtype=np.int64, count=len(reads))
    dones = np.fromiter((done for _, done in reads), dtype=np.int64, count=len(reads))
    picks = np.fromiter(
        (lowered.select if ok else 0 for (lowered, _), ok in zip(reads, one, strict=True)),
        dtype=np.int64,
        count=len(reads),
    )
    rows = [bases[one] + np.where(picks[one] < 0, picks[one] + dones[one], picks[one])]
    for (lowered, done), ok in zip(reads, one, strict=True):
        if not ok:
            kept = np.arange(lowered.base, lowered.base + done, dtype=np.int64)
            rows.append(kept if lowered.select is None else kept[lowered.select])
    index = np.concatenate(rows)
    if index.size and (index.min() < 0 or index.max() >= store.shape[0]):
        # (a slice of the store would stop at its end; an index past it on a GPU
        # is a device-side assert, which ends the engine)
        raise IndexError("a read's rows lie outside the store")
    index = torch.from_numpy(index)
    if store.device.type == "cuda":
        index = index.pin_memory().to(store.device, non_blocking=True)
    data = store.index_select(0, index)
    single = iter(data[: len(rows[0])].unbind(0))
    offset = len(rows[0])
    found = []
    for (lowered, _), ok, part in zip(reads, one, _parts(rows, one), strict=True):
        if ok:
            found.append({lowered.name: next(single)})
        else:
            found.append({lowered.name: data[offset : offset + part]})
            offset += part
    return found


def _parts(rows: list, one: np.ndarray) -> list[int]:
    """Each read's row count in :func:`read_together`'s index (1 for an integer's)."""
    rest = iter(rows[1:])
    return [1 if ok else len(next(rest)) for ok in one]


def layers_saves(lowered: Lowered, store: Any, steps: int, done: int, first: int) -> dict[str, Any]:
    """What a block keeping the same rows at several taps saved (``lowered.regions``,
    in the order its loop visits them): the one list it built, each step's rows
    at every tap before the next step's, gathered from the regions in one copy."""
    import torch

    lengths = _lengths(lowered, steps, first)
    if sum(lengths) != done:  # cannot happen while the fill keeps its books
        raise RuntimeError(f"kept {done} rows, counted {sum(lengths)}")
    bases = [base for _, base in lowered.regions]
    index = _layers_index(np.array(bases, dtype=np.int64), np.array(lengths, dtype=np.int64))
    data = store.index_select(0, torch.from_numpy(index).to(store.device))
    if picks_a_row(lowered):  # each element is one row: [width]
        found = Stacked(data, None) if len(index) >= 2 else list(data.unbind(0))
        return {lowered.name: found}
    each = tuple(length for length in lengths for _ in bases)
    return {lowered.name: Stacked(data, each) if len(each) >= 2 else list(Stacked(data, each).unstack())}


def _layers_index(bases: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The store's rows in the order the block's list holds them: each step's rows
    at every region (``bases``) before the next step's."""
    offsets = np.cumsum(lengths) - lengths
    starts = (bases[None, :] + offsets[:, None]).reshape(-1)  # step by step, region by region
    counts = np.repeat(lengths, len(bases))
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts, counts) + within


class Regions:
    """First-fit allocation of row ranges of the store (row 0 is never handed out)."""

    def __init__(self, rows: int) -> None:
        self.starts = [1]
        self.sizes = [rows - 1]

    def take(self, rows: int) -> int | None:
        for i, size in enumerate(self.sizes):
            if size >= rows:
                start = self.starts[i]
                if size == rows:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += rows
                    self.sizes[i] -= rows
                return start
        return None

    def give(self, start: int, rows: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.sizes.insert(i, rows)
        if i + 1 < len(self.starts) and start + rows == self.starts[i + 1]:  # merge the next
            self.sizes[i] += self.sizes.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == start:  # merge into the previous
            self.sizes[i - 1] += self.sizes.pop(i)
            self.starts.pop(i)

    def free_rows(self) -> int:
        return sum(self.sizes)
