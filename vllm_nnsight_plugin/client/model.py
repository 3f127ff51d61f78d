"""The client: ``VLLM``, an nnsight model whose forward pass is a stock vLLM engine.

It is nnsight's own ``VLLM`` front (the tracer, invokes, ``model.logits`` and
``model.samples``, result collection, the module tree built on meta), with the
engine-facing parts replaced:

- the engine is an unmodified ``vllm.LLM``; everything worker-side comes from
  this plugin, which vLLM loads by itself, so a user's own ``LLM`` works too;
- each block travels in a versioned envelope (``wire/envelope.py``) under
  ``SamplingParams.extra_args["nnsight"]``;
- stock defaults stay on (prefix caching, chunked prefill): the plugin makes a
  traced request safe under them rather than turning them off.

Three ways to build one::

    VLLM(path)                     # the module tree only; no engine, no GPU
    VLLM(path, dispatch=True, **engine_kwargs)   # starts a stock engine
    VLLM(llm)                      # wraps an LLM you already built
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nnsight.modeling.vllm.vllm import VLLM as _NNsightVLLM

from ..versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT, check_nnsight
from ..wire.envelope import EXTRA_ARGS_KEY, seal


@dataclass
class PreparedRequests:
    """Prompts and ``SamplingParams`` carrying blocks, ready for ``LLM.generate``."""

    prompts: list = field(default_factory=list)
    params: list = field(default_factory=list)
    lora_requests: list = field(default_factory=list)


def _seal_params(params: list, count: int) -> None:
    """Move nnsight's serialized block into our envelope, on the first ``count`` params."""
    for param in params[:count]:
        extra = param.extra_args
        block = extra.pop("nnsight_mediator")
        extra[EXTRA_ARGS_KEY] = seal(block, nnsight_version=SUPPORTED_NNSIGHT, plugin_version=PLUGIN_VERSION)


class VLLM(_NNsightVLLM):
    """nnsight on a stock vLLM engine; see the module docstring."""

    def __init__(self, model: Any, *args: Any, mode: str = "sync", **kwargs: Any) -> None:
        check_nnsight()
        if mode != "sync":
            raise NotImplementedError(
                f"mode={mode!r}: this release serves the synchronous engine only. Use "
                "mode='sync' (the default)."
            )
        if "taps" in kwargs:
            raise NotImplementedError(
                "taps are not supported yet: build the engine with enforce_eager=True "
                "(the default for VLLM(..., dispatch=True)), where every location is served."
            )
        self._given_llm = None
        if _is_llm(model):
            self._given_llm = model
            model = model.llm_engine.vllm_config.model_config.model
            kwargs["dispatch"] = True
        super().__init__(model, *args, mode=mode, **kwargs)

    # ------------------------------------------------------------------ engine
    def _load_meta(self, repo_id: str, **kwargs: Any) -> Any:
        with _without_accelerator_calls():
            return super()._load_meta(repo_id, **kwargs)

    def _load(self, repo_id: str, **kwargs: Any) -> Any:
        meta_model = self.__dict__.get("_module")
        if meta_model is None:
            meta_model = self._load_meta(repo_id, **kwargs)
        if self._owns_distributed:
            # The meta build brought up a one-rank process group; the engine
            # brings its own.
            self._cleanup_distributed()
        if self._given_llm is not None:
            self.vllm_entrypoint = self._given_llm
        else:
            from vllm import LLM

            # Module hooks fire only in an eager forward (see docs: locations).
            kwargs.setdefault("enforce_eager", True)
            self.vllm_entrypoint = LLM(repo_id, **kwargs)
        return meta_model

    def _call(self, prompts: list, params: list, lora_requests: list, **kwargs: Any) -> Any:
        """Run the engine; the plugin puts each request's saves on its output."""
        mediators = self._attach_mediators(params, **kwargs)
        outputs = self.vllm_entrypoint.generate(
            prompts, sampling_params=params, lora_request=lora_requests, use_tqdm=False
        )
        self._collect(mediators, outputs)
        return outputs

    def _attach_mediators(self, params: list, **kwargs: Any) -> list:
        attached = super()._attach_mediators(params, **kwargs)
        _seal_params(params, len(attached))
        return attached

    def interleave(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if getattr(fn, "_prepare_only", False):
            return fn(*args, **kwargs)  # no engine needed to build requests
        return super().interleave(fn, *args, **kwargs)

    # ------------------------------------------------------------------ API
    def requests(self, *inputs: Any, **kwargs: Any) -> Any:
        """Build requests carrying this block without running them.

        For users who drive a stock ``LLM`` themselves::

            with model.requests("The capital of France is", temperature=0.0) as tracer:
                hidden = model.model.layers[3].output[0].save()
            prepared = tracer.prepared
            outputs = llm.generate(prepared.prompts, prepared.params)
            vllm_nnsight_plugin.saves(outputs[0])["hidden"]
        """
        prepared = PreparedRequests()

        def take(prompts: list, params: list, lora_requests: list, **kw: Any) -> None:
            attached = self._attach_mediators(params, **kw)
            if len(attached) != len(params):
                raise ValueError("every invoke needs a prompt")
            prepared.prompts[:] = prompts
            prepared.params[:] = params
            prepared.lora_requests[:] = lora_requests

        take._prepare_only = True  # type: ignore[attr-defined]
        tracer = self.trace(*inputs, fn=take, **kwargs)
        tracer.prepared = prepared
        return tracer

    def edit(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "model.edit() (blocks installed on the engine for every request) is not "
            "available yet; put the block in each model.trace(...) instead."
        )

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_given_llm"] = None
        return state


@contextlib.contextmanager
def _without_accelerator_calls() -> Iterator[None]:
    """Let the meta tree build on a host with no accelerator.

    vLLM's model loader empties the accelerator's cache after building a model
    (``base_loader.py``, 0.25 and 0.32), which raises on a host that has none.
    The meta build allocates nothing, so there is nothing to empty.
    """
    import torch

    if torch.accelerator.current_accelerator() is not None:
        yield
        return
    original = torch.accelerator.empty_cache
    torch.accelerator.empty_cache = lambda: None
    try:
        yield
    finally:
        torch.accelerator.empty_cache = original


def _is_llm(value: Any) -> bool:
    try:
        from vllm import LLM
    except ImportError:
        return False
    return isinstance(value, LLM)
