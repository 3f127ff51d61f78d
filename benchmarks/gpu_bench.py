"""The GPU benchmark: the plugin against plain vLLM on the same engine settings.

    python benchmarks/gpu_bench.py run OUT_DIR MODEL_DIR [--engines=A,B,...] [--repeats=N]

Every engine runs in its own process (the plugin is off in a process with
``VLLM_PLUGINS=""``, and a plugin patches classes process-wide). Each prints
``RESULT {json}`` lines that the parent gathers into ``OUT_DIR/results.jsonl``
and a table (``python benchmarks/gpu_bench.py table OUT_DIR_OR_JSONL...``).

Engines (MODEL_DIR holds a config and tokenizer; weights are ``load_format="dummy"``):

- ``off-graphs``  plugin not loaded: stock vLLM, CUDA graphs and torch.compile
- ``on-graphs``   plugin installed, same settings, no taps (``"none"``: not the default
                  taps of a CUDA engine): idle, steer, capture, logit lens
- ``off-eager``   stock vLLM with ``enforce_eager=True``
- ``on-eager``    plugin, eager engine: the same jobs, to split forward from block cost
- ``on-taps``     plugin, graphed engine with layer 18 tapped: the steering block is
                  lowered onto the tap (``taps/``), the rest runs as on ``on-graphs``
- ``nnsight``     nnsight 0.8.1's own vLLM integration (eager; plugin off)
- ``hotwire``     hotwire-vllm 0.1.2 (wheel in ``.vllmkit/anchors``), steering the same
                  layer; its ``steer`` rows are against its own ``plain`` (plugin off)
- ``hf``          nnsight on HF transformers (``LanguageModel``), the usual baseline
- ``profile``     the plugin, eager, engine and worker in one process under cProfile
- ``profile-graphs`` the same on the graphed engine (one-token traces beside plain
                  calls, the lens, the sweep)
- ``profile-taps`` the same on the tapped engine (lowered capture and steering)
- ``profile-served`` the tapped engine as ``vllm.LLM`` runs it (the engine core in
                  a process of its own): each job's wall time unprofiled after its
                  plain run, then the front end and the worker each under cProfile
                  (the worker's profiler started and stopped through
                  ``collective_rpc``), both profiles packed into one archive
- ``phases-taps`` the tapped engine in one process, unprofiled, each phase a
                  traced request passes through timed (``phases_cpu.instrument``):
                  patching, the probe, the capture and blocks at the taps, each
                  after its plain run (``GPU_BENCH_PHASES_JOBS``: some, by name)
- ``phases-served`` the same jobs with the engine core in a process of its own,
                  as ``vllm.LLM`` runs it: the front end's phases, where it waits
                  for the engine's outputs and for a collect's reply, the engine
                  core's phases (through ``collective_rpc``), and both timelines;
                  with ``GPU_BENCH_STACKS=1``, the engine core's stacks sampled
                  every millisecond: those during each call of a step's longer
                  than 15 ms, and the job's whole profile of them
                  (``phases_cpu.Stacks``: slows the runs a little)

``GPU_BENCH_NO_IDLE=1`` skips the idle engine's plain runs (the paired jobs
carry their own); ``GPU_BENCH_ENGINE_S`` (560) stops an engine's process after
that many seconds.
``GPU_BENCH_LAYER`` and ``GPU_BENCH_PROMPT_LEN`` move the layer (18) and the prompt
length (32), so that no figure depends on one setting; ``GPU_BENCH_MAX_NUM_SEQS``
the engines' ``max_num_seqs`` (256; ``vllm``: vLLM's default for the device).
``GPU_BENCH_TAPS`` (patterns, comma-separated) replaces the tapped engines' one
tap, e.g. ``model.layers.*.output`` for every layer (the jobs still use ``LAYER``).
``GPU_BENCH_IDLE_ONLY=1`` stops after the plain jobs (what the plugin costs an idle engine);
``GPU_BENCH_JOBS=patch`` runs the tapped engine's plain jobs, then patching alone
(``at_taps``: the blocks that run as Python at the taps alone; ``prefix``: 1,024
prompts sharing a 512-token prefix, plain on every engine and, on the tapped
one, a sweep keeping one layer's last row, which shares the prefix cache; ``paired``:
issue 27's table, each job right after a plain run of its size on the same engine
(steering 64 and 256, the docs' loop, a direction removed and clamped, capture
1,000, patching, the last-row sweep of 1,024 unique prompts and, with every layer
tapped, the probe), and a plain one-token call, a one-token trace and the lens in
turn, ``--repeats`` rounds (first, ``collect_check``: requests finishing at
different steps, lowered against Python, and where their collects read): ratios that a drift of the machine between runs moves
on both sides; ``GPU_BENCH_PAIRED=steer,sweep`` picks some of its jobs, and
``GPU_BENCH_BESIDE=ab`` runs each of them twice a round on the one engine, its
collects beside the step in flight (``<job>_pair_beside``) and waiting for the device
(``<job>_pair_waited``); ``timeline``:
plain and steering runs and the sweep under the engine's torch profiler, each with
the device's busy time and span, so a cost can be told apart as kernels or as
waiting (``GPU_BENCH_TIMELINE=plain_sweep,sweep`` picks some); ``checks``:
lowered edits against the same blocks as Python, greedy tokens, on the tapped engine).
``GPU_BENCH_REAL=1`` loads real weights (e.g. SmolLM2) instead of dummy ones;
``GPU_BENCH_SMALL=1`` shrinks everything for a dry run of the script on a CPU.
Traced jobs pass ``use_tqdm=False``, as their plain runs do: a trace of many
prompts would otherwise draw vLLM's progress bar, which the plain side does not.

Jobs: ``plain`` 64 prompts x 128 tokens (repeated), ``plain1000`` 1,000 x 128,
``forward`` one fresh 32-token prompt, one token (latency), ``plain_sweep`` 1,024 prompts
x 1 token, ``sweep`` the same in one trace, each invoke keeping one layer's last
row (how activations are extracted for probes and SAEs), ``trace1`` one prompt,
one token, saving the logits (latency), ``steer`` add a vector to one layer's
output at every step (64 x 128), ``steer_docs`` the same as the user docs write it
(the value named, a scale, a CPU vector moved with ``.to(hidden)``), ``steer_spelled`` the same edit spelled otherwise (unpacked, named, subtracted),
``remove`` and ``clamp`` a direction removed, or held at 0.5 or more, at every
step with the steering page's helpers (64 x 128; ``project_check`` against
Python), ``ablate`` 128 of the layer's columns zeroed at every step (64 x 128), ``patch``
the patching page's activation patching (the layer's hidden state and residual at
one prompt position set to a clean prompt's, 64 invokes x 16 tokens, against
``plain16``),
``steer_draws``
the steering page's loop whole (that edit, ``tracer.all()``, each step's drawn
token kept: split, the draws Python at the sampler), ``lens_steps`` the docs' logit
lens at the tapped layer every step (served at the sampler on ``on-taps``, 64 x 128),
``lens_among_plain`` one such request among 63 plain ones, ``capture`` keep one layer's output for every
token (1,000 x 128; 64 x 128 for the anchors), ``prompt_read`` keep one layer's
last prompt row, then generate (64 x 128), ``lens`` the logit lens over every
layer for one prompt, one batched unembed (latency), ``probe`` every layer's last
row kept at every step (64 x 128; on ``on-taps`` with every layer tapped). On ``on-taps``,
``taps_check`` and ``capture_check`` compare the lowered steering and capture with
the same blocks written to run as Python.

Every timed job runs on prompts no earlier job used (``unique``): a traced request
never reads the prefix cache, so a plain job on repeated prompts would be spared
prefill work that the traced job beside it does. Each engine's process freezes its
heap once the engine (and the client's module tree) is built (``settle``), so that
no timed run, plain or traced, holds a full collection of it by chance.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

PROMPT_LEN, TOKENS, CONCURRENT, MANY, SWEEP, WIDE = 32, 128, 64, 1000, 1024, 256
LAYER = 18
SHORT = 16  # tokens of the patching job (and its plain baseline): 64 invokes x 16
# Another layer and prompt length, so that no figure is tuned to one setting.
LAYER = int(os.environ.get("GPU_BENCH_LAYER", LAYER))
PROMPT_LEN = int(os.environ.get("GPU_BENCH_PROMPT_LEN", PROMPT_LEN))
TAPS = [t for t in os.environ.get("GPU_BENCH_TAPS", "").split(",") if t] or [f"model.layers.{LAYER}.output"]
#: ``ab``: the paired jobs run each round once with collects beside the step in
#: flight (``worker/ready.py``) and once without, on the one engine.
BESIDE_AB = os.environ.get("GPU_BENCH_BESIDE") == "ab"
ENGINE = dict(
    load_format="dummy",
    dtype="bfloat16",
    max_model_len=1024,
    max_num_seqs=256,
    gpu_memory_utilization=0.85,
)
#: ``GPU_BENCH_MAX_NUM_SEQS``: another bound on a step's requests; ``vllm`` leaves it
#: to vLLM, whose default for an ``LLM`` on an H100 or H200 is 1,024 (256 elsewhere).
_SEQS = os.environ.get("GPU_BENCH_MAX_NUM_SEQS")
if _SEQS == "vllm":
    del ENGINE["max_num_seqs"]
elif _SEQS:
    ENGINE["max_num_seqs"] = int(_SEQS)
if os.environ.get("GPU_BENCH_REAL"):  # a checkpoint with weights (SmolLM2)
    ENGINE.update(load_format="auto")
if os.environ.get("GPU_BENCH_SMALL"):  # a dry run of the script itself, on a CPU
    PROMPT_LEN, TOKENS, CONCURRENT, MANY, SWEEP, WIDE, LAYER, SHORT = 8, 4, 4, 8, 16, 8, 1, 2
    ENGINE.update(
        dtype="float32",
        max_model_len=256,
        max_num_seqs=16,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=1 << 28,
    )


def result(**seen) -> None:
    print("RESULT " + json.dumps(seen), flush=True)


def prompts(n: int) -> list[list[int]]:
    """Token-id prompts (the dummy model's tokenizer is tiny; no detokenizing)."""
    return [[(7 * i + 13 * j) % 1000 + 1 for j in range(PROMPT_LEN)] for i in range(n)]


def fresh_prompts(n: int, run: int) -> list[list[int]]:
    """``n`` prompts no earlier run used: a one-token job is all prompt, and a
    plain request would otherwise be served from the prefix cache (a traced one
    never is)."""
    return [[run + 1, i % 1000 + 1, i // 1000 + 1] + p[3:] for i, p in enumerate(prompts(n))]


_RUNS = itertools.count(100)


def unique(n: int) -> list[list[int]]:
    """``n`` prompts no other call used. Every timed job gets its own: a traced
    request never reads the prefix cache (its block must see every prompt row),
    so a plain job that repeated earlier prompts would skip prefill work that
    the traced job it is compared with does."""
    return fresh_prompts(n, next(_RUNS))


def settle() -> None:
    """Freeze what this process holds now (``gc.freeze``), as vLLM's engine core does
    with its start-up heap: a full collection of the front end's heap (the engine's,
    the tokenizer's and the module tree's objects, hundreds of thousands) costs
    about 0.4 s whenever one falls, in a plain run or a traced one alike, and
    which run it falls in is chance. Frozen, the runs are timed without it."""
    import gc

    gc.collect()
    gc.freeze()


def plain_run(llm, n: int, tokens: int) -> list:
    """``n`` fresh prompts, plain, each drawing exactly ``tokens`` greedy tokens: the
    plain run a traced job of that size is set beside."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    return llm.generate(unique(n), params, use_tqdm=False)


def timed(fn) -> float:
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


# ---------------------------------------------------------------- the blocks
def rate(name: str, job: str, repeats: int, run, tokens: int | None = None) -> None:
    """``repeats`` runs of ``run(batch)``, each on a fresh batch of ``CONCURRENT``
    prompts generating ``tokens`` (``TOKENS``) each: a tokens-per-second result each."""
    tokens = TOKENS if tokens is None else tokens
    for _ in range(repeats):
        batch = unique(CONCURRENT)
        wall = timed(lambda batch=batch: run(batch))
        result(engine=name, job=job, tok_s=round(CONCURRENT * tokens / wall, 1))


def steer(model, batch, tokens, vector) -> None:
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                for _ in tracer.iter[:tokens]:
                    layer.output[0][:] += vector  # the seeds' loop: the vector is on the device


def steer_as_the_docs_write_it(model, batch, tokens, vector) -> None:
    """The user docs' steering loop as written: the tap's value named, a scale, and
    the client's float32 CPU vector moved to the value's dtype and device."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                for _ in tracer.iter[:tokens]:
                    hidden = layer.output[0]
                    hidden[:] += 1.0 * vector.to(hidden)


def steer_spelled_otherwise(model, batch, tokens, vector) -> None:
    """The same edit spelled another way: the output unpacked, the vector named
    first, subtracted (lowered by what it computes, ``taps/meaning.py``)."""
    layer = model.model.layers[LAYER]
    away = -vector
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                for _ in tracer.iter[:tokens]:
                    hidden, residual = layer.output
                    push = away.to(hidden)
                    hidden -= push


def remove(u):
    """The steering page's helpers, as written there."""

    def edit(hidden, residual):
        u_ = u.to(hidden)
        hidden[:] -= ((hidden + residual) @ u_)[:, None] * u_

    return edit


def clamp(u, least=None, most=None):
    def edit(hidden, residual):
        u_ = u.to(hidden)
        coefficient = (hidden + residual) @ u_
        hidden[:] -= (coefficient - coefficient.clamp(min=least, max=most))[:, None] * u_

    return edit


def project(model, batch, tokens, change) -> None:
    """A direction removed (or clamped) at every step with the steering page's
    helper, called on the layer's output as the page calls it."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                for _ in tracer.iter[:tokens]:
                    change(layer.output[0], layer.output[1])


def clean_rows(model, ids) -> tuple:
    """The layer's stream at every position of one prompt (what patching restores)."""
    with model.trace(ids, temperature=0.0, max_tokens=1, detokenize=False):
        out = model.model.layers[LAYER].output
        hidden, residual = out[0].clone().save(), out[1].clone().save()
    return hidden, residual


def patch(model, batch, tokens, rows) -> None:
    """Activation patching as the patching page writes it: each invoke sets the
    layer's hidden state and residual at one prompt position to the clean
    prompt's (positions in turn), then generates."""
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for i, ids in enumerate(batch):
            position = i % PROMPT_LEN
            hidden_row, residual_row = (half[position] for half in rows)
            with tracer.invoke(ids):
                out = model.model.layers[LAYER].output
                out[0][position] = hidden_row
                out[1][position] = residual_row


def patch_jobs(model, llm, name: str, repeats: int, few: list) -> None:
    """``patch`` timed, which path it took, and its tokens against the same block as
    Python (``patch_check``)."""
    rows = clean_rows(model, few[0])
    (before,) = llm.collective_rpc("nnsight_stats")
    patch(model, few[:4], 4, rows)  # warm-up
    rate(name, "patch", repeats, lambda batch: patch(model, batch, SHORT, rows), tokens=SHORT)
    (after,) = llm.collective_rpc("nnsight_stats")
    result(
        engine=name,
        job="patch_path",
        patched=after["lowered_by"].get("patch", 0) - before["lowered_by"].get("patch", 0),
        python=after["python_blocks"] - before["python_blocks"],
    )
    lowered, python = patched_tokens(model, few[:8], rows, False), patched_tokens(model, few[:8], rows, True)
    result(engine=name, job="patch_check", same_tokens=sum(a == b for a, b in zip(lowered, python)), of=8)


def patched_tokens(model, batch, rows, python: bool) -> list[list[int]]:
    """:func:`patch`'s block at the last position, 16 greedy tokens each; as Python
    (a read of the embedding beside it) or lowered."""
    hidden_row, residual_row = (half[-1] for half in rows)
    with model.trace(
        temperature=0.0, max_tokens=SHORT, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                if python:  # decided as the request arrives: a read that is no tap, or none
                    model.model.embed_tokens.output.clone()
                stream = model.model.layers[LAYER].output
                stream[0][-1] = hidden_row
                stream[1][-1] = residual_row
                out = tracer.result.save()
    return [list(o.outputs[0].token_ids) for o in out]


def ablate(model, batch, tokens) -> None:
    """An ablation held at every step: a head's worth of the layer's columns zeroed
    on every row (the ablation page's head, on the layer's output)."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                for _ in tracer.iter[:tokens]:
                    layer.output[0][:, 128:256] = 0


def project_tokens(model, batch, tokens, change) -> list[list[int]]:
    """:func:`project`'s block (lowered on a tapped engine); each request's tokens."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                for _ in tracer.iter[:tokens]:
                    change(layer.output[0], layer.output[1])
                out = tracer.result.save()
    return [list(o.outputs[0].token_ids) for o in out]


def project_tokens_python(model, batch, tokens, change) -> list[list[int]]:
    """The same with a read of a module that is not a tap first: Python."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                for _ in tracer.iter[:tokens]:
                    model.model.embed_tokens.output.clone()
                    change(layer.output[0], layer.output[1])
                out = tracer.result.save()
    return [list(o.outputs[0].token_ids) for o in out]


def steer_and_draw(model, batch, tokens, vector) -> list[list[int]]:
    """The steering page's loop as written: the docs' edit, every step to the end
    (``tracer.all()``), each step's drawn token kept (Python at the sampler, the
    edit on the taps: a split block); each request's tokens."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                drawn = list().save()
                for _ in tracer.all():
                    hidden = layer.output[0]
                    hidden[:] += 1.0 * vector.to(hidden)
                    drawn.append(model.samples.item())
    return [list(d) for d in drawn] if len(batch) > 1 else [list(drawn)]


def plain_tokens(llm, batch, tokens) -> list[list[int]]:
    """Each prompt's greedy tokens with no block (what an edit is checked to move)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]


def steer_tokens(model, batch, tokens, vector) -> list[list[int]]:
    """The steering block (lowered on a tapped engine); each request's tokens."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                for _ in tracer.iter[:tokens]:
                    layer.output[0][:] += vector
                out = tracer.result.save()
    return [list(o.outputs[0].token_ids) for o in out]


def steer_tokens_python(model, batch, tokens, vector) -> list[list[int]]:
    """The same edit written so that it runs as Python (an assignment, not ``+=``)."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                for _ in tracer.iter[:tokens]:
                    hidden = layer.output[0]
                    hidden[:] = hidden + vector
                out = tracer.result.save()
    return [list(o.outputs[0].token_ids) for o in out]


def capture(model, batch, tokens) -> int:
    """Rows kept in all (prompt rows plus one per generated token, per request)."""
    rows = capture_rows(model, batch, tokens)
    per_request = rows if len(batch) > 1 else [rows]
    return sum(sum(r.shape[0] for r in kept) for kept in per_request)


def capture_python(model, batch, tokens) -> list:
    """The same capture written so that it runs as Python (two statements, and a
    read of a location that is not a tap, or it would be served at the sampler)."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                rows = list().save()
                for _ in tracer.iter[:tokens]:
                    model.model.embed_tokens.output.clone()
                    hidden = layer.output[0]
                    rows.append(hidden.clone())
    return rows


def capture_rows(model, batch, tokens) -> list:
    """The capture block (lowered on a tapped engine); each request's kept rows."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                rows = list().save()
                for _ in tracer.iter[:tokens]:
                    rows.append(layer.output[0].clone())
    return rows


def probe_rows(model, batch, tokens, layers: int) -> list:
    """A probe's rows: every layer's last row at every step (lowered onto the taps
    where every layer is one); each request's list of ``tokens * layers`` rows."""
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                rows = list().save()
                for _ in tracer.iter[:tokens]:
                    for i in range(layers):
                        rows.append(model.model.layers[i].output[0][-1].clone())
    return rows


def every_layer_tapped() -> bool:
    return any(t in ("layers", "model.layers.*.output") for t in TAPS)


def lens_each_step(model, batch, tokens) -> None:
    """The docs' logit lens at the tapped layer, every step, each step's guesses
    kept: a read served at the sampler on a tapped engine (the norm and the
    unembedding run there), Python on any other."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                guesses = list().save()
                for _ in tracer.iter[:tokens]:
                    out = layer.output
                    logits = model.logits_processor(model.lm_head, model.model.norm(out[0] + out[1]))
                    guesses.append(logits.argmax(-1))


def lens_among_plain(model, llm, batch, tokens) -> None:
    """One request running :func:`lens_each_step`'s block, the rest plain, in one
    batch: what one researcher's read costs the others."""
    from vllm import SamplingParams

    layer = model.model.layers[LAYER]
    with model.requests(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False) as tracer:
        with tracer.invoke(batch[0]):
            guesses = list().save()
            for _ in tracer.iter[:tokens]:
                out = layer.output
                logits = model.logits_processor(model.lm_head, model.model.norm(out[0] + out[1]))
                guesses.append(logits.argmax(-1))
    prepared = tracer.prepared
    plain = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    others = [{"prompt_token_ids": ids} for ids in batch[1:]]
    llm.generate(prepared.prompts + others, prepared.params + [plain] * len(others), use_tqdm=False)


def halve_if_large(model, batch, tokens, among_plain=None) -> list:
    """A block no table runs (a Python ``if`` on the activation) on the tapped
    layer, every step: on a tapped engine Python at the taps, the forward compiled
    between them. ``among_plain`` (the engine): the first prompt traced, the rest
    plain in the same batch; their outputs come back."""
    from vllm import SamplingParams

    layer = model.model.layers[LAYER]
    traced = batch if among_plain is None else batch[:1]
    with model.requests(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False) as tracer:
        for ids in traced:
            with tracer.invoke(ids):
                for _ in tracer.iter[:tokens]:
                    hidden = layer.output[0]
                    if hidden.norm() > 1e9:  # never, on these activations; Python decides
                        hidden[:] *= 0.5
    prepared = tracer.prepared
    plain = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    others = [{"prompt_token_ids": ids} for ids in batch[len(traced) :]]
    llm = model.vllm_entrypoint if among_plain is None else among_plain
    return llm.generate(prepared.prompts + others, prepared.params + [plain] * len(others), use_tqdm=False)


def halve(model, batch, tokens, decided: bool) -> list:
    """The tapped layer's output halved every step: as a Python ``if`` that always
    holds (``decided``: Python at the taps) or as the lowered edit; their greedy
    tokens are compared (``at_taps_check``)."""
    layer = model.model.layers[LAYER]
    with model.requests(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                for _ in tracer.iter[:tokens]:
                    if decided:
                        hidden = layer.output[0]
                        if hidden.norm() > 0:
                            hidden[:] *= 0.5
                    else:
                        layer.output[0][:] *= 0.5
    prepared = tracer.prepared
    return model.vllm_entrypoint.generate(prepared.prompts, prepared.params, use_tqdm=False)


def carry_between_taps(model, batch, tokens) -> None:
    """A value carried from one tap to a later one in the same step (the stream
    norm after the layer before the benchmark's rescales its output): no table runs it."""
    first, second = model.model.layers[LAYER - 1], model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                for _ in tracer.iter[:tokens]:
                    stream = first.output[0] + first.output[1]
                    norm = stream.norm(dim=-1, keepdim=True)
                    hidden = second.output[0]
                    hidden[:] *= (norm / norm.clamp(min=1.0)).to(hidden.dtype)


def prompt_read(model, batch, tokens) -> list:
    """Each request keeps one layer's last prompt row (a sweep's read), then generates."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                last = layer.output[0][-1].clone().save()
    return last


def lens(model, ids):
    """The logit lens: every layer's residual stream at the last position, one
    norm and one batched unembed ([layers, hidden] x [hidden, vocab])."""
    import torch

    with model.trace(ids, temperature=0.0, max_tokens=1, detokenize=False):
        streams = []
        for layer in model.model.layers:
            hidden, residual = layer.output
            streams.append(hidden[-1:] + residual[-1:])
        stream = torch.cat(streams).float()
        gain, weight = model.model.norm.weight, model.lm_head.weight
        normed = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + 1e-6) * gain.float()
        tops = (normed.to(weight.dtype) @ weight.T).argmax(-1).save()
    return tops


def sweep(model, batch) -> list:
    """One trace, one invoke per prompt, each keeping one layer's last row."""
    layer = model.model.layers[LAYER]
    with model.trace(temperature=0.0, max_tokens=1, detokenize=False, use_tqdm=False) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                last = layer.output[0][-1].clone().save()
    return last


def shared_prefix(n: int, run: int, prefix: int = 512, own: int = 16) -> list[list[int]]:
    """``n`` prompts of one ``prefix``-token prefix no earlier run used (a template
    or a system prompt), each with ``own`` tokens of its own after it."""
    ids = 1000
    if os.environ.get("GPU_BENCH_SMALL"):  # (a tiny vocabulary)
        prefix, own, ids = 24, 4, 400
    shared = [run % ids + 1] + [(31 * run + 7 * j) % ids + 1 for j in range(prefix - 1)]
    return [
        shared + [i % ids + 1, i // ids + 1] + [(13 * i + j) % ids + 1 for j in range(own - 2)]
        for i in range(n)
    ]


def prefix_jobs(llm, name: str, repeats: int, model=None, vector=None) -> None:
    """``SWEEP`` prompts sharing a fresh 512-token prefix, one token each: plain
    (``prefix_plain``), and with the tapped engine's ``model`` a sweep keeping one
    layer's last row (``prefix_sweep``), which shares the prefix cache as the plain
    requests do (``prefix.py``); then the same prompts generating ``TOKENS`` each,
    plain (``prefix_plain128``) and steered with ``vector`` at every step
    (``prefix_steer128``), and the same steering installed on the engine with
    stock calls (``prefix_edit128``); ``prefix_check``: eight such steered requests in one
    trace against each alone on an emptied cache; ``prefix_path``: the prompt rows
    the cache gave traced requests."""
    from vllm import SamplingParams

    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    many = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, detokenize=False)
    runs = itertools.count(500)
    llm.generate(shared_prefix(8, next(runs)), one, use_tqdm=False)  # warm-up
    if model is not None:
        sweep(model, shared_prefix(8, next(runs)))
        steer_every_step(model, shared_prefix(8, next(runs)), 4, vector)
    # one token each, and ``TOKENS`` each steered with one vector over every step
    # (``steer_every_step``: its KV is shared by the requests making that edit)
    jobs = (
        ("prefix_plain", one, "prefix_sweep", lambda batch: sweep(model, batch)),
        (
            "prefix_plain128",
            many,
            "prefix_steer128",
            lambda batch: steer_every_step(model, batch, TOKENS, vector),
        ),
    )
    for plain_job, params, traced_job, traced in jobs:
        for _ in range(repeats):
            batch = shared_prefix(SWEEP, next(runs))
            wall = timed(lambda batch=batch, params=params: llm.generate(batch, params, use_tqdm=False))
            result(engine=name, job=plain_job, ms=round(1000 * wall, 1))
            if model is not None:
                batch = shared_prefix(SWEEP, next(runs))
                wall = timed(lambda batch=batch, traced=traced: traced(batch))
                result(engine=name, job=traced_job, ms=round(1000 * wall, 1))
    if model is not None:
        # the same steering installed on the engine (``model.edit()``), the requests
        # stock calls: the edit lets its requests share the KV made under it
        for _ in range(repeats):
            batch = shared_prefix(SWEEP, next(runs))
            edit = install_steering(model, vector)
            outputs: list = []
            try:
                wall = timed(
                    lambda batch=batch, outputs=outputs: outputs.extend(
                        llm.generate(batch, many, use_tqdm=False)
                    )
                )
            finally:
                edit.clear()
            cached = sum(output.num_cached_tokens or 0 for output in outputs)
            result(engine=name, job="prefix_edit128", ms=round(1000 * wall, 1), cached_tokens=cached)
        # the steered requests of one trace, sharing the steered prefix, against each
        # run alone with the cache emptied first (and against plain: the edit shows)
        big, short = 100 * vector, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        batch = shared_prefix(8, next(runs))
        (before,) = llm.collective_rpc("nnsight_stats")
        together = steer_and_draw(model, batch, 16, big)
        (after,) = llm.collective_rpc("nnsight_stats")
        alone = []
        for ids in batch:
            llm.reset_prefix_cache()
            alone += steer_and_draw(model, [ids], 16, big)
        plain = [list(o.outputs[0].token_ids) for o in llm.generate(batch, short, use_tqdm=False)]
        result(
            engine=name,
            job="prefix_check",
            same_tokens=sum(a == b for a, b in zip(together, alone)),
            steered=sum(a != b for a, b in zip(together, plain)),
            rows_cached=after["prompt_rows_cached"] - before["prompt_rows_cached"],
            of=len(batch),
        )
        (stats,) = llm.collective_rpc("nnsight_stats")
        result(
            engine=name,
            job="prefix_path",
            prompt_rows_cached=stats["prompt_rows_cached"],
            lowered_steer=stats["lowered_by"].get("steer", 0),
            python_blocks=stats.get("python_blocks"),
        )


def steer_every_step(model, batch, tokens, vector) -> None:
    """The steering page's loop over every step (``tracer.all()``), one vector for
    every request: requests sharing a prefix share its steered KV."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                for _ in tracer.all():
                    hidden = layer.output[0]
                    hidden[:] += vector.to(hidden)


def install_steering(model, vector):
    """The steering page's loop installed on the engine: every request steered."""
    layer = model.model.layers[LAYER]
    with model.edit() as (tracer, edit):
        for _ in tracer.all():
            hidden = layer.output[0]
            hidden[:] += vector.to(hidden)
    return edit


def trace1(model, ids):
    with model.trace(ids, temperature=0.0, max_tokens=1, detokenize=False):
        logits = model.logits.save()
    return logits


# ---------------------------------------------------------------- engines
def hidden_size(path: str) -> int:
    return json.loads((Path(path) / "config.json").read_text())["hidden_size"]


def layer_count(path: str) -> int:
    return json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]


def unit_vector(path: str):
    """A small steering vector, on the engine's device and in its dtype (as the
    user docs build one), so a block adds it without a copy each step."""
    import torch

    torch.manual_seed(0)
    vector = torch.randn(hidden_size(path))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return (0.01 * vector / vector.norm()).to(device, getattr(torch, ENGINE["dtype"]))


def vllm_engine(name: str, path: str, repeats: int) -> None:
    from vllm import LLM, SamplingParams

    plugin, kind = name.split("-")
    extra = {} if plugin == "off" else {"additional_config": {"nnsight_taps": "none"}}  # not the default taps
    if kind == "taps":  # graphs, with the benchmark's layer tapped
        extra = {"additional_config": {"nnsight_taps": TAPS}}
    timeline = os.environ.get("GPU_BENCH_JOBS") == "timeline"
    if timeline:  # the engine's own torch profiler, started and stopped per job
        extra["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": TIMELINE_DIR,
            "torch_profiler_with_stack": False,
            "torch_profiler_use_gzip": False,
        }
    result(
        engine=name,
        job="setting",
        layer=LAYER,
        prompt_len=PROMPT_LEN,
        taps=",".join(TAPS) if kind == "taps" else "",
    )
    if BESIDE_AB and plugin == "on":
        # the switch travels as a function (``switch_beside``): the engine's
        # processes must accept one, as they do for any collective_rpc callable
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        os.environ["VLLM_NNSIGHT_COLLECT_BESIDE"] = "1"
    t0 = time.perf_counter()
    llm = LLM(path, enforce_eager=(kind == "eager"), **ENGINE, **extra)
    result(engine=name, job="startup", s=round(time.perf_counter() - t0, 1))
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, detokenize=False)
    few = prompts(CONCURRENT)
    llm.generate(few[:8], SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False), use_tqdm=False)
    settle()

    def plain(batch):
        return timed(lambda: llm.generate(batch, params, use_tqdm=False))

    if timeline:
        timeline_jobs(llm, name, repeats, few, params, path)
        return
    if os.environ.get("GPU_BENCH_JOBS") == "checks" and kind == "taps":
        check_jobs(llm, name, few, path)
        return

    idle = 0 if os.environ.get("GPU_BENCH_NO_IDLE") else repeats
    for _ in range(idle):
        result(engine=name, job="plain", tok_s=round(CONCURRENT * TOKENS / plain(unique(CONCURRENT)), 1))
    for _ in range(idle):  # a median, as for the rest
        if kind in ("graphs", "taps"):
            result(engine=name, job="plain1000", tok_s=round(MANY * TOKENS / plain(unique(MANY)), 1))
        if kind == "taps" or (kind == "graphs" and plugin == "off"):
            result(engine=name, job="plain256", tok_s=round(WIDE * TOKENS / plain(unique(WIDE)), 1))
            short = SamplingParams(temperature=0.0, max_tokens=SHORT, ignore_eos=True, detokenize=False)
            batch = unique(CONCURRENT)
            wall = timed(lambda batch=batch, short=short: llm.generate(batch, short, use_tqdm=False))
            result(engine=name, job="plain16", tok_s=round(CONCURRENT * SHORT / wall, 1))
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    # Fresh prompts: a traced request never reads the prefix cache, so its plain
    # counterpart must not either.
    walls = [timed(lambda p=p: llm.generate([p], one, use_tqdm=False)) for p in fresh_prompts(12, 30)]
    result(engine=name, job="forward", ms=round(1000 * statistics.median(walls[2:]), 2))
    batches = [fresh_prompts(SWEEP, run) for run in range(3)]
    walls = [timed(functools.partial(llm.generate, batch, one, use_tqdm=False)) for batch in batches]
    result(engine=name, job="plain_sweep", ms=round(1000 * statistics.median(walls), 1))
    prefixed = os.environ.get("GPU_BENCH_JOBS") == "prefix"
    if prefixed and (plugin == "off" or kind != "taps"):
        prefix_jobs(llm, name, repeats)
    if plugin == "off" or os.environ.get("GPU_BENCH_IDLE_ONLY"):
        return

    from vllm_nnsight_plugin import VLLM

    model = VLLM(llm)
    settle()  # (the client's module tree)
    if kind == "taps" and os.environ.get("GPU_BENCH_JOBS") == "patch":  # that job alone
        patch_jobs(model, llm, name, repeats, few)
        return
    if kind == "taps" and prefixed:  # those jobs alone
        prefix_jobs(llm, name, repeats, model, unit_vector(path))
        return
    if kind == "taps" and os.environ.get("GPU_BENCH_JOBS") == "at_taps":  # those jobs alone
        at_taps_jobs(model, llm, name, repeats, few, params)
        return
    if kind == "taps" and os.environ.get("GPU_BENCH_JOBS") == "paired":  # those jobs alone
        paired_jobs(model, llm, name, repeats, few, params, path)
        return
    vector = unit_vector(path)
    steer(model, few[:4], 8, vector)  # warm-up: builds the worker's tree
    rate(name, "steer", repeats, lambda batch: steer(model, batch, TOKENS, vector))  # a median, as for plain
    cpu_vector = vector.float().cpu()
    rate(
        name,
        "steer_docs",
        repeats,
        lambda batch: steer_as_the_docs_write_it(model, batch, TOKENS, cpu_vector),
    )
    rate(name, "steer_draws", repeats, lambda batch: steer_and_draw(model, batch, TOKENS, cpu_vector))
    (before,) = llm.collective_rpc("nnsight_stats")
    rate(
        name,
        "steer_spelled",
        repeats,
        lambda batch: steer_spelled_otherwise(model, batch, TOKENS, cpu_vector),
    )
    (after,) = llm.collective_rpc("nnsight_stats")
    result(engine=name, job="steer_spelled_path", lowered=after["lowered"] - before["lowered"])
    if kind == "taps":
        (before,) = llm.collective_rpc("nnsight_stats")
        big = 100 * vector  # large enough to change greedy tokens
        lowered_ids = steer_tokens(model, few[:8], 16, big)
        python_ids = steer_tokens_python(model, few[:8], 16, big)
        (after,) = llm.collective_rpc("nnsight_stats")
        plain_ids = plain_tokens(llm, few[:8], 16)
        result(
            engine=name,
            job="taps_check",
            lowered=after["lowered"] - before["lowered"],
            same_tokens=sum(a == b for a, b in zip(lowered_ids, python_ids)),
            steered=sum(a != b for a, b in zip(lowered_ids, plain_ids)),
            of=len(lowered_ids),
        )
        for _ in range(repeats):
            wide = unique(WIDE)
            wall = timed(lambda wide=wide: steer(model, wide, TOKENS, vector))
            result(engine=name, job="steer256", tok_s=round(WIDE * TOKENS / wall, 1))
        u = vector / vector.norm()
        for job, change in (("remove", remove(u)), ("clamp", clamp(u, least=0.5))):
            (before,) = llm.collective_rpc("nnsight_stats")
            project(model, few[:4], 8, change)  # warm-up
            rate(name, job, repeats, lambda batch, change=change: project(model, batch, TOKENS, change))
            (after,) = llm.collective_rpc("nnsight_stats")
            result(
                engine=name,
                job=f"{job}_path",
                projected=after["lowered_by"].get("project", 0) - before["lowered_by"].get("project", 0),
                python=after["python_blocks"] - before["python_blocks"],
            )
        (before,) = llm.collective_rpc("nnsight_stats")
        ablate(model, few[:4], 8)  # warm-up
        rate(name, "ablate", repeats, lambda batch: ablate(model, batch, TOKENS))
        (after,) = llm.collective_rpc("nnsight_stats")
        result(
            engine=name,
            job="ablate_path",
            filled=after["lowered_by"].get("fill", 0) - before["lowered_by"].get("fill", 0),
            python=after["python_blocks"] - before["python_blocks"],
        )
        patch_jobs(model, llm, name, repeats, few)
        strong = clamp(u, least=8.0)  # held high enough to change greedy tokens
        lowered_ids = project_tokens(model, few[:8], 16, strong)
        python_ids = project_tokens_python(model, few[:8], 16, strong)
        plain_ids = plain_tokens(llm, few[:8], 16)
        result(
            engine=name,
            job="project_check",
            same_tokens=sum(a == b for a, b in zip(lowered_ids, python_ids)),
            edited=sum(a != b for a, b in zip(lowered_ids, plain_ids)),
            of=len(lowered_ids),
        )
        if every_layer_tapped():
            layers = layer_count(path)
            (before,) = llm.collective_rpc("nnsight_stats")
            probe_rows(model, few[:4], 8, layers)  # warm-up
            rate(name, "probe", repeats, lambda batch: probe_rows(model, batch, TOKENS, layers))
            (after,) = llm.collective_rpc("nnsight_stats")
            result(
                engine=name,
                job="probe_check",
                kept=after["lowered_by"].get("keep", 0) - before["lowered_by"].get("keep", 0),
                python=after["python_blocks"] - before["python_blocks"],
            )
        lens_each_step(model, few[:4], 8)  # warm-up
        (before,) = llm.collective_rpc("nnsight_stats")
        rate(name, "lens_steps", repeats, lambda batch: lens_each_step(model, batch, TOKENS))
        rate(name, "lens_among_plain", repeats, lambda batch: lens_among_plain(model, llm, batch, TOKENS))
        (after,) = llm.collective_rpc("nnsight_stats")
        result(
            engine=name,
            job="lens_check",
            served=after["lowered_by"]["replay"] - before["lowered_by"]["replay"],
            uncompiled_steps=after["uncompiled_steps"] - before["uncompiled_steps"],
        )
        (before,) = llm.collective_rpc("nnsight_stats")
        lowered_rows = capture_rows(model, few[:8], 16)
        python_rows = capture_python(model, few[:8], 16)
        (after,) = llm.collective_rpc("nnsight_stats")
        result(
            engine=name,
            job="capture_check",
            lowered=after["lowered"] - before["lowered"],
            **rows_against(lowered_rows, python_rows),
        )
    if kind == "taps" and every_layer_tapped():
        at_taps_jobs(model, llm, name, repeats, few, params)
    prompt_read(model, few[:4], 8)
    rate(
        name, "prompt_read", repeats, lambda batch: prompt_read(model, batch, TOKENS)
    )  # a median, as for plain
    n = MANY if kind in ("graphs", "taps") else CONCURRENT
    for _ in range(repeats):
        kept = []
        batch = unique(n)
        wall = timed(lambda batch=batch, kept=kept: kept.append(capture(model, batch, TOKENS)))
        result(engine=name, job=f"capture{n}", tok_s=round(n * TOKENS / wall, 1), rows=kept[0])
    (before,) = llm.collective_rpc("nnsight_stats")
    lens(model, few[0])
    walls = [timed(lambda: lens(model, few[0])) for _ in range(10)]
    result(engine=name, job="lens", ms=round(1000 * statistics.median(walls[2:]), 2))
    (after,) = llm.collective_rpc("nnsight_stats")
    result(  # which path the lens took: served at the sampler (every layer tapped) or Python
        engine=name,
        job="lens_path",
        served=after["lowered_by"].get("replay", 0) - before["lowered_by"].get("replay", 0),
        python=after["python_blocks"] - before["python_blocks"],
        uncompiled_steps=after["uncompiled_steps"] - before["uncompiled_steps"],
    )
    walls = [timed(lambda: trace1(model, few[0])) for _ in range(12)]
    result(engine=name, job="trace1", ms=round(1000 * statistics.median(walls[2:]), 2))
    kept = sweep(model, fresh_prompts(SWEEP, 10))
    assert len(kept) == SWEEP and tuple(kept[0].shape) == (hidden_size(path),), "the sweep lost rows"
    batches = [fresh_prompts(SWEEP, run) for run in range(11, 14)]
    walls = [timed(functools.partial(sweep, model, batch)) for batch in batches]
    result(engine=name, job="sweep", ms=round(1000 * statistics.median(walls), 1))
    (stats,) = llm.collective_rpc("nnsight_stats")
    result(engine=name, job="stats", **stats)


def staggered_rows(model, batch, python: bool) -> list:
    """The capture block, each request generating as many tokens as its place
    (2, 5, 8, ...): they finish at different steps while the others go on, so each
    collect comes with a step on the device. ``python``: beside a read that is no
    tap, so the same keep runs as Python."""
    layer = model.model.layers[LAYER]
    with model.trace(temperature=0.0, ignore_eos=True, detokenize=False, use_tqdm=False) as tracer:
        for i, ids in enumerate(batch):
            with tracer.invoke(ids, max_tokens=2 + 3 * i):
                rows = list().save()
                if python:
                    model.model.embed_tokens.output.clone()
                for _ in tracer.iter[: 2 + 3 * i]:
                    rows.append(layer.output[0].clone())
    return rows


def collect_check(model, llm, name: str, batch: list) -> None:
    """Requests finishing at different steps, lowered against Python: their rows
    (relative error), and how many collects read their saves beside the step in
    flight (``worker/ready.py``) or waited for the device."""
    (before,) = llm.collective_rpc("nnsight_stats")
    lowered_rows = staggered_rows(model, batch, False)
    (after,) = llm.collective_rpc("nnsight_stats")
    python_rows = staggered_rows(model, batch, True)
    result(
        engine=name,
        job="collect_check",
        lowered=after["lowered"] - before["lowered"],
        **rows_against(lowered_rows, python_rows),
        **collects_between(before, after),
    )


def collects_between(before: dict, after: dict) -> dict:
    """How many collects between two ``nnsight_stats`` read their saves beside the
    step in flight, and how many waited for the device (``worker/ready.py``)."""
    return {
        side: after.get(f"collects_{key}", 0) - before.get(f"collects_{key}", 0)
        for side, key in (("beside", "beside_step"), ("waited", "waited"))
    }


def rows_against(lowered_rows: list, python_rows: list) -> dict:
    """Each request's kept rows, lowered against Python: how many requests kept
    rows of the same shapes, and the largest error relative to the Python rows'
    size (a dummy model's rows can be tiny)."""
    errors = [
        float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300))
        for lo, py in zip(lowered_rows, python_rows)
        for a, b in zip(lo, py)
    ]
    same = sum([t.shape for t in lo] == [t.shape for t in py] for lo, py in zip(lowered_rows, python_rows))
    return {"same_shapes": same, "max_rel_err": float(f"{max(errors):.3g}"), "of": len(lowered_rows)}


