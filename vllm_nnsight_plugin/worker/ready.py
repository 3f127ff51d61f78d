"""A collect that reads its saves beside the step in flight, not after it.

With async scheduling (vLLM's default on a GPU) the engine has put its next step
on the device by the time the front end asks for a finished request's saves.
Waiting there for the whole device (``torch.cuda.synchronize``) holds the engine
core until that step is done, and the step after it is put on the device only
once the collect has returned: the device idles for the collect's time, at each
step that finishes traced requests (a sweep's every wave; a server's every
finished request).

A request the step in flight does not compute was last computed before it, so
its saves are complete once everything the device had queued when that step
began is. Each step marks that point as it begins (an event on the stream the
step computes on). A collect whose requests are all outside the latest step
reads their saves on a stream of its own, behind that mark, and the compute
stream waits for that stream before its next step (the store's rows it read go
back to the tables and may be written again). Of the samples that say at which
step a lowered request ended (``stops.py``), it waits only for those of the
steps before the mark. Anything else (a request in the
latest step, no mark, no GPU, an engine that schedules one step at a time)
waits for the device as before.

On by default since it was measured on an H100 (a last-row sweep of 1,024 prompts
took 1.36-1.38x a plain run's time beside the step in flight, against 1.53-1.68x
waiting, on one engine: ``benchmarks/RESULTS.md``); ``VLLM_NNSIGHT_COLLECT_BESIDE=0``
waits for the device as before. ``nnsight_stats`` counts ``collects_beside_step``
and ``collects_waited``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .. import seams


class Ready:
    """Where each step began on the device, for the collects between steps."""

    def __init__(self, enabled: bool) -> None:
        #: A GPU engine that schedules ahead (no step is in flight otherwise).
        self.enabled = enabled and torch.cuda.is_available()
        self._mark: Any = None  # an event recorded as the latest step began
        self._stream: Any = None  # the stream that step computes on
        self._side: Any = None
        self._latest: Any = None  # that step's scheduler output (None: no mark)
        #: collects read beside the step in flight, and those that waited for the device
        self.beside = self.waited = 0

    def began(self, scheduler_output: Any, tracking: bool) -> None:
        """A step begins, before any of its device work. ``tracking``: requests
        with blocks are held (otherwise nothing can be collected before the next
        mark, and none is made)."""
        if not self.enabled:
            return
        if not tracking:
            self._latest = None
            return
        stream = torch.cuda.current_stream()
        if self._mark is None:
            self._mark = torch.cuda.Event()
        self._mark.record(stream)
        self._stream, self._latest = stream, scheduler_output

    def switch(self, enabled: bool) -> None:
        """Turn reading beside the step in flight on or off while the engine runs
        (a benchmark's A/B on one engine). The latest mark is forgotten either
        way: a collect never reads behind a mark made before the switch."""
        self.enabled = enabled and torch.cuda.is_available()
        self._latest = None

    def apart(self, request_ids: Iterable[str]) -> bool:
        """Whether these requests' saves can be read beside the step in flight:
        none of them is in the latest step begun."""
        if self._latest is None:
            return False
        return outside(request_ids, seams.scheduled_ids(self._latest))

    @contextlib.contextmanager
    def reading(self, request_ids: Iterable[str]) -> Iterator[bool]:
        """Run a collect's device work. Yields True where it runs on the side
        stream behind the latest mark (no wait for the device is needed); False
        where the caller waits for the device as before."""
        if not self.apart(request_ids):
            self.waited += self.enabled
            yield False
            return
        self.beside += 1
        if self._side is None:
            # High priority: a prompt step's long kernels fill the device, and the
            # collect's few small copies would otherwise queue behind them.
            self._side = torch.cuda.Stream(priority=-1)
        side, compute = self._side, self._stream
        side.wait_event(self._mark)
        try:
            with torch.cuda.stream(side):
                yield True
        finally:
            compute.wait_stream(side)  # before the compute stream reuses what was read


def outside(request_ids: Iterable[str], scheduled: Any) -> bool:
    """Whether no id of ``request_ids`` is among ``scheduled`` (a step's ids)."""
    return not any(request_id in scheduled for request_id in request_ids)
