"""Worker seams: each process that runs the model.

vLLM has two model runners. The first ("V1": ``gpu_model_runner.py`` and its CPU
subclass, vLLM 0.25 to 0.33) keeps a persistent batch in scheduler order; the
second ("V2": ``gpu/model_runner.py``, its CPU subclass, and the standalone CPU
runner of 0.34) builds a fresh batch every step, sorted decode first, and frees a
preempted request's state, bringing it back later as a new request. Which one an
engine runs is vLLM's choice (V2 by default on a GPU since 0.25 for dense models,
the only one from 0.34); the plugin never changes it.

Everything the worker needs from a runner is one small interface,
:class:`Runner`, with one implementation per runner (``runner_v1.py``,
``runner_v2.py``):

- which rows of this step's slab are whose, and how far each request's prompt
  is (:class:`StepView`, read once the step's layout is known; just the rows:
  :meth:`Runner.rows`);
- the logits the sampler draws from and the tokens it drew
  (:meth:`Runner.hook_sampler`);
- asking for the next forward without CUDA graphs (:meth:`Runner.ask_eager`),
  as the graphs of the pieces between the taps (:meth:`Runner.ask_pieces`), or
  as its graph of the whole forward broken at the taps (:meth:`Runner.ask_broken`);
- where the tap tables are filled (the ``on_layout`` hook) and where the model
  is loaded (``on_loaded``, before vLLM compiles it or captures a graph);
- the requests a step resumes after a preemption (:meth:`Runner.resumed`).

Nothing above ``seams/`` knows which runner runs. The shared reads (the
scheduler output's requests, the model, the tokenizer, how a parallel layer is
split) are here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class StepHooks:
    """What the worker runtime is told of a runner's life (``worker/extension.py``)."""

    #: ``(runner, scheduler_output)``: before each real step (not a warm-up or profile run).
    on_step: Callable[[Any, Any], None]
    #: ``(runner)``: the step raised before its sampler ran.
    on_step_failed: Callable[[Any], None]
    #: ``(runner)``: the model is loaded, not yet compiled or captured.
    on_loaded: Callable[[Any], None]
    #: ``(runner)``: this step's rows are known, before its forward (the tap tables fill here).
    on_layout: Callable[[Any], None]
    #: ``(runner)``: the forward is about to replay graphs broken at the taps, where no
    #: Python forward (so no module hook) starts it.
    on_replay: Callable[[Any], None] = lambda runner: None


class StepView:
    """Which rows of this step's packed ``[tokens, ...]`` slab belong to which request.

    Per row of the step's batch, in the order the forward sees them (each
    runner's own: scheduler order on V1, decode first on V2): the request id,
    its slab rows ``bounds[i]:bounds[i + 1]``, how many of its tokens were
    computed before this step, how many make up what must be computed before
    it samples (its prompt; after a preemption, its prompt and what it had
    generated), and whether vLLM throws this step's sample away (a chunk that
    does not reach that end)."""

    __slots__ = ("req_ids", "bounds", "computed", "prefill", "discarded")

    def __init__(
        self, req_ids: Iterable[str], bounds: Any, computed: Any, prefill: Any, discarded: Any = None
    ) -> None:
        self.req_ids: list[str] = list(req_ids)
        n = len(self.req_ids)
        self.bounds = np.asarray(bounds[: n + 1], dtype=np.int64)
        self.computed = np.asarray(computed[:n], dtype=np.int64)
        self.prefill = np.asarray(prefill[:n], dtype=np.int64)
        counts = np.diff(self.bounds)
        self.discarded = (
            self.computed + counts < self.prefill
            if discarded is None
            else np.asarray(discarded[:n], dtype=bool)
        )

    @property
    def counts(self) -> list[int]:
        return [int(c) for c in np.diff(self.bounds)]

    def spans(self) -> list[tuple[str, int]]:
        return list(zip(self.req_ids, self.counts))

    def rows(self) -> dict[str, int]:
        """Request id -> its row of the step's logits and samples (one per request)."""
        return {request_id: row for row, request_id in enumerate(self.req_ids)}


