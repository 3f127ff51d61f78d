"""The V2 model runner (``vllm/v1/worker/gpu/model_runner.py`` and the CPU runner
that subclasses it, vLLM 0.25 on; and 0.34's standalone CPU runner,
``vllm/v1/worker/cpu/standalone_model_runner.py``, the same design without
Triton).

It builds a fresh ``InputBatch`` every step in ``prepare_inputs``, sorted decode
first, then by how many tokens each request has: so a request's rows are found
by its place in ``input_batch.req_ids``, never by the scheduler's order
(``query_start_loc_np`` gives the offsets, ``num_computed_tokens_np`` and
``prefill_len_np`` how far each request is). The batch is kept on the runner
from ``prepare_inputs`` to the sampler. Its sampler is a plain object called as
``sampler(logits, input_batch)``; the runner's own sampler gets a subclass of
its class that calls the worker around that call (``isinstance`` still holds).
A preempted request's state is freed (``preempted_req_ids``) and the request
comes back later as a *new* request whose prefill is its prompt and every token
it had generated: a new request whose block the worker already holds is one
resumed.

Wrapped: ``execute_model`` (the step; a warm-up or profile run passes
``dummy_run``), ``prepare_inputs`` (the layout: the tap tables fill there) and
``load_model``, of the GPU runner and of the standalone CPU runner; and, where
the GPU runner's ``execute_model`` calls it by name,
``dispatch_cg_and_sync_dp`` (no CUDA graph for a step with a Python block:
``need_eager``; piece graphs only for a step whose blocks run at the taps: the
batch dispatched as one that is not a uniform decode).

On a GPU runner that replays one CUDA graph of the whole forward for a decode
batch (``CudaGraphManager.capture``, ``run_fullgraph``), and whose taps ask for
it (:func:`break_at_taps`, which hands over ``taps/broken.BrokenGraph``), each
of those graphs is captured a second time broken at the taps, from the same
inputs and attention metadata in the same buffers (vLLM's
``create_forward_fn(desc, warmup=False)``, inside its own capture: its stream,
its pool); a step whose blocks run at the taps replays that one instead
(:meth:`Runner.ask_broken`). A capture that fails leaves vLLM's own graphs
captured and none broken (a warning says so). Wrapped for it:
``GPUModelRunner.capture_model`` (which runner captures), and
``CudaGraphManager.capture`` and ``run_fullgraph``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from .worker import (
    BREAKS,
    BROKEN_STEP,
    PIECEWISE_STEP,
    UNCOMPILED_STEP,
    Runner,
    StepHooks,
    StepView,
    count_graph_mode,
    finished_ids,
    loading,
    new_requests,
    present,
)
from .wrap import logger, wrap

MODULE = "vllm.v1.worker.gpu.model_runner"
STANDALONE_MODULE = "vllm.v1.worker.cpu.standalone_model_runner"
#: The runner classes of the V2 family, by module: each is wrapped where this vLLM has it.
CLASSES = ((MODULE, "GPUModelRunner"), (STANDALONE_MODULE, "StandaloneCPUModelRunner"))
#: On a runner: this step's ``InputBatch``, from ``prepare_inputs`` to the sampler.
BATCH = "_nnsight_input_batch"
#: On a sampler: the worker's calls around it (:meth:`V2Runner.hook_sampler`).
_SAMPLER_HOOKS = "_nnsight_sampler_hooks"
#: The runner whose ``execute_model`` is running in this process (one per worker).
_RUNNING: list[Any] = []
#: Where vLLM keeps the CUDA graphs of a batch size (``CudaGraphManager``).
GRAPHS_MODULE = "vllm.v1.worker.gpu.cudagraph_utils"
#: On a graph manager: batch descriptor -> its graph of the whole forward broken at the taps.
BROKEN = "_nnsight_broken_graphs"
#: The runner whose ``capture_model`` is running in this process.
_CAPTURING: list[Any] = []


def _dummy(args: tuple, kwargs: dict) -> bool:
    """Whether an ``execute_model(scheduler_output, intermediate_tensors, dummy_run, ...)``
    call is a warm-up, profile or data-parallel padding run."""
    if "dummy_run" in kwargs:
        return bool(kwargs["dummy_run"])
    return len(args) > 1 and bool(args[1])


class V2Runner(Runner):
    family = "V2"

    @classmethod
    def patch(cls, hooks: StepHooks) -> None:
        for module_name, class_name in CLASSES:
            if not present(module_name):
                continue
            runner_class = getattr(importlib.import_module(module_name), class_name)
            wrap(runner_class, "execute_model", _stepping(hooks))
            wrap(runner_class, "prepare_inputs", _laid_out(hooks))
            wrap(runner_class, "load_model", loading(hooks))
        if present(MODULE):
            module = importlib.import_module(MODULE)
            if hasattr(module, "dispatch_cg_and_sync_dp"):
                wrap(module, "dispatch_cg_and_sync_dp", _dispatching)
            wrap(module.GPUModelRunner, "capture_model", _capturing_model)
        if present(GRAPHS_MODULE):
            manager = importlib.import_module(GRAPHS_MODULE).CudaGraphManager
            wrap(manager, "capture", _capturing_graphs)
            wrap(manager, "run_fullgraph", _replaying(hooks))

    @classmethod
    def runs(cls, runner: Any) -> bool:
        return any(klass.__module__ in (MODULE, STANDALONE_MODULE) for klass in type(runner).__mro__)

    def view(self, runner: Any) -> StepView:
        return view_of(runner.__dict__[BATCH])

    def rows(self, runner: Any) -> tuple[Any, Any]:
        batch = runner.__dict__[BATCH]
        return batch.req_ids[: batch.num_reqs], batch.query_start_loc_np[: batch.num_reqs + 1]

    def hook_sampler(
        self, runner: Any, on_logits: Callable[[Any], Any], on_samples: Callable[[Any], Any]
    ) -> None:
        sampler = runner.sampler
        sampler.__dict__[_SAMPLER_HOOKS] = (on_logits, on_samples)
        if not getattr(type(sampler), "_nnsight_hooked", False):
            sampler.__class__ = _hooked(type(sampler))

    def __init__(self) -> None:
        #: Requests the scheduler preempted and has not yet sent back (or finished).
        self.preempted: set[str] = set()

    def resumed(self, scheduler_output: Any, tracked: Any) -> set[str]:
        self.preempted |= set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        self.preempted.difference_update(finished_ids(scheduler_output))
        back = {
            data.req_id
            for data in new_requests(scheduler_output)
            if data.req_id in self.preempted or data.req_id in tracked
        }
        self.preempted -= back
        return back


def view_of(batch: Any) -> StepView:
    """A V2 ``InputBatch``'s rows (its first ``num_reqs`` entries: the rest pad a
    CUDA graph's batch)."""
    n = batch.num_reqs
    return StepView(
        batch.req_ids[:n],
        batch.query_start_loc_np[: n + 1],
        batch.num_computed_tokens_np[:n],
        batch.prefill_len_np[:n],
    )


