"""Traced requests that share a long prompt prefix, on this CPU.

An eager SmolLM2 engine (fp32; prefix caching on, as vLLM configures it). Each
job is ``--prompts`` prompts that share a fresh prefix of ``--prefix`` tokens
(a template or a system prompt), each with ``--own`` tokens of its own, one
generated token each, as one batch:

- ``plain``: no block;
- ``last row``: each request keeps layer 10's last row (``output[0][-1]``),
  which reads no row the cache supplies: it shares the prefix cache
  (``prefix.py``);
- ``every row``: the same row taken from the whole output (``rows = output[0]``,
  then ``rows[-1]``), which the client cannot tell apart from a read of every
  row: it computes its whole prompt, as every traced request did before.

Times are milliseconds per batch (median of ``--repeats``), each run on a prefix
no earlier run used; ratios against ``plain`` in the same run.

    python benchmarks/prefix_cpu.py --prompts 32 --prefix 384 --own 16 --repeats 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time


def batch_of(tokenizer, run: int, prompts: int, prefix: int, own: int) -> list[dict]:
    words = [f"item{(run * 7919 + i) % 10007}" for i in range(prefix)]
    shared = tokenizer.encode(" ".join(words), add_special_tokens=False)[:prefix]
    return [
        {"prompt_token_ids": shared + tokenizer.encode(f" question {i} of run {run}:" + " x" * own)[:own]}
        for i in range(prompts)
    ]


def trace(model, batch: list[dict], whole: bool) -> list:
    with model.trace(temperature=0.0, max_tokens=1, use_tqdm=False) as tracer:
        for prompt in batch:
            with tracer.invoke(prompt):
                if whole:
                    rows = model.model.layers[10].output[0]
                    row = rows[-1].save()
                else:
                    row = model.model.layers[10].output[0][-1].save()
                result = tracer.result.save()  # noqa: F841
    return [row]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=384)
    parser.add_argument("--own", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.models.smollm2 import smollm2_path

    llm = LLM(
        smollm2_path(),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=args.prompts,
        max_num_batched_tokens=args.prompts * (args.prefix + args.own),
        kv_cache_memory_bytes=1 << 30,
    )
    model = VLLM(llm)
    tokenizer = llm.get_tokenizer()
    one = SamplingParams(temperature=0.0, max_tokens=1)
    runs = itertools.count(1)
    jobs = {
        "plain": lambda batch: llm.generate(batch, one, use_tqdm=False),
        "last row": lambda batch: trace(model, batch, whole=False),
        "every row": lambda batch: trace(model, batch, whole=True),
    }
    for run in jobs.values():  # warm-up
        run(batch_of(tokenizer, next(runs), 4, args.prefix, args.own))
    (before,) = llm.collective_rpc("nnsight_stats")
    walls: dict[str, list[float]] = {name: [] for name in jobs}
    for _ in range(args.repeats):
        for name, run in jobs.items():
            batch = batch_of(tokenizer, next(runs), args.prompts, args.prefix, args.own)
            start = time.perf_counter()
            run(batch)
            walls[name].append(1000 * (time.perf_counter() - start))
    (after,) = llm.collective_rpc("nnsight_stats")
    plain = statistics.median(walls["plain"])
    for name, times in walls.items():
        ms = statistics.median(times)
        print(
            json.dumps(
                {"job": name, "ms": round(ms, 1), "vs_plain": round(ms / plain, 3), "runs": len(times)}
            )
        )
    cached = after["prompt_rows_cached"] - before["prompt_rows_cached"]
    print(json.dumps({"job": "prompt_rows_cached", "rows": cached}))


if __name__ == "__main__":
    main()