class Runner:
    """One model runner, as the worker sees it (see the module docstring)."""

    #: Its name in ``nnsight_stats`` and error messages.
    family = ""

    @classmethod
    def patch(cls, hooks: StepHooks) -> None:
        """Wrap the runner classes this vLLM has (the worker extension, once per process)."""
        raise NotImplementedError

    @classmethod
    def runs(cls, runner: Any) -> bool:
        """Whether ``runner`` is this runner."""
        raise NotImplementedError

    def view(self, runner: Any) -> StepView:
        """This step's rows (valid from ``on_layout`` until the sampler ran)."""
        raise NotImplementedError

    def rows(self, runner: Any) -> tuple[Any, Any]:
        """Just this step's request ids in row order and their ``n + 1`` row
        offsets, as the runner holds them (what the tap tables read every step,
        without building a :class:`StepView`)."""
        raise NotImplementedError

    def hook_sampler(
        self,
        runner: Any,
        on_logits: Callable[[Any], Any],
        on_samples: Callable[[Any], Any],
    ) -> None:
        """Call ``on_logits(logits)`` as the sampler is called (a tensor back: the
        sampler draws from that instead) and ``on_samples(ids)`` with the
        ``[requests, 1]`` token ids it drew (a tensor back replaces them)."""
        raise NotImplementedError

    def ask_eager(self, runner: Any, eager: bool) -> None:
        """Run (or stop running) this runner's next forward without CUDA graphs."""
        runner.__dict__[UNCOMPILED_STEP] = eager

    def ask_pieces(self, runner: Any, pieces: bool) -> None:
        """Run (or stop running) this runner's next forward as the CUDA graphs of the
        pieces between the compiled graph's splitting operations, never as one graph
        of the whole forward: the operations (the taps, where :func:`split_graph_at`
        added them) then run as Python. Where vLLM has no piece graphs for the
        batch, the forward runs compiled without a graph."""
        runner.__dict__[PIECEWISE_STEP] = pieces

    def ask_broken(self, runner: Any, broken: bool) -> None:
        """Run (or stop running) this runner's next forward, where it would replay one
        CUDA graph of the whole forward, as that forward's graphs broken at the taps
        (``taps/broken.py``), so the taps hand their values to Python between them.
        Where none was captured for the batch, the forward runs compiled without a graph."""
        runner.__dict__[BROKEN_STEP] = broken

    def resumed(self, scheduler_output: Any, tracked: Any) -> set[str]:
        """The requests this step resumes after a preemption (``tracked``: the
        request ids whose blocks the worker holds); vLLM recomputes their prompt
        and the tokens they had generated."""
        raise NotImplementedError


#: Set on a runner for a step whose forward must run as plain Python.
UNCOMPILED_STEP = "_nnsight_uncompiled_step"
#: Set on a runner for a step whose forward may replay piece graphs only (:meth:`Runner.ask_pieces`).
PIECEWISE_STEP = "_nnsight_piecewise_step"
#: Set on a runner for a step whose graph of the whole forward is replayed broken at the taps.
BROKEN_STEP = "_nnsight_broken_step"
#: On a runner whose graphs are also captured broken at the taps: what captures them
#: (``runner_v2.break_at_taps``).
BREAKS = "_nnsight_breaks"
#: On a runner: how many forwards vLLM dispatched in each CUDA-graph mode.
GRAPH_MODES = "_nnsight_graph_modes"


def present(module: str) -> bool:
    """Whether this vLLM has ``module`` (found without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def loading(hooks: StepHooks) -> Callable[[Callable], Callable]:
    """The wrap of a runner's ``load_model``: ``on_loaded`` once the model is there."""

    def make(original: Callable) -> Callable:
        def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            hooks.on_loaded(self)
            return result

        return load_model

    return make


def count_graph_mode(runner: Any, mode: Any) -> None:
    counts = runner.__dict__.setdefault(GRAPH_MODES, {})
    name = getattr(mode, "name", str(mode))
    counts[name] = counts.get(name, 0) + 1


def graph_mode_counts(runner: Any) -> dict[str, int]:
    return dict(runner.__dict__.get(GRAPH_MODES, {}))


