"""A CUDA graph of the whole forward, broken at the taps.

A replayed graph runs no Python, so a block that must run as Python at a tap
(``worker/live.py``) used to take its whole step off the graphs: every layer's
kernels launched one by one, about 4.5 times a graphed decode step on an H100.
This captures the same forward as a run of graphs, one between each pair of
taps, with the tap's hand-off to Python between them: replayed, the layers
run from their graphs, attention inside them, and the only Python is each tap's
hand-off (which returns at once where no block reads that tap).

The captured kernels read and write fixed addresses, so what runs between two
graphs must work on the tensors the capture saw there (a tap's value and the
residual beside it), in place: it is handed aliases of them that do not keep
their memory (``weak``), as a graph's own tensors are not kept once captured.
The tap's kernel is captured with the graph before it, so a lowered block's
edits and reads at that tap replay as in the whole graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

#: The capture under way in this process (one at a time).
_CAPTURING: list[BrokenGraph | None] = [None]


def capturing() -> BrokenGraph | None:
    """The broken graph being captured now, if any."""
    return _CAPTURING[0]


class BrokenGraph:
    """Captured as ``with BrokenGraph(pool, weak): forward()``; :meth:`pause` ends
    one graph and starts the next; :meth:`replay` runs them and what is between."""

    def __init__(self, pool: Any, weak: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.pool = pool
        self.weak = weak
        #: the graphs' replays and the calls between them, in order
        self.parts: list[Callable[[], Any]] = []
        self.breaks = 0
        self._graph: torch.cuda.CUDAGraph | None = None

    def __enter__(self) -> BrokenGraph:
        if _CAPTURING[0] is not None:
            raise RuntimeError("a broken graph is already being captured")
        _CAPTURING[0] = self
        self._begin()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._end()
        finally:
            _CAPTURING[0] = None

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            graph.capture_begin()
        else:
            graph.capture_begin(pool=self.pool)
        self._graph = graph

    def _end(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            graph.capture_end()
            self.parts.append(graph.replay)

    def pause(self, fn: Callable[..., Any], *args: Any) -> None:
        """End the graph here; ``fn(*args)`` runs now and between the same two graphs
        at every replay, each tensor of ``args`` the one the capture saw."""
        held = tuple(self.weak(a) if isinstance(a, torch.Tensor) else a for a in args)
        call = functools.partial(fn, *held)
        self._end()
        call()
        self.parts.append(call)
        self.breaks += 1
        self._begin()

    def replay(self) -> None:
        for part in self.parts:
            part()

    def __repr__(self) -> str:
        return f"BrokenGraph(graphs={len(self.parts) - self.breaks}, breaks={self.breaks})"