def paired_jobs(model, llm, name: str, repeats: int, few: list, params, path: str) -> None:
    """Each job right after a plain run of its size on the same engine, ``repeats``
    times: ``<job>_pair`` rows carry both rates and their ratio, so a drift of the
    machine between runs (stock's own runs spread by up to 6%) moves both sides.
    The ratio to stock is this one times the idle engine's own (``plain`` rows)."""
    from vllm import SamplingParams

    vector = unit_vector(path)
    cpu_vector = vector.float().cpu()
    u = vector / vector.norm()
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    short = SamplingParams(temperature=0.0, max_tokens=SHORT, ignore_eos=True, detokenize=False)
    layers = layer_count(path)
    rows = clean_rows(model, few[0])
    steer(model, few[:4], 8, vector)  # warm-up: builds the worker's tree
    project(model, few[:4], 8, remove(u))
    patch(model, few[:4], 4, rows)
    lens(model, few[0])
    sweep(model, fresh_prompts(8, 20))
    collect_check(model, llm, name, few[:6])
    # job: (requests, its block, the plain run's params, tokens each: None, a time)
    jobs = {
        "steer": (CONCURRENT, lambda batch: steer(model, batch, TOKENS, vector), params, TOKENS),
        "steer_docs": (
            CONCURRENT,
            lambda batch: steer_as_the_docs_write_it(model, batch, TOKENS, cpu_vector),
            params,
            TOKENS,
        ),
        "remove": (CONCURRENT, lambda batch: project(model, batch, TOKENS, remove(u)), params, TOKENS),
        "clamp": (
            CONCURRENT,
            lambda batch: project(model, batch, TOKENS, clamp(u, least=0.5)),
            params,
            TOKENS,
        ),
        "steer256": (WIDE, lambda batch: steer(model, batch, TOKENS, vector), params, TOKENS),
        "capture1000": (MANY, lambda batch: capture(model, batch, TOKENS), params, TOKENS),
        "patch": (CONCURRENT, lambda batch: patch(model, batch, SHORT, rows), short, SHORT),
        "sweep": (SWEEP, lambda batch: sweep(model, batch), one, None),
    }
    if every_layer_tapped():
        probe_rows(model, few[:4], 8, layers)
        jobs["probe"] = (CONCURRENT, lambda batch: probe_rows(model, batch, TOKENS, layers), params, TOKENS)
    wanted = [j for j in os.environ.get("GPU_BENCH_PAIRED", "").split(",") if j]
    jobs = {job: spec for job, spec in jobs.items() if not wanted or job in wanted}
    for round_ in range(repeats):
        # with ``GPU_BENCH_BESIDE=ab`` each job twice a round, on and off, the
        # order turned each round
        sides = ((True, False) if round_ % 2 == 0 else (False, True)) if BESIDE_AB else (None,)
        for job, (n, run, plain_params, tokens) in jobs.items():
            for beside in sides:
                if beside is not None:
                    switch_beside(llm, beside)
                plain_batch, batch = unique(n), unique(n)
                plain_s = timed(lambda b=plain_batch, p=plain_params: llm.generate(b, p, use_tqdm=False))
                (before,) = llm.collective_rpc("nnsight_stats")
                job_s = timed(lambda b=batch, run=run: run(b))
                (after,) = llm.collective_rpc("nnsight_stats")
                rates = (
                    {"plain_ms": round(1000 * plain_s, 1), "ms": round(1000 * job_s, 1)}
                    if tokens is None
                    else {
                        "plain_tok_s": round(n * tokens / plain_s, 1),
                        "tok_s": round(n * tokens / job_s, 1),
                    }
                )
                side = "" if beside is None else ("_beside" if beside else "_waited")
                result(
                    engine=name,
                    job=f"{job}_pair{side}",
                    **rates,
                    ratio=round(plain_s / job_s, 4),
                    **collects_between(before, after),
                )
        if BESIDE_AB:
            switch_beside(llm, True)
        # latency: a plain one-token call, a one-token trace saving the logits, the lens
        walls = {"forward": [], "trace1": [], "lens": []}
        for p, q, r in zip(unique(10), unique(10), unique(10)):
            walls["forward"].append(timed(lambda p=p: llm.generate([p], one, use_tqdm=False)))
            walls["trace1"].append(timed(lambda q=q: trace1(model, q)))
            walls["lens"].append(timed(lambda r=r: lens(model, r)))
        result(
            engine=name,
            job="latency_pair",
            **{job: round(1000 * statistics.median(w), 2) for job, w in walls.items()},
        )


