"""What a one-token trace saving the logits costs over a plain one-token call, on
an engine run as users run it (front end, engine core and worker in their own
processes), and where the front end spends it.

    OMP_NUM_THREADS=2 python benchmarks/trace_latency.py [--eager] [--profile]

The model is ``profile_cpu.py``'s random 36-layer Qwen3 (built once under the
temp folder); every call gets a fresh 32-token prompt, so neither the plain nor
the traced request is served from the prefix cache. Prints the median of ten
plain and ten traced calls, twice; ``--profile`` adds the front end's cProfile
of ten more traces (cumulative).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path


def median_ms(fn, prompts) -> float:
    walls = []
    for prompt in prompts:
        start = time.perf_counter()
        fn(prompt)
        walls.append(time.perf_counter() - start)
    return 1000 * statistics.median(walls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="enforce_eager=True (default: compiled)")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_nnsight_plugin import VLLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_bench import trace1
    from profile_cpu import build_model

    folder = Path(tempfile.gettempdir()) / "vllm-nnsight-profile-qwen3-36"
    llm = LLM(
        build_model(folder, 36),
        dtype="float32",
        max_model_len=512,
        enforce_eager=args.eager,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=1 << 30,
        max_num_seqs=16,
    )
    model = VLLM(llm)
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    # The tiny model's vocabulary has 439 ids; every prompt differs in its first two.
    fresh = iter([[2 + i, 3 + i % 7] + [(5 * i + j) % 400 + 2 for j in range(30)] for i in range(80)])
    take = lambda n: [next(fresh) for _ in range(n)]  # noqa: E731
    for prompt in take(3):  # warm-up: builds the worker's tree
        llm.generate([prompt], one, use_tqdm=False)
        trace1(model, prompt)
    for _ in range(2):
        plain = median_ms(lambda p: llm.generate([p], one, use_tqdm=False), take(10))
        traced = median_ms(lambda p: trace1(model, p), take(10))
        print(f"plain {plain:.2f} ms, traced {traced:.2f} ms, +{traced - plain:.2f} ms", flush=True)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [trace1(model, p) for p in take(10)])
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)


if __name__ == "__main__":
    main()
