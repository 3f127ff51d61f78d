"""The worker's side of taps: the operations on each tapped module, and their tables.

Installed right after vLLM loads the model and before it compiles the forward or
captures a CUDA graph, so every compiled and graphed step contains the
operations. The tables are allocated once and never replaced (a CUDA graph holds
their addresses); before each step only their contents change:

- ``slots[site, row]``: the bank row to add at that tap to that token row of the
  step's slab, or -1 (most rows, always the padding);
- ``bank[entry]``: one steering vector per lowered request, in float32;
- ``codes[site, row]`` and ``dest[site, row]``: what to keep of that row at that
  tap (``ops.keep``; 0 for nothing), and where in the store (``kept.py``).

All three are views of one ``[row, table, site]`` tensor.

The rows a step's requests occupy come from the runner adapter (``seams.Runner.rows``:
V1's persistent batch, or the batch V2 builds for the step; the same reading as
the Python path's). The three tables are one tensor, staged on
the host (double-buffered, so filling the next step never races the upload of
the last one) and uploaded in one copy; nothing is uploaded while no request is
lowered. Each lowered request's per-step state lives in arrays indexed by its
entry, so a step's fill is a handful of array operations whatever the number of
requests. A decode step that repeats the last one (the same requests in the same
rows, none added or taken off, each still inside or outside its window, none
keeping rows at a new place) would write the same table: its fill only counts the
step, and nothing is uploaded (``_Repeat``).
"""

from __future__ import annotations

import ast
import logging
from types import SimpleNamespace
from typing import Any, NamedTuple

import numpy as np
import torch

from ..settings import BREAK_AT_TAPS, SPLIT_AT_TAPS, value
from . import ops, source
from .broken import BrokenGraph
from .kept import (
    Lowered,
    Regions,
    kept_saves,
    layers_saves,
    picks_a_row,
    read_together,
    rows_kept,
    single_read,
    store_rows,
)
from .spec import LAYER_LISTS, LAYERS, engine_taps, input_site, kernel_chosen, resolve, split_site

logger = logging.getLogger("vllm_nnsight_plugin")

__all__ = ["Lowered", "TapTables", "install"]

_NEVER = np.iinfo(np.int64).max  # the stop of ``tracer.all()``
#: The row of each step a keep of one row picks (``<kept>[-1]``, ``<kept>[0]``) -> its code.
_PICKS = {-1: 1, 0: 2}
#: An edit of each step's last k rows (``hidden[-k:]``), or of row p of a step
#: (a patch of the prompt's rows, on the first step).
_LAST_ROWS, _ROW = 3, 4


class _Repeat:
    """What a fill wrote the table from, where the next step's table would be the
    same if nothing here changed: a decode step (one row a request, not anyone's
    first). Entries that steer, or keep each step's rows over the last step's
    (``_ring``), write the same table again; an entry that keeps its row at a
    place that moves with the step (``moves``) writes only that place anew."""

    __slots__ = ("changes", "req_ids", "bounds", "entries", "live", "kept", "moves")

    def __init__(
        self,
        changes: int,
        req_ids: tuple,
        bounds: np.ndarray,
        entries: np.ndarray,
        live: np.ndarray,
        kept: int,
        moves: _Moves | None,
    ) -> None:
        self.changes = changes  # ``TapTables._changes`` when it was written
        self.req_ids, self.bounds = req_ids, bounds.copy()
        self.entries = entries  # every entry the step counted (a request's extra sites too)
        self.live = live  # which of them were inside their window
        self.kept = kept  # rows it added to ``kept_rows``
        self.moves = moves


class _Moves(NamedTuple):
    """The keeps of a repeatable step whose place moves with the step: each kept
    row's cell in the table (``rows``, ``sites``), its entry, whether the step's
    pick chose it, and the entries whose count of kept rows advances (not a ring)."""

    rows: np.ndarray
    sites: np.ndarray
    entries: np.ndarray
    chosen: np.ndarray
    advancing: np.ndarray


