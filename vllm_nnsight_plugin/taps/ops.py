"""The operations at each tap: add each row's steering vector, keep each row asked for.

``torch.ops.vllm_nnsight.steer(hidden, slots, bank, site)`` returns ``hidden``
with ``bank[slots[site, row]]`` added to every row whose slot is not -1; other
rows are copied bit for bit. The addition is what ``hidden[:] += vector`` does in
a block: in float32, rounded once to ``hidden``'s dtype (the bank holds the
vector's values exactly, in float32).

``torch.ops.vllm_nnsight.keep(first, second, codes, dest, store, site)`` writes
row ``r`` of ``first`` (code 1), of ``second`` (code 2) or of ``first + second``
(code 3: the residual stream leaving a decoder layer, by the same addition a
block's ``hidden + residual`` runs) to ``store[dest[site, r]]``. Rows nobody
keeps have destination 0, a row of the store that is never read, so the
operation has one shape for every step and one store serves every tap. Code 4
keeps both outputs, ``first`` at ``dest`` and ``second`` in the row after it
(a ``tracer.cache`` of the tap: its whole output, every step).

Both are ``torch.library`` custom ops with fake implementations, so
torch.compile keeps each whole (one opaque call in the graph) and a CUDA graph
records their kernels, which read the tables' current contents at every replay.

A tap whose value is not as wide as the bank (an operation of another width) is
left as it is: ``steer`` returns a copy and ``keep`` writes nothing. ``steer``
notes each site's width and dtype when it runs (the engine's first forwards,
before any request), so lowering can check them (:func:`seen`).
"""

from __future__ import annotations

import torch

NAMESPACE = "vllm_nnsight"

#: What ``keep`` writes for a row, by code.
KEEP_FIRST, KEEP_SECOND, KEEP_SUM, KEEP_BOTH = 1, 2, 3, 4

_SEEN: dict[tuple[int, int], tuple[tuple[int, ...], torch.dtype]] = {}


def seen(slots: torch.Tensor, site: int) -> tuple[tuple[int, ...], torch.dtype] | None:
    """The shape and dtype of the value the tap at ``site`` last had, if it ran."""
    return _SEEN.get((slots.data_ptr(), site))


def forget_seen(slots: torch.Tensor) -> None:
    """Drop what was noted under ``slots``' address (new tables may reuse an old one's)."""
    for key in [key for key in _SEEN if key[0] == slots.data_ptr()]:
        del _SEEN[key]


@torch.library.custom_op(f"{NAMESPACE}::steer", mutates_args=())
def steer(hidden: torch.Tensor, slots: torch.Tensor, bank: torch.Tensor, site: int) -> torch.Tensor:
    _SEEN[slots.data_ptr(), site] = (tuple(hidden.shape), hidden.dtype)
    if hidden.dim() != 2 or hidden.shape[-1] != bank.shape[-1] or hidden.shape[0] > slots.shape[1]:
        return hidden.clone()
    index = slots[site, : hidden.shape[0]]
    hit = (index >= 0).unsqueeze(-1)
    added = hidden.float() + bank.index_select(0, index.clamp(min=0).long())
    return torch.where(hit, added.to(hidden.dtype), hidden)


@steer.register_fake
def _(hidden: torch.Tensor, slots: torch.Tensor, bank: torch.Tensor, site: int) -> torch.Tensor:
    return torch.empty_like(hidden)


@torch.library.custom_op(f"{NAMESPACE}::keep", mutates_args=("store",))
def keep(
    first: torch.Tensor,
    second: torch.Tensor,
    codes: torch.Tensor,
    dest: torch.Tensor,
    store: torch.Tensor,
    site: int,
) -> None:
    rows = first.shape[0]
    if first.dim() != 2 or first.shape[-1] != store.shape[-1] or rows > codes.shape[1]:
        return
    code = codes[site, :rows].unsqueeze(-1)
    value = torch.where(code == KEEP_SECOND, second, first)
    value = torch.where(code == KEEP_SUM, first + second, value)
    places = dest[site, :rows].long()
    store.index_copy_(0, places, value.to(store.dtype))
    pairs = torch.where(code.squeeze(-1) == KEEP_BOTH, places + 1, 0)  # the rest to row 0
    store.index_copy_(0, pairs, second.to(store.dtype))


@keep.register_fake
def _(
    first: torch.Tensor,
    second: torch.Tensor,
    codes: torch.Tensor,
    dest: torch.Tensor,
    store: torch.Tensor,
    site: int,
) -> None:
    return None