def split_graph_at(vllm_config: Any, names: Iterable[str]) -> bool:
    """Have vLLM split the model's compiled graph at the operations ``names`` too,
    as it does at attention, where it splits the graph and replays the pieces
    between as CUDA graphs; whether it will (call before the model is compiled).

    Not where the whole forward is one graph (an eager engine, another compile
    mode, no splitting operations: full graphs only, sequence parallelism) or
    Inductor splits it (``use_inductor_graph_partition``). The operations join
    the configuration vLLM keys its compile cache by, so graphs split otherwise
    are not reused. A decode step replayed as one graph of the whole forward
    records the operations' kernels as before.
    """
    if vllm_config.model_config.enforce_eager:
        return False
    from vllm.config.compilation import CompilationMode

    compilation = vllm_config.compilation_config
    mode = compilation.cudagraph_mode
    splitting = compilation.splitting_ops
    if (
        compilation.mode != CompilationMode.VLLM_COMPILE
        or not splitting
        or getattr(compilation, "use_inductor_graph_partition", False)
        or mode is None
        or not mode.has_piecewise_cudagraphs()
    ):
        return False
    splitting.extend(name for name in names if name not in splitting)
    return True


def runner_name(runner: Any) -> str:
    return f"{type(runner).__module__}.{type(runner).__qualname__}"


def skip_compiled_forward() -> None:
    """Make the model's ``@support_torch_compile`` module call its Python forward.

    Called from the root module's forward pre-hook, inside the step's forward
    context: vLLM's decorator reads ``skip_compiled`` there on every call (0.25
    to 0.34, either runner), and it is what vLLM itself uses for steps a compiled
    graph cannot serve.
    """
    from vllm.forward_context import get_forward_context

    get_forward_context().skip_compiled = True


def speculates(runner: Any) -> bool:
    """Whether the engine decodes speculatively (a step may then carry several
    rows of a request, some of them rejected)."""
    return getattr(runner.vllm_config, "speculative_config", None) is not None


def new_requests(scheduler_output: Any) -> Any:
    """This step's newly scheduled requests (``NewRequestData``: ``req_id``, ``sampling_params``);
    on V2 also the requests it resumes after a preemption."""
    return getattr(scheduler_output, "scheduled_new_reqs", None) or ()


def new_params(scheduler_output: Any) -> list:
    """The ``SamplingParams`` of this step's newly scheduled requests."""
    return [getattr(data, "sampling_params", None) for data in new_requests(scheduler_output)]


def scheduled_ids(scheduler_output: Any) -> Any:
    """Ids of every request scheduled in this step."""
    return getattr(scheduler_output, "num_scheduled_tokens", None) or ()


def finished_ids(scheduler_output: Any) -> Any:
    """Ids of the requests the scheduler finished since the last step."""
    return getattr(scheduler_output, "finished_req_ids", None) or ()


def model_of(runner: Any) -> Any:
    """The runner's live model module (what the nnsight tree wraps)."""
    return runner.get_model()


def tokenizer_of(runner: Any) -> Any:
    from vllm.tokenizers import cached_tokenizer_from_config

    return cached_tokenizer_from_config(runner.model_config)


def eos_token_id(tokenizer: Any) -> int | None:
    return getattr(tokenizer, "eos_token_id", None)


def reports_saves() -> bool:
    """Whether this worker's saves are the ones sent home: under tensor or pipeline
    parallelism every rank runs each block on the same gathered values, and the
    first rank answers for all."""
    from vllm.distributed.parallel_state import get_pp_group

    return get_pp_group().rank == 0


def answers_for_engine() -> bool:
    """Whether this worker is the engine's first rank (tensor and pipeline), whose
    counts stand for the engine's: every rank runs the same steps."""
    from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

    return get_pp_group().rank == 0 and get_tensor_model_parallel_rank() == 0


def front_end_elsewhere() -> bool:
    """Whether the front end that collects from this worker runs in another
    process (vLLM's engine core as a child process, the default), and this is
    the first tensor-parallel rank, whose reply the front end keeps: then a pool
    on the GPU can be lent to it (``returns/lent.py``)."""
    import vllm.envs as envs
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return bool(envs.VLLM_ENABLE_V1_MULTIPROCESSING) and get_tensor_model_parallel_rank() == 0