def switch_beside(llm, on: bool) -> None:
    """Collects beside the step in flight on or off in the running engine's
    workers (``Ready.switch``), so both run on one engine."""

    def switch(worker, on):
        from vllm_nnsight_plugin.worker.extension import runtime_of

        runtime_of(worker.model_runner).ready.switch(on)

    llm.collective_rpc(switch, args=(on,))


def docs_tokens(model, batch, tokens, vector, python: bool) -> list[list[int]]:
    """The docs' steering loop (a host vector moved with ``.to(hidden)``), lowered,
    or as Python (a read that is no tap beside it); each request's tokens."""
    layer = model.model.layers[LAYER]
    with model.trace(
        temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False, use_tqdm=False
    ) as tracer:
        for ids in batch:
            with tracer.invoke(ids):
                if python:
                    model.model.embed_tokens.output.clone()
                for _ in tracer.iter[:tokens]:
                    hidden = layer.output[0]
                    hidden[:] += 1.0 * vector.to(hidden)
                out = tracer.result.save()
    return [list(o.outputs[0].token_ids) for o in out]


def check_jobs(llm, name: str, few: list, path: str) -> None:
    """Lowered against Python on this engine, greedy tokens of 8 prompts: steering
    with a device vector and with the docs' host vector (whose bank row goes up
    from pinned memory), a direction clamped, patching (two bank rows a request).
    Each row: how many requests drew the same tokens both ways, how many the edit
    moved from plain, and how many blocks were lowered."""
    from vllm_nnsight_plugin import VLLM

    model = VLLM(llm)
    batch = few[:8]
    plain = plain_tokens(llm, batch, 16)
    big = 100 * unit_vector(path)  # large enough to change greedy tokens
    u = big / big.norm()
    rows = clean_rows(model, few[0])
    checks = {
        "steer_device": (
            lambda: steer_tokens(model, batch, 16, big),
            lambda: steer_tokens_python(model, batch, 16, big),
        ),
        "steer_host": (
            lambda: docs_tokens(model, batch, 16, big.float().cpu(), False),
            lambda: docs_tokens(model, batch, 16, big.float().cpu(), True),
        ),
        "clamp": (
            lambda: project_tokens(model, batch, 16, clamp(u, least=8.0)),
            lambda: project_tokens_python(model, batch, 16, clamp(u, least=8.0)),
        ),
        "patch": (
            lambda: patched_tokens(model, batch, rows, False),
            lambda: patched_tokens(model, batch, rows, True),
        ),
    }
    for job, (lowered_run, python_run) in checks.items():
        (before,) = llm.collective_rpc("nnsight_stats")
        lowered = lowered_run()
        (after,) = llm.collective_rpc("nnsight_stats")
        python = python_run()
        result(
            engine=name,
            job=f"check_{job}",
            same_tokens=sum(a == b for a, b in zip(lowered, python)),
            moved=sum(a != b for a, b in zip(lowered, plain)),
            lowered=after["lowered"] - before["lowered"],
            of=len(batch),
        )


