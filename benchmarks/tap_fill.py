"""What filling the tap tables costs per step, with no engine: the host's work
before each forward of a tapped engine, by number of lowered requests.

    python benchmarks/tap_fill.py [--requests 64,256] [--steps 200]

Each lowered request has one decode row per step (the steady state); ``steer``
requests point their rows at a bank row, ``keep`` requests at a place in the
store. Prints microseconds per step (median of five timings of ``--steps`` fills).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from vllm_nnsight_plugin.taps.install import Lowered, TapTables
from vllm_nnsight_plugin.taps.ops import KEEP_FIRST


def per_step_us(requests: int, keep: bool, steps: int) -> float:
    room = 5 * steps + 1  # every fill below keeps one row a request
    # The fill never touches a row's width: a narrow model keeps the store small.
    tables = TapTables(
        ("model.layers.18",), 8192, 64, 2 * requests + 16, "cpu", store_size=requests * room + 1
    )
    ids = [f"request-{i}" for i in range(requests)]
    for request_id in ids:
        if keep:
            tables.add(request_id, Lowered(0, 0, None, None, code=KEEP_FIRST, name="rows"), room=room)
        else:
            tables.add(request_id, Lowered(0, 0, None, None), torch.ones(64))
    bounds = np.arange(requests + 1)
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(steps):
            tables.fill(ids, bounds)
        timings.append((time.perf_counter() - start) / steps * 1e6)
    assert len(tables.requests) == requests and not tables.overflowed(tables.requests[ids[-1]])
    return statistics.median(timings)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", default="64,256")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    for requests in (int(n) for n in args.requests.split(",")):
        for keep in (False, True):
            us = per_step_us(requests, keep, args.steps)
            print(f"{'keep' if keep else 'steer'} {requests} requests: {us:.1f} us a step")
