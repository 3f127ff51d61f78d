"""Where a traced request's time goes, on this CPU: the plugin's own cost, apart from the model's.

    python benchmarks/profile_cpu.py [--layers 36] [--sweep 1024] [--jobs sweep,forward,steer,capture]

The model is a random Qwen3 with ``--layers`` layers and hidden size 128, built in
code: as many modules per forward as Qwen3-8B (36 layers) but almost no arithmetic,
so what is left is the Python every traced request and step pays. Engine and
worker run in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so one cProfile
sees both. Per job it prints the plain and traced wall times (same engine, same
prompts, median) and one profiled traced run, split by entry point (``PARTS``,
cumulative milliseconds: the parts nest, so they do not add up), then the
functions with the most time of their own.

Jobs (the blocks of ``gpu_bench.py``; every call gets prompts no earlier call
used): ``sweep`` ``--sweep`` prompts x 1 token in one trace, each invoke keeping
layer L's last row; ``forward`` one prompt, one token, saving the logits
(latency, median of 20); ``steer`` 64 x 16 adding a vector at layer L every
step; ``capture`` 64 x 16 keeping layer L's output every step; ``prompt_read``
64 x 16 keeping layer L's last prompt row; ``probe`` 64 x 16 keeping every
layer's last row every step (``--every-layer`` taps them all, so it is lowered);
``patch`` 64 x 16, each request patching one prompt position of layer L with a
clean prompt's rows (activation patching, as the patching page writes it);
``prefix`` the ``sweep`` on ``--sweep`` prompts sharing a 512-token prefix,
each with 16 tokens of its own (``gpu_bench.shared_prefix``): the traced
requests read the prefix cache, as the plain ones do; ``at_taps`` ``--batch`` x 16
of a block no table runs (``gpu_bench.halve_if_large``), on this eager engine as
the Python forward (cProfile misplaces the time spent inside nnsight's greenlets:
``phases_cpu.py --compiled`` times the same block at the taps, unprofiled).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

#: Where a traced request's time goes: the cumulative time of each entry point
#: (``file fragment``, ``function``). They nest: ``generate`` holds ``admit``,
#: ``forward`` and ``collect (worker)``; the trace's total holds all of them.
PARTS = (
    ("seal (client)", "client/model.py", "_attach_mediators"),
    ("generate", "entrypoints/llm.py", "generate"),
    ("admit (worker)", "worker/admit.py", "admit"),
    ("step start (worker)", "worker/runtime.py", "_start"),
    ("model forward", "gpu_model_runner.py", "_model_forward"),
    ("interleaver handle", "modeling/vllm/interleaver.py", "handle"),
    ("collect (worker)", "worker/runtime.py", "collect"),
    ("attach (front end)", "returns/outputs.py", "attach_collected"),
    ("saves home (client)", "modeling/vllm/vllm.py", "_collect"),
)


def build_model(folder: Path, layers: int) -> str:
    """The test suite's tiny Qwen3, with ``layers`` layers (built once per folder).
    Only a build puts this checkout first on the path, which the engine's processes
    would inherit: a comparison of two checkouts on ``PYTHONPATH`` builds it first."""
    if (folder / "config.json").exists():
        return str(folder)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from vllm_nnsight_plugin.models.tiny import build_tiny_qwen3

    return build_tiny_qwen3(folder, layers=layers, max_positions=1024)


def fresh_ids(n: int, run: int) -> list[list[int]]:
    """``n`` prompts of 8 tokens, of the tiny vocabulary, that no other ``run`` uses:
    a plain request would otherwise be served from the prefix cache (a traced one
    that reads every row never is)."""
    return [[2 + run % 400, 2 + run // 400, 2 + i % 400, 2 + i // 400, 5, 6, 7, 8] for i in range(n)]


def engine(layers: int, taps: list[str], eager: bool = True) -> Any:
    """The engine the CPU profiles share: the random Qwen3 of ``layers`` layers,
    float32, eager (or vLLM's compiled forward: ``eager=False``), 256 requests a
    step, ``taps`` tapped (none: ``[]``)."""
    from vllm import LLM

    folder = Path(tempfile.gettempdir()) / f"vllm-nnsight-profile-qwen3-{layers}"
    return LLM(
        build_model(folder, layers),
        dtype="float32",
        max_model_len=1024,
        enforce_eager=eager,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=1 << 30,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        additional_config={"nnsight_taps": taps} if taps else {},
    )


def split(profile: cProfile.Profile, total: float) -> dict[str, float]:
    """Milliseconds in each of ``PARTS`` (cumulative), and the whole traced call."""
    stats = pstats.Stats(profile)
    found = {"total": round(1000 * total, 1)}
    for name, fragment, function in PARTS:
        cumulative = sum(
            row[3] for (file, _, fn), row in stats.stats.items() if fragment in file and fn == function
        )
        found[name] = round(1000 * cumulative, 1)
    return found


def top(profile: cProfile.Profile, n: int = 25) -> list[str]:
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:n]
    return [
        f"{own:7.3f} {total:7.3f} {calls:7d} {'/'.join(file.split('/')[-3:])}:{line}:{fn}"
        for (file, line, fn), (_, calls, own, total, _) in rows
    ]


def plugin_parts(profile: cProfile.Profile, n: int = 40) -> list[str]:
    """The plugin's own functions by cumulative time (the parts of ``PARTS`` opened
    up: which of a collect's or an attach's steps costs what on this machine)."""
    stats = pstats.Stats(profile)
    rows = sorted(
        ((key, row) for key, row in stats.stats.items() if "vllm_nnsight_plugin" in key[0]),
        key=lambda item: -item[1][3],
    )[:n]
    return [
        f"{total:7.3f} {own:7.3f} {calls:7d} {file.split('vllm_nnsight_plugin/')[-1]}:{line}:{fn}"
        for (file, line, fn), (_, calls, own, total, _) in rows
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--layer", type=int, default=18)
    parser.add_argument("--sweep", type=int, default=1024)
    parser.add_argument("--jobs", default="sweep,forward,steer,capture,prompt_read")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--taps", action="store_true", help="tap layer L, so steer and capture are lowered")
    parser.add_argument(
        "--every-layer", action="store_true", help="tap every decoder layer (the probe needs it)"
    )
    parser.add_argument("--batch", type=int, default=64, help="requests in the steer and capture jobs")
    parser.add_argument(
        "--dump", help="folder to write each job's pstats files to (NAME.pstats, NAME-plain.pstats)"
    )
    args = parser.parse_args()

    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_nnsight_plugin import VLLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_bench as blocks

    taps = ["layers"] if args.every_layer else [f"model.layers.{args.layer}.output"] if args.taps else []
    llm = engine(args.layers, taps)
    model = VLLM(llm)
    torch.manual_seed(0)
    vector = torch.randn(128)
    blocks.LAYER = args.layer
    blocks.PROMPT_LEN = 8  # the prompts below: the positions patching restores
    runs = iter(range(1_000_000))

    def ids(n: int) -> list[list[int]]:
        return fresh_ids(n, next(runs))

    @functools.cache
    def clean() -> tuple:
        return blocks.clean_rows(model, ids(1)[0])

    def plain(n: int, tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids(n)], params, use_tqdm=False)

    def shared(n: int) -> list[list[int]]:
        prompts = blocks.shared_prefix(n, 700 + next(runs))  # (into the tiny vocabulary)
        return [[t % 400 + 2 for t in p] for p in prompts]

    def plain_shared(n: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in shared(n)], params, use_tqdm=False)

    jobs = {  # (traced, plain); the blocks are the GPU benchmark's own
        "sweep": (lambda: blocks.sweep(model, ids(args.sweep)), lambda: plain(args.sweep, 1)),
        "forward": (lambda: blocks.trace1(model, ids(1)[0]), lambda: plain(1, 1)),
        "lens": (lambda: blocks.lens(model, ids(1)[0]), lambda: plain(1, 1)),
        "steer": (lambda: blocks.steer(model, ids(args.batch), 16, vector), lambda: plain(args.batch, 16)),
        "capture": (lambda: blocks.capture(model, ids(args.batch), 16), lambda: plain(args.batch, 16)),
        "prompt_read": (
            lambda: blocks.prompt_read(model, ids(args.batch), 16),
            lambda: plain(args.batch, 16),
        ),
        "probe": (
            lambda: blocks.probe_rows(model, ids(args.batch), 16, args.layers),
            lambda: plain(args.batch, 16),
        ),
        "patch": (
            lambda: blocks.patch(model, ids(args.batch), 16, clean()),
            lambda: plain(args.batch, 16),
        ),
        "at_taps": (
            lambda: blocks.halve_if_large(model, ids(args.batch), 16),
            lambda: plain(args.batch, 16),
        ),
        "prefix": (
            lambda: blocks.sweep(model, shared(args.sweep)),
            lambda: plain_shared(args.sweep),
        ),
    }
    for name in args.jobs.split(","):
        traced, untraced = jobs[name]
        untraced(), traced()  # warm-up (the worker builds its tree on the first block)
        repeats = 20 if name in ("forward", "lens") else 3
        plain_s = statistics.median(_wall(untraced) for _ in range(repeats))
        traced_s = statistics.median(_wall(traced) for _ in range(repeats))
        profile = cProfile.Profile()
        profiled_s = _wall(functools.partial(profile.runcall, traced))
        if args.dump:  # with the plain run's profile, to compare function by function
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            profile.dump_stats(Path(args.dump) / f"{name}.pstats")
            plain_profile = cProfile.Profile()
            plain_profile.runcall(untraced)
            plain_profile.dump_stats(Path(args.dump) / f"{name}-plain.pstats")
        print(
            "RESULT "
            + json.dumps(
                {
                    "job": name,
                    "plain_ms": round(1000 * plain_s, 2),
                    "traced_ms": round(1000 * traced_s, 2),
                    "ratio": round(traced_s / plain_s, 3),
                    "profiled_ms": split(profile, profiled_s),
                }
            ),
            flush=True,
        )
        for row in top(profile, args.top):
            print(f"  {name} {row}")


def _wall(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