TIMELINE_DIR = "/tmp/vllm-nnsight-timeline"


def gpu_time(trace: dict) -> dict:
    """What the device did over one profiled job: its busy time (the union of its
    kernels and copies), the span from its first to its last, the kernels, and
    the kernels with the most time."""
    spans, by_name = [], {}
    for event in trace.get("traceEvents", ()):
        if event.get("ph") != "X" or event.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        start, dur = float(event["ts"]), float(event.get("dur", 0))
        spans.append((start, start + dur))
        name = str(event.get("name", "?"))[:48]
        by_name[name] = by_name.get(name, 0.0) + dur
    if not spans:
        return {"kernels": 0}
    spans.sort()
    busy, (low, high) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > high:
            busy, low, high = busy + high - low, start, end
        else:
            high = max(high, end)
    busy += high - low
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:6]
    return {
        "kernels": len(spans),
        "busy_ms": round(busy / 1000, 1),
        "span_ms": round((spans[-1][1] - spans[0][0]) / 1000, 1) if spans else 0,
        "top": {name: round(us / 1000, 1) for name, us in top},
    }


def timeline_jobs(llm, name: str, repeats: int, few: list, params, path: str) -> None:
    """Plain and steering runs under the engine's torch profiler: whether what a
    lowered edit costs is the device's time (its kernels) or time the device
    waits (gaps between steps). Each job is profiled alone; the device's busy
    time and span come from the worker's trace."""
    import glob

    from vllm import SamplingParams

    from vllm_nnsight_plugin import VLLM

    model = VLLM(llm)
    vector = unit_vector(path)
    cpu_vector = vector.float().cpu()
    u = vector / vector.norm()
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    steer(model, few[:4], 8, vector)  # warm-up: builds the worker's tree
    sweep(model, few[:8])
    project(model, few[:4], 8, remove(u))
    jobs = {
        "plain64": (CONCURRENT, lambda b: llm.generate(b, params, use_tqdm=False)),
        "steer64": (CONCURRENT, lambda b: steer(model, b, TOKENS, vector)),
        "docs64": (CONCURRENT, lambda b: steer_as_the_docs_write_it(model, b, TOKENS, cpu_vector)),
        "remove64": (CONCURRENT, lambda b: project(model, b, TOKENS, remove(u))),
        "plain256": (WIDE, lambda b: llm.generate(b, params, use_tqdm=False)),
        "steer256": (WIDE, lambda b: steer(model, b, TOKENS, vector)),
        # whether a collect between steps leaves the device waiting (its waves of
        # finished requests each a round trip to the worker)
        "plain_sweep": (SWEEP, lambda b: llm.generate(b, one, use_tqdm=False)),
        "sweep": (SWEEP, lambda b: sweep(model, b)),
    }
    wanted = [j for j in os.environ.get("GPU_BENCH_TIMELINE", "").split(",") if j]
    jobs = {job: spec for job, spec in jobs.items() if not wanted or job in wanted}
    for round_ in range(repeats):
        for job, (n, run) in jobs.items():
            batch = unique(n)
            before = set(glob.glob(f"{TIMELINE_DIR}/**/*.json", recursive=True))
            llm.start_profile(f"{job}-{round_}")
            wall = timed(lambda b=batch, run=run: run(b))
            llm.stop_profile()
            found: list[str] = []
            for _ in range(120):  # the worker writes its trace as it stops
                found = sorted(set(glob.glob(f"{TIMELINE_DIR}/**/*.json", recursive=True)) - before)
                if found:
                    time.sleep(1.0)
                    break
                time.sleep(0.5)
            seen = {}
            for file in found:
                try:
                    seen = gpu_time(json.loads(Path(file).read_text()))
                except (OSError, ValueError):
                    continue
                if seen.get("kernels"):
                    break
            for file in found:
                Path(file).unlink(missing_ok=True)
            result(
                engine=name, job=f"{job}_timeline", wall_ms=round(1000 * wall, 1), files=len(found), **seen
            )


