"""A one-token trace's cost over a plain call, with the engine in its own process
(as ``vllm.LLM`` runs it), on this CPU.

    python benchmarks/latency_cpu.py [--rounds 4] [--calls 20]

The model is ``profile_cpu.py``'s random 36-layer Qwen3 (hidden size 128, eager),
every decoder layer tapped. Each round times, call after call on fresh prompts, a
plain one-token call, a one-token trace saving the logits (``gpu_bench.trace1``),
the logit lens over every layer (``gpu_bench.lens``, served at the sampler) and a
bare ``collective_rpc`` to the worker; it prints each one's median. The front end,
the engine core and the worker are apart here, so the trace pays what it pays
under ``vllm.LLM``: its seal, the collect's round trip to the worker, the attach.
To compare two checkouts, run it with each on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_nnsight_plugin import VLLM

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import gpu_bench as blocks
    from profile_cpu import build_model

    folder = Path(tempfile.gettempdir()) / "vllm-nnsight-profile-qwen3-36"
    # built once (``build_model`` puts this checkout first on the path, which the
    # engine's processes would inherit: a comparison of two checkouts builds it first)
    path = str(folder) if (folder / "config.json").exists() else build_model(folder, 36)
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=1024,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=1 << 30,
        additional_config={"nnsight_taps": ["layers"]},
    )
    model = VLLM(llm)
    runs = iter(range(1_000_000))
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)

    def fresh() -> list[int]:
        run = next(runs)
        return [2 + run % 400, 2 + run // 400, 3, 4, 5, 6, 7, 8]

    jobs = {
        "plain": lambda: llm.generate([TokensPrompt(prompt_token_ids=fresh())], one, use_tqdm=False),
        "trace1": lambda: blocks.trace1(model, fresh()),
        "lens": lambda: blocks.lens(model, fresh()),
        "rpc": lambda: llm.collective_rpc("nnsight_stats"),
    }
    for job in jobs.values():  # warm-up (the worker builds its tree on the first block)
        job(), job()
    for round_ in range(args.rounds):
        found = {}
        for name, job in jobs.items():
            walls = []
            for _ in range(args.calls):
                start = time.perf_counter()
                job()
                walls.append(1000 * (time.perf_counter() - start))
            found[name] = round(statistics.median(walls), 2)
        found["trace1_over_plain"] = round(found["trace1"] - found["plain"], 2)
        found["lens_over_plain"] = round(found["lens"] - found["plain"], 2)
        print("RESULT " + json.dumps({"round": round_, **found}), flush=True)


if __name__ == "__main__":
    main()