def _row_of(index: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Python's row ``index`` of a step of ``counts`` rows (-1 where it has none)."""
    found = np.where(index >= 0, index, counts + index)
    return np.where((found >= 0) & (found < counts), found, -1)


def _pick(lowered: Lowered) -> tuple[int, int]:
    """(which rows of each step, k of the last k or the row p) for a request's entries."""
    if not picks_a_row(lowered):
        return 0, 0
    if type(lowered.select) is slice:
        return _LAST_ROWS, -lowered.select.start
    if lowered.select in _PICKS:
        return _PICKS[lowered.select], 0
    return _ROW, lowered.select


def _put(rows: torch.Tensor, host: torch.Tensor | None, slot: int, value: torch.Tensor) -> None:
    """Write ``value`` (any float dtype, any device) into row ``slot`` of ``rows``.

    From the host, through the row's pinned copy ``host`` and an upload that does
    not wait: the row it overwrites is no request's (a row is taken again only
    once its request is gone), and the steps that read it are queued after the
    upload. On the device already, a copy queued like any kernel."""
    value = value.detach().reshape(-1)
    if host is None or value.device.type != "cpu":
        rows[slot].copy_(value)
        return
    host[slot].copy_(value)
    rows[slot].copy_(host[slot], non_blocking=True)


class TapTables:
    """The per-row tables every tap reads, and the requests lowered onto them."""

    def __init__(
        self,
        sites: tuple[str, ...],
        max_tokens: int,
        hidden: int,
        entries: int,
        device: Any,
        dtype: torch.dtype = torch.float32,
        tuple_sites: frozenset[int] | None = None,
        store_size: int | None = None,
        one_op: bool = False,
        bank_rows: int | None = None,
    ):
        self.sites = sites
        self.site_of = {path: i for i, path in enumerate(sites)}
        #: Sites whose module's forward returns a tuple, by its source: only there
        #: is ``output[0]`` the whole hidden state a lowered block means.
        self.returned_tuples = frozenset(range(len(sites))) if tuple_sites is None else tuple_sites
        #: the tuple sites whose value is always exactly (hidden, residual) (set at install)
        self.returned_pairs = self.returned_tuples
        #: Sites whose every call in their parent's forward is unpacked into two
        #: names (``source.unpacked_in_two``; set at install): a sequence of two
        #: values, a pair or (value, None) by what the tap has seen (``ops.passed``).
        self.two_sites: frozenset[int] = frozenset()
        #: a module's path -> the sites of the values its parent hands it, in order
        #: (``<module>.inputs`` taps; set at install)
        self.inputs: dict[str, tuple[int, ...]] = {}
        #: a module's path -> where its parent's forward first calls it (line,
        #: column), for modules whose inputs are served (set at install)
        self.reached: dict[str, tuple[int, int]] = {}
        #: a child module's path -> the operation site whose value its parent's forward
        #: hands it as its one input (``source.handed_to``; set at install)
        self.handed: dict[str, int] = {}
        self.hidden = hidden
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        # Row-major by token row, so the rows [0, n) a step uses are one contiguous
        # block (an asynchronous upload from pinned memory); the ops read
        # ``[site, row]`` views of it.
        table = torch.zeros((max_tokens, 3, len(sites)), dtype=torch.int32, device=self.device)
        table[:, 0].fill_(-1)
        self.table = self._table = table  # the tap operation reads the three tables as one
        #: each tap runs as ``ops.tap`` (one kernel on CUDA) rather than ``steer`` and ``keep``
        self.one_op = one_op
        #: the compiled graph is split at each tap (``seams.split_graph_at``; set at install)
        self.split = False
        #: its graphs of the whole forward are also captured broken at the taps (``seams.break_at_taps``)
        self.broken = False
        self.slots, self.codes, self.dest = (table[:, part].t() for part in range(3))
        ops.forget_seen(self.slots, self.codes)
        ops.quiet(table, None)
        #: the sites the last step's entries touch (``fill``); told to the taps once
        #: ``only_filled`` says ``fill`` is all that writes the table
        self._busy = np.zeros(len(sites), dtype=bool)
        self._told = False
        # One row of the bank per steering request (its entries at several sites
        # share it); a keep takes entries and no row.
        bank_rows = entries if bank_rows is None else bank_rows
        self.bank = torch.zeros((bank_rows, hidden), dtype=torch.float32, device=self.device)
        #: per bank row: which edit it makes, and the edit's bounds (``ops.steer``)
        self.how = torch.zeros((bank_rows, 4), dtype=torch.float32, device=self.device)
        #: pinned copies of both, from which a request's rows go up without waiting:
        #: a copy from pageable memory waits for all the device work queued before it,
        #: so each steering request admitted would stall the step in flight
        self._bank_host = self.bank.cpu().pin_memory() if cuda else None
        self._how_host = self.how.cpu().pin_memory() if cuda else None
        self.bank_free = list(range(bank_rows - 1, -1, -1))
        memory = torch.cuda.get_device_properties(self.device).total_memory if cuda else 0
        rows = store_size or store_rows(hidden * dtype.itemsize, cuda, memory)
        self.store = torch.zeros((rows, hidden), dtype=dtype, device=self.device)
        self.regions = Regions(rows)
        self._staging = [table.cpu().pin_memory() if cuda else table.clone() for _ in range(2)]
        self._turn = 0
        self._dirty = [0, 0]  # per staging buffer: rows [0, n) may hold entries
        self._uploaded = 0  # the device table may hold entries in rows [0, n)
        # per entry (a lowered request), indexed by Lowered.entry
        self._kind = np.zeros(entries, dtype=np.int64)  # which table: 0 slots, 1 codes
        self._site = np.zeros(entries, dtype=np.int64)
        self._value = np.zeros(entries, dtype=np.int32)  # the slot (= entry) or the code
        self._start = np.zeros(entries, dtype=np.int64)
        self._stop = np.zeros(entries, dtype=np.int64)
        self._steps = np.zeros(entries, dtype=np.int64)  # forwards the request has been in
        self._base = np.zeros(entries, dtype=np.int64)  # its region of the store
        self._done = np.zeros(entries, dtype=np.int64)  # rows kept so far
        self._room = np.zeros(entries, dtype=np.int64)  # rows its region holds
        self._stride = np.ones(entries, dtype=np.int64)  # store rows per kept token row
        self._first = np.zeros(entries, dtype=np.int64)  # rows of its first forward
        # keeps or edits all its rows (0), the last (1), the first (2), the last k (3), row p (4)
        self._pick = np.zeros(entries, dtype=np.int64)
        self._last = np.zeros(entries, dtype=np.int64)  # the k of the last k rows, or the row p
        #: keeps each step's rows at the start of its region, over the last step's
        #: (a block served them at the sampler: ``replay.py``)
        self._ring = np.zeros(entries, dtype=bool)
        self.free = list(range(entries - 1, -1, -1))
        self.requests: dict[str, Lowered] = {}
        self._entry_of: dict[str, int] = {}
        #: a request steering several sites: its entries beyond the first
        self._also_of: dict[str, np.ndarray] = {}
        self._per_entry = (
            self._kind,
            self._site,
            self._value,
            self._start,
            self._stop,
            self._steps,
            self._base,
            self._done,
            self._room,
            self._stride,
            self._first,
            self._pick,
            self._last,
            self._ring,
        )
        self._lowered: list[Lowered | None] = [None] * entries
        self.kept_rows = 0
        #: entries added or given back so far: a repeated fill holds only while none was
        self._changes = 0
        self._repeat: _Repeat | None = None
        #: fills that repeated the last one (nothing written, nothing uploaded)
        self.repeated = 0

    # ------------------------------------------------------------ requests
    def add(
        self,
        request_id: str,
        lowered: Lowered,
        vector: torch.Tensor | None = None,
        room: int = 0,
        also: tuple[int, ...] = (),
        how: tuple[float, ...] = (0.0, 0.0, 0.0),
        residual: torch.Tensor | None = None,
    ) -> bool:
        """Put a request on the tables; False when there is no room (it runs as Python).

        A steering block brings its ``vector``; a keeping block needs ``room``
        rows of the store (all its request can produce). ``also``: other sites a
        steering block adds the same vector at, or a keeping block (or one served
        at the sampler, ``replay.py``) keeps, in a region of ``room`` rows each,
        each an entry of its own.
        """
        if request_id in self.requests or len(self.free) < 1 + len(also):
            return False
        if vector is not None and len(self.bank_free) < 1 + (residual is not None):
            return False
        if also and lowered.code and lowered.single:
            return False  # a read on the first step names one tap
        if lowered.code:
            bases = [self.regions.take(room) if room > 0 else None for _ in range(1 + len(also))]
            if None in bases:
                for base in bases:
                    if base is not None:
                        self.regions.give(base, room)
                return False
            lowered.base, lowered.rows = bases[0], room
            lowered.regions = tuple(zip((lowered.site, *also), bases))
        self._changes += 1
        entry = lowered.entry = self.free.pop()
        if vector is not None:
            slot = lowered.slot = self.bank_free.pop()
            _put(self.bank, self._bank_host, slot, vector)
            if how[0] == ops.PATCH:  # the rows its values are in: its own, and one for the residual
                if residual is not None:
                    lowered.slot2 = self.bank_free.pop()
                    _put(self.bank, self._bank_host, lowered.slot2, residual)
                how = (ops.PATCH, slot if how[1] >= 0 else -1, lowered.slot2)
            elif how[0] == ops.PATCH_COLUMNS:  # its columns' values are in its own row
                how = (ops.PATCH_COLUMNS, slot, *how[2:])
            _put(
                self.how,
                self._how_host,
                slot,
                torch.tensor((*how, 0.0, 0.0, 0.0, 0.0)[:4], dtype=torch.float32),
            )
        self._kind[entry] = 1 if lowered.code else 0
        self._site[entry] = lowered.site
        self._value[entry] = lowered.code or lowered.slot
        self._start[entry] = lowered.start
        self._stop[entry] = _NEVER if lowered.stop is None else lowered.stop
        self._steps[entry] = self._done[entry] = self._first[entry] = 0
        self._base[entry], self._room[entry] = lowered.base, lowered.rows
        self._stride[entry] = self._stride_at(lowered, lowered.site)
        self._pick[entry], self._last[entry] = _pick(lowered)
        self._ring[entry] = lowered.replay
        self.requests[request_id] = lowered
        self._entry_of[request_id] = entry
        self._lowered[entry] = lowered
        if also:
            more = self._also_of[request_id] = np.array([self.free.pop() for _ in also], dtype=np.int64)
            for extra, site in zip(more, also):
                for array in self._per_entry:
                    array[extra] = array[entry]
                self._site[extra] = site
                self._stride[extra] = self._stride_at(lowered, site)
                if lowered.code:  # a keep: its own region
                    self._base[extra] = dict(lowered.regions)[site]
                self._lowered[extra] = lowered
        return True

    def _two(self, passed: int) -> frozenset[int]:
        return frozenset(s for s in self.two_sites if ops.passed(self.codes, s) == passed)

    @property
    def tuple_sites(self) -> frozenset[int]:
        """Sites whose value is a tuple led by the hidden state: by their source, or
        two values by their parent's calls that the tap has seen."""
        if not self.two_sites:
            return self.returned_tuples
        return self.returned_tuples | self._two(ops.PAIR) | self._two(ops.FIRST)

    @property
    def pair_sites(self) -> frozenset[int]:
        """The tuple sites whose value is exactly (hidden, residual)."""
        return self.returned_pairs | self._two(ops.PAIR) if self.two_sites else self.returned_pairs

    @property
    def first_sites(self) -> frozenset[int]:
        """Sites whose value is (value, None), as their parent's calls and the tap tell."""
        return self._two(ops.FIRST) if self.two_sites else frozenset()

    def served_whole(self, site: int) -> bool:
        """Whether the rows a tap keeps are its whole value, as a block reads it: a
        (hidden, residual) pair, or one tensor of any width (a module's output, an
        MLP's neurons, or an operation's value that a child is handed)."""
        if site in self.pair_sites:
            return True
        if site in self.first_sites:  # (value, None): its value is kept as one tensor
            return self._fits(site, any_width=True)
        return site not in self.tuple_sites and self.means(site, whole=True, any_width=True)

    def width(self, site: int) -> int:
        """The width of the tap's value, once it has run (the hidden size until then)."""
        value = ops.seen(self.slots, site)
        return value[0][-1] if value is not None and len(value[0]) == 2 else self.hidden

    def replay_stride(self, site: int) -> int:
        """Rows of the store a served block's token row takes at a tap: both values,
        each over as many rows as its width needs (``ops.chunks``)."""
        return 2 * ops.chunks(self.width(site), self.store.shape[-1])

    def _stride_at(self, lowered: Lowered, site: int) -> int:
        return self.replay_stride(site) if lowered.replay else lowered.stride

    def means(self, site: int, whole: bool, any_width: bool = False) -> bool:
        """Whether a block's reading of the tap is what the operations see there.

        ``whole``: the block uses ``output`` itself (a module returning a tensor, or
        an operation); otherwise ``output[0]``/``output[1]`` (a tuple-returning
        forward, whose first value is the hidden state); ``any_width``: a value of
        another width than the hidden state's will do. A tensor's width is only
        known once it has run through the tap (``ops.seen``: the engine's first
        forward, which a GPU engine runs before it serves and an eager CPU engine
        with its first step); until then such blocks run as Python. What ran must
        be one row per token, as wide as the bank, in the store's dtype, and have
        come through the tap as the block reads it (a pair, or one tensor:
        ``ops.passed``; a tuple without a second tensor keeps nothing).
        """
        if whole == (site in self.tuple_sites):
            return False
        value = ops.seen(self.slots, site)
        if value is None:
            return not whole
        if ops.passed(self.codes, site) != (ops.ONE if whole else ops.PAIR):
            return False
        return self._fits(site, any_width)

    def _fits(self, site: int, any_width: bool) -> bool:
        """Whether the value the tap last had is one row per token, as wide as the
        bank (or ``any_width``), in the store's dtype."""
        value = ops.seen(self.slots, site)
        if value is None:
            return False
        shape, dtype = value
        return len(shape) == 2 and (any_width or shape[1] == self.hidden) and dtype == self.store.dtype

    def forget(self, request_id: str) -> tuple[Lowered, int] | None:
        """Take a request off the tables: its entry and how many forwards it was in."""
        lowered = self.requests.pop(request_id, None)
        if lowered is None:
            return None
        self._give_back(request_id, lowered)
        return lowered, self._state(lowered)[0]

    def retire(self, request_id: str) -> None:
        """A request finished: its entries and bank row go back now, so that the
        requests after it find room while its kept rows wait in its region until
        they are read (:meth:`saves`, then :meth:`release`)."""
        lowered = self.requests.get(request_id)
        if lowered is not None and lowered.retired is None:
            self._give_back(request_id, lowered)

    def _give_back(self, request_id: str, lowered: Lowered) -> None:
        if lowered.retired is not None:
            return
        self._changes += 1
        entry = self._entry_of.pop(request_id)
        lowered.retired = (int(self._steps[entry]), int(self._done[entry]), int(self._first[entry]))
        for each in (entry, *self._also_of.pop(request_id, ())):
            self._lowered[each] = None
            self.free.append(each)
        for slot in (lowered.slot, lowered.slot2):
            if slot >= 0:
                self.bank_free.append(slot)
        lowered.slot = lowered.slot2 = -1

    def _state(self, lowered: Lowered) -> tuple[int, int, int]:
        """(forwards, rows kept, rows of its first forward) of a request."""
        if lowered.retired is not None:
            return lowered.retired
        entry = lowered.entry
        return int(self._steps[entry]), int(self._done[entry]), int(self._first[entry])

    def steps(self, request_id: str) -> int:
        """How many forwards a lowered request has been in (this step's included)."""
        return self._state(self.requests[request_id])[0]

    def _counted(self, lowered: Lowered, counted: int | None) -> tuple[int, int, int]:
        """:meth:`_state`, cut to the first ``counted`` forwards where vLLM threw
        the later ones' samples away."""
        steps, done, first = self._state(lowered)
        if counted is not None and counted < steps:
            steps, done = counted, rows_kept(lowered, counted, first)
        return steps, done, first

    def saves(self, lowered: Lowered, counted: int | None = None) -> dict[str, Any]:
        """What a request's lowered block kept (read before :meth:`release`), in its
        first ``counted`` forwards where vLLM threw the later ones' samples away."""
        steps, done, first = self._counted(lowered, counted)
        if len(lowered.regions) > 1 and not lowered.replay:
            return layers_saves(lowered, self.store, steps, done, first)
        return kept_saves(lowered, self.store, steps, done, first)

    def reads(self, taken: list[tuple[Lowered, int | None]]) -> dict[int, dict[str, Any]]:
        """:meth:`saves` of the single reads among ``taken`` (``(lowered, counted)``),
        gathered in one copy (``kept.read_together``), by ``id`` of each lowered;
        the others are not here (ask :meth:`saves`)."""
        wanted = []
        for lowered, counted in taken:
            if (len(lowered.regions) > 1 and not lowered.replay) or self.overflowed(lowered):
                continue
            done = self._counted(lowered, counted)[1]
            if single_read(lowered, done):
                wanted.append((lowered, done))
        if len(wanted) < 2:
            return {}
        found = read_together(self.store, wanted)
        return {id(lowered): saves for (lowered, _), saves in zip(wanted, found, strict=True)}

    def release(self, lowered: Lowered) -> None:
        """Give a forgotten request's region of the store back (its rows were read)."""
        if lowered.code and lowered.rows:
            for _, base in lowered.regions or ((lowered.site, lowered.base),):
                self.regions.give(base, lowered.rows)
            lowered.rows = 0

    def overflowed(self, lowered: Lowered) -> bool:
        """Whether the request had more rows than its region (its rows were dropped)."""
        return bool(lowered.code) and self._state(lowered)[1] * lowered.stride > lowered.rows

    # ------------------------------------------------------------ each step
    def fill(self, req_ids: list[str], bounds: Any) -> None:
        """Point this step's rows at their requests' entries, then upload.

        ``req_ids`` are the step's requests in row order and ``bounds`` their
        row offsets (``len(req_ids) + 1`` of them).
        """
        bounds = np.asarray(bounds, dtype=np.int64)
        if self._repeats(req_ids, bounds):
            self.repeated += 1
            moves = self._repeat.moves
            if moves is not None:
                self._move(moves)
            return
        staging = self._staging[self._turn]
        table = staging.numpy()
        dirty = self._dirty[self._turn]
        if dirty:
            table[:dirty, 0] = -1
            table[:dirty, 1:] = 0
        self._busy[:] = False
        used = self._place(table, req_ids, bounds)
        self._dirty[self._turn] = used
        rows = max(used, self._uploaded)
        if rows:
            self._table[:rows].copy_(staging[:rows], non_blocking=True)
            self._turn ^= 1
        self._uploaded = used
        if self._told:
            ops.quiet(self._table, (~self._busy).tolist())

    def _repeats(self, req_ids: Any, bounds: np.ndarray) -> bool:
        """Whether this step's table is the last fill's (``_Repeat``); if so, the
        step is counted as ``_place`` counts it."""
        last = self._repeat
        if last is None or last.changes != self._changes or not np.array_equal(bounds, last.bounds):
            return False
        if tuple(req_ids) != last.req_ids:
            return False
        entries = last.entries
        steps = self._steps[entries]
        if not np.array_equal((self._start[entries] <= steps) & (steps < self._stop[entries]), last.live):
            return False
        self._steps[entries] = steps + 1
        self.kept_rows += last.kept
        return True

    def _move(self, moves: _Moves) -> None:
        """A repeated step's table: the last one's, with each moving keep's place
        advanced as ``_place`` advances it (a row a step), uploaded."""
        kept = moves.entries
        stride = self._stride[kept]
        place = self._done[kept] * stride
        fits = moves.chosen & (place + stride <= self._room[kept])
        staging = self._staging[self._turn]
        table = staging.numpy()
        used = self._uploaded
        table[:used] = self._staging[self._turn ^ 1].numpy()[:used]  # the last step's table
        table[moves.rows, 2, moves.sites] = np.where(fits, self._base[kept] + place, 0)
        self._dirty[self._turn] = max(self._dirty[self._turn], used)
        self._table[:used].copy_(staging[:used], non_blocking=True)
        self._turn ^= 1
        self._done[moves.advancing] += 1

    def only_filled(self) -> None:
        """From now on only ``fill`` writes the table: the taps, where they run from
        Python, may then copy the value at each site the step's entries leave alone
        (``ops.quiet``), which with no entry yet is every site."""
        self._told = True
        ops.quiet(self._table, (~self._busy).tolist())

    def _place(self, table: np.ndarray, req_ids: list[str], bounds: np.ndarray) -> int:
        """Write this step's entries into ``table``; the rows used."""
        self._repeat = None
        get = self._entry_of.get
        found = np.fromiter((get(r, -1) for r in req_ids), dtype=np.int64, count=len(req_ids))
        rows = np.flatnonzero(found >= 0)
        if not rows.size:
            return 0
        entries = found[rows]
        if self._also_of:  # requests at several sites: one more (row, entry) per site
            also = self._also_of.get
            found_also = [(row, more) for row in rows.tolist() if (more := also(req_ids[row])) is not None]
            if found_also:  # one array operation per request, not one per site
                extra_rows = np.repeat([row for row, _ in found_also], [len(more) for _, more in found_also])
                rows = np.concatenate([rows, extra_rows])
                entries = np.concatenate([entries, *(more for _, more in found_also)])
        steps = self._steps[entries]
        self._steps[entries] = steps + 1
        counts = bounds[rows + 1] - bounds[rows]
        self._first[entries[steps == 0]] = counts[steps == 0]
        live = (self._start[entries] <= steps) & (steps < self._stop[entries])
        counted, in_window = entries, live
        if not live.any():
            self._remember(req_ids, bounds, counted, in_window, counts, steps, 0)
            return 0
        entries, starts, counts, steps = entries[live], bounds[rows[live]], counts[live], steps[live]
        odd = (counts != 1) & (steps > 0)
        for entry, step, count in zip(entries[odd], steps[odd], counts[odd]):
            self._lowered[entry].irregular[int(step)] = int(count)
        # one index per token row: the entry it belongs to, its row in the slab,
        # and its place among the entry's rows of this step
        total = int(counts.sum())
        each = np.repeat(entries, counts)
        offsets = np.repeat(np.cumsum(counts) - counts, counts)
        within = np.arange(total, dtype=np.int64) - offsets
        slab = np.repeat(starts, counts) + within
        kind, site, pick = self._kind[each], self._site[each], self._pick[each]
        self._busy[site] = True
        chosen = None
        if pick.any():  # blocks on one row of each step: the last, or the first
            before_end = np.repeat(counts, counts) - within  # 1 on a step's last row
            chosen = (
                (pick == 0)
                | ((pick == 1) & (before_end == 1))
                | ((pick == 2) & (within == 0))
                | ((pick == 3) & (before_end <= self._last[each]))
                | ((pick == 4) & (within == _row_of(self._last[each], np.repeat(counts, counts))))
            )
        if chosen is None:
            table[slab, kind, site] = self._value[each]
        else:  # a steer of one row leaves the others' slots at -1
            written = (kind == 1) | chosen
            table[slab[written], kind[written], site[written]] = self._value[each[written]]
        keeping = kind == 1
        moves = None
        if keeping.any():
            kept = each[keeping]
            stride, pick, row = self._stride[kept], pick[keeping], within[keeping]
            # a keep of one row of each step keeps that row only; the rest go to row 0
            if chosen is None:
                chosen = np.ones(total, dtype=bool)
            chosen = chosen[keeping]
            place = (self._done[kept] + np.where(pick == 0, row, 0)) * stride
            fits = chosen & (place + stride <= self._room[kept])
            table[slab[keeping], 2, site[keeping]] = np.where(fits, self._base[kept] + place, 0)
            mine = self._kind[entries] == 1  # entries appear once each: add per entry
            added = np.where(self._pick[entries] == 0, counts, 1)[mine]
            self._done[entries[mine]] += np.where(self._ring[entries[mine]], 0, added)
            self.kept_rows += int(added.sum())
            moving = ~self._ring[kept]
            if moving.any():  # (a repeat of this step moves these places on, ``_move``)
                advancing = entries[mine][~self._ring[entries[mine]]]
                moves = _Moves(
                    slab[keeping][moving], site[keeping][moving], kept[moving], chosen[moving], advancing
                )
        self._remember(
            req_ids,
            bounds,
            counted,
            in_window,
            counts,
            steps,
            int(added.sum()) if keeping.any() else 0,
            moves,
        )
        return int((starts + counts).max())

    def _remember(
        self,
        req_ids: Any,
        bounds: np.ndarray,
        counted: np.ndarray,
        in_window: np.ndarray,
        counts: np.ndarray,
        steps: np.ndarray,
        kept: int,
        moves: _Moves | None = None,
    ) -> None:
        """Keep what this fill wrote from where the next step may repeat it
        (``_Repeat``): a decode step past everyone's first forward."""
        if (counts != 1).any() or (steps == 0).any():
            return
        self._repeat = _Repeat(self._changes, tuple(req_ids), bounds, counted, in_window, kept, moves)

    def idle(self) -> bool:
        """Nothing lowered and nothing left in the device table: no fill, no upload."""
        return not self.requests and not self._uploaded

    def stats(self) -> dict[str, Any]:
        return {
            "taps": list(self.sites),
            "tap_operation": "one" if self.one_op else "steer and keep",
            "split_at_taps": self.split,
            "broken_at_taps": self.broken,
            "lowered_now": len(self.requests),
            "kept_rows": self.kept_rows,
            "kept_free_rows": self.regions.free_rows(),
            "fills_repeated": self.repeated,
        }


def install(runner: Any, model: Any) -> TapTables | None:
    """Put the operations on every tapped module of ``model``; None when the engine has no taps."""
    from .. import seams

    patterns = engine_taps(seams.config_of(runner))
    if not patterns:
        return None
    sites = _sites(model, patterns)
    if not sites:
        return None
    max_tokens, hidden, max_seqs, device = seams.tap_table_sizes(runner)
    outputs = [i for i, site in enumerate(sites) if input_site(site) is None and split_site(site)[1] is None]
    tuples = frozenset(i for i in outputs if returns_tuple(type(model.get_submodule(sites[i]))))
    tables = TapTables(
        sites,
        max_tokens,
        hidden,
        (2 * max_seqs + 16) * len(sites),  # every running request at every tap (a probe)
        device,
        seams.model_dtype(runner),
        tuples,
        one_op=kernel_chosen(seams.config_of(runner)),
        bank_rows=2 * max_seqs + 16,
    )
    tables.returned_pairs = frozenset(
        i for i in tuples if returns_tuple(type(model.get_submodule(sites[i])), exactly=2)
    )
    tables.two_sites = frozenset(i for i in outputs if i not in tuples and _unpacked_in_two(model, sites[i]))
    by_module, tables.handed, tables.inputs = _served_by(model, sites)
    tables.reached = _first_calls(model, [*tables.handed, *tables.inputs, *(sites[i] for i in outputs)])
    tables.only_filled()
    for path in dict.fromkeys([*by_module, *tables.inputs]):  # in model order
        _tap(model.get_submodule(path), by_module.get(path, {}), tables, tables.inputs.get(path, ()))
    # Where the operator asks, and vLLM splits the compiled graph (at attention),
    # split it at each tap too, so blocks at the taps run between the pieces' graph
    # replays (``worker/live.py``); every step that replays pieces then runs the
    # taps as Python, which costs prefills (``benchmarks/RESULTS.md``).
    tables.split = (
        tables.one_op
        and bool(value(SPLIT_AT_TAPS))
        and seams.split_graph_at(seams.config_of(runner), ops.SPLITTING)
    )
    # Elsewhere a GPU engine that replays one graph of the whole forward for a
    # decode batch also captures that graph broken at the taps, for the steps
    # whose blocks run there (``broken.py``); plain steps keep the whole graph.
    tables.broken = (
        tables.one_op
        and not tables.split
        and bool(value(BREAK_AT_TAPS))
        and seams.break_at_taps(runner, BrokenGraph)
    )
    logger.info(
        "vllm-nnsight: taps on %d site(s)%s: %s",
        len(sites),
        ", the compiled graph split at each"
        if tables.split
        else ", graphs also captured broken at each"
        if tables.broken
        else "",
        ", ".join(sites),
    )
    return tables


def _served_by(
    model: Any, sites: tuple[str, ...]
) -> tuple[dict[str, dict[str | None, int]], dict[str, int], dict[str, tuple[int, ...]]]:
    """Which sites each module's taps are: by module, its output's (key None) and
    its operations'; ``<child>.input`` -> the operation site whose value the
    child's parent hands it; a module's path -> the sites of the values it is handed."""
    by_module: dict[str, dict[str | None, int]] = {}
    handed: dict[str, int] = {}
    handed_to: dict[str, list[int]] = {}
    for i, site in enumerate(sites):
        found = input_site(site)
        if found is not None:  # a value the module is handed: its input taps, in order
            handed_to.setdefault(found[0], []).append(i)
            continue
        path, operation = split_site(site)
        by_module.setdefault(path, {})[operation] = i
        # ``<child>.input`` where an operation's value is handed to it
        child = None if operation is None else source.handed_to(type(model.get_submodule(path)), operation)
        if child is not None:
            handed[f"{path}.{child}"] = i
    return by_module, handed, {path: tuple(found) for path, found in handed_to.items()}


def served_locations(model: Any, patterns: tuple[str, ...]) -> Any:
    """What an engine built with ``patterns`` serves at its taps, read off a model
    of the same classes (the client's meta model): the ``site_of``, ``handed`` and
    ``inputs`` the lowering reads of :class:`TapTables`, without the tables."""
    sites = _sites(model, patterns) if patterns else ()
    _, handed, inputs = _served_by(model, sites)
    return SimpleNamespace(site_of={path: i for i, path in enumerate(sites)}, handed=handed, inputs=inputs)


def _sites(model: Any, patterns: tuple[str, ...]) -> tuple[str, ...]:
    """The sites ``patterns`` name on ``model``, in model order."""
    if patterns == (LAYERS,):
        return _decoder_layers(model)
    return resolve(
        patterns,
        (name for name, _ in model.named_modules()),
        source.operations_in(model),
        source.handed_in(model),
    )


def _first_calls(model: Any, paths: list[str]) -> dict[str, tuple[int, int]]:
    """Where each module's parent first calls it in its forward's source: siblings
    are reached in the order of their calls, not the order the parent made them in
    (``o_proj`` is made before ``attn`` and called after it)."""
    found = {}
    for path in paths:
        parent, _, child = path.rpartition(".")
        place = source.first_call(type(model.get_submodule(parent)), child) if parent else None
        if place is not None:
            found[path] = place
    return found


def _unpacked_in_two(model: Any, site: str) -> bool:
    """Whether a module's parent calls it only to unpack its value into two names."""
    path, operation = split_site(site)
    if operation is not None or "." not in path:
        return False
    parent, child = path.rsplit(".", 1)
    return source.unpacked_in_two(type(model.get_submodule(parent)), child)


def _decoder_layers(model: Any) -> tuple[str, ...]:
    """The sites of ``"layers"`` (the default on CUDA): every decoder layer whose
    forward returns the pair ``(hidden, residual)`` by its source. A model whose
    layers are elsewhere, or return something else, gets no taps: the word never
    stops an engine from starting, whatever the model."""
    try:
        sites = resolve((LAYERS,), (name for name, _ in model.named_modules()))
        kinds = {type(model.get_submodule(site)) for site in sites}
        paired = all(returns_tuple(kind, exactly=2) for kind in kinds)
    except Exception:  # noqa: BLE001 - a model this reading does not know: no taps
        logger.warning("vllm-nnsight: no taps: this model's decoder layers could not be read", exc_info=True)
        return ()
    if not sites:
        logger.info("vllm-nnsight: no taps: this model has no decoder layers at %s", ", ".join(LAYER_LISTS))
        return ()
    if not paired:
        logger.info("vllm-nnsight: no taps: this model's decoder layers do not return (hidden, residual)")
        return ()
    return sites


def returns_tuple(cls: type, exactly: int | None = None) -> bool:
    """Whether every ``return`` of the class's ``forward`` is a tuple display of two
    or more values (a decoder layer's ``return hidden_states, residual``), or of
    ``exactly`` that many, none of them ``None`` (``return hidden_states, None``
    has no second value to keep).

    Read from the source, so it holds for every call; anything unreadable or less
    certain is False, and blocks on that tap run as Python. A tapped module's class
    is read as the class it was made from (its forward returns what that one does).
    """
    cls = cls.__dict__.get(_BASE, cls)
    try:
        function = source.forward_definition(cls)
    except source.SourceTapError:
        return False
    returns: list[ast.Return] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
                continue  # their returns are not this forward's
            if isinstance(child, ast.Return):
                returns.append(child)
            visit(child)

    visit(function)
    return bool(returns) and all(
        isinstance(r.value, ast.Tuple)
        and len(r.value.elts) >= 2
        and (exactly is None or len(r.value.elts) == exactly)
        and not any(isinstance(e, ast.Starred) for e in r.value.elts)
        and not any(isinstance(e, ast.Constant) and e.value is None for e in r.value.elts)
        for r in returns
    )


def _tap(module: Any, sites: dict[str | None, int], tables: TapTables, inputs: tuple[int, ...] = ()) -> None:
    """Run the operations on the module's output (site key None) and on the named
    operations of its forward.

    The module's class is swapped for a subclass whose ``forward`` adds them, and
    the sites and tables are attributes of the module. Compiled code reads them
    from there on every call, so they stay reachable when nnsight later puts its
    own callable in the module's instance ``forward`` (a closure over the
    original would not: compiled code fetches a closure's cells through the
    instance's ``forward``).
    """
    module.__dict__[_SITES] = dict(sites)
    module.__dict__[_INPUT_SITES] = tuple(inputs)
    module.__dict__[_TABLES] = tables
    operations = frozenset(name for name in sites if name is not None)
    module.__class__ = _tapped_class(type(module), operations, None in sites, len(inputs))


_SITES = "_vllm_nnsight_tap_sites"
_INPUT_SITES = "_vllm_nnsight_tap_input_sites"
_TABLES = "_vllm_nnsight_tap_tables"
_TAPPED: dict[tuple[type, frozenset[str], bool, int], type] = {}
#: On a tapped module's class: the model's own class it was made from.
_BASE = "_vllm_nnsight_tapped_from"


def _apply(tables: TapTables, site: int, out: Any, in_place: bool = False) -> Any:
    """The tap operations on a value: a tensor, or a tuple led by the hidden state
    (whose second value, where it is a tensor, is kept beside it).

    ``in_place``: the value may be edited where it is (a module's output that is
    none of the values it was handed), which spares the copy of every row nobody
    touches. Otherwise, or where the graph is split at the taps, the tap writes a
    new tensor: an operation's result or a value handed to a module may be a view
    of something the forward reads again."""
    paired = isinstance(out, tuple) and len(out) >= 2 and isinstance(out[1], torch.Tensor)
    # (value, None): a linear layer's output without its bias, kept as one tensor
    first = isinstance(out, tuple) and len(out) == 2 and out[1] is None
    if tables.one_op:
        table, bank, how, store = tables.table, tables.bank, tables.how, tables.store
        # in place an idle row costs nothing; a graph split at the taps needs each
        # piece's output in a buffer of its own
        over = in_place and not tables.split
        if paired:  # the residual is patched in place (``out[1]`` is the same tensor after)
            if over:
                ops.tap_pair_in_place.default(out[0], out[1], table, bank, how, store, site)
                return out
            return (ops.tapped_pair(out[0], out[1], table, bank, how, store, site), *out[1:])
        value = out[0] if isinstance(out, tuple) else out
        keeps = (ops.FIRST if first else 0) if isinstance(out, tuple) else ops.ONE
        if over:
            value = ops.tapped_in_place(value, table, bank, how, store, site, keeps)
        else:
            value = ops.tapped(value, value, table, bank, how, store, site, keeps)
        return (value, *out[1:]) if isinstance(out, tuple) else value
    steer, keep = torch.ops.vllm_nnsight.steer, torch.ops.vllm_nnsight.keep
    if paired:
        hidden = torch.ops.vllm_nnsight.steer_pair(
            out[0], out[1], tables.slots, tables.bank, tables.how, site
        )
        keep(hidden, out[1], tables.codes, tables.dest, tables.store, site)
        return (hidden, *out[1:])
    if first:
        hidden = steer(out[0], out[0], tables.slots, tables.bank, tables.how, site)
        keep(hidden, hidden, tables.codes, tables.dest, tables.store, site, ops.FIRST)
        return (hidden, None)
    if isinstance(out, tuple):
        return (steer(out[0], out[0], tables.slots, tables.bank, tables.how, site), *out[1:])
    hidden = steer(out, out, tables.slots, tables.bank, tables.how, site)
    keep(hidden, hidden, tables.codes, tables.dest, tables.store, site)
    return hidden


class _OperationTap:
    """What a rewritten forward calls on each tapped operation's value.

    An object rather than a function: nnsight peels a forward's wrappers by the
    functions it calls from closure cells, and this must not look like one.
    """

    def __call__(self, module: Any, operation: str, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value  # a tuple or anything else passes untouched (never lowered)
        site = module.__dict__[_SITES].get(operation)
        return value if site is None else _apply(module.__dict__[_TABLES], site, value)


def _tapped_class(base: type, operations: frozenset[str], output: bool, inputs: int = 0) -> type:
    key = (base, operations, output, inputs)
    found = _TAPPED.get(key)
    if found is not None:
        return found
    inner = source.rewritten_forward(base, operations, _OperationTap()) if operations else base.forward
    if inputs:
        # The values the parent hands it (``self.attn(q, k, v)``), each through its
        # own tap before the forward sees them (only reads are served there).
        handed = inner

        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            tables, sites = self.__dict__[_TABLES], self.__dict__[_INPUT_SITES]
            args = tuple(
                _apply(tables, sites[i], arg) if i < len(sites) and isinstance(arg, torch.Tensor) else arg
                for i, arg in enumerate(args)
            )
            return handed(self, *args, **kwargs)

    if not output:
        forward = inner
    else:
        # Called by name from a closure cell: nnsight's ``.source`` sees through such a
        # wrapper (it instruments ``original`` and rebuilds the wrapper around it), so a
        # block reading a tapped module's operations finds the model's own, by the
        # same names as on an untapped engine.
        original = inner

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            value = out[0] if isinstance(out, tuple) and out else out
            handed = any(value is given for given in (*args, *kwargs.values()))
            return _apply(self.__dict__[_TABLES], self.__dict__[_SITES][None], out, in_place=not handed)

    found = _TAPPED[key] = type(
        base.__name__, (base,), {"forward": forward, "__module__": base.__module__, _BASE: base}
    )
    return found