def at_taps_jobs(model, llm, name: str, repeats: int, few: list, params) -> None:
    """Blocks no table runs, whose every location is a tap: Python at the taps,
    the forward compiled between them. One among 63 plain (and whether the 63 draw
    what they draw in an all-plain batch), 64 of them, and a second block (a value
    carried between two taps)."""
    (before,) = llm.collective_rpc("nnsight_stats")
    halve_if_large(model, few[:4], 8)  # warm-up
    # the all-plain batch each job is set beside, on this engine (before and after them)
    rate(name, "at_taps_plain", repeats, lambda batch: llm.generate(batch, params, use_tqdm=False))
    # The same edit at the taps (between piece graphs) and lowered (in the graphs):
    # the same compiled kernels, so the same greedy tokens.
    checked = unique(8)
    at_taps = halve(model, checked, 16, decided=True)
    lowered = halve(model, checked, 16, decided=False)
    plain = llm.generate([{"prompt_token_ids": ids} for ids in checked], params, use_tqdm=False)
    result(
        engine=name,
        job="at_taps_check",
        same_as_lowered=sum(
            list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids) for a, b in zip(at_taps, lowered)
        ),
        differs_from_plain=sum(
            list(a.outputs[0].token_ids)[:16] != list(b.outputs[0].token_ids)[:16]
            for a, b in zip(at_taps, plain)
        ),
        paths=sorted({str(getattr(o, "nnsight_path", {}).get("form")) for o in at_taps + lowered}),
        of=len(checked),
    )
    rate(
        name,
        "at_taps_among_plain",
        repeats,
        lambda batch: halve_if_large(model, batch, TOKENS, among_plain=llm),
    )
    batch = unique(CONCURRENT)
    beside = halve_if_large(model, batch, TOKENS, among_plain=llm)
    alone = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    result(
        engine=name,
        job="at_taps_neighbours",
        same_tokens=sum(
            list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
            for a, b in zip(beside[1:], alone[1:])
        ),
        of=len(batch) - 1,
    )
    rate(name, "at_taps_all", repeats, lambda batch: halve_if_large(model, batch, TOKENS))
    carry_between_taps(model, few[:4], 8)  # warm-up
    rate(name, "at_taps_carry", repeats, lambda batch: carry_between_taps(model, batch, TOKENS))
    rate(name, "at_taps_plain", repeats, lambda batch: llm.generate(batch, params, use_tqdm=False))
    (after,) = llm.collective_rpc("nnsight_stats")
    result(
        engine=name,
        job="at_taps_path",
        at_taps=after.get("python_at_taps", 0) - before.get("python_at_taps", 0),
        steps_at_taps=after.get("steps_at_taps", 0) - before.get("steps_at_taps", 0),
        uncompiled_steps=after["uncompiled_steps"] - before["uncompiled_steps"],
        split_at_taps=after.get("split_at_taps"),
        broken_at_taps=after.get("broken_at_taps"),
        graph_modes={
            mode: count - before.get("graph_modes", {}).get(mode, 0)
            for mode, count in after.get("graph_modes", {}).items()
        },
        step_seconds_at_taps=round(
            after.get("step_seconds", {}).get("taps", 0) - before.get("step_seconds", {}).get("taps", 0), 3
        ),
    )


