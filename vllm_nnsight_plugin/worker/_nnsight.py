"""Every touch of nnsight's internals the worker makes, and nowhere else.

The worker reuses nnsight 0.8.1's machinery for running a block beside a forward
(``Mediator``, ``VLLMInterleaver``, ``VLLMBatcher``, the ``Requests`` book of
in-flight blocks, its ``eproperty`` ``provide`` calls) but not nnsight's model
runner: the plugin drives those pieces from torch hooks. Much of what it uses is
not nnsight's public API, so every such name is used here, in a named function,
and listed in :data:`TOUCHES`, which ``tests/unit/test_nnsight_seams.py`` checks on
the installed nnsight. Upgrading nnsight means reading this file.

Two pieces replace nnsight's own where the profile says they are the cost:

- :func:`load_block` compiles a block's source once per distinct source (nnsight
  compiles it again for every request, and registers a new ``linecache`` entry
  each time, which is never freed);
- :func:`collect_entries` winds up a finished request from just its own entries
  (nnsight's ``collect_nnsight`` walks every tracked request per call and syncs
  the device once per call: quadratic, and one sync per request, when a thousand
  requests finish together).

:func:`copy_block` gives a request its own copy of an installed edit.

Imported by the runtime with the first request that carries a block, never before.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import linecache
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

from nnsight.intervention.errors import capture_exception
from nnsight.intervention.interleaver import Mediator
from nnsight.intervention.serialization import CustomCloudUnpickler
from nnsight.intervention.tracer import InterleavingTracer
from nnsight.modeling.vllm.collect import dumps_compact
from nnsight.modeling.vllm.interleaver import VLLMInterleaver
from nnsight.modeling.vllm.vllm import VLLM as NNsightVLLM
from nnsight.tracing.tracer import _local, _saves, inc

from ..wire.reply import RequestReply, request_reply, sequence_reply
from .fragments import FusedFragments
from .parameters import read_whole

#: nnsight's module holding the book of in-flight requests (``Request``, ``Requests``).
REQUEST_BOOK = "nnsight.modeling.vllm.model_runners.GPUModelRunner"
_V1_RUNNER = "vllm.v1.worker.gpu_model_runner"


def request_book() -> Any:
    """nnsight's module with ``Request`` and ``Requests``, which the worker reuses.

    The same module defines nnsight's own model runner, a subclass of vLLM's V1
    runner, and imports that runner at its top. vLLM 0.34 has no V1 runner: there
    the import is answered, for the length of this one import, by a stand-in
    class, and taken back at once (nnsight's subclass of it is never used; the
    plugin runs its own hooks on whichever runner vLLM built)."""
    try:
        return importlib.import_module(REQUEST_BOOK)
    except ModuleNotFoundError as error:
        if error.name != _V1_RUNNER:
            raise
    stand_in = types.ModuleType(_V1_RUNNER)
    stand_in.GPUModelRunner = type("GPUModelRunner", (), {"__module__": _V1_RUNNER})  # type: ignore[attr-defined]
    sys.modules[_V1_RUNNER] = stand_in
    try:
        return importlib.import_module(REQUEST_BOOK)
    finally:
        if sys.modules.get(_V1_RUNNER) is stand_in:
            del sys.modules[_V1_RUNNER]


_BOOK = request_book()
Request, Requests = _BOOK.Request, _BOOK.Requests

__all__ = [
    "TOUCHES",
    "InterleavingTracer",
    "Mediator",
    "Request",
    "block_scope",
    "block_source",
    "build_model",
    "capture_exception",
    "collect_entries",
    "copy_block",
    "dumps_compact",
    "finish_erred",
    "is_out_of_order",
    "load_block",
    "open_save_scope",
    "persistent_objects",
    "provide_logits",
    "provide_samples",
    "reads_are_copies",
    "still_running",
    "time_switches",
    "saves_tracked",
    "with_source",
]

#: ``(module, attribute path)`` of every nnsight name this module relies on that
#: is not a documented public API. ``tests/unit/test_nnsight_seams.py`` resolves each.
TOUCHES: tuple[tuple[str, str], ...] = (
    ("nnsight.intervention.interleaver", "Mediator.__setstate__"),
    ("nnsight.intervention.interleaver", "Mediator.__init__"),
    ("nnsight.intervention.interleaver", "Mediator.alive"),
    ("nnsight.intervention.interleaver", "Mediator.switch"),
    ("nnsight.intervention.interleaver", "Interleaver.reindex"),
    ("nnsight.intervention.interleaver", "Interleaver.__enter__"),
    ("nnsight.intervention.interleaver", "Interleaver.__exit__"),
    ("nnsight.intervention.serialization", "CustomCloudUnpickler.find_class"),
    ("nnsight.intervention.tracer", "InterleavingTracer.iter"),
    ("nnsight.intervention.tracer", "InterleavingTracer.all"),
    ("nnsight.intervention.tracer", "InterleavingTracer.stop"),
    ("nnsight.intervention.tracer", "InterleavingTracer.result"),
    ("nnsight.intervention.serialization", "CustomCloudUnpickler.persistent_load"),
    ("nnsight.modeling.vllm.collect", "dumps_compact"),
    ("nnsight.modeling.vllm.fragments", "VLLMFragments.whole"),
    ("nnsight.modeling.vllm.fragments", "VLLMFragments.split"),
    ("nnsight.util", "apply"),
    ("nnsight.intervention.envoy", "Envoy.__getattr__"),
    ("nnsight.modeling.vllm.batching", "VLLMBatcher._widen_tensor"),
    ("nnsight.modeling.vllm.batching", "VLLMBatcher._token_dim"),
    (REQUEST_BOOK, "Request.named"),
    (REQUEST_BOOK, "Request.key"),
    (REQUEST_BOOK, "Request.saves"),
    (REQUEST_BOOK, "Request.deferred"),
    (REQUEST_BOOK, "Request.workers"),
    (REQUEST_BOOK, "Requests.scope"),
    (REQUEST_BOOK, "Requests.unflatten"),
    (REQUEST_BOOK, "Requests.record_saves"),
    (REQUEST_BOOK, "Requests.harvest"),
    (REQUEST_BOOK, "Requests.serve_result"),
    (REQUEST_BOOK, "Requests.finish_dangling"),
    ("nnsight.modeling.vllm.vllm", "VLLM._remoteable_persistent_objects"),
    ("nnsight.modeling.vllm.vllm", "VLLM.logits"),
    ("nnsight.modeling.vllm.vllm", "VLLM.samples"),
    ("nnsight.tracing.tracer", "_local"),
    ("nnsight.tracing.tracer", "_saves"),
    ("nnsight.tracing.tracer", "inc"),
)

#: The attributes of a ``Mediator``, ``Request`` and ``Requests`` instance read or
#: written here (instance state, so :data:`TOUCHES` cannot resolve them on the
#: class); the same test builds one of each and checks them.
INSTANCE_TOUCHES: dict[str, tuple[str, ...]] = {
    "Mediator": (
        "pending",
        "worker",
        "exception",
        "batch_group",
        "caches",
        "presaved",
        "lcls",
        "glbls",
        "code",
    ),
    "Request": ("id", "mediator", "copies", "harvested", "error"),
    "Requests": ("requests", "templates", "names"),
    "VLLMBatcher": ("clone_reads",),
    "VLLMFragments": ("enabled", "rules"),
    "Envoy": ("_module", "path"),
}


# ---------------------------------------------------------------------- setup
def build_model(module: Any, tokenizer: Any, batcher: Any) -> Any:
    """nnsight's tree over the live module, with a deferring interleaver.

    A block's error is recorded on its own mediator (``defer_exceptions``) so it
    ends that request, never the engine. Under tensor parallelism split values
    are gathered by nnsight's fragments, fused projections laid out as on one
    device (``fragments.py``), and so are parameters a block reads
    (``parameters.py``).
    """
    model = NNsightVLLM(module, interleaver=VLLMInterleaver((), fragments=FusedFragments()))
    if getattr(model.interleaver.fragments, "enabled", False):
        from nnsight.intervention.envoy import Envoy

        read_whole(Envoy)
    model.tokenizer = tokenizer
    model.interleaver.batcher = batcher
    model.interleaver.defer_exceptions = True
    return model


def reads_are_copies(model: Any) -> bool:
    """Whether blocks on this engine are served copies of what they read
    (``NNSIGHT_VLLM_CLONE_READS``, fixed when the batcher is built): an in-place
    edit then changes the copy only, and the model never sees it."""
    return bool(model.interleaver.batcher.clone_reads)


def new_requests() -> Requests:
    return Requests()


def persistent_objects(model: Any) -> dict:
    """The objects a block refers to by id rather than by copy (nnsight's own)."""
    return dict(model._remoteable_persistent_objects())


# ---------------------------------------------------------------------- blocks
#: Source text -> (compiled code, its linecache filename). Bounded: sources are
#: few (one per ``with`` block a client wrote), but a hostile stream of distinct
#: ones must not grow it without end.
_CODE: dict[str, Any] = {}
_CODE_LIMIT = 1024


def _compiled(source: str) -> Any:
    code = _CODE.get(source)
    if code is None:
        if len(_CODE) >= _CODE_LIMIT:
            for stale in list(_CODE)[: _CODE_LIMIT // 2]:
                linecache.cache.pop(_CODE.pop(stale).co_filename, None)
        # A filename per source, registered once, so tracebacks and nnsight's
        # source introspection (a nested ``with`` reads its body from linecache)
        # work as they do for nnsight's per-request name.
        filename = f"<block-{hashlib.sha256(source.encode('utf-8')).hexdigest()[:16]}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        code = _CODE[source] = compile(source, filename, "exec")
    return code


class _SharedCodeMediator(Mediator):
    """A ``Mediator`` whose block code is compiled once per source, not per request.

    Same state as nnsight's ``Mediator.__setstate__`` builds (its scope, copy
    flag, presaved names); only where the code object comes from differs.
    """

    def __setstate__(self, state: dict) -> None:
        source, glbls, lcls = state["reduced"]
        self.__init__(_compiled(source), glbls, lcls, copy=state["copy"])
        self.presaved = state["presaved"]
        self.source = source


def copy_block(template: Any) -> Any:
    """A request's own copy of an installed edit: the template's code and captured
    values, a scope of its own (what it saves is this request's)."""
    copy = _SharedCodeMediator.__new__(_SharedCodeMediator)
    Mediator.__init__(copy, template.code, template.glbls, dict(template.lcls))
    copy.presaved = set(template.presaved)
    copy.source = getattr(template, "source", None)
    copy.needs_forward = getattr(template, "needs_forward", True)
    copy.may_write = getattr(template, "may_write", True)
    return copy


class _BlockUnpickler(CustomCloudUnpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == Mediator.__module__ and name == Mediator.__name__:
            return _SharedCodeMediator
        return super().find_class(module, name)


def with_source(mediator: Any, source: str) -> Any:
    """The same block running ``source`` (part of its own) against the same captured
    values: the statements left to Python when the rest runs on the taps."""
    rebuilt = _SharedCodeMediator.__new__(_SharedCodeMediator)
    Mediator.__init__(rebuilt, _compiled(source), mediator.glbls, dict(mediator.lcls), copy=mediator.copy)
    rebuilt.presaved = set(getattr(mediator, "presaved", ()))
    rebuilt.source = source
    return rebuilt


def load_block(data: bytes, persistent: dict) -> Any:
    """A block's mediator from its serialized bytes (nnsight's format)."""
    block = _BlockUnpickler(io.BytesIO(data), persistent).load()
    if not isinstance(block, Mediator):
        raise TypeError(f"the payload is a {type(block).__name__}, not an nnsight block")
    return block


def block_source(mediator: Any) -> str | None:
    """The source a block was loaded from (None for one nnsight loaded itself)."""
    return getattr(mediator, "source", None)


def block_scope(mediator: Any) -> dict[str, Any]:
    """The values a block captured, by the names its source uses for them."""
    return {**(mediator.glbls or {}), **(mediator.lcls or {})}


def envoy_module(envoy: Any) -> Any:
    """The torch module an envoy of the tree stands for."""
    return envoy._module


def open_save_scope() -> None:
    """A block's ``.save()`` needs an open trace scope on this thread; open one."""
    if not getattr(_local, "depth", 0):
        inc()


class OwnedSaves(set):
    """nnsight's per-thread set of saved object ids, which also keeps which block
    saved each (the one running when ``.save()`` was called: :func:`time_switches`
    sets ``owner``). A block's ids leave the set when it is collected
    (:func:`forget_saves`) or, for one nobody collects (an installed edit's copy,
    a block dropped), when its mediator is freed. Without that, a value a block
    saved but did not keep under a name (or one whose block raised) stays in the
    set for as long as the engine is never idle: the set grows, and a later
    object given the same id would pass for saved."""

    def __init__(self, *items: Any) -> None:
        super().__init__(*items)
        self.owner: Any = None
        self._owned: dict[int, tuple[Any, list]] = {}  # id(owner) -> (weak ref to it, its ids)
        self._owners: dict[Any, int] = {}  # an id -> how many blocks hold it (ids are reused)

    def add(self, item: Any) -> None:
        super().add(item)
        owner = self.owner
        if owner is None:
            return
        entry = self._owned.get(id(owner))
        if entry is None:
            try:
                ref = weakref.ref(owner, functools.partial(self._freed, id(owner)))
            except TypeError:  # an owner that cannot be weakly referenced keeps no account
                return
            entry = self._owned[id(owner)] = (ref, [])
        entry[1].append(item)
        self._owners[item] = self._owners.get(item, 0) + 1

    def forget(self, owner: Any) -> None:
        self._drop(id(owner))

    def _freed(self, key: int, ref: Any) -> None:
        entry = self._owned.get(key)
        if entry is not None and entry[0] is ref:
            self._drop(key)

    def _drop(self, key: int) -> None:
        entry = self._owned.pop(key, None)
        for item in entry[1] if entry is not None else ():
            left = self._owners.get(item, 1) - 1
            if left > 0:
                self._owners[item] = left  # another block still holds it
            else:
                self._owners.pop(item, None)
                self.discard(item)

    def clear(self) -> None:
        super().clear()
        self._owned, self._owners = {}, {}


def owned_saves() -> OwnedSaves:
    """This thread's save set, as an :class:`OwnedSaves` (installed on first use)."""
    saves = _saves()
    if not isinstance(saves, OwnedSaves):
        saves = _local.saves = OwnedSaves(saves)
    return saves


def saves_tracked() -> int:
    """How many objects nnsight's per-thread save set holds (a leak shows here)."""
    return len(_saves())


def clear_saves() -> None:
    """Forget every saved id (nothing is in flight, so none can matter)."""
    _saves().clear()


def forget_saves(mediator: Any) -> None:
    """Forget the ids a finished block saved (its values are collected or dropped)."""
    saves = _saves()
    if isinstance(saves, OwnedSaves):
        saves.forget(mediator)


# ---------------------------------------------------------------------- a step
def still_running(interleaver: Any) -> None:
    """Keep only the mediators still parked mid-block (for logits and samples)."""
    interleaver.mediators = [mediator for mediator in interleaver.mediators if mediator.alive]
    interleaver.reindex()


def provide_logits(model: Any, logits: Any) -> Any:
    return type(model).logits.provide(model, logits)


def provide_samples(model: Any, sampled: Any) -> Any:
    return type(model).samples.provide(model, sampled)


def finish_erred(requests: Any, sampled: Any, eos: int) -> None:
    """Force end-of-sequence for each request whose block, or a copy of an
    installed edit it runs, raised (or stopped).

    vLLM ends a request on its sampled token; a block that raised stays scheduled
    (``Requests.scope``) so this runs each step until vLLM retires it.
    """
    for request in requests.requests.values():
        for mediator in request.workers():
            if mediator.exception is not None and mediator.batch_group is not None:
                sampled[mediator.batch_group[0]] = eos
                break


def is_out_of_order(error: Any) -> bool:
    """Whether a captured block error is nnsight's "location never reached"."""
    return error is not None and "OutOfOrder" in repr(error)


def time_switches(watch: Any) -> None:
    """Every switch into a block's code is timed by ``watch`` (``budget.py``), and
    what it saves is marked as its own (:class:`OwnedSaves`): nnsight runs a
    block only inside ``Mediator.switch``. Once per process."""
    if getattr(Mediator.switch, "_vllm_nnsight_timed", False):
        return
    Mediator.switch = timed_switch(Mediator.switch, watch)


def timed_switch(original: Callable[..., Any], watch: Any) -> Callable[..., Any]:
    """``original`` (nnsight's ``Mediator.switch``) timed by ``watch``, with the
    block's saves marked as its own; a stop comes out as the block's error."""

    def switch(self: Any, *args: Any) -> Any:
        saves = owned_saves()
        before, saves.owner = saves.owner, self  # what the block saves now is this block's
        try:
            return watch.run(self, original, self, *args)
        finally:
            saves.owner = before

    switch._vllm_nnsight_timed = True  # type: ignore[attr-defined]
    return switch


# ---------------------------------------------------------------------- collect
def collect_entries(
    requests: Any, model: Any, asked: str, answering: list[str], outputs: dict | None, reporting: bool
) -> dict[str, dict]:
    """Wind up one finished request's blocks and return its reply.

    ``asked`` is the id the front end asked about; ``answering`` the engine's
    request ids that answer to it (the request, or the sequences of an ``n > 1``
    request). The reply is nnsight's: ``saves``, ``error``, ``registered`` and
    per-sequence ``sequences``, as ``NNsightGPUModelRunner.collect_nnsight``
    builds it, from just these requests rather than a walk over all of them.
    """
    names = {asked}
    if requests.templates:  # registered blocks: shelve what they kept
        requests.harvest(names)
    taps = getattr(model.interleaver, "taps", frozenset())
    saved = _saves()
    collected: dict[str, RequestReply] = {}
    for request_id in answering:
        request = requests.requests.get(request_id)
        if request is None or not request.named(names):
            continue
        engine_id, index = request.key(names)
        entry = collected.setdefault(engine_id, request_reply())
        sequence = entry["sequences"].setdefault(index, sequence_reply())
        for taken in request.harvested.values():
            sequence["edits"].update(taken["saves"])
            if entry["error"] is None:
                entry["error"] = taken["error"]
        request.harvested = {}
        mediator = request.mediator
        if mediator is not None:
            if outputs and engine_id in outputs:
                output = outputs[engine_id]
                if sequence["edits"]:
                    output.saves = dict(sequence["edits"])
                requests.serve_result(mediator, output)  # a block parked on tracer.result
            requests.finish_dangling(mediator, taps)
            values = request.saves()
            if reporting:
                sequence["saves"] = values
            for value in values.values():
                saved.discard(id(value))
            forget_saves(mediator)
        if reporting and entry["error"] is None:
            entry["error"] = request.deferred()
        if not request.copies:
            requests.requests.pop(request.id, None)
    for entry in collected.values():
        primary = entry["sequences"].get(0)
        if primary is not None:
            entry["saves"], entry["edits"] = primary["saves"], primary["edits"]
    return collected
