"""What the plugin wraps in vLLM (:data:`SEAMS`) and which lines of vLLM's source it
relies on (:data:`FACTS`): declared once, checked by ``tests/engine/test_seams.py`` on the
installed vLLM and by ``check.missing`` on any release's source."""

from __future__ import annotations

from dataclasses import dataclass

from .check import RUNNERS, calls_by_name, installed_root, module_file

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
            root = installed_root()
            if root is None or module_file(root, RUNNERS[self.runner]) is None:
                return False
        if not self.owner:
            root = installed_root()
            return root is not None and calls_by_name(root, self.module, self.name)
        if self.platform is None:
            return True
        from vllm.platforms import current_platform

        return current_platform.is_cpu() if self.platform == "cpu" else False

    @property
    def label(self) -> str:
        return f"{self.owner or self.module}.{self.name}"


_V1, _V2, _V2_CPU = RUNNERS["v1"], RUNNERS["v2"], RUNNERS["v2-cpu"]
_GRAPHS = "vllm.v1.worker.gpu.cudagraph_utils"
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
    # Graphs of the whole forward also captured broken at the taps, and replayed.
    Seam(_V2, "GPUModelRunner", "capture_model", ("self",), WORKER, runner="v2"),
    Seam(_GRAPHS, "CudaGraphManager", "capture", ("self", "create_forward_fn"), WORKER, runner="v2"),
    Seam(_GRAPHS, "CudaGraphManager", "run_fullgraph", ("self", "desc"), WORKER, runner="v2"),
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
#: in :data:`SEAMS`. ``tests/engine/test_seams.py`` checks each on the installed vLLM,
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
    # A step whose running requests fill every slot, or that preempts, starts no
    # waiting request (``engine._no_room``): the scheduler's reads are skipped then.
    Fact(
        _SCHEDULER,
        "Scheduler.schedule",
        ("num_running >= self.max_num_running_reqs", "num_running >= self.max_num_active_reqs"),
        "the scheduler's reads skipped when no slot is free",
    ),
    Fact(
        _SCHEDULER,
        "Scheduler.schedule",
        "if not preempted_reqs",
        "the scheduler's reads skipped when no slot is free",
    ),
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
    # Graphs broken at the taps (``runner_v2._capturing_graphs``): vLLM makes a full
    # graph's inputs with ``create_forward_fn(desc, warmup=False)`` (the attention
    # metadata in the buffers every replay reads), captures ``forward_fn(NONE)``
    # in its pool, and replays by the batch's descriptor; a step's forward is that
    # replay, with no Python forward.
    Fact(
        _GRAPHS,
        "CudaGraphManager.capture",
        ("create_forward_fn(desc, warmup=False)", "desc, warmup=False"),
        "graphs broken at the taps",
        "v2",
    ),
    Fact(
        _GRAPHS,
        "CudaGraphManager.capture",
        "forward_fn(CUDAGraphMode.NONE)",
        "graphs broken at the taps",
        "v2",
    ),
    Fact(_GRAPHS, "CudaGraphManager.capture", "self.pool", "graphs broken at the taps", "v2"),
    Fact(
        _GRAPHS,
        "CudaGraphManager.run_fullgraph",
        "self.graphs[desc].replay()",
        "graphs broken at the taps",
        "v2",
    ),
    Fact(
        _V2,
        "GPUModelRunner.execute_model",
        "self.cudagraph_manager.run_fullgraph(batch_desc)",
        "graphs broken at the taps",
        "v2",
    ),
    Fact(
        _V2,
        "GPUModelRunner.capture_model",
        "self.cudagraph_manager.capture(",
        "graphs broken at the taps",
        "v2",
    ),
    Fact("vllm.utils.torch_utils", "weak_ref_tensor", "def weak_ref_tensor", "graphs broken at the taps"),
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