def hotwire_engine(path: str, repeats: int) -> None:
    """hotwire-vllm 0.1.2 (a Triton op in every decoder layer, graphs kept), steering
    the same layer with the same vector through its own request spec."""
    import tempfile

    import torch
    from vllm import LLM, SamplingParams

    vectors = Path(tempfile.mkdtemp())
    torch.save(unit_vector(path).cpu(), vectors / "bench.pt")
    os.environ["HOTWIRE_VECTORS"] = str(vectors)
    t0 = time.perf_counter()
    llm = LLM(path, **ENGINE)
    result(engine="hotwire", job="startup", s=round(time.perf_counter() - t0, 1))
    spec = json.dumps({"id": "bench", "layer": LAYER, "scale": 1.0})
    plain = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, detokenize=False)
    steered = SamplingParams(
        temperature=0.0, max_tokens=TOKENS, ignore_eos=True, detokenize=False, extra_args={"hotwire": spec}
    )
    few = prompts(CONCURRENT)
    llm.generate(few[:8], steered, use_tqdm=False)
    settle()
    for _ in range(repeats):
        for job, params in (("plain", plain), ("steer", steered)):
            batch = unique(CONCURRENT)
            wall = timed(lambda batch=batch, params=params: llm.generate(batch, params, use_tqdm=False))
            result(engine="hotwire", job=job, tok_s=round(CONCURRENT * TOKENS / wall, 1))
    for job, params in (("plain256", plain), ("steer256", steered)):
        batch = unique(WIDE)
        wall = timed(lambda batch=batch, params=params: llm.generate(batch, params, use_tqdm=False))
        result(engine="hotwire", job=job, tok_s=round(WIDE * TOKENS / wall, 1))
    steered_ids = llm.generate(few[:8], steered, use_tqdm=False)
    plain_ids = llm.generate(few[:8], plain, use_tqdm=False)
    changed = sum(
        list(a.outputs[0].token_ids) != list(b.outputs[0].token_ids) for a, b in zip(steered_ids, plain_ids)
    )
    result(engine="hotwire", job="steer_check", steered=changed, of=8)


def nnsight_engine(path: str) -> None:
    """nnsight's own vLLM integration (its runner), eager, as its docs build it."""
    from nnsight.modeling.vllm import VLLM

    t0 = time.perf_counter()
    model = VLLM(path, dispatch=True, enforce_eager=True, **ENGINE)
    result(engine="nnsight", job="startup", s=round(time.perf_counter() - t0, 1))
    few = prompts(CONCURRENT)
    vector = unit_vector(path)
    steer(model, few[:4], 8, vector)
    wall = timed(lambda: steer(model, few, TOKENS, vector))
    result(engine="nnsight", job="steer", tok_s=round(CONCURRENT * TOKENS / wall, 1))
    wall = timed(lambda: capture(model, few, TOKENS))
    result(engine="nnsight", job=f"capture{CONCURRENT}", tok_s=round(CONCURRENT * TOKENS / wall, 1))
    lens(model, few[0])
    walls = [timed(lambda: lens(model, few[0])) for _ in range(10)]
    result(engine="nnsight", job="lens", ms=round(1000 * statistics.median(walls[2:]), 2))
    sweep(model, fresh_prompts(SWEEP, 10))
    batches = [fresh_prompts(SWEEP, run) for run in range(11, 14)]
    walls = [timed(functools.partial(sweep, model, batch)) for batch in batches]
    result(engine="nnsight", job="sweep", ms=round(1000 * statistics.median(walls), 1))


def profile_engine(path: str, graphs: bool = False, taps: bool = False) -> None:
    """Where a traced request's time goes: cProfile over engine and worker in one
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), each job split by entry point
    (``profile_cpu.PARTS``), by the functions with the most time of their own, and
    by the plugin's functions with the most time in all (``<job>-plugin`` rows).
    Eager (``profile``): the sweep, ten one-token traces, and 64 steered requests
    x 32 tokens. Graphed (``profile-graphs``): the sweep, ten one-token traces and
    ten plain one-token calls beside them, and ten logit lenses. Tapped
    (``profile-taps``, graphed, layer 18 tapped, or ``GPU_BENCH_TAPS``): the lowered
    capture of 1,000 x 128 and steering of 256 x 128, beside plain 1,000 x 128,
    steering and a direction removed at 64 x 128 (``steer64``, ``remove``), plain
    64 x 128 and 64 x 16 (``plain64``, ``plain16``: the probe's and patching's
    plain runs), ten
    logit lenses beside ten one-token traces, patching (64 x 16), where every
    layer is tapped the probe (64 x 128), one block at the taps among 63 plain
    requests (x 32, ``at_taps``) and ten plain one-token calls (``plain1``), and
    1,024 prompts sharing a 512-token prefix, plain and as a last-row sweep
    (``prefix_plain``, ``prefix_sweep``), and 1,024 unique prompts the same way
    (``unique_plain``, ``unique_sweep``);
    ``GPU_BENCH_PROFILE_JOBS`` (comma-separated names) picks some;
    ``GPU_BENCH_PROFILE_DUMP`` (a folder) keeps each job's ``<job>.pstats``."""
    import cProfile

    from vllm import LLM, SamplingParams

    from vllm_nnsight_plugin import VLLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from profile_cpu import plugin_parts, split, top

    name = "profile-taps" if taps else "profile-graphs" if graphs else "profile"
    extra = {"additional_config": {"nnsight_taps": TAPS if taps else "none"}}
    llm = LLM(path, enforce_eager=not graphs, **ENGINE, **extra)
    model = VLLM(llm)
    vector, few, swept = unit_vector(path), prompts(CONCURRENT), fresh_prompts(SWEEP, 20)
    steer(model, few[:4], 8, vector)
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    runs = itertools.count(40)
    jobs = {
        "sweep": lambda: sweep(model, swept),
        "trace1": lambda: [trace1(model, few[0]) for _ in range(10)],
    }
    if taps:
        many = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, detokenize=False)
        jobs = {
            "plain1000": lambda: llm.generate(unique(MANY), many, use_tqdm=False),
            "plain64": lambda: plain_run(llm, CONCURRENT, TOKENS),
            "plain16": lambda: plain_run(llm, CONCURRENT, SHORT),
            "capture1000": lambda: capture(model, unique(MANY), TOKENS),
            "steer256": lambda: steer(model, unique(WIDE), TOKENS, vector),
            "lens": lambda: [lens(model, few[0]) for _ in range(10)],
            "trace1": lambda: [trace1(model, few[0]) for _ in range(10)],
        }
        # 64 x 128 steered, and the same with a direction removed: what the
        # direction edit adds over an add
        jobs["steer64"] = lambda: steer(model, unique(CONCURRENT), TOKENS, vector)
        u = vector / vector.norm()
        jobs["remove"] = lambda: project(model, unique(CONCURRENT), TOKENS, remove(u))
        rows = clean_rows(model, few[0])
        jobs["patch"] = lambda: patch(model, unique(CONCURRENT), SHORT, rows)
        if every_layer_tapped():
            layers = layer_count(path)
            jobs["probe"] = lambda: probe_rows(model, unique(CONCURRENT), TOKENS, layers)
        # a block at the taps among plain requests, and plain one-token calls (a
        # prefill: piece graphs), where the time between pieces goes
        # (with ``VLLM_NNSIGHT_SPLIT_AT_TAPS=1``, the taps run as Python there)
        jobs["at_taps"] = lambda: halve_if_large(model, unique(CONCURRENT), 32, among_plain=llm)
        jobs["plain1"] = lambda: [
            llm.generate([p], one, use_tqdm=False) for p in fresh_prompts(10, next(runs))
        ]
        # prompts sharing a 512-token prefix: plain, and a last-row sweep that shares
        # the prefix cache (``prefix.py``)
        jobs["prefix_plain"] = lambda: llm.generate(shared_prefix(SWEEP, next(runs)), one, use_tqdm=False)
        jobs["prefix_sweep"] = lambda: sweep(model, shared_prefix(SWEEP, next(runs)))
        # 1,024 unique prompts, one token each: plain, and a last-row sweep
        jobs["unique_plain"] = lambda: llm.generate(unique(SWEEP), one, use_tqdm=False)
        jobs["unique_sweep"] = lambda: sweep(model, unique(SWEEP))
        wanted = [j for j in os.environ.get("GPU_BENCH_PROFILE_JOBS", "").split(",") if j]
        jobs = {job: fn for job, fn in jobs.items() if not wanted or job in wanted}
    elif graphs:
        jobs["plain1"] = lambda: [
            llm.generate([p], one, use_tqdm=False) for p in fresh_prompts(10, next(runs))
        ]
        jobs["lens"] = lambda: [lens(model, few[0]) for _ in range(10)]
    else:
        jobs["steer"] = lambda: steer(model, few, 32, vector)
    for job, fn in jobs.items():
        fn()
        profiler = cProfile.Profile()
        wall = timed(lambda: profiler.runcall(fn))  # noqa: B023
        result(engine=name, job=job, s=round(wall, 3), split_ms=split(profiler, wall))
        for row in top(profiler, 30):
            result(engine=name, job=f"{job}-top", row=row)
        for row in plugin_parts(profiler):
            result(engine=name, job=f"{job}-plugin", row=row)
        if dump := os.environ.get("GPU_BENCH_PROFILE_DUMP"):
            profiler.dump_stats(Path(dump) / f"{job}.pstats")


