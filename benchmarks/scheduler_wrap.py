"""What the scheduler wrap costs a step, on stand-in schedulers (no engine).

    python benchmarks/scheduler_wrap.py [--traced 1000] [--slots 256] [--steps 2000]

``--traced`` traced requests, ``--slots`` of them running (every slot taken) and
the rest waiting, as in the GPU capture of 1,000 requests; then the same with a
slot free (the waiting prompts' sizes are read). Prints microseconds a step for
``seams.engine.scheduled`` (vLLM's own ``schedule`` replaced by a function that
returns at once) and for the reads the wrap made every step before it skipped
them (``previous_reads``, kept here for the comparison).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace


def previous_reads(scheduler: SimpleNamespace) -> None:
    """The wrap's per-step reads before they were skipped where they cannot change
    a step: every traced id against the live requests, the running list sorted
    whenever its last request is traced, and, while a traced prompt waits, every
    waiting id and every waiting prompt's size."""
    traced = scheduler.__dict__["_nnsight_traced"]
    for request_id in [rid for rid in traced if rid not in scheduler.requests]:
        traced.discard(request_id)
    running = scheduler.running
    if traced and len(running) > 1 and running[-1].request_id in traced:
        running.sort(key=lambda request: request.request_id not in traced)
    waiting = scheduler.__dict__["_nnsight_waiting"]
    for request_id in [rid for rid in waiting if rid not in scheduler.requests]:
        del waiting[request_id]
    budget = scheduler.max_num_scheduled_tokens
    all(r.num_tokens - r.num_computed_tokens <= budget for r in scheduler.waiting)


def stand_in(traced: int, running: int) -> SimpleNamespace:
    ids = [f"request-{i}" for i in range(traced)]
    requests = {i: SimpleNamespace(request_id=i, num_tokens=48, num_computed_tokens=0) for i in ids}
    found = SimpleNamespace(
        requests=requests,
        running=[requests[i] for i in ids[:running]],
        waiting=[requests[i] for i in ids[running:]],
        max_num_running_reqs=None,
        max_num_scheduled_tokens=8192,
        scheduler_config=SimpleNamespace(),
    )
    found.__dict__["_nnsight_traced"] = set(ids)
    found.__dict__["_nnsight_waiting"] = {i: requests[i] for i in ids[running:]}
    return found


def per_step_us(step, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - started) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traced", type=int, default=1000)
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()

    from vllm_nnsight_plugin.seams import engine

    output = SimpleNamespace(scheduled_new_reqs=[])
    for free in (0, 1):
        found = stand_in(args.traced, args.slots - free)
        found.max_num_running_reqs = args.slots
        now = per_step_us(lambda found=found: engine.scheduled(found, lambda _: output), args.steps)
        before = per_step_us(lambda found=found: previous_reads(found), args.steps)
        print(
            f"{args.traced} traced, {args.slots - free} of {args.slots} slots running: "
            f"the wrap {now:.1f} us a step, the previous reads {before:.1f} us"
        )


if __name__ == "__main__":
    main()
