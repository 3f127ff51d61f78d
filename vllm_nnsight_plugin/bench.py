"""``vllm-nnsight bench``: what the plugin costs, plain vLLM against the same batch
with the plugin installed (``benchmarks/overhead.py`` runs the same).

One command, two engine processes with identical settings, run one after the
other (vLLM loads plugins per process, so "without the plugin" needs its own):

- ``plain``: ``VLLM_NNSIGHT_DISABLE=1``, stock vLLM;
- with the plugin: ``idle`` (no block), ``capture`` (one layer's output, every
  token of every request, cloned and saved), ``steer`` (add a vector to one
  layer on every step), and the sweep pair: ``idle_sweep`` (``--sweep`` prompts,
  one token each, no block) against ``sweep`` (the same prompts in one trace,
  each invoke keeping one layer's last row), counted in prompts/s.

Each job generates ``--prompts`` x ``--tokens`` greedy tokens (``ignore_eos``)
and is repeated ``--repeats`` times; the best run counts. Every run has prompts
of its own (a traced request never reads the prefix cache, so a plain run on
repeated prompts would skip work the traced run does). Ratios are tokens/s
against ``plain`` (another process, so it carries that process's noise) and
against ``idle`` (the same engine, same process: the cost of the block itself).
With ``--taps`` both engines are built with layer ``--layer`` tapped, so the
capture and steering blocks run lowered onto the tap (``docs/taps.md``).

    vllm-nnsight bench --prompts 16 --tokens 32 [--taps]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from vllm_nnsight_plugin.models.smollm2 import smollm2_path
from vllm_nnsight_plugin.settings import DISABLE

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle number"
_RUNS = iter(range(1_000_000))


def prompts(n: int) -> list[str]:
    """``n`` prompts no earlier call used (they differ from the first token on)."""
    run = next(_RUNS)
    return [f"{run}: {PROMPT} {i}." for i in range(n)]


def run_jobs(args: argparse.Namespace, jobs: list[str]) -> dict:
    import torch
    from vllm import LLM, SamplingParams

    from vllm_nnsight_plugin.seams.frontend import hidden_size_of

    llm = LLM(
        args.model or smollm2_path(),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_num_seqs=max(16, args.prompts),
        additional_config={"nnsight_taps": [f"model.layers.{args.layer}.output"] if args.taps else "none"},
    )
    batch = prompts(args.prompts)
    sampling = dict(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(batch[:2], SamplingParams(**{**sampling, "max_tokens": 4}), use_tqdm=False)  # warm-up
    results: dict[str, float] = {}

    def timed(fn) -> float:
        nonlocal batch, swept
        best = 0.0
        for _ in range(args.repeats):
            batch, swept = prompts(args.prompts), prompts(args.sweep)
            started = time.perf_counter()
            produced = fn()
            best = max(best, produced / (time.perf_counter() - started))
        return best

    def plain() -> int:
        outs = llm.generate(batch, SamplingParams(**sampling), use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    swept = prompts(args.sweep)

    def idle_sweep() -> int:
        llm.generate(swept, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        return len(swept)

    model = None
    if any(job in ("capture", "steer", "sweep") for job in jobs):
        from .client.model import VLLM

        model = VLLM(llm)
    layer = args.layer
    torch.manual_seed(0)
    vector = torch.randn(hidden_size_of(llm))
    vector = vector / vector.norm()

    def capture() -> int:
        with model.trace(**sampling) as tracer:
            for prompt in batch:
                with tracer.invoke(prompt):
                    rows = list().save()
                    for _ in tracer.iter[: args.tokens]:
                        rows.append(model.model.layers[layer].output[0].clone())
        assert len(rows) == len(batch) and all(len(r) == args.tokens for r in rows), "capture lost steps"
        return len(batch) * args.tokens

    def steer() -> int:
        with model.trace(**sampling) as tracer:
            for prompt in batch:
                with tracer.invoke(prompt):
                    for _ in tracer.iter[: args.tokens]:
                        model.model.layers[layer].output[0][:] += 8.0 * vector
                    result = tracer.result.save()
        return sum(len(r.outputs[0].token_ids) for r in result)

    def sweep() -> int:
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            for prompt in swept:
                with tracer.invoke(prompt):
                    last = model.model.layers[layer].output[0][-1].clone().save()
        assert len(last) == len(swept), "the sweep lost rows"
        return len(swept)

    for job in jobs:
        fn = {
            "plain": plain,
            "idle": plain,
            "capture": capture,
            "steer": steer,
            "idle_sweep": idle_sweep,
            "sweep": sweep,
        }[job]
        results[job] = timed(fn)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm-nnsight bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--sweep", type=int, default=128)
    parser.add_argument("--taps", action="store_true", help="tap --layer: capture and steer run lowered")
    parser.add_argument("--jobs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.jobs:  # child process: run the jobs, print one JSON line
        print("RESULT " + json.dumps(run_jobs(args, args.jobs.split(","))), flush=True)
        return

    def child(jobs: str, disable: bool) -> dict:
        env = dict(os.environ)
        if disable:
            env[DISABLE] = "1"
        flags = [
            f"--{k}" if v is True else f"--{k}={v}"
            for k, v in vars(args).items()
            if v is not None and v is not False and k != "jobs"
        ]
        command = [sys.executable, "-m", "vllm_nnsight_plugin.bench", "--jobs", jobs, *flags]
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        for line in out.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        raise SystemExit(f"benchmark child failed:\n{out.stderr[-4000:]}")

    results = {**child("plain", disable=True), **child("idle,capture,steer,idle_sweep,sweep", disable=False)}
    import torch
    import vllm

    base = results["plain"]
    print(
        f"# {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, vLLM {vllm.__version__}, torch {torch.__version__}"
    )
    taps = f", layer {args.layer} tapped" if args.taps else ""
    print(
        f"# {args.prompts} prompts x {args.tokens} tokens, best of {args.repeats}, layer {args.layer}{taps}"
    )
    idle = results["idle"]
    print("| job | tokens/s | vs plain (plugin off) | vs idle (same engine) |")
    print("| --- | ---: | ---: | ---: |")
    for job in ("plain", "idle", "capture", "steer"):
        same = "" if job == "plain" else f"{results[job] / idle:.3f}"
        print(f"| {job} | {results[job]:.1f} | {results[job] / base:.3f} | {same} |")
    print(
        f"| sweep, {args.sweep} prompts x 1 token (prompts/s) | {results['sweep']:.1f} | | "
        f"{results['sweep'] / results['idle_sweep']:.3f} of {results['idle_sweep']:.1f} without a block |"
    )


if __name__ == "__main__":
    main()