def _worker_profile_start(worker) -> None:
    """(In the worker, through ``collective_rpc``.) Start profiling its thread."""
    import cProfile

    worker.__dict__["_bench_profile"] = profiler = cProfile.Profile()
    profiler.enable()


def _worker_profile_stop(worker, file: str) -> dict:
    """(In the worker.) Stop, keep the profile in ``file``, and split it by entry point."""
    profiler = worker.__dict__.pop("_bench_profile")
    profiler.disable()
    profiler.dump_stats(file)
    import pstats

    stats = pstats.Stats(profiler)
    parts = {}
    for (found, _, function), row in stats.stats.items():
        if "vllm_nnsight_plugin" in found and function in (
            "begin_step",
            "_admit",
            "collect",
            "_collect",
            "fill",
            "pack_all",
            "pool_part",
            "forget",
            "wind_up",
        ):
            key = f"{found.split('vllm_nnsight_plugin/')[-1]}:{function}"
            parts[key] = round(1000 * row[3], 1)
    return parts


def served_profile_engine(path: str, repeats: int, out: Path) -> None:
    """Where a traced job's time goes as ``vllm.LLM`` serves it: each job's wall time
    unprofiled, ``repeats`` times after its plain run (``<job>_served`` rows), then
    one run with the front end's process and the worker's each under cProfile
    (``<job>_profiled`` rows: the worker's plugin parts, cumulative ms), the
    profiles packed into ``out/served-pstats.tgz``."""
    import cProfile
    import tarfile

    from vllm import LLM, SamplingParams

    from vllm_nnsight_plugin import VLLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from profile_cpu import split

    llm = LLM(path, enforce_eager=False, **ENGINE, additional_config={"nnsight_taps": TAPS})
    model = VLLM(llm)
    few = prompts(CONCURRENT)
    rows = clean_rows(model, few[0])
    layers = layer_count(path)
    runs = itertools.count(700)
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    pairs = {
        "patch": (
            lambda: plain_run(llm, CONCURRENT, SHORT),
            lambda: patch(model, unique(CONCURRENT), SHORT, rows),
        ),
        "capture1000": (
            lambda: plain_run(llm, MANY, TOKENS),
            lambda: capture(model, unique(MANY), TOKENS),
        ),
        "sweep": (
            lambda: llm.generate(unique(SWEEP), one, use_tqdm=False),
            lambda: sweep(model, unique(SWEEP)),
        ),
        "prefix_sweep": (
            lambda: llm.generate(shared_prefix(SWEEP, next(runs)), one, use_tqdm=False),
            lambda: sweep(model, shared_prefix(SWEEP, next(runs))),
        ),
    }
    if every_layer_tapped():
        pairs["probe"] = (
            lambda: plain_run(llm, CONCURRENT, TOKENS),
            lambda: probe_rows(model, unique(CONCURRENT), TOKENS, layers),
        )
    wanted = [j for j in os.environ.get("GPU_BENCH_PROFILE_JOBS", "").split(",") if j]
    pairs = {job: pair for job, pair in pairs.items() if not wanted or job in wanted}
    kept = out / "served-pstats"
    kept.mkdir(parents=True, exist_ok=True)
    for job, (plain, traced) in pairs.items():
        plain(), traced()  # warm-up
        for _ in range(repeats):
            plain_s, traced_s = timed(plain), timed(traced)
            result(
                engine="profile-served",
                job=f"{job}_served",
                plain_ms=round(1000 * plain_s, 1),
                ms=round(1000 * traced_s, 1),
                ratio=round(plain_s / traced_s, 4),
            )
        llm.collective_rpc(_worker_profile_start)
        front = cProfile.Profile()
        wall = timed(lambda: front.runcall(traced))  # noqa: B023
        (worker,) = llm.collective_rpc(_worker_profile_stop, args=(str(kept / f"{job}-worker.pstats"),))
        front.dump_stats(kept / f"{job}-front.pstats")
        result(
            engine="profile-served",
            job=f"{job}_profiled",
            s=round(wall, 3),
            front_ms=split(front, wall),
            worker_ms=worker,
        )
    with tarfile.open(out / "served-pstats.tgz", "w:gz") as archive:
        archive.add(kept, arcname="served-pstats")
    shutil.rmtree(kept)


def phases_engine(path: str, repeats: int, name: str = "phases-taps") -> None:
    """Where the host time of patching, the probe, the capture, blocks at the taps
    and the last-row sweeps goes, unprofiled (``GPU_BENCH_PHASES_JOBS``: some of them, by name):
    the tapped engine, front end and worker in one process, each phase timed
    (``phases_cpu.instrument``), each job ``repeats`` times after its plain run of
    the same size (``<job>_phases`` rows: the wall time and each phase's
    milliseconds and calls)."""
    from vllm import LLM, SamplingParams

    from vllm_nnsight_plugin import VLLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import phases_cpu

    llm = LLM(path, enforce_eager=False, **ENGINE, additional_config={"nnsight_taps": TAPS})
    model = VLLM(llm)
    phases_cpu.instrument()
    few = prompts(CONCURRENT)
    rows = clean_rows(model, few[0])
    layers = layer_count(path)
    jobs = {
        "plain16": lambda: plain_run(llm, CONCURRENT, SHORT),
        "patch": lambda: patch(model, unique(CONCURRENT), SHORT, rows),
        "plain64": lambda: plain_run(llm, CONCURRENT, TOKENS),
        "capture64": lambda: capture(model, unique(CONCURRENT), TOKENS),
        "plain1000": lambda: plain_run(llm, MANY, TOKENS),
        "capture1000": lambda: capture(model, unique(MANY), TOKENS),
    }
    if every_layer_tapped():
        jobs["plain64_"] = jobs["plain64"]
        jobs["probe"] = lambda: probe_rows(model, unique(CONCURRENT), TOKENS, layers)
    # blocks at the taps: one among 63 plain, and 64 (their hand-offs, the steps' starts)
    jobs["at_taps"] = lambda: halve_if_large(model, unique(CONCURRENT), TOKENS, among_plain=llm)
    jobs["at_taps_all"] = lambda: halve_if_large(model, unique(CONCURRENT), TOKENS)
    # last-row sweeps of 1,024 prompts, one token each: unique, and behind one prefix
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    runs = itertools.count(900)
    jobs["unique_plain"] = lambda: llm.generate(unique(SWEEP), one, use_tqdm=False)
    jobs["unique_sweep"] = lambda: sweep(model, unique(SWEEP))
    jobs["prefix_plain"] = lambda: llm.generate(shared_prefix(SWEEP, next(runs)), one, use_tqdm=False)
    jobs["prefix_sweep"] = lambda: sweep(model, shared_prefix(SWEEP, next(runs)))
    wanted = [job for job in os.environ.get("GPU_BENCH_PHASES_JOBS", "").split(",") if job]
    jobs = {job: fn for job, fn in jobs.items() if not wanted or job in wanted}
    served = name == "phases-served"  # the engine core's own phases, through collective_rpc
    here = str(Path(__file__).resolve().parent)
    if served:
        llm.collective_rpc(_worker_phases, args=(here, "instrument"))
    for job, fn in jobs.items():
        fn()  # warm-up
        settle()  # (what the warm-up left, out of the collector's walks)
        for _ in range(repeats):
            if served:  # (before the front end's timers start: not a collect's wait)
                llm.collective_rpc(_worker_phases, args=(here, "begin"))
            phases_cpu.SPENT.clear()
            phases_cpu.EVENTS = [] if served else None
            origin = time.perf_counter()
            wall = timed(fn)
            spent = {label: [round(1000 * s, 1), n] for label, (s, n) in phases_cpu.SPENT.items()}
            extra = {}
            if served:
                (worker,) = llm.collective_rpc(_worker_phases, args=(here, "take"))
                extra = {
                    "worker_phases": {k: [round(1000 * s, 1), n] for k, (s, n) in worker[0].items()},
                    "timeline": phases_cpu.timeline(phases_cpu.EVENTS, origin),
                    "worker_timeline": phases_cpu.timeline(worker[1], origin),
                    "allocator": {
                        k: v for k, v in worker[2].items() if k not in ("steps", "stacks", "stack_profile")
                    },
                    "steps": [[round(1000 * (t - origin), 1), *rest] for t, *rest in worker[2]["steps"]],
                }
                if "stack_profile" in worker[2]:  # (``GPU_BENCH_STACKS``)
                    extra["stack_profile"] = worker[2]["stack_profile"]
                if "stacks" in worker[2]:
                    extra["stacks"] = [
                        [label, round(1000 * (start - origin), 1), *rest]
                        for label, start, *rest in worker[2]["stacks"]
                    ]
            seqs = ENGINE.get("max_num_seqs", "vllm")
            result(
                engine=name,
                job=f"{job}_phases",
                ms=round(1000 * wall, 1),
                max_num_seqs=seqs,
                phases=spent,
                **extra,
            )