def _stepping(hooks: StepHooks) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if _dummy(args, kwargs):
                return original(self, scheduler_output, *args, **kwargs)
            self.__dict__.pop(BATCH, None)
            hooks.on_step(self, scheduler_output)
            _RUNNING.append(self)
            try:
                return original(self, scheduler_output, *args, **kwargs)
            except BaseException:
                hooks.on_step_failed(self)
                raise
            finally:
                _RUNNING.pop()

        return execute_model

    return make


def _laid_out(hooks: StepHooks) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def prepare_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
            batch = original(self, *args, **kwargs)
            if _RUNNING and _RUNNING[-1] is self:
                self.__dict__[BATCH] = batch
                hooks.on_layout(self)
            return batch

        return prepare_inputs

    return make


def _dispatching(original: Callable) -> Callable:
    signature = inspect.signature(original)

    def dispatch_cg_and_sync_dp(*args: Any, **kwargs: Any) -> Any:
        runner = _RUNNING[-1] if _RUNNING else None
        result = None
        mode = None
        if runner is not None and runner.__dict__.get(UNCOMPILED_STEP):
            kwargs["need_eager"] = True  # no CUDA graph for this step's batch
        elif runner is not None and runner.__dict__.get(PIECEWISE_STEP):
            result = _in_pieces(original, signature, args, kwargs)
            if result is None:
                kwargs["need_eager"] = True
        elif runner is not None and runner.__dict__.get(BROKEN_STEP):
            result = _broken(original, signature, args, kwargs)
            if result is None:
                kwargs["need_eager"] = True
            else:
                mode = "BROKEN"
        if result is None:
            result = original(*args, **kwargs)
        if runner is not None:
            count_graph_mode(runner, mode or getattr(result[0], "cg_mode", None))
        return result

    return dispatch_cg_and_sync_dp


def _broken(original: Callable, signature: inspect.Signature, args: tuple, kwargs: dict) -> Any:
    """The dispatch of a batch whose graph of the whole forward was also captured
    broken at the taps (``run_fullgraph`` replays that one), or None where it has
    none, or ranks must agree on the dispatch (data parallel: asked once)."""
    bound = signature.bind(*args, **kwargs)
    if bound.arguments.get("dp_size", 1) != 1:
        return None
    result = original(*args, **kwargs)
    broken = getattr(bound.arguments.get("cudagraph_manager"), "__dict__", {}).get(BROKEN)
    return result if broken and result[0] in broken else None


