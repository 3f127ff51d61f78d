"""Worker seams: each process that runs the model.

The runner wraps (:func:`patch_model_runner`, installed by ``worker/extension.py``
when a worker imports it), the switches for a step run as plain Python, and the
small reads of the scheduler output, the runner and the sampler output that the
worker runtime makes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _wrap


def patch_model_runner(
    on_step: Callable[[Any, Any], None],
    on_step_end: Callable[[Any], None],
    on_loaded: Callable[[Any], None],
    on_dispatch: Callable[[Any], None],
) -> None:
    """Call ``on_step(runner, scheduler_output)`` before each real forward step,
    ``on_loaded(runner)`` once the model is loaded (before any compile or graph
    capture), and ``on_dispatch(runner)`` once a forward's layout is known."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make(original: Callable) -> Callable:
        def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            on_step(self, scheduler_output)
            try:
                return original(self, scheduler_output, *args, **kwargs)
            except BaseException:
                on_step_end(self)
                raise

        return execute_model

    def make_dispatch(original: Callable) -> Callable:
        def determine(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.__dict__.get(UNCOMPILED_STEP):
                kwargs["force_eager"] = True  # no CUDA graph for this step's batch
            result = original(self, *args, **kwargs)
            mode = getattr(result[0], "name", str(result[0]))
            counts = self.__dict__.setdefault(GRAPH_MODES, {})
            counts[mode] = counts.get(mode, 0) + 1
            on_dispatch(self)
            return result

        return determine

    def make_load(original: Callable) -> Callable:
        def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            on_loaded(self)
            return result

        return load_model

    _wrap(GPUModelRunner, "execute_model", make)
    _wrap(GPUModelRunner, "_determine_batch_execution_and_padding", make_dispatch)
    for runner_class in model_runner_classes():
        _wrap(runner_class, "load_model", make_load)


def model_runner_classes() -> list[type]:
    """The runner classes whose ``load_model`` loads the model: the GPU runner, and
    the CPU runner (which overrides it) where this vLLM build has one."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    classes: list[type] = [GPUModelRunner]
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        classes.append(CPUModelRunner)
    return classes


#: Set on a runner for a step whose forward must run as plain Python.
UNCOMPILED_STEP = "_nnsight_uncompiled_step"
#: On a runner: how many forwards vLLM dispatched in each CUDA-graph mode.
GRAPH_MODES = "_nnsight_graph_modes"


def graph_mode_counts(runner: Any) -> dict[str, int]:
    return dict(runner.__dict__.get(GRAPH_MODES, {}))


def runner_name(runner: Any) -> str:
    return f"{type(runner).__module__}.{type(runner).__qualname__}"


def mark_uncompiled_step(runner: Any, uncompiled: bool) -> None:
    """Run (or stop running) this runner's next forward without CUDA graphs."""
    runner.__dict__[UNCOMPILED_STEP] = uncompiled


def skip_compiled_forward() -> None:
    """Make the model's ``@support_torch_compile`` module call its Python forward.

    Called from the root module's forward pre-hook, inside the step's forward
    context: vLLM's decorator reads ``skip_compiled`` there on every call (0.25
    and 0.32), and it is what vLLM itself uses for steps a compiled graph cannot
    serve.
    """
    from vllm.forward_context import get_forward_context

    get_forward_context().skip_compiled = True


class StepLayout:
    """Which rows of this step's packed ``[tokens, ...]`` slab belong to which request.

    Read from the V1 runner's persistent batch with no device sync:
    ``input_batch.req_ids[:num_reqs]`` is the row order, ``query_start_loc.np``
    the row offsets. Valid between ``_prepare_inputs`` and the sampler, which is
    exactly when the forward hooks run.
    """

    __slots__ = ("req_ids", "starts", "counts")

    def __init__(self, runner: Any) -> None:
        req_ids, bounds = step_rows(runner)
        self.req_ids: list[str] = list(req_ids)
        self.starts = [int(x) for x in bounds[:-1]]
        self.counts = [int(b - a) for a, b in zip(bounds[:-1], bounds[1:])]

    def spans(self) -> list[tuple[str, int]]:
        return list(zip(self.req_ids, self.counts))


def step_rows(runner: Any) -> tuple[list[str], Any]:
    """This step's request ids in row order and their row offsets (``n + 1``, a
    numpy array), as the persistent batch holds them: what ``StepLayout`` is
    built from, and what the tap tables read without per-request lists."""
    batch = runner.input_batch
    n = batch.num_reqs
    return batch.req_ids[:n], runner.query_start_loc.np[: n + 1]


def discarded_rows(runner: Any) -> Any:
    """Per row of this step's persistent batch, whether vLLM throws its sample away
    (a prompt or recompute chunk that is not the last): ``discard_request_mask``,
    set in ``_prepare_inputs`` before the forward (0.25 and 0.32)."""
    return runner.discard_request_mask.np[: runner.input_batch.num_reqs]


def speculates(runner: Any) -> bool:
    """Whether the engine decodes speculatively (a step may then carry several
    rows of a request, some of them rejected)."""
    return getattr(runner.vllm_config, "speculative_config", None) is not None


def new_requests(scheduler_output: Any) -> Any:
    """This step's newly scheduled requests (``NewRequestData``: ``req_id``, ``sampling_params``)."""
    return getattr(scheduler_output, "scheduled_new_reqs", None) or ()


def new_params(scheduler_output: Any) -> list:
    """The ``SamplingParams`` of this step's newly scheduled requests."""
    return [getattr(data, "sampling_params", None) for data in new_requests(scheduler_output)]


def resumed_ids(scheduler_output: Any) -> set[str]:
    """Requests this step resumes after a preemption: vLLM recomputes their prompt
    and generated tokens in this one step (``CachedRequestData.resumed_req_ids``)."""
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    return set(getattr(cached, "resumed_req_ids", None) or ())


def scheduled_ids(scheduler_output: Any) -> Any:
    """Ids of every request scheduled in this step."""
    return getattr(scheduler_output, "num_scheduled_tokens", None) or ()


def finished_ids(scheduler_output: Any) -> Any:
    """Ids of the requests the scheduler finished since the last step."""
    return getattr(scheduler_output, "finished_req_ids", None) or ()


def model_of(runner: Any) -> Any:
    """The runner's live model module (what the nnsight tree wraps)."""
    return runner.get_model()


def sampler_of(runner: Any) -> Any:
    """The runner's sampler, an ``nn.Module`` called as ``sampler(logits=..., ...)`` (V1)."""
    return runner.sampler


def tokenizer_of(runner: Any) -> Any:
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(runner.model_config)


def sampled_ids(sampler_output: Any) -> Any:
    """The ``[requests, 1]`` token ids the sampler drew (``SamplerOutput``)."""
    return sampler_output.sampled_token_ids


def set_sampled_ids(sampler_output: Any, ids: Any) -> None:
    sampler_output.sampled_token_ids = ids


def eos_token_id(tokenizer: Any) -> int | None:
    return getattr(tokenizer, "eos_token_id", None)


def reports_saves() -> bool:
    """Whether this worker's saves are the ones sent home: under tensor or pipeline
    parallelism every rank runs each block on the same gathered values, and the
    first rank answers for all."""
    from vllm.distributed.parallel_state import get_pp_group

    return get_pp_group().rank == 0


def front_end_elsewhere() -> bool:
    """Whether the front end that collects from this worker runs in another
    process (vLLM's engine core as a child process, the default), and this is
    the first tensor-parallel rank, whose reply the front end keeps: then a pool
    on the GPU can be lent to it (``returns/lent.py``)."""
    import vllm.envs as envs
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING) and get_tensor_model_parallel_rank() == 0


