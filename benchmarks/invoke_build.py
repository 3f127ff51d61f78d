"""What a trace of many invokes costs the client to build, on any Python: no vLLM, no engine.

    python benchmarks/invoke_build.py [--invokes 1024] [--layers 36] [--layer 18] [--skip lines|nnsight]

Builds issue 29's sweep (one invoke per prompt, each keeping one layer's last row)
with ``model.requests(...)`` against a module tree on meta (a served model's
stand-in tree, so nothing is contacted) and prints, as ``RESULT`` JSON, the
median of 7 builds: the whole call (``total_ms``), the part that runs the trace's
body, entering and leaving each invoke (``invokes_ms``), and the seal after it.
``--skip nnsight`` keeps nnsight's own way of skipping each block's body (a
global trace function set and cleared per invoke), ``lines`` the client's
(``client/skip.py``, Python 3.12 and later). The heap is frozen after the
warm-up, as the client does for a trace it runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--invokes", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--layer", type=int, default=18)
    parser.add_argument("--skip", choices=("lines", "nnsight"), default="lines")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", help="a file for cProfile's stats of one more build (not timed)")
    args = parser.parse_args()

    import nnsight.tracing.tracer as nnsight_tracer
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from vllm_nnsight_plugin.client import model as client
    from vllm_nnsight_plugin.client import skip
    from vllm_nnsight_plugin.wire.tree import describe, rebuild

    config = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    )
    with torch.device("meta"):
        tree = rebuild(describe(Qwen3ForCausalLM(config)))
    client._ServedModel.tree = lambda self: (tree, None)  # the server's tree, without a server
    model = client.VLLM("stand-in", serve="http://127.0.0.1:9", key="k" * 32)
    if args.skip == "nnsight":
        nnsight_tracer.skip_context = skip.ORIGINAL
    prompts = [[2 + i % 400, 2 + i // 400, 5, 6, 7, 8] for i in range(args.invokes)]
    layer = model.model.layers[args.layer]
    ended: list[float] = []

    def build() -> tuple[float, float]:
        started = time.perf_counter()
        with model.requests(temperature=0.0, max_tokens=1) as tracer:
            for ids in prompts:
                with tracer.invoke(ids):
                    layer.output[0][-1].clone().save()
            ended.append(time.perf_counter())
        return time.perf_counter() - started, ended[-1] - started

    for _ in range(2):
        build()
    gc.collect()
    gc.freeze()
    rounds = [build() for _ in range(args.rounds)]
    if args.profile:
        import cProfile

        cProfile.runctx("build()", globals(), locals(), args.profile)
    total = statistics.median(r[0] for r in rounds)
    invokes = statistics.median(r[1] for r in rounds)
    print(
        "RESULT "
        + json.dumps(
            {
                "python": platform.python_version(),
                "skip": args.skip if nnsight_tracer.skip_context is skip.skip_body else "nnsight",
                "invokes": args.invokes,
                "layer": args.layer,
                "total_ms": round(1000 * total, 1),
                "invokes_ms": round(1000 * invokes, 1),
                "seal_ms": round(1000 * (total - invokes), 1),
                "machine": platform.processor() or platform.machine(),
            }
        ),
        flush=True,
    )
    sys.exit(0)
