"""Which path each traced request took, and the first reason it ran as Python.

A request's block either runs on the tap tables inside the compiled forward
(lowered) or as Python. Users see which on the finished output
(``output.nnsight_path``, and on the output a block's ``tracer.result`` serves);
operators see the counts in ``nnsight_stats``. A reason is one sentence about
the request, so that a user can change the block or ask for a tap.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Path:
    lowered: bool
    #: lowered: steer, keep, read, cache, or replay (served at the sampler); Python:
    #: ``taps`` where it runs at the taps of a compiled forward (``live.py``)
    form: str | None = None
    kind: str | None = None  # Python: why, in one word (counted)
    reason: str | None = None  # Python: why, in words (on the output)

    def reply(self) -> dict[str, Any]:
        """What travels home: plain values, read by the front end without the plugin's types."""
        return {"lowered": self.lowered, "form": self.form, "reason": self.reason}


#: Reasons decided before a block is looked at.
NO_TAPS = ("no_taps", "this engine declares no taps (the `nnsight_taps` setting)")
EDITED = (
    "edits",
    "two or more of its blocks (its own, its installed edits: `model.edit()`) use the forward, so all run as Python",
)
CHUNKED = ("chunked", "its prompt is split over several steps by chunked prefill")
SEQUENCES = ("sequences", "it is one of several sequences (`n > 1`) or a copy of a registered block")
SPECULATIVE = ("speculative", "this engine decodes speculatively")
COPIES = (
    "copies",
    "every read is a copy on this engine (NNSIGHT_VLLM_CLONE_READS), so an edit runs as Python",
)
OUT_OF_RANGE = ("row", "its first-step read indexes a row outside the prompt (Python raises on that step)")
UNSIZED = ("unsized", "it keeps rows, and has no `max_tokens` to size their room by")
NO_ROOM = ("room", "the tap tables have no room for it now")
FAILED = ("error", "lowering it failed (the engine's log says why)")
#: A block that never reaches a module location: it runs as Python at the sampler
#: on any engine, and its steps stay in the graphs (``reach.py``).
AT_SAMPLER = (
    "sampler",
    "it reads only what the sampler serves (`model.logits`, `model.samples`, `tracer.result`), "
    "which runs as Python there while the forward stays compiled",
)


#: The form of a Python block that runs at the taps of a compiled forward.
AT_TAPS = "taps"


class Paths:
    """Per tracked request, the path it took, until its reply is built."""

    def __init__(self) -> None:
        self.taken: dict[str, Path] = {}
        self.python_why: Counter[str] = Counter()
        self.at_taps_count = 0

    def lowered(self, request_id: str, form: str) -> None:
        self.taken[request_id] = Path(True, form=form)

    def python(self, request_id: str, kind: str, reason: str, form: str | None = None) -> None:
        if request_id not in self.taken:  # the first reason stands
            self.python_why[kind] += 1
            self.taken[request_id] = Path(False, form=form, kind=kind, reason=reason)

    def at_taps(self, request_id: str, kind: str, reason: str) -> None:
        """Python, at the taps of a compiled forward: its steps stay compiled."""
        if request_id not in self.taken:
            self.at_taps_count += 1
        self.python(request_id, kind, reason, form=AT_TAPS)

    def take(self, request_ids: list[str]) -> dict[str, Any] | None:
        """The reply of the first of ``request_ids`` (a request, or its sequences,
        stem first) that has a path; every one is forgotten."""
        found = [self.taken.pop(rid, None) for rid in request_ids]
        return next((path.reply() for path in found if path is not None), None)

    def keep_only(self, tracked: Any) -> None:
        for request_id in [rid for rid in self.taken if rid not in tracked]:
            del self.taken[request_id]

    def stats(self) -> dict[str, Any]:
        return {
            "python_blocks": sum(self.python_why.values()),
            "python_why": dict(self.python_why),
            "python_at_taps": self.at_taps_count,
        }