def request_state(runner: Any, request_id: str) -> Any:
    """The runner's ``CachedRequestState`` for a request (prompt length, computed tokens)."""
    return runner.requests.get(request_id)


def engine_is_eager(vllm_config: Any) -> bool:
    """Whether the model's forward runs as Python (so module hooks fire)."""
    if vllm_config.model_config.enforce_eager:
        return True
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "mode", None)
    return int(getattr(mode, "value", mode) or 0) == 0 and not getattr(compilation, "cudagraph_mode", None)


def whole_prompt_scheduled(data: Any, scheduler_output: Any) -> bool:
    """Whether a new request's (``NewRequestData``) whole prompt is in this step,
    rather than split by chunked prefill. Read before the runner's own request
    state exists (``begin_step`` runs before ``_update_states``)."""
    prompt = getattr(data, "prompt_token_ids", None)
    scheduled = scheduled_ids(scheduler_output)
    if prompt is None or not hasattr(scheduled, "get"):
        return False
    return int(getattr(data, "num_computed_tokens", 0) or 0) + int(scheduled.get(data.req_id, 0)) >= len(
        prompt
    )


def scheduled_rows(data: Any, scheduler_output: Any) -> int:
    """How many token rows a new request (``NewRequestData``) has in this step."""
    scheduled = scheduled_ids(scheduler_output)
    return int(scheduled.get(data.req_id, 0)) if hasattr(scheduled, "get") else 0


def model_dtype(runner: Any) -> Any:
    return runner.model_config.dtype


def tap_table_sizes(runner: Any) -> tuple[int, int, int, Any]:
    """What the tap tables are sized by: the most token rows one forward can have
    (the batch budget, or a larger CUDA-graph capture size), the model's width,
    the most requests one step can hold, and the runner's device."""
    config = runner.vllm_config
    scheduler = config.scheduler_config
    sizes = getattr(config.compilation_config, "cudagraph_capture_sizes", None) or ()
    max_tokens = max([int(scheduler.max_num_batched_tokens), *sizes])
    return max_tokens, config.model_config.get_hidden_size(), int(scheduler.max_num_seqs), runner.device


def parallel_split(module: Any) -> str | None:
    """How a layer's parameters are split over the tensor-parallel group:
    ``"row"`` (``RowParallelLinear``: its weight's input columns), ``"column"``
    (``ColumnParallelLinear``: output rows), ``"vocab"`` (a
    ``VocabParallelEmbedding`` without added rows), or None (held whole, split
    over another group, or laid out otherwise). Read by ``worker/parameters.py``."""
    if getattr(module, "tp_size", 1) < 2:
        return None
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if module.tp_size != get_tensor_model_parallel_world_size():
        return None
    if isinstance(module, RowParallelLinear):
        return "row"
    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, VocabParallelEmbedding) and not getattr(module, "num_added_embeddings", 0):
        return "vocab"  # with added rows, each rank's slice is its base rows then its added rows
    return None


def tensor_parallel_gather(tensor: Any, dim: int) -> Any:
    """Every tensor-parallel rank's ``tensor``, concatenated along ``dim``."""
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(tensor, dim=dim)
