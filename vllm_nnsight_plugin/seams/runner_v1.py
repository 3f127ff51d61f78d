"""The V1 model runner (``vllm/v1/worker/gpu_model_runner.py``, and the CPU runner
that subclasses it; vLLM 0.25 to 0.33).

It keeps a persistent batch in the scheduler's order: ``input_batch.req_ids`` is
the row order and ``query_start_loc.np`` the row offsets, valid from
``_prepare_inputs`` to the sampler. Its sampler is an ``nn.Module`` called as
``sampler(logits=..., sampling_metadata=...)``, so the logits and the drawn
tokens are a forward pre-hook and a forward hook on it. A preempted request
stays in its state and is resumed as a cached request
(``CachedRequestData.resumed_req_ids``).

Wrapped: ``GPUModelRunner.execute_model`` (the step),
``GPUModelRunner._determine_batch_execution_and_padding`` (no CUDA graph for a
step with a Python block, ``force_eager``; piece graphs only for a step whose
blocks run at the taps, its dispatcher's ``invalid_modes``; the layout is known
there, so the tap tables fill there), and ``load_model`` of the GPU runner and of the CPU
runner, which does not call it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .worker import (
    PIECEWISE_STEP,
    UNCOMPILED_STEP,
    Runner,
    StepHooks,
    StepView,
    count_graph_mode,
    loading,
    present,
)
from .wrap import wrap

MODULE = "vllm.v1.worker.gpu_model_runner"
CPU_MODULE = "vllm.v1.worker.cpu_model_runner"


def _in_pieces(runner: Any, original: Callable, args: tuple, kwargs: dict) -> Any:
    """The runner's dispatch with graphs of the whole forward ruled out (its
    dispatcher's ``invalid_modes``), or None where that still gave one, or ranks
    must agree on it (data parallel)."""
    dispatcher = getattr(runner, "cudagraph_dispatcher", None)
    if dispatcher is None or runner.vllm_config.parallel_config.data_parallel_size > 1:
        return None
    from vllm.config.compilation import CUDAGraphMode

    dispatch, own = dispatcher.dispatch, dispatcher.__dict__.get("dispatch")

    def without_full(*a: Any, **k: Any) -> Any:
        k["invalid_modes"] = set(k.get("invalid_modes") or ()) | {CUDAGraphMode.FULL}
        return dispatch(*a, **k)

    dispatcher.dispatch = without_full  # for this call only
    try:
        result = original(runner, *args, **kwargs)
    finally:
        if own is None:
            del dispatcher.dispatch
        else:
            dispatcher.dispatch = own
    return result if result[0] in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE) else None


class V1Runner(Runner):
    family = "V1"

    @classmethod
    def patch(cls, hooks: StepHooks) -> None:
        if not present(MODULE):
            return  # vLLM 0.34 on: V2 only
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        def make(original: Callable) -> Callable:
            def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
                hooks.on_step(self, scheduler_output)
                try:
                    return original(self, scheduler_output, *args, **kwargs)
                except BaseException:
                    hooks.on_step_failed(self)
                    raise

            return execute_model

        def make_dispatch(original: Callable) -> Callable:
            def determine(self: Any, *args: Any, **kwargs: Any) -> Any:
                result = None
                if self.__dict__.get(UNCOMPILED_STEP):
                    kwargs["force_eager"] = True  # no CUDA graph for this step's batch
                elif self.__dict__.get(PIECEWISE_STEP):
                    result = _in_pieces(self, original, args, kwargs)
                    if result is None:
                        kwargs["force_eager"] = True
                if result is None:
                    result = original(self, *args, **kwargs)
                count_graph_mode(self, result[0])
                hooks.on_layout(self)
                return result

            return determine

        wrap(GPUModelRunner, "execute_model", make)
        wrap(GPUModelRunner, "_determine_batch_execution_and_padding", make_dispatch)
        for runner_class in _loading_classes():
            wrap(runner_class, "load_model", loading(hooks))

    @classmethod
    def runs(cls, runner: Any) -> bool:
        return any(klass.__module__ in (MODULE, CPU_MODULE) for klass in type(runner).__mro__)

    def rows(self, runner: Any) -> tuple[Any, Any]:
        n = runner.input_batch.num_reqs
        return runner.input_batch.req_ids[:n], runner.query_start_loc.np[: n + 1]

    def view(self, runner: Any) -> StepView:
        req_ids, bounds = self.rows(runner)
        n = len(req_ids)
        states = [runner.requests.get(request_id) for request_id in req_ids]
        computed = [getattr(state, "num_computed_tokens", 0) for state in states]
        prompts = [getattr(state, "num_prompt_tokens", 0) for state in states]
        # vLLM's own word on which samples it throws away (a prompt's or a
        # recompute's chunk before its last): set in _prepare_inputs.
        discarded = runner.discard_request_mask.np[:n]
        return StepView(req_ids, bounds, computed, prompts, discarded)

    def hook_sampler(
        self, runner: Any, on_logits: Callable[[Any], Any], on_samples: Callable[[Any], Any]
    ) -> None:
        def before(module: Any, args: Any, kwargs: Any) -> Any:
            logits = kwargs["logits"] if "logits" in kwargs else args[0]
            new = on_logits(logits)
            if new is None:
                return None
            if "logits" in kwargs:
                return args, {**kwargs, "logits": new}
            return (new, *args[1:]), kwargs

        def after(module: Any, args: Any, output: Any) -> Any:
            ids = on_samples(output.sampled_token_ids)
            if ids is not None:
                output.sampled_token_ids = ids
            return output

        runner.sampler.register_forward_pre_hook(before, with_kwargs=True)
        runner.sampler.register_forward_hook(after)

    def resumed(self, scheduler_output: Any, tracked: Any) -> set[str]:
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        return set(getattr(cached, "resumed_req_ids", None) or ())


def _loading_classes() -> list[type]:
    """The runner classes whose ``load_model`` loads the model: the GPU runner, and
    the CPU runner (which overrides it) where this vLLM build has one."""
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    classes: list[type] = [GPUModelRunner]
    if current_platform.is_cpu() and present(CPU_MODULE):
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        classes.append(CPUModelRunner)
    return classes
