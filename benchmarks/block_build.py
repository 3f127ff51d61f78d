"""What building blocks costs on the client: no engine, only the module tree.

    python benchmarks/block_build.py [--blocks 64] [--tree-copies]

Builds ``--blocks`` steering blocks (one per request: add a vector to layer 18's
output on each of 128 steps) for SmolLM2 with ``model.requests(...)`` and prints
the time and one block's size. ``--tree-copies`` serializes them the way nnsight
does by itself (every envoy copied into every block) for comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import time

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--tree-copies", action="store_true")
    args = parser.parse_args()

    import torch

    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.client import model as client
    from vllm_nnsight_plugin.models.smollm2 import smollm2_path

    if args.tree_copies:
        client.envoys_by_reference = lambda model: contextlib.nullcontext()
    model = VLLM(smollm2_path())  # the module tree on meta: no engine
    vector = torch.randn(576)
    prompts = [[(7 * i + 13 * j) % 1000 + 1 for j in range(32)] for i in range(args.blocks)]

    def build(n: int):
        layer = model.model.layers[18]
        with model.requests(temperature=0.0, max_tokens=128) as tracer:
            for ids in prompts[:n]:
                with tracer.invoke(ids):
                    for _ in tracer.iter[:128]:
                        hidden = layer.output[0]
                        hidden[:] += vector.to(hidden.device)
        return tracer.prepared

    build(4)  # warm-up
    start = time.perf_counter()
    prepared = build(args.blocks)
    seconds = time.perf_counter() - start
    size = len(prepared.params[0].extra_args["nnsight"])
    mode = "tree copies" if args.tree_copies else "references"
    print(f"{args.blocks} blocks ({mode}): {seconds:.3f} s, {size:,} bytes a block")
