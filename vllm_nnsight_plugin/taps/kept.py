"""Lowered requests, and the rows they keep leaving the arena.

A lowered block that keeps a tap's rows (``rows.append(layer.output[0].clone())``,
or a read on the first step) has them written into the arena by the operation
inside the forward. Right after the forward is queued, the step's kept rows are
copied out of the arena in one copy, queued on the same stream (so the next
forward, which writes the arena again, runs after it): into GPU memory while
the rows held there stay under ``VLLM_NNSIGHT_KEPT_GPU_BYTES`` (default 1 GiB),
into pinned host memory beyond that. Each request holds views of those copies,
one per step, and its saves are built from them when it is collected, on the
model's device, as the Python path's are.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..returns.stacked import Stacked

KEPT_GPU_BYTES_ENV = "VLLM_NNSIGHT_KEPT_GPU_BYTES"
DEFAULT_KEPT_GPU_BYTES = 1 << 30


@dataclass
class Lowered:
    """One request's lowered block: what it does at one tap, on which of its steps."""

    site: int
    start: int
    stop: int | None  # None: every step
    result: str | None  # the name ``tracer.result.save()`` was assigned to
    slot: int = -1  # steering: the bank row added to the request's rows
    code: int = 0  # keeping: what ``ops.keep`` writes (0: nothing kept)
    name: str | None = None  # keeping: the name the kept rows are saved under
    select: Any = None  # a single read: the index applied to the step's rows
    single: bool = False  # one value (a read in the body), not a list of steps
    steps: int = 0  # forwards this request has been in
    pieces: list = field(default_factory=list)  # keeping: one view of kept rows per step

    def active(self) -> bool:
        return self.start <= self.steps and (self.stop is None or self.steps < self.stop)

    def finished_loop(self) -> bool:
        """Whether the block's loop ran to its end (``tracer.all()`` never does), so
        that the line after it ran too."""
        return self.stop is not None and self.steps >= self.stop

    def saves(self, device: torch.device) -> dict[str, Any]:
        """What the block saved, as the Python path would have it."""
        if not self.code or self.name is None:
            return {}
        pieces = [piece.to(device, non_blocking=True) for piece in self.pieces]
        if self.single:
            return {self.name: pieces[0][self.select].clone()} if pieces else {}
        if len(pieces) < 2:
            return {self.name: [piece.clone() for piece in pieces]}
        return {self.name: Stacked(torch.cat(pieces), tuple(int(p.shape[0]) for p in pieces))}


class Kept:
    """The step's kept rows, and where their copies go."""

    def __init__(self, arena: torch.Tensor) -> None:
        self.arena = arena
        self.now: list[tuple[Lowered, int, int]] = []  # (request, first row, rows) this step
        self.limit = int(os.environ.get(KEPT_GPU_BYTES_ENV) or DEFAULT_KEPT_GPU_BYTES)
        self.held = 0  # bytes of copies on the device still referred to
        self.rows = 0
        self.host_rows = 0
        self._row_bytes = arena.shape[1] * arena.element_size()

    def take(self) -> None:
        now, self.now = self.now, []
        if not now:
            return
        low = min(start for _, start, _ in now)
        high = max(start + count for _, start, count in now)
        kept = sum(count for _, _, count in now)
        if kept == high - low:
            source, place = self.arena[low:high], {start: start - low for _, start, _ in now}
            fresh = False
        else:  # scattered rows: gather just those
            index, place, at = [], {}, 0
            for _, start, count in now:
                index.extend(range(start, start + count))
                place[start], at = at, at + count
            rows = torch.tensor(index, dtype=torch.long).to(self.arena.device, non_blocking=True)
            source, fresh = self.arena.index_select(0, rows), True
        copy = self._copy(source, fresh)
        for lowered, start, count in now:
            lowered.pieces.append(copy[place[start] : place[start] + count])
        self.rows += kept

    def _copy(self, source: torch.Tensor, fresh: bool) -> torch.Tensor:
        """``source`` (a slice of the arena, or a gathered ``fresh`` copy) where it will be kept."""
        size = source.shape[0] * self._row_bytes
        if source.device.type != "cuda" or self.held + size <= self.limit:
            copy = source if fresh else source.clone()
            if source.device.type == "cuda":
                self.held += size
                weakref.finalize(copy, self._release, size)
            return copy
        copy = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        copy.copy_(source, non_blocking=True)
        self.host_rows += source.shape[0]
        return copy

    def _release(self, size: int) -> None:
        self.held -= size

    def stats(self) -> dict[str, Any]:
        return {"kept_rows": self.rows, "kept_host_rows": self.host_rows}