def _worker_phases(_worker: object, here: str, what: str) -> object:
    """In the engine core's process (``collective_rpc``): ``settle`` its heap,
    ``instrument`` its phases, ``begin`` a job's, ``take`` them (the sums, and
    each call's span)."""
    if what == "settle":
        settle()
        return None
    if here not in sys.path:
        sys.path.insert(0, here)
    import phases_cpu

    if what == "instrument":
        phases_cpu.instrument()
        from vllm.v1.engine import core
        from vllm.v1.worker import gpu_worker

        phases_cpu.wrap(gpu_worker.Worker, "execute_model", "worker: execute_model")
        phases_cpu.wrap(gpu_worker.Worker, "sample_tokens", "worker: sample_tokens")
        phases_cpu.wrap(core.EngineCore, "step_with_batch_queue", "engine core: step (batch queue)")
        phases_cpu.wrap(core.EngineCore, "step", "engine core: step")
        _record_schedules(phases_cpu)
        if os.environ.get("GPU_BENCH_STACKS"):  # where a long step call waited
            phases_cpu.STACKS = phases_cpu.Stacks()
        return None
    if what == "begin":
        phases_cpu.SPENT.clear()
        phases_cpu.EVENTS = []
        phases_cpu.ALLOCATOR = _allocator_counts()  # (kept where it is imported, not pickled)
        phases_cpu.SCHEDULED = []
        if getattr(phases_cpu, "STACKS", None) is not None:
            phases_cpu.STACKS.clear()
        return None
    spent, events = dict(phases_cpu.SPENT), phases_cpu.EVENTS or []
    phases_cpu.EVENTS = None
    before, after = getattr(phases_cpu, "ALLOCATOR", {}), _allocator_counts()
    counts = {key: after[key] - before.get(key, 0) for key in after}
    found = {**counts, "steps": getattr(phases_cpu, "SCHEDULED", [])}
    stacks = getattr(phases_cpu, "STACKS", None)
    if stacks is not None:
        found["stacks"] = stacks.where(events, _LONG_CALLS, 0.015)
        found["stack_profile"] = stacks.profile()
    return spent, events, found


#: The engine core's calls whose long ones ``GPU_BENCH_STACKS`` explains.
_LONG_CALLS = (
    "worker: execute_model",
    "worker: sample_tokens",
    "steps: begin (worker)",
    "collect (worker)",
    "steps: schedule (engine core)",
)


def _record_schedules(phases_cpu) -> None:
    """Each step the scheduler makes, as (when, its tokens, its requests, new ones,
    running, waiting): a job's steps set side by side with its plain run's."""
    import time

    from vllm.v1.core.sched import scheduler

    schedule = scheduler.Scheduler.schedule

    def recorded(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        steps = getattr(phases_cpu, "SCHEDULED", None)
        if steps is not None and out.total_num_scheduled_tokens:
            steps.append(
                (
                    round(time.perf_counter(), 4),
                    out.total_num_scheduled_tokens,
                    len(out.num_scheduled_tokens),
                    len(out.scheduled_new_reqs),
                    len(self.running),
                    len(self.waiting),
                )
            )
        return out

    scheduler.Scheduler.schedule = recorded


def _allocator_counts() -> dict:
    """The CUDA caching allocator's counts of the events that wait for the whole
    device (a retry frees cached blocks, ``cudaFree`` synchronizes): a collect that
    waits for the step in flight this way shows here, not in its phases' names."""
    import torch

    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")
    return {key: stats.get(key, 0) for key in keys}


def hf_engine(path: str) -> None:
    """nnsight's ``LanguageModel`` on HF transformers, random bf16 weights on the GPU."""
    import torch
    from nnsight import LanguageModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, ENGINE["dtype"]))
    model = LanguageModel(hf.eval(), tokenizer=AutoTokenizer.from_pretrained(path))
    result(engine="hf", job="startup", s=round(time.perf_counter() - t0, 1))
    batch = torch.tensor(prompts(CONCURRENT), device=device)
    mask = torch.ones_like(batch)
    vector = unit_vector(path).to(device, hf.dtype)
    args = dict(max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False, pad_token_id=0)

    def hf_steer():
        with model.generate({"input_ids": batch, "attention_mask": mask}, **args) as tracer:
            with tracer.all():
                out = model.model.layers[LAYER].output
                hidden = out[0] if isinstance(out, tuple) else out
                hidden[:] += vector

    def hf_capture():
        with model.generate({"input_ids": batch, "attention_mask": mask}, **args) as tracer:
            rows = list().save()
            with tracer.all():
                out = model.model.layers[LAYER].output
                rows.append((out[0] if isinstance(out, tuple) else out).clone())

    for name, fn in (("steer", hf_steer), (f"capture{CONCURRENT}", hf_capture)):
        wall = timed(fn)
        result(engine="hf", job=name, tok_s=round(CONCURRENT * TOKENS / wall, 1))


# ---------------------------------------------------------------- driver
def run(out: Path, path: str, engines: list[str], repeats: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    sink = (out / "results.jsonl").open("a")
    for name in engines:
        env = dict(os.environ)
        if name == "profile-served":  # the worker's profiler travels as a function
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        elif name == "phases-served":  # the front end's phases, as ``vllm.LLM`` serves
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the engine core's timers
        elif name.startswith(("profile", "phases")):
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        elif name == "hotwire":  # its wheel, unpacked for this process only
            site = out / "hotwire-site"
            wheels = sorted(Path(".vllmkit/anchors").glob("hotwire_vllm-*.whl"))
            if not wheels:
                print("# hotwire: no wheel in .vllmkit/anchors", flush=True)
                continue
            zipfile.ZipFile(wheels[-1]).extractall(site)
            env["PYTHONPATH"] = f"{site}:{env.get('PYTHONPATH', '')}"
            env["VLLM_PLUGINS"] = "hotwire"
        elif not name.startswith("on-"):
            env["VLLM_PLUGINS"] = ""  # load no vLLM plugin in this process
        env["GPU_BENCH_OUT"] = str(out)
        command = [sys.executable, __file__, "engine", name, path, str(repeats)]
        log = (out / f"{name}.log").open("w")
        started = time.perf_counter()
        # Each result is written as it comes: an engine stopped at its time limit
        # (or the machine's) leaves what it measured.
        with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log, text=True) as proc:
            limit = threading.Timer(float(os.environ.get("GPU_BENCH_ENGINE_S", 560)), proc.kill)
            limit.start()
            for line in proc.stdout:
                if line.startswith("RESULT "):
                    sink.write(line[7:])
                    sink.flush()
                    print(line, end="", flush=True)
            limit.cancel()
        print(f"# {name}: rc={proc.returncode} in {time.perf_counter() - started:.0f} s", flush=True)


def table(*paths: Path) -> str:
    """Medians and ratios; each path is a run's folder or a ``results.jsonl``."""
    files = [p / "results.jsonl" if p.is_dir() else p for p in paths]
    rows = [json.loads(line) for f in files for line in f.read_text().splitlines() if line]
    by: dict[tuple[str, str], list[float]] = {}
    rows_of: dict[tuple[str, str], dict] = {}  # a row of each, for its unit
    for row in rows:
        value = row.get("tok_s", row.get("ms"))
        if value is not None and not row["engine"].startswith(("profile", "phases")):
            by.setdefault((row["engine"], row["job"]), []).append(value)
            rows_of[(row["engine"], row["job"])] = row
    median = {key: statistics.median(values) for key, values in by.items()}
    base = median.get(("off-graphs", "plain"))
    base1000 = median.get(("off-graphs", "plain1000"))
    forward = median.get(("off-graphs", "forward"))
    swept = median.get(("off-graphs", "plain_sweep"))
    prefixed = median.get(("off-graphs", "prefix_plain"))
    prefixed128 = median.get(("off-graphs", "prefix_plain128"))
    lines = [
        "| engine | job | median | runs | vs plain vLLM (graphs) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for (engine, job), values in sorted(by.items()):
        unit = "ms" if "ms" in rows_of[(engine, job)] else "tok/s"
        ref = base1000 if job in ("plain1000", "capture1000") else base
        ref = median.get(("off-graphs", "plain16")) if job in ("plain16", "patch") else ref
        ref = median.get(("off-graphs", "plain256")) if job in ("plain256", "steer256") else ref
        if engine == "hotwire" and job.startswith("steer"):  # its own idle, as its docs measure
            ref = median.get((engine, "plain256" if job == "steer256" else "plain"))
        if job == "lens":
            ratio = f"{median[(engine, job)] / forward:.2f}x a plain forward" if forward else ""
        elif job == "trace1":
            ratio = f"+{median[(engine, job)] - forward:.2f} ms over a plain forward" if forward else ""
        elif job in ("sweep", "plain_sweep"):
            ratio = f"{median[(engine, job)] / swept:.2f}x plain time" if swept else ""
        elif job in ("prefix_plain", "prefix_sweep"):
            ratio = f"{median[(engine, job)] / prefixed:.2f}x plain time" if prefixed else ""
        elif job in ("prefix_plain128", "prefix_steer128", "prefix_edit128") and prefixed128:
            ratio = f"{median[(engine, job)] / prefixed128:.2f}x plain time"
        elif unit == "tok/s" and ref:
            ratio = f"{median[(engine, job)] / ref:.3f}"
        else:
            ratio = ""
        spread = f"{min(values):,.0f}-{max(values):,.0f}" if len(values) > 1 else ""
        lines.append(
            f"| {engine} | {job} | {median[(engine, job)]:,.1f} {unit} | {len(values)} {spread} | {ratio} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    command = sys.argv[1]
    if command == "engine":
        name, path, repeats = sys.argv[2], sys.argv[3], int(sys.argv[4])
        if name == "nnsight":
            nnsight_engine(path)
        elif name in ("profile", "profile-graphs", "profile-taps"):
            profile_engine(path, graphs=name != "profile", taps=name == "profile-taps")
        elif name in ("phases-taps", "phases-served"):
            phases_engine(path, repeats, name)
        elif name == "profile-served":
            served_profile_engine(path, repeats, Path(os.environ.get("GPU_BENCH_OUT", ".")))
        elif name == "hf":
            hf_engine(path)
        elif name == "hotwire":
            hotwire_engine(path, repeats)
        else:
            vllm_engine(name, path, repeats)
    elif command == "run":
        out, path = Path(sys.argv[2]), sys.argv[3]
        engines = "off-graphs,on-graphs,off-eager,on-eager,nnsight,hf"
        repeats = 5
        for arg in sys.argv[4:]:
            if arg.startswith("--engines="):
                engines = arg.split("=", 1)[1]
            if arg.startswith("--repeats="):
                repeats = int(arg.split("=", 1)[1])
        run(out, path, engines.split(","), repeats)
        print(table(out))
    elif command == "table":
        print(table(*[Path(p) for p in sys.argv[2:]]))
    else:
        sys.exit(__doc__)
