"""A one-token trace's cost over a plain call, with the engine in its own process
(as ``vllm.LLM`` runs it), on this CPU.

    python benchmarks/latency_cpu.py [--rounds 4] [--calls 20] [--layers 36] [--sweep 0]

The model is ``profile_cpu.py``'s random 36-layer Qwen3 (hidden size 128, eager),
every decoder layer tapped. Each round times, call after call on fresh prompts, a
plain one-token call, a one-token trace saving the logits (``gpu_bench.trace1``),
the logit lens over every layer (``gpu_bench.lens``, served at the sampler) and a
bare ``collective_rpc`` to the worker; it prints each one's median. The front end,
the engine core and the worker are apart here, so the trace pays what it pays
under ``vllm.LLM``: its seal, the collect's round trip to the worker, the attach.
To compare two checkouts, run it with each on ``PYTHONPATH``.

``--sweep N`` times instead, round after round, ``N`` plain one-token prompts and
the last-row sweep of ``N`` (``gpu_bench.sweep``, the middle layer), with the
front end's parts of each: the client's seal, ``add_request``, the engine's steps,
and within them the collects' round trips to the worker (``FrontEnd.stepped``)
and the attach. ``--layers`` picks the model's depth (a shallow one leaves the
host's work a larger share).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--sweep", type=int, default=0, help="time a sweep of this many prompts instead")
    args = parser.parse_args()

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_nnsight_plugin import VLLM

    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import gpu_bench as blocks
    from profile_cpu import engine, fresh_ids

    llm = engine(args.layers, ["layers"])
    model = VLLM(llm)
    if args.sweep:
        blocks.LAYER = args.layers // 2
        sweeps(llm, model, blocks, args.sweep, args.rounds)
        return
    runs = iter(range(1_000_000))
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)

    def fresh() -> list[int]:
        return fresh_ids(1, next(runs))[0]

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


def sweeps(llm, model, blocks, n: int, rounds: int) -> None:
    """A plain one-token run of ``n`` prompts, then the sweep of ``n``, per round;
    each with the front end's parts (``phases_cpu.py``'s timers)."""
    import gc

    import phases_cpu as phases
    from profile_cpu import fresh_ids
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine import llm_engine

    from vllm_nnsight_plugin import front
    from vllm_nnsight_plugin.client import model as client

    phases.wrap(client.VLLM, "_attach_mediators", "seal (client)")
    phases.wrap(llm_engine.LLMEngine, "add_request", "add_request (vLLM)")
    phases.wrap(llm_engine.LLMEngine, "step", "engine steps (vLLM)")
    phases.wrap(front.FrontEnd, "stepped", "steps: collects' round trips and attach")
    phases.wrap(front, "attach_collected", "attach (front end)")
    runs = iter(range(1_000_000))

    def ids() -> list[list[int]]:
        return fresh_ids(n, next(runs))

    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    jobs = {
        "plain_sweep": lambda: llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in ids()], one, use_tqdm=False
        ),
        "sweep": lambda: blocks.sweep(model, ids()),
    }
    for job in jobs.values():  # warm-up
        job()
    gc.collect()
    gc.freeze()  # (a full collection of the front end's heap lands on either job by chance)
    for round_ in range(rounds):
        found: dict = {"round": round_}
        for name, job in jobs.items():
            phases.SPENT.clear()
            start = time.perf_counter()
            job()
            found[name] = round(1000 * (time.perf_counter() - start), 1)
            found[f"{name} parts"] = {k: [round(1000 * s, 1), int(c)] for k, (s, c) in phases.SPENT.items()}
        found["sweep_over_plain"] = round(found["sweep"] - found["plain_sweep"], 1)
        print("RESULT " + json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