def engine_is_eager(vllm_config: Any) -> bool:
    """Whether the model's forward runs as Python (so module hooks fire)."""
    if vllm_config.model_config.enforce_eager:
        return True
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "mode", None)
    return int(getattr(mode, "value", mode) or 0) == 0 and not getattr(compilation, "cudagraph_mode", None)


def schedules_ahead(vllm_config: Any) -> bool:
    """Whether the scheduler lays out a step before it has read the last one's
    samples (async scheduling), so a request runs one step past its ending token."""
    return bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))


def whole_prompt_scheduled(data: Any, scheduler_output: Any) -> bool:
    """Whether a new request's (``NewRequestData``) whole prompt is in this step,
    rather than split by chunked prefill. Read before the runner's own request
    state exists (``on_step`` runs before the runner adds the step's requests)."""
    prompt = getattr(data, "prompt_token_ids", None)
    scheduled = scheduled_ids(scheduler_output)
    if prompt is None or not hasattr(scheduled, "get"):
        return False
    return int(getattr(data, "num_computed_tokens", 0) or 0) + int(scheduled.get(data.req_id, 0)) >= len(
        prompt
    )


def cached_rows(data: Any) -> int:
    """How many prompt tokens of a new request (``NewRequestData``) came from the
    prefix cache (computed before its first step)."""
    return int(getattr(data, "num_computed_tokens", 0) or 0)


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


def fused_layout(module: Any) -> tuple[list[int], list[int]] | None:
    """``(each piece's width on one rank, how many ranks hold each piece's same
    slice)`` for a fused column-parallel module; None for any other module."""
    sizes = getattr(module, "output_sizes", None)
    tp = tensor_parallel_size(module)
    if not sizes or len(sizes) < 2 or tp < 2:
        return None
    widths = [size // tp for size in sizes]
    replicas = [1] * len(sizes)
    kv = getattr(module, "num_kv_head_replicas", 1)
    if kv > 1 and len(sizes) == 3:  # a QKV projection: keys and values repeat over ranks
        replicas[1] = replicas[2] = kv
    return widths, replicas


def split_output(module: Any) -> bool:
    """Whether ``module`` is a fused column-parallel layer whose output each rank
    holds a slice of (vLLM does not gather it)."""
    return fused_layout(module) is not None and not getattr(module, "gather_output", False)


def sliced_values(block: Any) -> list[tuple[str, Any]]:
    """The values inside a decoder block that each tensor-parallel rank holds a
    slice of, by their path under the block, each with the fused layer it is
    sliced like: the MLP's activation (``gate_up_proj``'s slices) and the
    attention's input (``qkv_proj``'s, where no key or value head repeats over
    ranks). vLLM gathers neither."""
    found = []
    gate_up = getattr(block, "gate_up_proj", None)
    if hasattr(block, "act_fn") and split_output(gate_up):
        found.append(("act_fn.output", gate_up))
    qkv = getattr(block, "qkv_proj", None)
    if hasattr(block, "attn") and split_output(qkv) and getattr(qkv, "num_kv_head_replicas", 1) == 1:
        found.append(("attn.input", qkv))
    return found


def sharded_dim(split: str | None, name: str, value: Any) -> int | None:
    """The dimension along which a parameter ``name`` of a layer split as
    ``split`` (:func:`parallel_split`) is divided over ranks, or None when this
    rank holds it whole (or its layout is not a plain slice)."""
    if split is None or not value.dtype.is_floating_point or getattr(value, "packed_dim", None) is not None:
        return None
    if split == "row":
        return getattr(value, "input_dim", None) if name == "weight" else None
    if split in ("column", "vocab"):
        return getattr(value, "output_dim", None)
    return None


def tensor_parallel_size(layer: Any) -> int:
    """Over how many ranks a parallel layer is split."""
    return getattr(layer, "tp_size", 1)


def tensor_parallel_gather(tensor: Any, dim: int) -> Any:
    """Every tensor-parallel rank's ``tensor``, concatenated along ``dim``."""
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(tensor, dim=dim)