def break_at_taps(runner: Any, capture: Callable[[Any, Callable], Any]) -> bool:
    """Have this runner capture each graph of its whole forward a second time,
    broken at the taps, as ``with capture(pool, weak_ref): forward()``
    (``taps/broken.BrokenGraph``); whether it will (call before it captures its graphs).

    Only a V2 GPU runner on CUDA whose configuration captures full graphs."""
    if not any(klass.__module__ == MODULE for klass in type(runner).__mro__):
        return False
    config = runner.vllm_config
    mode = config.compilation_config.cudagraph_mode
    if config.model_config.enforce_eager or mode is None or not mode.has_full_cudagraphs():
        return False
    if getattr(getattr(runner, "device", None), "type", None) != "cuda":
        return False
    runner.__dict__[BREAKS] = capture
    return True


def _capturing_model(original: Callable) -> Callable:
    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        _CAPTURING.append(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            _CAPTURING.pop()

    return capture_model


def _capturing_graphs(original: Callable) -> Callable:
    def capture(self: Any, create_forward_fn: Callable, *args: Any, **kwargs: Any) -> Any:
        runner = _CAPTURING[-1] if _CAPTURING else None
        broken_graph = None if runner is None else runner.__dict__.get(BREAKS)
        if broken_graph is None or runner.cudagraph_manager is not self:
            return original(self, create_forward_fn, *args, **kwargs)
        from vllm.utils.torch_utils import weak_ref_tensor

        broken = self.__dict__.setdefault(BROKEN, {})
        failed: list[BaseException] = []

        def create(desc: Any, warmup: bool) -> Any:
            made = create_forward_fn(desc, warmup=warmup)
            if warmup or failed or desc.cg_mode.name != "FULL" or desc in broken:
                return made
            # vLLM captures from what this returns: capture the broken graph first,
            # on its stream and in its pool, then give vLLM fresh inputs of its own.
            forward = made[0] if isinstance(made, tuple) else made
            try:
                with broken_graph(self.pool, weak_ref_tensor) as graph:
                    forward(type(desc.cg_mode).NONE)
            except Exception as error:  # noqa: BLE001 - vLLM's own capture goes on without them
                logger.warning(
                    "vllm-nnsight: capturing the graph of %s broken at the taps failed (%s): "
                    "steps whose blocks run at the taps run without a graph",
                    desc,
                    error,
                )
                failed.append(error)
                broken.clear()
            else:
                broken[desc] = graph
            return create_forward_fn(desc, warmup=warmup)

        return original(self, create, *args, **kwargs)

    return capture


def _replaying(hooks: StepHooks) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def run_fullgraph(self: Any, desc: Any, *args: Any, **kwargs: Any) -> Any:
            runner = _RUNNING[-1] if _RUNNING else None
            broken = self.__dict__.get(BROKEN)
            if not broken or runner is None or not runner.__dict__.get(BROKEN_STEP) or desc not in broken:
                return original(self, desc, *args, **kwargs)
            hooks.on_replay(runner)
            graphs = self.graphs
            whole, graphs[desc] = graphs[desc], broken[desc]  # replayed in its place
            try:
                return original(self, desc, *args, **kwargs)
            finally:
                graphs[desc] = whole

        return run_fullgraph

    return make


def _in_pieces(original: Callable, signature: inspect.Signature, args: tuple, kwargs: dict) -> Any:
    """The dispatch of a batch that is not a uniform decode (only piece graphs
    serve those), or None where that gave a graph of the whole forward (an engine
    whose mixed batches replay one graph) or ranks must agree on it (data parallel)."""
    bound = signature.bind(*args, **kwargs)
    if bound.arguments.get("dp_size", 1) != 1:
        return None
    bound.arguments["uniform_token_count"] = None
    if "max_query_len" in signature.parameters:  # 0.34: graphs for short queries
        bound.arguments["max_query_len"] = None
    result = original(*bound.args, **bound.kwargs)
    mode = getattr(getattr(result[0], "cg_mode", None), "name", None)
    return result if mode in ("PIECEWISE", "NONE") else None


_HOOKED: dict[type, type] = {}


def _hooked(base: type) -> type:
    """``base`` with its call made between the worker's two hooks."""
    found = _HOOKED.get(base)
    if found is None:

        def __call__(self: Any, logits: Any, *args: Any, **kwargs: Any) -> Any:
            hooks = self.__dict__.get(_SAMPLER_HOOKS)
            if hooks is None:
                return base.__call__(self, logits, *args, **kwargs)
            on_logits, on_samples = hooks
            new = on_logits(logits)
            output = base.__call__(self, logits if new is None else new, *args, **kwargs)
            ids = on_samples(output.sampled_token_ids)
            if ids is not None:
                output.sampled_token_ids = ids
            return output

        found = _HOOKED[base] = type(
            base.__name__,
            (base,),
            {"__call__": __call__, "__module__": base.__module__, "_nnsight_hooked": True},
        )
    return found
