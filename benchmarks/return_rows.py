"""What making a collect's lists of rows costs the front end, with Python's cyclic
collector paused (as ``returns/outputs.merge_replies`` pauses it) and running.

    python benchmarks/return_rows.py [--requests 64] [--rows 4608] [--rounds 5]

A probe keeps every layer's last row at every step: 64 requests x 128 steps x 36
layers are 64 lists of 4,608 rows, each row a tensor of its own, made from one
stacked tensor per request (``returns/stacked.Stacked.unstack``). Every tensor is
an object the collector tracks, so how long the lists take depends on how many
objects the process holds; this process imports vLLM and the client, as a user's
does. Prints one ``RESULT {json}`` line: the process's tracked objects and the
milliseconds of each round, paused and running, alternated.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch


def made_ms(stacks: list, paused: bool) -> float:
    from vllm_nnsight_plugin.returns.stacked import uncollected

    started = time.perf_counter()
    if paused:
        with uncollected():
            lists = [stack.unstack() for stack in stacks]
    else:
        lists = [list(stack.data.unbind(0)) for stack in stacks]  # unstack's work, collector running
    elapsed = time.perf_counter() - started
    del lists
    return round(1000 * elapsed, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rows", type=int, default=4608)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    import vllm  # noqa: F401 - the objects a front end holds

    from vllm_nnsight_plugin import VLLM  # noqa: F401 - and the client's
    from vllm_nnsight_plugin.returns.stacked import Stacked

    stacks = [Stacked(torch.zeros(args.rows, 8), None) for _ in range(args.requests)]
    found: dict = {"tracked_objects": len(gc.get_objects()), "paused_ms": [], "running_ms": []}
    for _ in range(args.rounds):
        found["running_ms"].append(made_ms(stacks, paused=False))
        found["paused_ms"].append(made_ms(stacks, paused=True))
    print("RESULT " + json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
