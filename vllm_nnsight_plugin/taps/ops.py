"""The operations at each tap: add each row's steering vector, keep each row asked for.

``torch.ops.vllm_nnsight.steer(hidden, second, slots, bank, how, site)`` returns
``hidden`` with each row whose slot is not -1 edited by its entry of the bank;
other rows are copied bit for bit. ``how[slot]`` says which edit (its first
value; the others are the edit's numbers):

- 0, an addition: ``bank[slot]`` added, as ``hidden[:] += vector`` does in a
  block: in float32, rounded once to ``hidden``'s dtype (the bank holds the
  vector's values exactly, in float32);
- 1 and 2, a direction ``u = bank[slot]`` (in ``hidden``'s dtype) removed or
  clamped: ``c = s @ u`` with ``s`` the row (1) or the row plus ``second``'s
  (2, the residual stream leaving a decoder layer), then
  ``hidden -= (c - c.clamp(how[slot, 1], how[slot, 2])) * u``, each operation
  rounded to ``hidden``'s dtype as a block's arithmetic in that dtype rounds
  (bounds of 0 and 0 remove the direction, as ``hidden -= c * u``). The tensor
  operations compute ``c`` for a request's rows together, as the block's own
  matrix product does (on a CPU, bit for bit); the kernel sums in float32 in
  its own order;
- 3 and 4, the value scaled or filled on columns ``how[slot, 2]`` up to
  ``how[slot, 3]``: ``hidden * how[slot, 1]`` (the number in float32, the
  product rounded to ``hidden``'s dtype, as ``hidden[:] *= s`` does), or
  ``how[slot, 1]`` itself (``hidden[:] = c``); the bank row is not read;
- 5, the row patched: set to ``bank[how[slot, 1]]`` and, on a pair, the
  residual's row to ``bank[how[slot, 2]]`` (-1: left as it is), each rounded
  once from float32 as ``x[p] = a`` rounds ``a``. Only ``steer_pair`` and
  ``tap_pair`` (the ops a (hidden, residual) pair's tap runs) write the
  residual, in place: declared as a mutation, so torch.compile keeps it where
  it is (Inductor writes into the residual's own buffer, no copy);
- 6, columns ``how[slot, 2]`` up to ``how[slot, 3]`` of the row patched: set to
  those columns of ``bank[how[slot, 1]]``, rounded once from float32
  (``x[p, a:b] = v``, a head's output put back).

``torch.ops.vllm_nnsight.keep(first, second, codes, dest, store, site)`` writes
row ``r`` of ``first`` (code 1), of ``second`` (code 2) or of ``first + second``
(code 3: the residual stream leaving a decoder layer, by the same addition a
block's ``hidden + residual`` runs) to ``store[dest[site, r]]``. Rows nobody
keeps have destination 0, a row of the store that is never read, so the
operation has one shape for every step and one store serves every tap. Code 4
keeps both outputs, ``first`` at ``dest`` and ``second`` in the row after it
(a ``tracer.cache`` of the tap: its whole output, every step).

A tap runs both as one operation. On a module's output (none of the values it
was handed) where the compiled graph is whole at the taps (the default) that is
``torch.ops.vllm_nnsight.tap_in_place(hidden, table, bank, how, store, site,
keeps)`` (``tap_pair_in_place`` for a (hidden, residual) pair), which edits
``hidden`` itself: the kernel does not touch a row nobody steers or keeps, and
torch.compile keeps the edit in the value's own buffer. On an operation's result
or a value handed to a module (either may be a view of a tensor the forward
reads again), and where the graph is split at the taps, it is
``torch.ops.vllm_nnsight.tap(hidden,
second, out, table, bank, how, store, site, keeps)``, which writes the new value
into ``out`` (:func:`tapped` allocates it just before, so the piece before the
tap owns that buffer and the piece after reads it where it was captured;
:data:`SPLITTING`), copying the rows it leaves alone. ``table`` is the
``[row, part, site]`` tensor the three tables are views of; ``keeps`` 0: steer only, 1: keep with
``second``, 2: keep with the steered value as the second, a tap whose value is
one tensor, 3: the same for the first of a pair whose second is ``None``, a
linear layer's ``(output, bias)``; ``keep``'s ``passed`` notes that one the
same way). On CUDA it can be one Triton kernel a
tap, one program a row, where a row nobody steers or keeps costs a read of its
table entry (in place) or one copy (into ``out``): as
two ops of plain tensor operations a tap costs about 15 small kernels, which
with every decoder layer tapped took 13-18% of an idle graphed step
(``benchmarks/RESULTS.md``, 2026-12-04); the kernel does the same arithmetic
(the float32 addition rounded once, the sum by the same rounding), and
``benchmarks/tap_kernels.py``, ``tests/gpu/test_gpu_kernel.py`` and, in Triton's
interpreter on a CPU, ``tests/unit/test_tap_kernel.py`` check it bit for bit, in
place and into ``out``. With it every decoder layer tapped costs an idle engine
nothing measurable (0.995-1.010 of stock on an H100), against 12-18% as tensor
operations. Elsewhere, or where Triton is missing, it runs ``steer`` and
``keep`` below. An engine built on CUDA with Triton runs its taps as this
operation unless ``VLLM_NNSIGHT_TAP_KERNEL=0``; other engines call ``steer``
and ``keep`` themselves unless it is ``1`` (``spec.kernel_chosen``: the choice
travels in the config the compile cache is keyed by).

While a graph of the whole forward is captured broken at the taps
(``broken.py``), each ``tap`` operation ends the graph being captured after its
kernel, and its hand-off to blocks at the taps (:func:`at_taps`) runs between
that graph and the next at every replay.

All are operations of a ``torch.library.Library`` with fake implementations, so
torch.compile keeps each whole (one opaque call in the graph) and a CUDA graph
records their kernels, which read the tables' current contents at every replay.
They are registered with the library directly rather than with ``custom_op``,
whose Python wrappers cost about 30 us a call on a 2-core CPU (1.9 us this
way): nothing where a graph replays them, but paid at every tap where they run
from Python (an eager engine, or a graph split at the taps). Where they run from
Python, a tap at a site no entry of the step's tables touches copies its value
and launches nothing else (:func:`quiet`).

A tap whose value is not as wide as the bank (an MLP's neurons, a projection's
output) takes the edits that read no bank row (3 and 4: scaled or filled on
columns; ``steer`` leaves its rows as they are for any other), and ``keep``
writes each of its rows over as many consecutive rows of the store as it needs
(:func:`chunks`; code 4's second value in the rows after them). ``steer``
notes each site's width and dtype when it runs (the engine's first forwards,
before any request), so lowering can check them (:func:`seen`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import broken

try:  # the kernel of a tap on CUDA; without Triton a tap runs as tensor operations
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - a build without Triton
    triton = None

NAMESPACE = "vllm_nnsight"

#: Holds the operations' registrations (they go with it).
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def _operation(mutates: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Any]:
    """Register a function as ``torch.ops.vllm_nnsight.<its name>``, its schema read
    from its annotations; the operation is what it returns."""

    def register(fn: Callable[..., Any]) -> Any:
        name = fn.__name__
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=mutates))
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        return getattr(torch.ops.vllm_nnsight, name)

    return register


def _fake(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The operation's shapes without running it (torch.compile's tracing)."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        torch.library.register_fake(f"{NAMESPACE}::{name}", fn, lib=_LIBRARY)
        return fn

    return register


#: What ``keep`` writes for a row, by code.
KEEP_FIRST, KEEP_SECOND, KEEP_SUM, KEEP_BOTH = 1, 2, 3, 4

_SEEN: dict[tuple[int, int], tuple[tuple[int, ...], torch.dtype]] = {}


def chunks(width: int, store_width: int) -> int:
    """Rows of the store one kept row of ``width`` values takes."""
    return max(1, -(-width // store_width))


def seen(slots: torch.Tensor, site: int) -> tuple[tuple[int, ...], torch.dtype] | None:
    """The shape and dtype of the value the tap at ``site`` last had, if it ran."""
    return _SEEN.get((slots.data_ptr(), site))


#: How each site's value last came through a tap, keyed by the codes table's
#: address: 1 a pair (the hidden state and a second tensor beside it), 2 one
#: tensor, 3 the first of a pair whose second is ``None`` (kept as one tensor);
#: 0 or absent, neither (a tuple with no second tensor: nothing is kept there).
_PASSED: dict[tuple[int, int], int] = {}
#: ``keeps`` of a tap (and what ``passed`` answers): a pair, one tensor, the first of (value, None).
PAIR, ONE, FIRST = 1, 2, 3


def passed(codes: torch.Tensor, site: int) -> int:
    """1 where the tap at ``site`` last ran on a pair, 2 on one tensor, 3 on the
    first of (value, None), 0 otherwise."""
    return _PASSED.get((codes.data_ptr(), site), 0)


def forget_seen(slots: torch.Tensor, codes: torch.Tensor | None = None) -> None:
    """Drop what was noted under the tables' addresses (new tables may reuse an old one's)."""
    for key in [key for key in _SEEN if key[0] == slots.data_ptr()]:
        del _SEEN[key]
    if codes is not None:
        for key in [key for key in _PASSED if key[0] == codes.data_ptr()]:
            del _PASSED[key]


#: Per table (by its address): for each site, whether no entry of the step the
#: host last wrote into the table touches it (``TapTables.fill``), so that a tap
#: there leaves its value as it is. Absent: every tap runs in full.
_QUIET: dict[int, Sequence[bool]] = {}


def quiet(table: torch.Tensor, sites: Sequence[bool] | None) -> None:
    """Note which sites no entry of ``table`` touches (from the host's copy of it);
    by its address and its codes' (``keep`` is handed the codes). None: forget it
    (a new table where an old one was)."""
    for at in (table.data_ptr(), table.data_ptr() + table.stride(1) * table.element_size()):
        if sites is None:
            _QUIET.pop(at, None)
        else:
            _QUIET[at] = sites


def _still(table_at: int, site: int, hidden: torch.Tensor) -> bool:
    """Whether a tap run from Python may copy its value and do nothing else: no entry
    touches its site and no CUDA graph is being captured (a captured tap must read the
    tables at every replay)."""
    sites = _QUIET.get(table_at)
    if sites is None or not sites[site]:
        return False
    return not (hidden.is_cuda and torch.cuda.is_current_stream_capturing())


#: Called with each tap's value while blocks run as Python at the taps
#: (``worker/live.py``): ``(site, value, second)``, ``second`` the residual of a
#: pair or None. The value is this operation's own output and the residual is
#: declared mutated, so a block's in-place edits of either are edits of what the
#: forward goes on with. None outside such a forward.
_LIVE: list[Any] = [None]


def at_taps(hook: Any) -> None:
    """Hand every tap's value to ``hook`` (None: to nobody) from now on."""
    _LIVE[0] = hook


def _at_the_tap(site: int, out: torch.Tensor, second: torch.Tensor | None) -> torch.Tensor:
    hook = _LIVE[0]
    if hook is not None:
        hook(site, out, second)
    return out


#: ``how[slot, 0]``: the edit an entry of the bank makes.
ADD, PROJECT, PROJECT_STREAM, SCALE, FILL, PATCH, PATCH_COLUMNS = 0, 1, 2, 3, 4, 5, 6


@_operation()
def steer(
    hidden: torch.Tensor,
    second: torch.Tensor,
    slots: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
    site: int,
) -> torch.Tensor:
    if _still(slots.data_ptr(), site, hidden):
        return _at_the_tap(site, _unsteered(hidden, slots, site), None)
    return _at_the_tap(site, _steered(hidden, second, slots, bank, how, site, pair=False), None)


@_operation(mutates=("second",))
def steer_pair(
    hidden: torch.Tensor,
    second: torch.Tensor,
    slots: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
    site: int,
) -> torch.Tensor:
    """``steer`` on a (hidden, residual) pair, whose residual rows a patch also sets."""
    if _still(slots.data_ptr(), site, hidden):
        return _at_the_tap(site, _unsteered(hidden, slots, site), second)
    return _at_the_tap(site, _steered(hidden, second, slots, bank, how, site, pair=True), second)


def _unsteered(hidden: torch.Tensor, slots: torch.Tensor, site: int) -> torch.Tensor:
    """What ``_steered`` returns where no row has an entry: the value, copied."""
    _SEEN[slots.data_ptr(), site] = (tuple(hidden.shape), hidden.dtype)
    return hidden.clone()


def _steered(
    hidden: torch.Tensor,
    second: torch.Tensor,
    slots: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
    site: int,
    pair: bool,
) -> torch.Tensor:
    _SEEN[slots.data_ptr(), site] = (tuple(hidden.shape), hidden.dtype)
    if hidden.dim() != 2 or hidden.shape[0] > slots.shape[1]:
        return hidden.clone()
    index = slots[site, : hidden.shape[0]]
    safe = index.clamp(min=0).long()
    mode = torch.where(index >= 0, how[safe, 0], -1.0)
    if hidden.shape[-1] != bank.shape[-1]:  # another width: only what reads no bank row
        if hidden.is_cuda or bool(((mode == SCALE) | (mode == FILL)).any()):
            return _changed_rows(hidden, hidden, mode, safe, how)
        return hidden.clone()
    hit = (mode == ADD).unsqueeze(-1)
    added = hidden.float() + bank.index_select(0, safe)
    out = torch.where(hit, added.to(hidden.dtype), hidden)
    if hidden.is_cuda or bool((mode >= SCALE).any()):  # on CUDA no host sync (graphs): masked
        out = _changed_rows(out, hidden, mode, safe, how)
        out = _patched_rows(out, second if pair else None, mode, safe, bank, how)
    if second.shape != hidden.shape:
        return out
    if hidden.is_cuda:  # every row, masked
        return _projected_rows(out, hidden, second, mode, safe, bank, how)
    if not bool(((mode == PROJECT) | (mode == PROJECT_STREAM)).any()):
        return out
    return _projected_runs(out, hidden, second, mode.tolist(), index.tolist(), bank, how)


def _changed_rows(
    out: torch.Tensor, hidden: torch.Tensor, mode: torch.Tensor, safe: torch.Tensor, how: torch.Tensor
) -> torch.Tensor:
    """The rows scaled or filled, on their columns."""
    limits = how.index_select(0, safe)
    columns = torch.arange(hidden.shape[-1], device=hidden.device, dtype=torch.float32)
    inside = (columns >= limits[:, 2:3]) & (columns < limits[:, 3:4])
    number = limits[:, 1:2]
    scaled = (hidden.float() * number).to(hidden.dtype)
    changed = torch.where((mode == SCALE).unsqueeze(-1), scaled, number.to(hidden.dtype))
    return torch.where(((mode == SCALE) | (mode == FILL)).unsqueeze(-1) & inside, changed, out)


def _patched_rows(
    out: torch.Tensor,
    second: torch.Tensor | None,
    mode: torch.Tensor,
    safe: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
) -> torch.Tensor:
    """The rows a patch sets: to ``bank[how[slot, 1]]``, and the residual's to
    ``bank[how[slot, 2]]`` (in place, where ``second`` is a pair's residual); a
    row index of -1 leaves that value as it is. A patch of columns sets only those."""
    limits = how.index_select(0, safe)
    patched = mode == PATCH
    # other edits keep other numbers there (a scale, a bound, infinity): only a
    # patch's are rows of the bank
    first = torch.where(patched, limits[:, 1], -1.0).long()
    other = torch.where(patched, limits[:, 2], -1.0).long()
    value = bank.index_select(0, first.clamp(min=0)).to(out.dtype)
    out = torch.where((first >= 0).unsqueeze(-1), value, out)
    columns = torch.where(mode == PATCH_COLUMNS, limits[:, 1], -1.0).long()
    value = bank.index_select(0, columns.clamp(min=0)).to(out.dtype)
    at = torch.arange(out.shape[-1], device=out.device, dtype=torch.float32)
    inside = (at >= limits[:, 2:3]) & (at < limits[:, 3:4]) & (columns >= 0).unsqueeze(-1)
    out = torch.where(inside, value, out)
    if second is not None and second.shape == out.shape:
        puts = other >= 0
        if second.is_cuda:  # no host sync (graphs): every row, masked
            values = bank.index_select(0, other.clamp(min=0)).to(second.dtype)
            second.copy_(torch.where(puts.unsqueeze(-1), values, second))
        elif bool(puts.any()):
            rows = puts.nonzero().squeeze(-1)
            second.index_copy_(0, rows, bank.index_select(0, other[rows]).to(second.dtype))
    return out


_INF = float("inf")


def _projected_runs(
    out: torch.Tensor,
    hidden: torch.Tensor,
    second: torch.Tensor,
    mode: list[float],
    index: list[int],
    bank: torch.Tensor,
    how: torch.Tensor,
) -> torch.Tensor:
    """The directions removed or clamped, each request's rows (a run of one slot)
    with the block's own operations (``s @ u`` on those rows together: the same
    product, so the same bits on a CPU)."""
    row, rows = 0, len(index)
    while row < rows:
        end = row + 1
        while end < rows and index[end] == index[row] and mode[end] == mode[row]:
            end += 1
        if mode[row] in (PROJECT, PROJECT_STREAM):
            slot = index[row]
            u = bank[slot].to(hidden.dtype)
            part = hidden[row:end]
            stream = part + second[row:end] if mode[row] == PROJECT_STREAM else part
            c = stream @ u
            low, high = (float(v) for v in how[slot, 1:3].tolist())
            held = c.clamp(min=None if low == -_INF else low, max=None if high == _INF else high)
            out[row:end] = part - (c - held)[:, None] * u
        row = end
    return out


def _projected_rows(
    out: torch.Tensor,
    hidden: torch.Tensor,
    second: torch.Tensor,
    mode: torch.Tensor,
    safe: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
) -> torch.Tensor:
    """The same on every row at once (a CUDA graph cannot wait on the host): the
    product summed in float32 per row, rounded as the block's is."""
    u = bank.index_select(0, safe).to(hidden.dtype)
    stream = torch.where((mode == PROJECT_STREAM).unsqueeze(-1), hidden + second, hidden)
    c = (stream.float() * u.float()).sum(-1).to(hidden.dtype)
    limits = how.index_select(0, safe).to(hidden.dtype)
    held = torch.minimum(torch.maximum(c, limits[:, 1]), limits[:, 2])
    projected = hidden - (c - held)[:, None] * u
    return torch.where(((mode == PROJECT) | (mode == PROJECT_STREAM)).unsqueeze(-1), projected, out)


def _steered_fake(
    hidden: torch.Tensor,
    second: torch.Tensor,
    slots: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
    site: int,
) -> torch.Tensor:
    return torch.empty_like(hidden)


_fake("steer")(_steered_fake)
_fake("steer_pair")(_steered_fake)


@_operation(mutates=("store",))
def keep(
    first: torch.Tensor,
    second: torch.Tensor,
    codes: torch.Tensor,
    dest: torch.Tensor,
    store: torch.Tensor,
    site: int,
    passed: int = 0,
) -> None:
    _PASSED[codes.data_ptr(), site] = passed or (2 if first.data_ptr() == second.data_ptr() else 1)
    if _still(codes.data_ptr(), site, first):
        return
    rows = first.shape[0]
    if first.dim() != 2 or rows > codes.shape[1] or second.shape != first.shape:
        return
    code = codes[site, :rows].unsqueeze(-1)
    value = torch.where(code == KEEP_SECOND, second, first)
    value = torch.where(code == KEEP_SUM, first + second, value)
    places = dest[site, :rows].long()
    width = store.shape[-1]
    if first.shape[-1] == width:
        store.index_copy_(0, places, value.to(store.dtype))
        pairs = torch.where(code.squeeze(-1) == KEEP_BOTH, places + 1, 0)  # the rest to row 0
        store.index_copy_(0, pairs, second.to(store.dtype))
        return
    # Wider or narrower than the store: each row over ``k`` rows of it, read flat.
    # On CUDA (no host sync: graphs) rows nobody keeps write row 0 only, never
    # read, so no region is touched; elsewhere only the kept rows are written.
    k = chunks(first.shape[-1], width)
    flat, code = store.view(-1), code.squeeze(-1)
    columns = torch.arange(first.shape[-1], device=first.device)
    for part, shift, kept in ((value, 0, code != 0), (second, k, code == KEEP_BOTH)):
        if not first.is_cuda:
            rows_kept = kept.nonzero().squeeze(-1)
            if rows_kept.numel():
                at = (places[rows_kept] + shift).unsqueeze(-1) * width + columns
                flat.index_put_((at.reshape(-1),), part[rows_kept].to(store.dtype).reshape(-1))
            continue
        at = (places + shift).unsqueeze(-1) * width + columns
        at = torch.where(kept.unsqueeze(-1), at, columns % width)
        flat.index_put_((at.reshape(-1),), part.to(store.dtype).reshape(-1))


@_operation(mutates=("out", "store"))
def tap(
    hidden: torch.Tensor,
    second: torch.Tensor,
    out: torch.Tensor,
    table: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
    store: torch.Tensor,
    site: int,
    keeps: int,
) -> None:
    """``steer`` then (where ``keeps``) ``keep`` at one tap, in one pass on CUDA,
    the new value written into ``out`` (:func:`tapped` allocates it)."""
    _tapped(hidden, second, out, table, bank, how, store, site, keeps, pair=False)


@_operation(mutates=("second", "out", "store"))
def tap_pair(
    hidden: torch.Tensor,
    second: torch.Tensor,
    out: torch.Tensor,
    table: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
    store: torch.Tensor,
    site: int,
) -> None:
    """``tap`` on a (hidden, residual) pair, keeping with the residual; a patch also
    sets the residual's rows, in place."""
    _tapped(hidden, second, out, table, bank, how, store, site, 1, pair=True)


@_operation(mutates=("hidden", "store"))
def tap_in_place(
    hidden: torch.Tensor,
    table: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
    store: torch.Tensor,
    site: int,
    keeps: int,
) -> None:
    """``tap`` writing the new value over ``hidden`` itself (its second value is
    ``hidden`` as it came): the kernel leaves a row nobody steers or keeps as it
    is, where ``tap`` copies it. What a graph that is not split at the taps runs
    (:func:`tapped_in_place`)."""
    _tapped(hidden, hidden, hidden, table, bank, how, store, site, keeps, pair=False)


@_operation(mutates=("hidden", "second", "store"))
def tap_pair_in_place(
    hidden: torch.Tensor,
    second: torch.Tensor,
    table: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
    store: torch.Tensor,
    site: int,
) -> None:
    """``tap_pair`` writing the new value over ``hidden`` itself."""
    _tapped(hidden, second, hidden, table, bank, how, store, site, 1, pair=True)


def _writes_only(*args: Any, **kwargs: Any) -> None:
    """The fake of an operation that returns nothing (it writes into its arguments,
    as its schema declares): one for all of them, whatever their arguments."""
    return None


for _name in ("keep", "tap", "tap_pair", "tap_in_place", "tap_pair_in_place"):
    _fake(_name)(_writes_only)


#: The operations a compiled engine's graph may be split at, so that on a step whose
#: blocks run at the taps each runs outside the CUDA graphs of the pieces between
#: them (``seams.split_graph_at``). They write into a buffer the piece before
#: them allocated, which the piece after them reads at the address it was
#: captured with: a tensor they returned would be a new one every step.
SPLITTING = (f"{NAMESPACE}::tap", f"{NAMESPACE}::tap_pair")
_TAP, _TAP_PAIR = tap.default, tap_pair.default


def tapped(
    hidden: torch.Tensor,
    second: torch.Tensor,
    table: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
    store: torch.Tensor,
    site: int,
    keeps: int,
) -> torch.Tensor:
    """The tap's new value (``tap`` into a tensor allocated here, in the caller's graph)."""
    out = torch.empty_like(hidden)
    _TAP(hidden, second, out, table, bank, how, store, site, keeps)
    return out


def tapped_in_place(
    hidden: torch.Tensor,
    table: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
    store: torch.Tensor,
    site: int,
    keeps: int,
) -> torch.Tensor:
    """``hidden``, edited where the tables say (``tap_in_place``)."""
    tap_in_place.default(hidden, table, bank, how, store, site, keeps)
    return hidden


def tapped_pair(
    hidden: torch.Tensor,
    second: torch.Tensor,
    table: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
    store: torch.Tensor,
    site: int,
) -> torch.Tensor:
    """The same for a (hidden, residual) pair (``tap_pair``; the residual is edited in place)."""
    out = torch.empty_like(hidden)
    _TAP_PAIR(hidden, second, out, table, bank, how, store, site)
    return out


def _tapped(
    hidden: torch.Tensor,
    second: torch.Tensor,
    out: torch.Tensor,
    table: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
    store: torch.Tensor,
    site: int,
    keeps: int,
    pair: bool,
) -> None:
    # (the addresses of the views ``table[:, part].t()``, without making them: on a
    # step replaying the pieces between the taps this runs as Python at every tap)
    slots_at, codes_at = table.data_ptr(), table.data_ptr() + table.stride(1) * table.element_size()
    _PASSED[codes_at, site] = keeps  # 0: a tuple without a second tensor
    keeps = ONE if keeps == FIRST else keeps  # the first of (value, None) is kept as one tensor
    in_place = out is hidden
    if _still(slots_at, site, hidden):  # (run from Python: one copy, no kernel)
        _SEEN[slots_at, site] = (tuple(hidden.shape), hidden.dtype)
        if not in_place:
            out.copy_(hidden)
        _hand(site, out, second if pair else None)
        return
    kernel = _kernel() if hidden.is_cuda else None
    fits = (
        hidden.dim() == 2
        and hidden.shape[0] <= table.shape[0]
        and second.shape == hidden.shape
        and hidden.is_contiguous()
        and second.is_contiguous()
        and out.is_contiguous()
        and store.dtype == hidden.dtype
        and table.is_contiguous()
        and how.is_contiguous()
    )
    if kernel is None or not fits:
        slots, codes, dest = (table[:, part].t() for part in range(3))
        out.copy_(_steered(hidden, second, slots, bank, how, site, pair))
        if keeps:
            keep(out, out if keeps == 2 else second, codes, dest, store, site)
    else:
        _SEEN[slots_at, site] = (tuple(hidden.shape), hidden.dtype)
        launch(kernel, hidden, second, table, bank, how, store, site, keeps, pair, out=out)
    _hand(site, out, second if pair else None)


def _hand(site: int, out: torch.Tensor, second: torch.Tensor | None) -> None:
    """Hand the tap's value on; where a graph broken at the taps is being captured,
    end the graph here so the hand-off runs as Python at every replay (``broken.py``)."""
    capture = broken.capturing()
    if capture is None:
        _at_the_tap(site, out, second)
    else:
        capture.pause(_at_the_tap, site, out, second)


def launch(
    kernel: Any,
    hidden: torch.Tensor,
    second: torch.Tensor,
    table: torch.Tensor,
    bank: torch.Tensor,
    how: torch.Tensor,
    store: torch.Tensor,
    site: int,
    keeps: int,
    pair: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One program a row of ``hidden``; the new value, into ``out`` where given (a
    new tensor otherwise), which may be ``hidden`` itself: then a row nobody steers
    or keeps is not written. ``store``, and for a pair the residual's patched rows,
    are written in place."""
    out = torch.empty_like(hidden) if out is None else out
    rows, width = hidden.shape
    if rows:
        block = min(1024, 1 << (width - 1).bit_length())
        bank_width, store_width = bank.shape[-1], store.shape[-1]
        kernel[(rows,)](
            hidden, second, out, table, bank, how, store, site, table.shape[2],
            width, bank_width, store_width, chunks(width, store_width), block, keeps, pair, int(out is hidden),
        )  # fmt: skip
    return out


def _kernel() -> Any:
    """The Triton kernel; None where Triton is missing."""
    return None if triton is None else _tap_rows


if triton is not None:

    @triton.jit
    def _tap_rows(
        hidden, second, out, table, bank, how, store, site, sites,
        H: tl.constexpr, BH: tl.constexpr, SH: tl.constexpr, K: tl.constexpr,
        BLOCK: tl.constexpr, KEEPS: tl.constexpr, PAIR: tl.constexpr, IN_PLACE: tl.constexpr,
    ):  # fmt: skip
        # H: the value's width; BH: the bank's; SH: the store's, whose K rows hold a kept row
        row = tl.program_id(0).to(tl.int64)
        at = table + row * 3 * sites + site
        slot = tl.load(at)
        code = tl.load(at + sites) * (KEEPS > 0)
        dest = tl.load(at + 2 * sites).to(tl.int64)
        entry = tl.maximum(slot, 0).to(tl.int64)
        mode = tl.where(slot >= 0, tl.load(how + entry * 4).to(tl.int32), -1)
        if H != BH:  # another width than the bank's: only the edits that read no bank row
            mode = tl.where((mode == 3) | (mode == 4), mode, -1)
        dtype = hidden.dtype.element_ty
        delta = 0.0
        projects = (mode == 1) | (mode == 2)
        if projects:  # a direction removed or clamped: first c = s @ u, rounded
            total = 0.0
            for start in range(0, H, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < H
                h = tl.load(hidden + row * H + offs, mask=mask, other=0.0)
                u = tl.load(bank + entry * BH + offs, mask=mask, other=0.0).to(dtype)
                s = h
                if mode == 2:  # the stream: the row plus the second value's, rounded
                    r = tl.load(second + row * H + offs, mask=mask, other=0.0)
                    s = (h.to(tl.float32) + r.to(tl.float32)).to(dtype)
                total += tl.sum(s.to(tl.float32) * u.to(tl.float32), axis=0)
            c = total.to(dtype).to(tl.float32)
            low = tl.load(how + entry * 4 + 1).to(dtype).to(tl.float32)
            high = tl.load(how + entry * 4 + 2).to(dtype).to(tl.float32)
            held = tl.minimum(tl.maximum(c, low), high)
            delta = (c - held).to(dtype).to(tl.float32)
        # in place, a row nobody steers or keeps is left as it is: no pass over it
        span = tl.where((mode >= 0) | (code != 0) | (IN_PLACE == 0), H, 0)
        for start in range(0, span, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < H
            h = tl.load(hidden + row * H + offs, mask=mask)
            if mode == 0:  # hidden.float() + bank[slot], rounded once
                added = h.to(tl.float32) + tl.load(bank + entry * BH + offs, mask=mask)
                h = added.to(h.dtype)
            elif projects:  # hidden - round(delta * u), rounded
                u = tl.load(bank + entry * BH + offs, mask=mask).to(dtype).to(tl.float32)
                push = (delta * u).to(dtype).to(tl.float32)
                h = (h.to(tl.float32) - push).to(h.dtype)
            elif mode == 5:  # patched: the row set to bank[how[slot, 1]], unless -1
                first = tl.load(how + entry * 4 + 1).to(tl.int64)
                if first >= 0:
                    h = tl.load(bank + first * BH + offs, mask=mask).to(h.dtype)
            elif mode == 6:  # patched on columns [low, high) from bank[how[slot, 1]]
                first = tl.load(how + entry * 4 + 1).to(tl.int64)
                low = tl.load(how + entry * 4 + 2)
                high = tl.load(how + entry * 4 + 3)
                inside = (offs.to(tl.float32) >= low) & (offs.to(tl.float32) < high)
                value = tl.load(bank + first * BH + offs, mask=mask).to(h.dtype)
                h = tl.where(inside, value, h)
            elif mode > 2:  # scaled (3) or filled (4) on columns [low, high)
                number = tl.load(how + entry * 4 + 1)
                low = tl.load(how + entry * 4 + 2)
                high = tl.load(how + entry * 4 + 3)
                inside = (offs.to(tl.float32) >= low) & (offs.to(tl.float32) < high)
                scaled = (h.to(tl.float32) * number).to(h.dtype)
                filled = (tl.zeros_like(h.to(tl.float32)) + number).to(h.dtype)
                h = tl.where(inside, tl.where(mode == 3, scaled, filled), h)
            tl.store(out + row * H + offs, h, mask=mask)
            if PAIR:
                if mode == 5:  # and the residual's row set to bank[how[slot, 2]], unless -1
                    other = tl.load(how + entry * 4 + 2).to(tl.int64)
                    if other >= 0:
                        value = tl.load(bank + other * BH + offs, mask=mask).to(h.dtype)
                        tl.store(second + row * H + offs, value, mask=mask)
            if code != 0:  # 1 the output, 2 the second value, 3 their sum, 4 both
                if KEEPS == 2:  # a tensor's tap: its second value is the edited one
                    r = h
                else:
                    r = tl.load(second + row * H + offs, mask=mask)
                kept = tl.where(code == 2, r, h)
                summed = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
                kept = tl.where(code == 3, summed, kept)
                tl.store(store + dest * SH + offs, kept, mask=mask)
                if code == 4:
                    tl.store(store + (dest + K) * SH + offs, r, mask=mask)
