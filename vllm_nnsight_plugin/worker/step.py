"""One engine step, as the worker sees it: what was scheduled, and how far it got.

A *step* is one call of the runner's ``execute_model`` then its sampler. vLLM
packs every scheduled request's new tokens into one ``[tokens, ...]`` slab; a
block belongs to one request, so each step it is pointed at its own rows.

A step goes through its phases in order, and may stop early at any of them
(nothing to serve, or the forward raised)::

    SCHEDULED  execute_model was called with this SchedulerOutput
    FORWARD    the interleaver is open: module hooks serve the blocks
    SAMPLING   the forward is over; logits and samples are served per request
    DONE       saves recorded, or nothing in this step needed the interleaver
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Phase(enum.Enum):
    SCHEDULED = "scheduled"
    FORWARD = "forward"
    SAMPLING = "sampling"
    DONE = "done"


@dataclass
class Step:
    scheduler_output: Any
    #: The forward runs as Python on a compiled engine (no CUDA graph, compiled
    #: module bypassed), because a block may run in it.
    python: bool = False
    #: The forward runs compiled, without a CUDA graph, and its taps hand their
    #: values to the blocks that read only taps (``live.py``).
    at_taps: bool = False
    #: Those hand-offs, while the forward runs.
    live: Any = None
    #: When a step whose forward runs as Python, or at the taps, began (for the metrics).
    started: float | None = None
    phase: Phase = Phase.SCHEDULED
    #: Request id -> its row in the step's per-request tensors (logits, samples).
    rows: dict[str, int] = field(default_factory=dict)
    #: The tap tables hold this step's rows (``taps/install.py``).
    taps_filled: bool = False
    #: What the tap tables were filled with: the request ids in row order, their row offsets.
    filled: Any = None
    #: Requests whose sample this step vLLM throws away (a chunk before the prompt's end).
    discarded: list[str] = field(default_factory=list)
    #: A block in this step may ask for a module location during the forward: the
    #: interleaver opens for it. Otherwise it opens at the sampler.
    forward: bool = True
    #: The step's (request id, token rows) in slab order, once the interleaver opened.
    spans: list[tuple[str, int]] = field(default_factory=list)
    #: How often the interleaver had reached each location when it opened: a tap
    #: the forward did not reach is served at the sampler (``taps/replay.py``).
    visits: dict[str, int] = field(default_factory=dict)

    @property
    def open(self) -> bool:
        """Whether this step has started serving blocks and not yet finished."""
        return self.phase in (Phase.FORWARD, Phase.SAMPLING)
