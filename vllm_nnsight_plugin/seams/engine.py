"""Engine-core seams: the process that schedules.

``Scheduler.add_request`` / ``Scheduler.schedule``; see :func:`patch_scheduler`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from .wrap import carries_block, wrap


class _Unchunked:
    """A view of a ``SchedulerConfig`` that admits waiting prompts whole or not at all."""

    def __init__(self, config: Any) -> None:
        self._config = config

    enable_chunked_prefill = False
    long_prefill_token_threshold = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def patch_scheduler() -> None:
    """Keep a traced prompt in one step: a block sees its prompt whole.

    vLLM's chunked prefill splits a prompt across steps when the step's token
    budget is partly taken, and a block would then see a slice of its prompt.
    While a request with a block waits for admission, ``schedule`` reads a view
    of its config with chunking off for *waiting* requests (vLLM 0.25 and 0.32
    read both fields from ``self.scheduler_config`` inside ``schedule``): a
    waiting prompt that does not fit this step waits for the next one instead of
    being split. Running requests chunk as before. This is done only while every
    waiting prompt fits the step budget at all, so nothing can wait forever; a
    traced prompt longer than the budget is still chunked and its block refused
    with a clear error in the worker.
    """
    from vllm.v1.core.sched.scheduler import Scheduler

    def make_add(original: Callable) -> Callable:
        def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, request, *args, **kwargs)
            if carries_block(request.sampling_params):
                self.__dict__.setdefault("_nnsight_waiting", {})[request.request_id] = request
                self.__dict__.setdefault("_nnsight_traced", set()).add(request.request_id)
            return result

        return add_request

    def make_schedule(original: Callable) -> Callable:
        def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
            return scheduled(self, original, *args, **kwargs)

        return schedule

    wrap(Scheduler, "add_request", make_add)
    wrap(Scheduler, "schedule", make_schedule)


def scheduled(scheduler: Any, original: Callable, *args: Any, **kwargs: Any) -> Any:
    """``Scheduler.schedule`` with the two orders above: traced requests first among
    the running, and a waiting traced prompt whole or not this step.

    Both read request ids, so the reads are kept to the steps that need them: a
    step whose running requests fill every slot starts no waiting request (vLLM
    0.25 to 0.34 leave their waiting queues untouched then, :func:`_no_room`), a
    running list of traced requests alone is left as it is, and finished ids leave
    the books once they outnumber the live ones by ``_STALE``. A thousand traced
    requests, a quarter of them running, read every id three times a step before
    (0.27 ms a step on this project's CPU machine; ``benchmarks/scheduler_wrap.py``).
    """
    _traced_first(scheduler)
    waiting = scheduler.__dict__.get("_nnsight_waiting")
    if not waiting or _no_room(scheduler):
        return original(scheduler, *args, **kwargs)
    for request_id in [rid for rid in waiting if rid not in scheduler.requests]:
        del waiting[request_id]  # aborted before it ran
    budget = scheduler.max_num_scheduled_tokens
    whole = bool(waiting) and all(r.num_tokens - r.num_computed_tokens <= budget for r in scheduler.waiting)
    config = scheduler.scheduler_config
    if whole:
        scheduler.scheduler_config = _Unchunked(config)
    try:
        output = original(scheduler, *args, **kwargs)
    finally:
        scheduler.scheduler_config = config
    for data in output.scheduled_new_reqs:
        waiting.pop(data.req_id, None)
    return output


def _no_room(scheduler: Any) -> bool:
    """Whether every request slot is taken by a running request, so that this step
    starts no waiting one (the scheduler's waiting loop stops at its limit before
    it looks at a waiting request; a preemption this step stops it too). Without
    the limit's attribute: False, and the full reads run."""
    limit = getattr(scheduler, "max_num_active_reqs", None)  # (0.32 on)
    if limit is None:
        limit = getattr(scheduler, "max_num_running_reqs", None)  # (0.25)
    return isinstance(limit, int) and len(scheduler.running) >= limit


_REQUEST_ID = operator.attrgetter("request_id")

#: Finished or aborted ids the books may hold beyond the scheduler's live
#: requests before they are dropped: a stale id costs a set entry, nothing more
#: (the engine's ids carry a random suffix unless an operator turns it off).
_STALE = 256


def _traced_first(scheduler: Any) -> None:
    """Order the running requests with blocks first, so that when the KV cache runs
    out, vLLM's first-come-first-served scheduler preempts a plain request (it takes
    the last running one), which it recomputes exactly, before a traced one, whose
    block a recompute could not replay if it wrote (``worker/resume.py``). Among plain
    requests, and among traced ones, the order stays as it was. A scheduler with
    priorities chooses by priority and is left to it."""
    traced = scheduler.__dict__.get("_nnsight_traced")
    if not traced:
        return
    if len(traced) > len(scheduler.requests) + _STALE:
        for request_id in [rid for rid in traced if rid not in scheduler.requests]:
            traced.discard(request_id)  # finished or aborted
    running = scheduler.running
    if (
        len(running) > 1
        and running[-1].request_id in traced
        and not traced.issuperset(map(_REQUEST_ID, running))  # (all traced: as it is)
    ):
        running.sort(key=lambda request: request.request_id not in traced)  # stable
