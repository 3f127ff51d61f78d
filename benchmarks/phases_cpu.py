"""Where a traced request's host time goes, unprofiled: each phase's wall time, on this CPU.

    python benchmarks/phases_cpu.py [--jobs sweep,plain_sweep,steer] [--rounds 3] [--layers 36] [--served]

``profile_cpu.py`` splits a traced call under cProfile, which multiplies the
cost of small Python functions several times over (a steering trace's seal reads
44 ms there and 5 ms here). This wraps the phases a traced request passes
through in a timer each and runs the jobs as they are: the client's seal
(``_attach_mediators``, and inside it the pickle keys and the prefix claims),
vLLM's ``add_request`` and ``process_inputs`` (which holds the plugin's front-end
check), the worker's admission, its collect (the tables' saves, the wind-up,
the packing of replies, the pool), the front end's attach, and the engine's
steps, which hold all of the worker's. Per job and round it prints each phase's
milliseconds and calls. Engine, front end and worker share one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as in ``profile_cpu.py``; the model is its
random Qwen3 of ``--layers`` layers (36; hidden size 128), its middle layer tapped
(18: the layer the jobs below name).

With ``--served`` the engine core runs in a process of its own, as ``vllm.LLM``
runs it by default: its phases come back through ``collective_rpc``
(``gpu_bench._worker_phases``), and each job prints both processes' timelines
on one clock (each call's start and length; where the front end waits for
outputs and for a collect's reply). With ``--layers 2`` the model computes
almost nothing, so a job's time is its host work, as on a GPU whose steps are
short: there the last-row sweeps read 1.3-1.9x their plain runs (1.3-1.6x on an
H100), though not what this machine's Python 3.11 spares a trace's build that
the GPU machine's 3.12 does not (``benchmarks/RESULTS.md``). Jobs run in turn each round, after every job's warm-up, with both
processes' heaps then frozen (as vLLM's GPU worker and ``gpu_bench`` do); the
last lines give each traced job's median against its plain one's.

Jobs: ``sweep`` 1,024 prompts x 1 token in one trace, each keeping layer 18's
last row (``gpu_bench.sweep``); ``plain_sweep`` the same prompts plain;
``prefix`` and ``plain_prefix`` the same behind one fresh 512-token prefix, 16
tokens each after it (``gpu_bench.shared_prefix``);
``steer`` 64 x ``--tokens`` (4) with the seeds' loop, ``steer_docs`` the docs'
loop, ``plain_steer`` the same plain; ``trace1`` twenty one-token traces saving
the logits one after another, ``plain1`` twenty plain one-token calls;
``patch`` 64 invokes x ``--tokens``, each patching one prompt position of layer
18 from a clean prompt's rows (``gpu_bench.patch``); ``probe`` 64 x ``--tokens``
keeping every layer's last row every step (``gpu_bench.probe_rows``; with
``--every-layer``, which taps them all, it is lowered); ``capture`` 1,000 x
``--tokens`` keeping layer 18's output every step (``gpu_bench.capture``: a
quarter of them run at a time, the rest wait), ``plain_capture`` the same plain;
``at_taps`` 1 block no table runs (a Python ``if`` at the tap) among 63 plain
requests x ``--tokens``, ``at_taps_all`` 64 of them (``gpu_bench.halve_if_large``),
beside ``plain_steer``: on this eager engine their steps run the Python forward,
with ``--compiled`` the blocks run at the taps and the rest of the step compiled
(``gpu_bench.py``'s ``phases-taps`` engine times the same on a GPU).
The scheduler's ``schedule`` is timed per step. The
worker's per-step phases (the tables' fill, the forward's start, the sampler's
two calls) are timed too, so a per-step cost shows apart from a per-request one,
and so are Python's cyclic collections (``gc: generation N``, and ``gc in <phase>``
for the phase that was running when one began).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

#: Per phase, wall seconds and calls (reset per round).
SPENT: dict[str, list[float]] = {}


#: The phases running now, innermost last (where a collection lands).
_ACTIVE: list[str] = []

#: When a list: each timed call's (label, start, end), ``time.perf_counter`` seconds
#: (one clock for every process of the machine), for a timeline across processes.
EVENTS: list[tuple[str, float, float]] | None = None


def _timer(original: Any, label: str) -> Any:
    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        _ACTIVE.append(label)
        try:
            return original(*args, **kwargs)
        finally:
            _ACTIVE.pop()
            ended = time.perf_counter()
            seen = SPENT.setdefault(label, [0.0, 0])
            seen[0] += ended - started
            seen[1] += 1
            if EVENTS is not None:
                EVENTS.append((label, started, ended))

    return timed


def wrap(holder: Any, name: str, label: str | None = None) -> None:
    """Time ``holder.name`` (a module's function, as its callers look it up, or a
    class's method) under ``label``; a name the checkout lacks is left out (an
    older checkout, timed for comparison)."""
    if hasattr(holder, name):
        setattr(holder, name, _timer(getattr(holder, name), label or name))


_GC_STARTED: list[float] = []


def _gc_timer(phase: str, info: dict) -> None:
    """Python's cyclic collections, timed as phases of their own (per generation):
    their cost otherwise lands on whatever allocation set them off."""
    if phase == "start":
        _GC_STARTED[:] = [time.perf_counter()]
    elif _GC_STARTED:
        spent = time.perf_counter() - _GC_STARTED.pop()
        where = _ACTIVE[-1] if _ACTIVE else "outside the phases"
        for label in (f"gc: generation {info.get('generation')}", f"gc in {where}"):
            seen = SPENT.setdefault(label, [0.0, 0])
            seen[0] += spent
            seen[1] += 1


class Stacks:
    """Samples one thread's Python stack every ``every`` seconds while a job runs,
    so that a call much longer than its kind (a step's ``sample_tokens`` that
    waits) says where it waited, without a profiler's cost on every call. The
    sampling thread takes the interpreter lock about a thousand times a second:
    a job timed with it is slower than without, so it is on only when asked."""

    def __init__(self, every: float = 0.001, depth: int = 14) -> None:
        import threading

        self.ident = threading.get_ident()  # the thread that builds it is the one sampled
        self.every, self.depth = every, depth
        self.samples: list[tuple[float, tuple[str, ...]]] = []
        threading.Thread(target=self._run, name="stacks", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.every)
            frame = sys._current_frames().get(self.ident)
            if frame is None:
                continue
            stack = []
            while frame is not None and len(stack) < self.depth:
                code = frame.f_code
                stack.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
                frame = frame.f_back
            self.samples.append((time.perf_counter(), tuple(stack)))

    def clear(self) -> None:
        self.samples = []

    def where(self, events: list[tuple[str, float, float]], labels: tuple[str, ...], longer: float) -> list:
        """Each call of ``labels`` longer than ``longer`` seconds: its label, start,
        length, and the stacks sampled during it, most frequent first (each sample
        about ``every`` seconds)."""
        samples = self.samples
        found = []
        for label, start, end in events:
            if label not in labels or end - start < longer:
                continue
            counts: dict[tuple[str, ...], int] = {}
            for when, stack in samples:
                if start <= when <= end:
                    counts[stack] = counts.get(stack, 0) + 1
            top = sorted(counts.items(), key=lambda kv: -kv[1])[:6]
            found.append([label, start, round(1000 * (end - start), 1), [[n, list(s)] for s, n in top]])
        return found

    def profile(self, top: int = 30, depth: int = 8) -> dict[str, Any]:
        """Where the thread was through the whole job: every sample's innermost
        ``depth`` frames, the ``top`` most frequent, and each function's share of
        the samples it was on the stack of (a profile without a profiler's
        per-call cost, for steps too short to time one by one)."""
        samples = [stack for _, stack in self.samples]
        inner: dict[tuple[str, ...], int] = {}
        within: dict[str, int] = {}
        for stack in samples:
            inner[stack[:depth]] = inner.get(stack[:depth], 0) + 1
            for frame in set(stack):
                name = frame.split(" ", 1)[1] + " (" + frame.split(":", 1)[0] + ")"
                within[name] = within.get(name, 0) + 1
        return {
            "samples": len(samples),
            "stacks": [[n, list(s)] for s, n in sorted(inner.items(), key=lambda kv: -kv[1])[:top]],
            "functions": sorted(within.items(), key=lambda kv: -kv[1])[: 2 * top],
        }


def timeline(events: list[tuple[str, float, float]], origin: float, many: int = 40) -> dict[str, Any]:
    """Per label, each call's start and length in ms after ``origin``; a label of
    more than ``many`` calls gives its count, first start and last end instead."""
    by_label: dict[str, list[tuple[float, float]]] = {}
    for label, start, end in events:
        by_label.setdefault(label, []).append((start, end))
    found: dict[str, Any] = {}
    for label, spans in by_label.items():
        if len(spans) > many:
            found[label] = {
                "calls": len(spans),
                "first": round(1000 * (spans[0][0] - origin), 1),
                "last_end": round(1000 * (spans[-1][1] - origin), 1),
            }
        else:
            found[label] = [[round(1000 * (a - origin), 1), round(1000 * (b - a), 1)] for a, b in spans]
    return found


def instrument() -> None:
    import gc

    if _gc_timer not in gc.callbacks:
        gc.callbacks.append(_gc_timer)
    from vllm.v1.core.sched import scheduler
    from vllm.v1.engine import core_client, input_processor, llm_engine

    from vllm_nnsight_plugin import front
    from vllm_nnsight_plugin.client import _nnsight as client_nnsight
    from vllm_nnsight_plugin.client import model as client
    from vllm_nnsight_plugin.returns import pool
    from vllm_nnsight_plugin.taps import broken, install
    from vllm_nnsight_plugin.worker import _nnsight as worker_nnsight
    from vllm_nnsight_plugin.worker import live, lowering, runtime

    # (a trace is sealed in parts as vLLM reads its requests, where the checkout does so)
    wrap(
        client.VLLM,
        "_attach_part" if hasattr(client.VLLM, "_attach_part") else "_attach_mediators",
        "seal (client)",
    )
    wrap(client_nnsight, "_pickle_key", "seal: pickle keys")
    wrap(client.VLLM, "_claim_last_rows", "seal: prefix claims")
    wrap(llm_engine.LLMEngine, "add_request", "add_request (vLLM)")
    wrap(input_processor.InputProcessor, "process_inputs", "add_request: process_inputs")
    wrap(llm_engine.LLMEngine, "step", "engine steps (vLLM)")
    wrap(scheduler.Scheduler, "schedule", "steps: schedule (engine core)")
    wrap(runtime.WorkerRuntime, "begin_step", "steps: begin (worker)")
    wrap(runtime.WorkerRuntime, "_on_forward", "steps: forward's start (worker)")
    wrap(install.TapTables, "fill", "steps: tables filled")
    wrap(runtime.WorkerRuntime, "_start", "steps: forward's start: interleaver opened")
    wrap(runtime.WorkerRuntime, "_open_taps", "steps: forward's start: taps opened")
    wrap(live.AtTaps, "__call__", "steps: hand-offs at the taps")
    wrap(broken.BrokenGraph, "replay", "steps: graph broken at the taps replayed")
    wrap(runtime.WorkerRuntime, "_close_taps", "steps: taps closed")
    wrap(runtime.WorkerRuntime, "_on_logits", "steps: logits (worker)")
    wrap(runtime.WorkerRuntime, "_on_samples", "steps: samples (worker)")
    wrap(runtime, "admit", "steps: admission (worker)")
    wrap(runtime.WorkerRuntime, "collect", "collect (worker)")
    wrap(lowering.Lowering, "forget", "collect: tables")
    wrap(install.TapTables, "saves", "collect: tables' saves")
    wrap(worker_nnsight, "collect_entries", "collect: wind-up")
    wrap(runtime, "pack_all", "collect: packing")
    wrap(runtime, "pack", "collect: packing")  # (one request at a time, before pack_all)
    wrap(runtime, "pool_part", "collect: pool")
    wrap(pool.Pooler, "pool", "collect: pool: join")
    wrap(pool, "_room", "collect: pool: free memory asked")
    wrap(pool.Pool, "share", "collect: pool: shared")
    wrap(pool, "_as_bytes", "collect: pool: to host")
    wrap(front, "attach_collected", "attach (front end)")
    # With the engine core in a process of its own (``gpu_bench``'s ``phases-served``),
    # where the front end waits: for the engine's outputs, and for a collect's reply.
    wrap(core_client.SyncMPClient, "get_output", "outputs awaited (front end)")
    wrap(llm_engine.LLMEngine, "collective_rpc", "collect's reply awaited (front end)")
    wrap(pool.Resolver, "__init__", "attach: own copies")
    collect = client.VLLM._collect  # a static method: wrapped as one
    client.VLLM._collect = staticmethod(_timer(collect, "saves home (client)"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default="sweep,plain_sweep,steer,steer_docs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4, help="tokens a steering job draws")
    parser.add_argument("--every-layer", action="store_true", help="tap every decoder layer, not layer 18")
    parser.add_argument(
        "--layers", type=int, default=36, help="the random Qwen3's layers (the middle one tapped)"
    )
    parser.add_argument(
        "--served",
        action="store_true",
        help="the engine core in a process of its own, as vllm.LLM runs it: its phases come through "
        "collective_rpc, and each job's timeline of both processes is printed",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="vLLM's compiled forward (enforce_eager=False): a block at the taps runs there, "
        "the rest of the step compiled",
    )
    args = parser.parse_args()
    here = Path(__file__).resolve().parent
    if args.served:  # (before vLLM is imported)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        # the engine core's timers travel as functions of this folder's modules
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(here), os.environ.get("PYTHONPATH"))))

    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_nnsight_plugin import VLLM

    sys.path.insert(0, str(here))
    import gpu_bench as blocks
    from profile_cpu import engine, fresh_ids

    middle = args.layers // 2
    taps = ["layers"] if args.every_layer else [f"model.layers.{middle}.output"]
    llm = engine(args.layers, taps, eager=not args.compiled)
    model = VLLM(llm)
    blocks.LAYER = middle
    blocks.PROMPT_LEN = len(fresh_ids(1, 0)[0])  # the positions patching picks from
    instrument()
    torch.manual_seed(0)
    vector = torch.randn(128)
    runs = iter(range(1_000_000))

    def ids(n: int) -> list[list[int]]:
        return fresh_ids(n, next(runs))

    clean: list = []  # the rows patching restores, from the first call that needs them

    def patch() -> None:
        if not clean:
            clean.append(blocks.clean_rows(model, ids(1)[0]))
        blocks.patch(model, ids(64), args.tokens, clean[0])

    def shared(n: int) -> list[list[int]]:  # one fresh 512-token prefix, 16 tokens each after it
        return [[t % 400 + 2 for t in p] for p in blocks.shared_prefix(n, 700 + next(runs))]

    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    jobs = {
        "prefix": lambda: blocks.sweep(model, shared(1024)),
        "plain_prefix": lambda: llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in shared(1024)], one, use_tqdm=False
        ),
        "sweep": lambda: blocks.sweep(model, ids(1024)),
        "plain_sweep": lambda: llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in ids(1024)], one, use_tqdm=False
        ),
        "plain_steer": lambda: llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in ids(64)],
            SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False),
            use_tqdm=False,
        ),
        "plain1": lambda: [
            llm.generate([TokensPrompt(prompt_token_ids=ids(1)[0])], one, use_tqdm=False) for _ in range(20)
        ],
        "trace1": lambda: [blocks.trace1(model, ids(1)[0]) for _ in range(20)],
        "steer": lambda: blocks.steer(model, ids(64), args.tokens, vector),
        "patch": patch,
        "probe": lambda: blocks.probe_rows(model, ids(64), args.tokens, args.layers),
        "capture": lambda: blocks.capture(model, ids(1000), args.tokens),
        "plain_capture": lambda: llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in ids(1000)],
            SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False),
            use_tqdm=False,
        ),
        "steer_docs": lambda: blocks.steer_as_the_docs_write_it(model, ids(64), args.tokens, vector),
        "at_taps": lambda: blocks.halve_if_large(model, ids(64), args.tokens, among_plain=llm),
        "at_taps_all": lambda: blocks.halve_if_large(model, ids(64), args.tokens),
    }
    names = args.jobs.split(",")
    for name in names:
        jobs[name]()  # warm-up (the worker builds its tree on the first block)
    blocks.settle()  # (both heaps as vLLM's GPU worker leaves its own: frozen after start-up)
    if args.served:
        llm.collective_rpc(blocks._worker_phases, args=(str(here), "settle"))
        llm.collective_rpc(blocks._worker_phases, args=(str(here), "instrument"))
    walls: dict[str, list[float]] = {}
    global EVENTS
    for _ in range(args.rounds):  # the jobs in turn, so that a drift of the machine falls on all
        for name in names:
            if args.served:  # (before the front end's timers start: not a collect's wait)
                llm.collective_rpc(blocks._worker_phases, args=(str(here), "begin"))
            SPENT.clear()
            EVENTS = [] if args.served else None
            started = time.perf_counter()
            jobs[name]()
            wall = time.perf_counter() - started
            walls.setdefault(name, []).append(wall)
            found: dict[str, Any] = {"job": name, "ms": round(1000 * wall, 1)}
            found["phases"] = {label: [round(1000 * s, 1), int(n)] for label, (s, n) in SPENT.items()}
            if args.served:
                # (the scheduler's steps, which ``gpu_bench`` also records, are not here:
                # this CPU engine runs its worker, where the timers are, apart from it)
                ((spent, events, _counts),) = llm.collective_rpc(
                    blocks._worker_phases, args=(str(here), "take")
                )
                found["engine_core"] = {
                    label: [round(1000 * s, 1), int(n)] for label, (s, n) in spent.items()
                }
                found["timeline"] = timeline(EVENTS or [], started)
                found["engine_core_timeline"] = timeline(events, started)
            print("RESULT " + json.dumps(found), flush=True)
    for traced, plain in (("sweep", "plain_sweep"), ("prefix", "plain_prefix"), ("steer", "plain_steer")):
        if traced in walls and plain in walls:
            ratio = statistics.median(walls[traced]) / statistics.median(walls[plain])
            print(f"SUMMARY {traced}: {ratio:.3f}x {plain}'s time (medians of {args.rounds})", flush=True)


if __name__ == "__main__":
    main()
