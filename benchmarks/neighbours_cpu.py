"""What a block the tables cannot run costs the requests beside it, on this CPU.

A compiled SmolLM2 engine (vLLM's torch.compile path on a CPU; no CUDA graphs)
tapping layer 10. Each job is a batch of ``--prompts`` requests of ``--tokens``
greedy tokens, every one running to its last token (``ignore_eos``):

- ``plain``: no block;
- ``taps 1`` / ``taps all``: one request (or every one) whose block halves layer
  10's output when a Python ``if`` on its norm says so (it never does here): no
  table runs it, every location is a tap, so it runs at the taps and the forward
  stays compiled between them;
- ``python 1`` / ``python all``: the same block plus a read of the embedding
  (no tap), which runs the step's whole forward as Python (eager kernels).

Ratios are throughput against ``plain`` in the same run; ``same tokens`` counts
the plain neighbours whose tokens equal those of the all-plain batch.

    python benchmarks/neighbours_cpu.py --prompts 16 --tokens 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

PROMPTS = [
    "The capital of France is",
    "The largest planet in the solar system is",
    "Water boils at a temperature of",
    "The author of Pride and Prejudice is",
    "A haiku is a poem with",
    "The chemical symbol for gold is",
    "In computer science, a linked list is",
    "The first person to walk on the moon was",
]


def prepared_block(model, prompt: str, tokens: int, whole_forward: bool):
    with model.requests(prompt, temperature=0.0, max_tokens=tokens, ignore_eos=True) as tracer:
        for _ in tracer.iter[:tokens]:
            if whole_forward:
                model.model.embed_tokens.output.clone()
            hidden = model.model.layers[10].output[0]
            if hidden.norm() > 1e9:  # never, on these activations; Python decides
                hidden[:] *= 0.5
    return tracer.prepared


def run_batch(
    llm, model, batch: list[str], tokens: int, traced: int, whole_forward: bool
) -> tuple[float, list]:
    from vllm import SamplingParams

    plain = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts, params = [], []
    for i, prompt in enumerate(batch):
        if i < traced:
            prepared = prepared_block(model, prompt, tokens, whole_forward)
            prompts += prepared.prompts
            params += prepared.params
        else:
            prompts.append(prompt)
            params.append(plain)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from vllm import LLM

    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.models.smollm2 import smollm2_path

    llm = LLM(
        smollm2_path(),
        dtype="float32",
        max_model_len=512,
        enforce_eager=False,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=512 * 1024 * 1024,
        additional_config={"nnsight_taps": ["model.layers.10.output"]},
    )
    model = VLLM(llm)
    batch = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(args.prompts)]
    run_batch(llm, model, batch[:2], 4, 1, False)  # warm-up: compiles, builds the tree
    run_batch(llm, model, batch[:2], 4, 1, True)
    jobs = {
        "plain": (0, False),
        "taps 1": (1, False),
        "python 1": (1, True),
        "taps all": (args.prompts, False),
        "python all": (args.prompts, True),
    }
    walls: dict[str, list[float]] = {name: [] for name in jobs}
    tokens: dict[str, list] = {}
    (before,) = llm.collective_rpc("nnsight_stats")
    for _ in range(args.repeats):
        for name, (traced, whole) in jobs.items():
            wall, drawn = run_batch(llm, model, batch, args.tokens, traced, whole)
            walls[name].append(wall)
            tokens.setdefault(name, drawn)
    (after,) = llm.collective_rpc("nnsight_stats")
    plain = statistics.median(walls["plain"])
    rows = []
    for name in jobs:
        wall = statistics.median(walls[name])
        traced = jobs[name][0]
        same = sum(a == b for a, b in zip(tokens[name][traced:], tokens["plain"][traced:]))
        rows.append(
            {
                "job": name,
                "tok_s": round(args.prompts * args.tokens / wall, 1),
                "vs_plain": round(plain / wall, 3),
                "same_tokens": same,
                "of": args.prompts - traced,
            }
        )
    print(json.dumps({"prompts": args.prompts, "tokens": args.tokens, "repeats": args.repeats, "rows": rows}))
    print(
        json.dumps(
            {
                "uncompiled_steps": after["uncompiled_steps"] - before["uncompiled_steps"],
                "steps_at_taps": after["steps_at_taps"] - before["steps_at_taps"],
                "step_seconds": after["step_seconds"],
            }
        )
    )
    print("| job | tok/s | vs plain | neighbours' tokens as in the plain batch |")
    print("| --- | ---: | ---: | ---: |")
    for row in rows:
        print(
            f"| {row['job']} | {row['tok_s']:,.1f} | {row['vs_plain']:.3f} | {row['same_tokens']} of {row['of']} |"
        )


if __name__ == "__main__":
    main()
