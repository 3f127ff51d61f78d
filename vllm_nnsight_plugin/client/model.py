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

Ways to build one::

    VLLM(path)                     # the module tree only; no engine, no GPU
    VLLM(path, dispatch=True, **engine_kwargs)   # starts a stock engine
    VLLM(path, mode="async", dispatch=True)      # starts a stock AsyncLLM
    VLLM(llm)                      # wraps an LLM or AsyncLLM you already built

and ``model.trace(..., serve="http://host:8000")`` runs a trace on a server
instead (``client/remote.py``): no engine here, no GPU. A model made for a
server (``VLLM(name, serve=url, key=...)``, or :func:`connect`) takes its module
tree and tokenizer from that server, so it needs no vLLM at all
(``wire/tree.py``, ``client/standalone.py``), and every trace and edit goes
there. ``model.edit()`` installs a block on the engine for every request
(``client/edits.py``).
"""

from __future__ import annotations

import asyncio
import atexit
import difflib
import functools
import types
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nnsight.modeling.vllm.async_backend import AsyncVLLMBackend
from nnsight.modeling.vllm.vllm import VLLM as _NNsightVLLM
from nnsight.tracing.backend import Backend

from .. import seams
from ..plugin import _disabled, switched_off
from ..prefix import CLAIM_KEY, LAST_ROWS, SAME_EDIT, last_rows_only, names_used, one_edit_every_step
from ..returns.outputs import RESULT_KEY, UNREAD
from ..seams.frontend import built_for_one_request, config_of, cuda_with_triton, model_path_of
from ..taps.source import handed_in, operations_in
from ..taps.spec import CONFIG_KEY, engine_taps, parse, resolve, taps_for
from ..versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT, UnsupportedVersion, check_nnsight
from ..wire.edits import EDITS_KEY
from ..wire.envelope import EXTRA_ARGS_KEY, seal
from ..wire.references import envoy_of, envoys_as_references
from ..wire.tree import TREE_VERSION, TreeError, load_tokenizer, rebuild
from ..wire.trust import VOUCHED_KEY, Vouched, operator_key
from . import skip
from ._nnsight import (
    Envoy,
    InterleavingTracer,
    attaching_only,
    block_of,
    one_pickle_per_block,
    pickle_memo,
    reattach_caches,
    reduce_once,
    rides_a_request,
    trace_mediators,
)
from .edits import Edits, command
from .heap import frozen
from .remote import TREE_ROUTE, Server
from .served import SERVER_KEY, key_spelling, served_xargs
from .standalone import SamplingParams as _StandInParams
from .standalone import vllm_installed, vllm_stand_ins
from .unread import reads_result


@dataclass
class PreparedRequests:
    """Prompts and ``SamplingParams`` carrying blocks, ready for ``LLM.generate``
    (or, built with a server's key, for the OpenAI API: see :attr:`vllm_xargs`)."""

    prompts: list = field(default_factory=list)
    params: list = field(default_factory=list)
    lora_requests: list = field(default_factory=list)

    @property
    def vllm_xargs(self) -> list[dict]:
        """Per request, the ``vllm_xargs`` that carry its block (and its choice of
        installed edits) to a server."""
        return [served_xargs(param.extra_args) for param in self.params]


class UntappedLocationWarning(UserWarning):
    """A block names a module location that no tap of its compiled engine serves."""


def _untapped_message(location: str) -> str:
    """What a user is told of an untapped location, and the tap that serves it."""
    path, _, end = location.rpartition(".")
    pattern = f"{path.removeprefix('model.')}.{'output' if end == 'output' else 'inputs'}"
    return (
        f"`{location}` is not a tap on this engine: each step this request's block "
        "reads it runs the whole forward as Python, for every request in that step "
        "(an engine started with VLLM_NNSIGHT_EAGER_STEPS=0 refuses the request). "
        f"Tap it where the engine is built, taps=[{pattern!r}] (docs/taps.md)."
    )


#: On a model: the prefix claims of blocks that capture nothing a caller can change
#: (``VLLM._claim_last_rows``), and how many are kept.
_CLAIMS = "_vllm_nnsight_claims"
_CLAIMS_KEPT = 256


def _plain_value(value: Any) -> bool:
    return value is None or type(value) in (bool, int, float, str, bytes)


def _lasting_key(model: Any, source: str | None, used: list[tuple[str, Any]]) -> tuple[tuple, tuple] | None:
    """What a block's prefix claim depends on, where that outlives its trace: each
    used name's value a plain one, one of ``model``'s envoys or a module (by
    identity), or a tracer (by type: the claim asks only whether it is one);
    None where any other value (a tensor, a list, a function) could change
    between traces. With the key, the objects its identities name (to be held
    with it, so no id is another object's while it is kept)."""
    parts, held = [], []
    for name, value in used:
        if _plain_value(value):
            parts.append((name, type(value), value))
        elif isinstance(value, types.ModuleType) or envoy_of(model, value):
            parts.append((name, "object", id(value)))
            held.append(value)
        elif isinstance(value, InterleavingTracer):
            parts.append((name, "tracer", type(value)))
        else:
            return None
    return (source, tuple(parts)), tuple(held)


def _say_result_unread(mediators: list, params: list) -> None:
    """On each request whose block cannot read ``tracer.result``, say so: the front
    end then does not send its finished output back to the workers to collect it
    (``returns/outputs.RESULT_KEY``)."""
    for mediator, param in zip(mediators, params, strict=False):
        try:
            source, scope = block_of(mediator)
            unread = not reads_result(source, scope, InterleavingTracer, Envoy)
        except Exception:  # noqa: BLE001 - any doubt: the output goes, as always
            unread = False
        if unread:
            param.extra_args[RESULT_KEY] = UNREAD


#: Keywords a trace takes besides vLLM's sampling parameters (nnsight's and ours):
#: never read as a misspelling, however close (``max_new_tokens`` is nnsight's
#: spelling of ``max_tokens``).
_TRACE_KEYWORDS = frozenset(
    {
        "max_new_tokens",
        "lora_request",
        "edits",
        "api_key",
        "serve",
        "remote",
        "backend",
        "fn",
        "tracer_cls",
        "use_tqdm",
    }
)


def _check_sampling_keywords(kwargs: dict) -> None:
    """Refuse a misspelled sampling keyword now, with the one it is close to (vLLM
    refuses it only as the trace ends, and names no alternative)."""
    if not vllm_installed():
        fields = [*vars(_StandInParams()), "extra_args"]
    else:
        try:
            from vllm import SamplingParams

            fields = [name for name in SamplingParams.__struct_fields__ if not name.startswith("_")]
        except Exception:  # another SamplingParams: vLLM's own check stands
            return
    for name in kwargs:
        if name in fields or name in _TRACE_KEYWORDS:
            continue
        close = difflib.get_close_matches(name, fields, n=1, cutoff=0.8)
        if close:
            raise TypeError(f"{name!r} is not a sampling parameter; did you mean {close[0]!r}?")


def _seal_params(params: list, count: int, server_key: str | None = None) -> None:
    """Move nnsight's serialized block into our envelope, on the first ``count`` params.

    For an engine in this process the envelope is vouched for (``wire/trust.py``);
    for a server, signed with the operator's ``server_key``.
    """
    sealed: dict[int, tuple[bytes, str, Vouched]] = {}  # unsigned: one envelope per block
    for param in params[:count]:
        extra = param.extra_args
        block = extra.pop("nnsight_mediator")
        if server_key is not None:  # a signed envelope is good once: each its own nonce
            extra[EXTRA_ARGS_KEY] = seal(
                block, nnsight_version=SUPPORTED_NNSIGHT, plugin_version=PLUGIN_VERSION, key=server_key
            )
            continue
        # Invokes that share a block's bytes (``one_pickle_per_block``) share its
        # envelope, and the front end and worker then check it once.
        kept = sealed.get(id(block))
        if kept is None or kept[0] is not block:
            envelope = seal(block, nnsight_version=SUPPORTED_NNSIGHT, plugin_version=PLUGIN_VERSION)
            kept = sealed[id(block)] = (block, envelope, Vouched(envelope))
        extra[EXTRA_ARGS_KEY], extra[VOUCHED_KEY] = kept[1], kept[2]


class _Sealing(Sequence):
    """A trace's sampling params as ``LLM.generate`` reads them: each invoke's block
    pickled and sealed onto its params when vLLM first asks for them, a part at a
    time.

    vLLM adds each request as it reads its params, and an engine core in a process
    of its own starts on the first while the client seals the rest: a sweep of a
    thousand invokes no longer waits for all of them to be sealed before its first
    request goes (vLLM gives the same advice for rendering prompts). The first part
    is sealed when this is made, and every invoke's edits are checked then, so
    what is wrong with the trace (a misspelled setting, an edit nothing is
    installed under, an invoke without a prompt that does something) is raised
    before any request is sent; the prefix claims are
    decided for the whole trace first too (all or none). Anything raised later, a
    block that cannot be pickled, ends the call as before, and vLLM aborts the
    requests it had added. Where the trace's invokes and its params do not pair
    up one to one, it is all sealed at once, as nnsight does.
    """

    FIRST = 16  # invokes sealed before anything is sent
    MOST = 256  # the largest part (each part doubles the last)

    def __init__(self, model: VLLM, params: list, kwargs: dict) -> None:
        self._model, self._params, self._kwargs = model, params, kwargs
        everyone = trace_mediators(model)
        riding = [m for m in everyone if rides_a_request(m)]
        self._others = [m for m in everyone if not rides_a_request(m)]
        self._riding = riding
        self.pickles = pickle_memo()  # one pickle per block across the parts
        self.said: set[str] = set()  # untapped locations warned of
        self.claims = model._claim_last_rows(riding)
        self.attached: list = []
        self.sealed = 0
        self._part = self.FIRST
        if len(riding) != len(params):
            self._riding, self._others, self.claims = None, everyone, None
            self._upto(len(params))
            return
        if not getattr(model, "_serving", False):  # each invoke's edits, as its part would check them
            for param in params:
                model._check_edit_names(getattr(param, "nnsight_edits", None))
        self._upto(min(self.FIRST, len(params)))

    def __len__(self) -> int:
        return len(self._params)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            self._upto(len(self._params))
            return self._params[index]
        at = index + len(self._params) if index < 0 else index
        if 0 <= at:
            self._upto(at + 1)
        return self._params[index]

    def finish(self) -> list:
        """The attached mediators of every invoke (the rest sealed, if vLLM did not
        ask for them all)."""
        self._upto(len(self._params))
        return self.attached

    def _upto(self, count: int) -> None:
        count = min(count, len(self._params))
        while self.sealed < count or (self.sealed == 0 and self._others is not None):
            start = self.sealed
            if self._riding is None:  # all at once, every mediator as nnsight reads them
                end, mediators = len(self._params), self._others
            else:
                end = min(len(self._params), max(count, start + self._part))
                mediators = self._riding[start:end]
                if start == 0:  # nnsight drops, or refuses, the invokes without a prompt once
                    mediators = self._others + mediators
            self.attached.extend(
                self._model._attach_part(mediators, self._params[start:end], self._kwargs, self)
            )
            self.sealed, self._others = end, None
            self._part = min(2 * self._part, self.MOST)


class VLLM(Edits, _NNsightVLLM):
    """nnsight on a stock vLLM engine; see the module docstring. ``model.edit()``
    and the other edit methods are :class:`~.edits.Edits`'."""

    def __init__(
        self,
        model: Any,
        *args: Any,
        mode: str = "sync",
        serve: str | None = None,
        key: str | None = None,
        **kwargs: Any,
    ) -> None:
        check_nnsight()
        skip.install()  # a block's body skipped without re-instrumenting Python (``skip.py``)
        key = key_spelling(key, kwargs)
        self._served: Any = None
        if serve is not None:
            self._served = _served_model(model, serve, key, mode, kwargs)
            with vllm_stand_ins():
                super().__init__(model, *args, **kwargs)
            if not vllm_installed():  # nothing of vLLM's was brought up to tear down
                atexit.unregister(_NNsightVLLM._cleanup_distributed)
            return
        _check_vllm()
        if mode not in ("sync", "async"):
            raise ValueError(f"mode={mode!r}: use 'sync' (vllm.LLM) or 'async' (AsyncLLM).")
        taps = kwargs.pop("taps", None)
        self._taps: tuple[str, ...] = ()
        self._taps_asked = taps is not None
        self._given_llm = None
        if taps is not None and (_is_llm(model) or _is_async_llm(model)):
            raise ValueError(
                "taps are part of how an engine is built: pass taps= with a model path "
                "(VLLM(path, dispatch=True, taps=[...])), or build your LLM with "
                "additional_config={'nnsight_taps': [...]} (docs/taps.md)."
            )
        if taps is not None:
            extra = dict(kwargs.get("additional_config") or {})
            extra[CONFIG_KEY] = list(parse(taps))
            kwargs["additional_config"] = extra
        if _is_llm(model) or _is_async_llm(model):
            self._given_llm = model
            mode = "async" if _is_async_llm(model) else "sync"
            model = model_path_of(model)
            kwargs["dispatch"] = True
        super().__init__(model, *args, mode=mode, **kwargs)

    # ------------------------------------------------------------------ engine
    def _init_distributed(self) -> None:
        if self.__dict__.get("_served") is None:  # a served model builds nothing of vLLM's
            _NNsightVLLM._init_distributed()

    def _load_meta(self, repo_id: str, **kwargs: Any) -> Any:
        served = self.__dict__.get("_served")
        if served is not None:
            module, self.tokenizer = served.tree()
            self._graph_unsafe_prefill = False
            return module

        with seams.building_meta_tree():
            return super()._load_meta(repo_id, **kwargs)

    def _load(self, repo_id: str, **kwargs: Any) -> Any:
        if self.__dict__.get("_served") is not None:
            raise RuntimeError(
                f"this model runs on {self._served.url}: trace it (its forward is the "
                "server's); there is no engine here to dispatch."
            )
        meta_model = self.__dict__.get("_module")
        if meta_model is None:
            meta_model = self._load_meta(repo_id, **kwargs)
        if self._owns_distributed:
            # The meta build brought up a one-rank process group; the engine
            # brings its own.
            self._cleanup_distributed()
        if self._given_llm is not None:
            self.vllm_entrypoint = self._given_llm
            return meta_model

        self._taps, kernel = taps_for(kwargs.get("additional_config"), cuda_with_triton)
        if self._taps:  # refused here, with what exists, before an engine starts
            names = (name for name, _ in meta_model.named_modules())
            resolve(self._taps, names, operations_in(meta_model), handed_in(meta_model))
        # An engine with taps is built for its graphs, where its taps are one kernel
        # each (CUDA) or were asked for here. Otherwise eager skips the compile at
        # start-up, and a traced step runs as Python on any engine: pass
        # enforce_eager=False for graphed plain requests.
        graphed = bool(self._taps) and (kernel or self._taps_asked)
        kwargs.setdefault("enforce_eager", not graphed)
        if self._async_engine:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self.vllm_entrypoint = AsyncLLM.from_engine_args(AsyncEngineArgs(model=repo_id, **kwargs))
        else:
            from vllm import LLM

            self.vllm_entrypoint = LLM(repo_id, **kwargs)
        return meta_model

    def _call(
        self, prompts: list, params: list, lora_requests: list, *, use_tqdm: bool | None = None, **kwargs: Any
    ) -> Any:
        """Run the engine; the plugin puts each request's saves on its output. A
        trace of several requests shows vLLM's progress bar unless ``use_tqdm=False``."""
        with frozen():  # a full collection walks only what this call makes (``heap.py``)
            sealing = _Sealing(self, params, kwargs)  # its first part now: a trace's mistakes raise here
            built_for_one_request(params)  # made by this trace's invokes, one each (``_batch``)
            outputs = self.vllm_entrypoint.generate(
                prompts,
                sampling_params=sealing,
                lora_request=lora_requests,
                use_tqdm=len(prompts) > 1 if use_tqdm is None else use_tqdm,
            )
            self._collect(sealing.finish(), self._with_trees(outputs))
        return outputs

    def _with_trees(self, outputs: list) -> list:
        for output in outputs:
            reattach_caches(getattr(output, "saves", None) or {}, self)
        return outputs

    def _batch(self, invokes: list[tuple], fn: Any) -> tuple:
        with vllm_stand_ins():
            return super()._batch(invokes, fn)

    def _prompt(self, *inputs: Any) -> Any:
        with vllm_stand_ins():
            return super()._prompt(*inputs)

    def _attach_mediators(self, params: list, **kwargs: Any) -> list:
        return _Sealing(self, params, kwargs).finish()

    def _attach_part(self, mediators: list, params: list, kwargs: dict, sealing: _Sealing) -> list:
        """Attach and seal one part of a trace's invokes (``mediators``, with the
        requests' ``params``): nnsight's pickle of each block, our envelope, the
        prefix claims decided for the whole trace, what the blocks read."""
        reduce_once()  # one reduction per with-block, not per invoke (``_nnsight.py``)
        with (
            envoys_as_references(self),
            one_pickle_per_block(sealing.pickles),
            vllm_stand_ins(),
            attaching_only(self, mediators),
        ):
            attached = super()._attach_mediators(params, **kwargs)
        _seal_params(params, len(attached), SERVER_KEY.get())
        if sealing.claims is not None:
            for param, claim in zip(params, sealing.claims[sealing.sealed :], strict=False):
                param.extra_args[CLAIM_KEY] = claim
                if hasattr(param, "skip_reading_prefix_cache") and not _wants_prompt_logprobs(param):
                    param.skip_reading_prefix_cache = False  # (nnsight's client sets it)
        _say_result_unread(attached, params)
        self._say_untapped(attached, sealing.said)
        return attached

    def _claim_last_rows(self, mediators: list) -> list | None:
        """Where every block of the trace reads each module only at the last row of
        each step, and writes nothing or one edit of every row at every step, what
        each request says of it (set on its params as it is sealed): it then
        shares the prefix cache as a plain request does, or with the requests
        making the same edit (``prefix.py``; the worker checks). None otherwise."""
        meta = self.__dict__.get("_module")
        if meta is None or not mediators:
            return None
        from ..taps.replay import modules_of

        module_at = modules_of(meta)

        known: dict[tuple, str | None] = {}  # invokes of one block with the same captured objects
        lasting: dict[tuple, tuple] = self.__dict__.setdefault(_CLAIMS, {})
        if len(lasting) > _CLAIMS_KEPT:
            lasting.clear()

        def qualifies(mediator: Any) -> str | None:
            source, scope = block_of(mediator)
            # the values of the names the block uses: a plain one by its value (an
            # ``if`` on it picks what the block does), any other by its identity
            used = [(name, scope[name]) for name in names_used(source) if name in scope]
            key = (source, tuple((name, v if _plain_value(v) else id(v)) for name, v in used))
            if key in known:
                return known[key]
            lasting_key, held = _lasting_key(self, source, used) or (None, ())
            if lasting_key is not None and lasting_key in lasting:
                known[key] = lasting[lasting_key][0]
            elif last_rows_only(source, scope, self, module_at, InterleavingTracer):
                known[key] = LAST_ROWS
            elif one_edit_every_step(source, scope, self, module_at, InterleavingTracer):
                known[key] = SAME_EDIT
            else:
                known[key] = None
            if lasting_key is not None and lasting_key not in lasting:
                lasting[lasting_key] = (known[key], held)
            return known[key]

        try:
            claims = [qualifies(mediator) for mediator in mediators]
        except Exception:  # noqa: BLE001 - without the claim a request computes its whole prompt
            return None
        return claims if all(claims) else None

    def _say_untapped(self, mediators: list, said: set[str] | None = None) -> None:
        """Before a block's request goes: warn of each location it names that no tap of
        this compiled engine serves. Such a block's steps run the whole forward as
        Python, for every request in them (or, on an engine started with
        ``VLLM_NNSIGHT_EAGER_STEPS=0``, the request is refused)."""
        served = self._served_at_taps()
        if served is None:
            return
        from ..taps.replay import untapped

        said = set() if said is None else said  # (each location once a trace)
        known: dict[tuple, tuple[str, ...]] = {}
        for mediator in mediators:
            source, scope = block_of(mediator)
            # by what the block reads: a sweep's invokes differ in their loop's
            # variables, which the block need not read
            key = (source, tuple((name, id(scope[name])) for name in names_used(source) if name in scope))
            found = known.get(key)
            if found is None:
                try:
                    found = untapped(source, scope, self, served)
                except Exception:  # noqa: BLE001 - a warning's worth: never in the way of the trace
                    found = ()
                known[key] = found
            for location in found:
                if location not in said:
                    said.add(location)
                    warnings.warn(UntappedLocationWarning(_untapped_message(location)), stacklevel=4)

    def _served_at_taps(self) -> Any:
        """What this client's own compiled engine serves at its taps
        (``install.served_locations``); None for an eager engine, a server's, or
        none yet."""
        if "_served_locations" in self.__dict__:
            return self.__dict__["_served_locations"]
        engine = self.__dict__.get("vllm_entrypoint")
        config = config_of(engine)
        meta_model = self.__dict__.get("_module")
        if config is None or meta_model is None:
            return None
        from ..taps.install import served_locations

        served = None
        if not seams.engine_is_eager(config):
            try:
                served = served_locations(meta_model, engine_taps(config))
            except Exception:  # noqa: BLE001 - a warning's worth: never in the way of the trace
                served = None
        self.__dict__["_served_locations"] = served
        return served

    def _call_served(
        self, server: Any, prompts: list, params: list, lora_requests: list, **kwargs: Any
    ) -> Any:
        """``_call`` for ``serve=``: the same requests, sent to a server."""
        if any(lora is not None for lora in lora_requests):
            raise NotImplementedError("LoRA adapters are not sent to a server; load them there.")
        mediators = self._attach_for_server(params, server.key, **kwargs)
        try:
            outputs = server.run(prompts, params)
        finally:
            server.close()
        self._collect(mediators, self._with_trees(outputs))
        return outputs

    def _attach_for_server(self, params: list, key: str | None, **kwargs: Any) -> list:
        """``_attach_mediators``, signing for a server's ``key`` (None: this process)."""
        token = SERVER_KEY.set(key)
        try:
            return self._attach_mediators(params, **kwargs)
        finally:
            SERVER_KEY.reset(token)

    def interleave(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        if getattr(fn, "_no_engine", False):
            return fn(*args, **kwargs)  # building requests, or a server runs them
        return super().interleave(fn, *args, **kwargs)

    def trace(self, *inputs: Any, serve: str | None = None, key: str | None = None, **kwargs: Any) -> Any:
        """nnsight's trace; ``serve=url`` (with the operator's ``key``, or
        ``VLLM_NNSIGHT_KEY``) runs it on a server with the plugin installed.
        ``api_key=`` (nnsight's spelling for a remote service) is the same as ``key=``."""
        key = key_spelling(key, kwargs)
        if "fn" not in kwargs:  # a served model's own server, unless the call builds requests only
            serve, key = self._where(serve, key)
        use_tqdm = kwargs.pop("use_tqdm", None)
        _check_sampling_keywords(kwargs)
        if serve is None and "fn" not in kwargs and not self._async_engine:
            kwargs["fn"] = functools.partial(self._call, use_tqdm=use_tqdm)
        if serve is not None:
            signing_key = operator_key(key)
            if signing_key is None:
                raise ValueError(
                    "a served trace must be signed: pass key=... (the server operator's "
                    "key) or set VLLM_NNSIGHT_KEY."
                )
            fn = functools.partial(self._call_served, Server(serve, signing_key))
            fn._no_engine = True  # type: ignore[attr-defined]
            kwargs["fn"] = fn
            kwargs.setdefault("backend", Backend())
        elif getattr(kwargs.get("fn"), "_no_engine", False):
            # Building requests only: run the block's capture here, on any engine.
            kwargs.setdefault("backend", Backend())
        elif self._async_engine and kwargs.get("backend") is None:
            kwargs["backend"] = _AsyncBackend(self)
        return super().trace(*inputs, **kwargs)

    def _generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """Plain requests (no block of the caller's; installed edits still run):
        ``model.generate(prompts, max_tokens=..., edits=..., use_tqdm=...)``."""
        if "serve" in kwargs or self.__dict__.get("_served") is not None:
            raise NotImplementedError(
                "model.generate(serve=...) without a with-block has no block to send; "
                "use the openai client for plain requests, or a with-block."
            )
        from vllm import SamplingParams

        if not self.dispatched:
            self.dispatch()
        kwargs = self._sampling_kwargs(kwargs)
        use_tqdm = kwargs.pop("use_tqdm", True)
        lora_request = kwargs.pop("lora_request", None)
        edits = self._edit_names(kwargs.pop("edits", None))
        self._check_edit_names(edits)
        _check_sampling_keywords(kwargs)
        params = SamplingParams(**kwargs)
        if edits is not None:
            params.extra_args = {**(params.extra_args or {}), EDITS_KEY: edits}
        prompts = inputs[0] if len(inputs) == 1 else list(inputs)
        if self._async_engine:
            return self._generate_async(prompts, params, lora_request)
        return self.vllm_entrypoint.generate(prompts, params, lora_request=lora_request, use_tqdm=use_tqdm)

    async def _generate_async(self, prompts: Any, params: Any, lora_request: Any) -> list:
        """Plain requests on the async engine, drained to their final outputs."""
        engine = self.vllm_entrypoint
        prompts = prompts if isinstance(prompts, (list, tuple)) else [prompts]

        async def run(prompt: Any) -> Any:
            last = None
            async for output in engine.generate(prompt, params, uuid.uuid4().hex, lora_request=lora_request):
                last = output
            return last

        return list(await asyncio.gather(*(run(prompt) for prompt in prompts)))

    # ------------------------------------------------------------------ API
    def requests(self, *inputs: Any, key: str | None = None, **kwargs: Any) -> Any:
        """Build requests carrying this block without running them.

        For users who drive a stock ``LLM`` (or ``AsyncLLM``) themselves::

            with model.requests("The capital of France is", temperature=0.0) as tracer:
                hidden = model.model.layers[3].output[0].save()
            prepared = tracer.prepared
            outputs = llm.generate(prepared.prompts, prepared.params)
            vllm_nnsight_plugin.saves(outputs[0])["hidden"]

        With ``key`` (a server operator's key) the blocks are signed for that
        server instead, and ``prepared.vllm_xargs`` go in an OpenAI request's
        ``extra_body``.
        """
        prepared = PreparedRequests()
        key = key_spelling(key, kwargs)
        served = self.__dict__.get("_served")
        if key is None and served is not None:
            key = served.key
        tracer = self.trace(*inputs, fn=_Take(self, prepared, key), **kwargs)
        tracer.prepared = prepared
        return tracer

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_given_llm"] = None
        state["_served"] = None  # holds the operator's key
        state.pop("_vllm_nnsight_references", None)  # a cache (``wire/references.py``)
        state.pop(_CLAIMS, None)  # a cache (``_claim_last_rows``)
        return state


def connect(url: str, key: str | None = None, **kwargs: Any) -> VLLM:
    """The model a server serves, ready to trace: ``connect("http://host:8000", key=...)``.

    Needs no vLLM here: the module tree and tokenizer come from the server."""
    signing_key = operator_key(key_spelling(key, kwargs))
    name = Server(url, signing_key or "").model_name()
    return VLLM(name, serve=url, key=signing_key, **kwargs)


@dataclass
class _ServedModel:
    """Where a model made with ``serve=`` runs, and the key that signs for it."""

    url: str
    key: str

    def tree(self) -> tuple[Any, Any]:
        """The server's module tree (stand-in modules on meta) and its tokenizer."""
        document = command(self.url, self.key, "GET", TREE_ROUTE)
        if document.get("version") != TREE_VERSION:
            raise TreeError(
                f"the server describes its model in format {document.get('version')!r}; this "
                f"client reads {TREE_VERSION}: install the same vllm-nnsight-plugin on both."
            )
        return rebuild(document.get("modules")), load_tokenizer(document.get("tokenizer") or {})


def _served_model(model: Any, url: str, key: str | None, mode: str, kwargs: dict) -> _ServedModel:
    if not isinstance(model, str):
        raise TypeError("VLLM(name, serve=url): name the served model (or use connect(url)).")
    if mode != "sync" or kwargs.get("dispatch"):
        raise ValueError(
            "a model made with serve=... runs on that server: no dispatch=True and no "
            "mode='async' here (the server streams; its engine is its own)."
        )
    signing_key = operator_key(key)
    if signing_key is None:
        raise ValueError(
            "a served model must be signed for: pass key=... (the server operator's key) "
            "or set VLLM_NNSIGHT_KEY."
        )
    return _ServedModel(url.rstrip("/"), signing_key)


def _check_vllm() -> None:
    """Refuse to build requests for a vLLM the plugin switched itself off on (they
    would reach the engine with nothing there to run them)."""
    reason = None if _disabled() else switched_off()
    if reason is not None:
        raise UnsupportedVersion(f"vllm-nnsight-plugin is switched off beside this vLLM: {reason}")


def _is_llm(value: Any) -> bool:
    try:
        from vllm import LLM
    except ImportError:
        return False
    return isinstance(value, LLM)


def _is_async_llm(value: Any) -> bool:
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:
        return False
    return isinstance(value, AsyncLLM)


def _wants_prompt_logprobs(params: Any) -> bool:
    """Whether a request asks for its prompt's log-probabilities, which vLLM computes
    only for prompt rows it does not read from the cache (it then skips reading)."""
    return (
        getattr(params, "prompt_logprobs", None) is not None
        or getattr(params, "prompt_logprob_token_ids", None) is not None
    )


class _Take:
    """The traced call of ``model.requests()``: keeps the requests instead of running them.

    A block that names its tracer pickles it, and this with it; the key and the
    requests stay here (see ``__getstate__``).
    """

    _no_engine = True

    def __init__(self, model: VLLM, prepared: PreparedRequests, key: str | None) -> None:
        self.model, self.prepared, self.key = model, prepared, key

    def __call__(self, prompts: list, params: list, lora_requests: list, **kwargs: Any) -> None:
        attached = self.model._attach_for_server(params, self.key, **kwargs)
        if len(attached) != len(params):
            raise ValueError("every invoke needs a prompt")
        self.prepared.prompts[:] = prompts
        self.prepared.params[:] = params
        self.prepared.lora_requests[:] = lora_requests

    def __getstate__(self) -> dict:
        return {"model": None, "prepared": None, "key": None}


class _AsyncBackend(AsyncVLLMBackend):
    """nnsight's streaming backend; the plugin's ``AsyncLLM.generate`` seam has
    already put the saves on the finished output, so nothing is fetched here."""

    async def _attach_saves(self, output: Any) -> None:
        from nnsight.intervention.errors import raise_deferred

        output.saves = {**getattr(output, "nnsight_edit_saves", {}), **getattr(output, "nnsight_saves", {})}
        reattach_caches(output.saves, self.model)
        raise_deferred(getattr(output, "nnsight_error", None))

    async def _free_worker(self) -> None:
        # Closing the engine's stream aborts the request; the seam then winds up
        # its block in the workers.
        if self._generator is not None:
            await self._generator.aclose()
