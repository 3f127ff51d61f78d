"""The client's touches of nnsight's internals (the worker's are in ``worker/_nnsight.py``).

Serializing a block reduces it to source text plus the names it reads
(``nnsight.intervention.serialization.reduce_block``), then pickles that, and
nnsight does both for every invoke, although the invokes of a loop share one AST
node (nnsight's tracer caches it per call site) and so one source, and mostly
the same captured values. :func:`reduce_once` installs two memos:

- the reduction, keyed by the node and by the source text: the same results,
  computed once per ``with`` block instead of once per request;
- the pickle, within one :func:`one_pickle_per_block` (a trace's attach): an
  invoke whose block has the same source and captures the very same objects as
  an earlier invoke's gets that invoke's bytes, which are the bytes its own
  pickling would give. Only values whose pickle depends on nothing but the
  value are trusted to that (numbers, strings, plain tensors, nnsight's envoys
  and tracers); any other captured value means a pickle of its own. One
  steering vector on a GPU is then copied to the host once per trace, not once
  per request.

A captured tensor's pickle is a function of its value (``wire/canonical.py``):
torch names a storage by its address, and equal vectors that are different
objects would give different bytes, so requests making the same edit would not
share its KV (``prefix.py``). A tensor that owns its storage travels as its bytes,
dtype, shape and device; any other is torch's pickle with the storage renamed. A
block's state is read once per invoke, for the memo's key and its pickle alike.

The reduction also sends each captured view of a larger tensor as a copy of its own
(:func:`compacted`): a row taken from a saved ``[tokens, hidden]`` activation
(``hidden_row = clean[position]``, activation patching) would otherwise carry its
whole storage with every request, a thousand times the row.

Installed for the process on first use and never removed (a swap per trace
would race between threads); the memos are bounded.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import copyreg
import functools
import io
import types
from collections.abc import Iterator
from typing import Any

import nnsight.intervention.serialization as serialization
import nnsight.modeling.vllm.vllm as nnsight_vllm
import torch
from nnsight.intervention.envoy import Envoy  # noqa: F401 - a module of the model, as the client sees it
from nnsight.intervention.interleaver import Mediator
from nnsight.intervention.tracer import InterleavingTracer  # noqa: F401 - the client's name for it (model.py)
from nnsight.tracing.tracer import Tracer

from ..wire.canonical import canonical_storage, rebuild_tensor, tensor_args
from ..wire.references import reference_of

#: ``(module, attribute)`` of every private nnsight name used here, checked by
#: ``tests/unit/test_nnsight_seams.py``.
TOUCHES: tuple[tuple[str, str], ...] = (
    ("nnsight.intervention.serialization", "reduce_block"),
    ("nnsight.intervention.serialization", "code_reduce"),
    ("nnsight.intervention.serialization", "_referenced_names"),
    ("nnsight.intervention.serialization", "_function_referenced_names"),
    ("nnsight.modeling.vllm.vllm", "dumps"),
    ("nnsight.intervention.serialization", "CustomCloudPickler"),
    ("nnsight.intervention.serialization", "DEFAULT_PROTOCOL"),
    ("nnsight.intervention.interleaver", "Mediator.__getstate__"),
    ("nnsight.tracing.tracer", "_saves"),
)

#: nnsight's private methods the client's classes override (``model.py``: ``VLLM``,
#: ``_AsyncBackend``). A release that renamed one would leave ours never called,
#: silently: ``tests/unit/test_nnsight_seams.py`` checks that each still exists where
#: it is listed, and that the client overrides no private method unlisted here.
OVERRIDES: tuple[tuple[str, str], ...] = tuple(
    ("nnsight.modeling.vllm.vllm", f"VLLM.{name}")
    for name in (
        "_init_distributed",
        "_load_meta",
        "_load",
        "_call",
        "_batch",
        "_prompt",
        "_attach_mediators",
        "_generate",
        "_generate_async",
    )
) + (
    ("nnsight.modeling.vllm.async_backend", "AsyncVLLMBackend._attach_saves"),
    ("nnsight.modeling.vllm.async_backend", "AsyncVLLMBackend._free_worker"),
)

_MEMO_SIZE = 4096
_INSTALLED = "_vllm_nnsight_memoized"


def _names_memo(original: Any) -> Any:
    """``original(source)`` (a set of names), computed once per source text."""
    cached = functools.lru_cache(maxsize=_MEMO_SIZE)(lambda source: frozenset(original(source)))

    @functools.wraps(original)
    def names(source: str) -> set[str]:
        return set(cached(source))

    return names


def _block_source(node: Any) -> str:
    """What ``reduce_block`` makes of a ``with`` block's body: its source, padded
    so the statements keep their original line numbers."""
    offset = "\n" * (node.body[0].lineno - 1)
    return offset + ast.unparse(ast.Module(body=node.body, type_ignores=[]))


_SOURCES: dict[int, tuple[Any, str]] = {}


def _source_of(node: Any) -> str:
    """:func:`_block_source`, once per AST node (held, so its id cannot be reused
    by another node while it is in the memo)."""
    kept = _SOURCES.get(id(node))
    if kept is None or kept[0] is not node:
        if len(_SOURCES) >= _MEMO_SIZE:
            _SOURCES.clear()
        kept = _SOURCES[id(node)] = (node, _block_source(node))
    return kept[1]


def _reduce_block(node: Any, globals: dict, locals: dict) -> tuple:
    """``reduce_block`` with the unparse done once per AST node."""
    source, used_globals, used_locals = serialization.code_reduce(_source_of(node), globals, locals)
    return (source, *compacted(used_globals, used_locals))


def rides_a_request(mediator: Any) -> bool:
    """Whether an invoke's mediator has a request of its own (a prompt, so a row
    range of the batch: nnsight's ``batch_group``); an invoke without one is
    nnsight's to drop or refuse."""
    return getattr(mediator, "batch_group", None) is not None


def trace_mediators(model: Any) -> list:
    """The trace's mediators, in invoke order, as nnsight's attach reads them."""
    return list(model.interleaver.mediators)


@contextlib.contextmanager
def attaching_only(model: Any, mediators: list) -> Iterator[None]:
    """nnsight's attach (``VLLM._attach_mediators``) takes the trace's mediators off
    its interleaver: within this it takes ``mediators`` only, one part of them."""
    interleaver = model.interleaver
    everyone = interleaver.mediators
    interleaver.mediators = mediators
    try:
        yield
    finally:
        interleaver.mediators = everyone


def block_of(mediator: Any) -> tuple[str | None, dict[str, Any]]:
    """A block's source as it travels, and the values it captured by name, read
    off the client's mediator (its ``node``, ``glbls`` and ``lcls``)."""
    node = getattr(mediator, "node", None)
    source = _source_of(node) if node is not None and getattr(node, "body", None) else None
    return source, {**(getattr(mediator, "glbls", None) or {}), **(getattr(mediator, "lcls", None) or {})}


#: A captured tensor whose storage is at least twice its size, and larger by this
#: many bytes, travels as a copy of its own.
_SLACK_BYTES = 4096
#: How deep, and over how many items, the captured containers are searched for
#: other tensors on the same storage (a larger or unknown one: nothing is copied).
_DEPTH, _ITEMS = 4, 10_000


def compacted(*scopes: dict) -> tuple[dict, ...]:
    """The captured scopes with each captured view of a larger storage (a row of
    a saved activation) replaced by a compact copy, so its pickle carries the row
    and not the storage around it.

    The copy holds the same values, with the same shape, strides, dtype and
    device; only its storage differs (offset 0, no neighbours), and the worker's
    tensor is a copy of its own either way. Only where that is all: a plain,
    contiguous tensor that needs no grad and is not saved, whose elements nothing
    else the block captures reaches (the activation itself, a list holding the
    same row), so no write through one captured value shows through another on
    one side and not the other. Rows of one storage that do not overlap (a
    patched position's hidden state and residual, which came home together) are
    each copied. A captured value of a kind this cannot see into leaves every
    tensor as it is.
    """
    try:
        return _compacted(scopes)
    except Exception:  # noqa: BLE001 - an optimisation: any doubt sends the block as it is
        return scopes


def _compacted(scopes: tuple[dict, ...]) -> tuple[dict, ...]:
    found: list[torch.Tensor] = []
    if not all(_reach(value, found, 0) for scope in scopes for value in scope.values()):
        return scopes
    if any(t.layout is not torch.strided or t.is_quantized for t in found):
        return scopes  # storage this does not read
    if not any(_worth_copying(t) for t in found):
        return scopes
    extents: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for t in found:
        extents.setdefault(_storage(t), []).append(_extent(t))
    from nnsight.tracing.tracer import _saves

    saved = _saves()
    copies = _COPIES.get()
    out = []
    for scope in scopes:
        scope = dict(scope)
        for name, value in scope.items():
            if (
                type(value) is torch.Tensor
                and _worth_copying(value)
                and _alone(value, extents[_storage(value)])
                and id(value) not in saved
            ):
                scope[name] = _copy_of(value, copies)
        out.append(scope)
    return tuple(out)


def _copy_of(value: torch.Tensor, copies: dict | None) -> torch.Tensor:
    """One copy per captured view within an attach, so invokes that capture the
    same view still share a pickle (the memo keys on the objects)."""
    if copies is None:
        return value.clone()
    kept = copies.get(id(value))
    if kept is None or kept[0] is not value:
        kept = copies[id(value)] = (value, value.clone())
    return kept[1]


def _worth_copying(value: torch.Tensor) -> bool:
    if value.requires_grad or not value.is_contiguous() or value.device.type == "meta":
        return False
    size = value.untyped_storage().nbytes()
    used = value.numel() * value.element_size()
    return size >= 2 * used and size - used >= _SLACK_BYTES


def _storage(value: torch.Tensor) -> tuple[str, int]:
    return str(value.device), value.untyped_storage().data_ptr()


def _extent(value: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor can reach, ``[start, end)`` (empty: none)."""
    if value.numel() == 0:
        return 0, 0
    size, offset = value.element_size(), value.storage_offset()
    last = sum((n - 1) * step for n, step in zip(value.shape, value.stride()))
    return offset * size, (offset + last + 1) * size


def _alone(value: torch.Tensor, extents: list[tuple[int, int]]) -> bool:
    """Whether no other captured reference to its storage reaches its bytes."""
    others = list(extents)
    others.remove(_extent(value))  # its own reference
    start, end = _extent(value)
    return all(b <= start or a >= end or a == b for a, b in others)


#: Kinds pickled by name, holding no tensor of the block's.
_BY_REFERENCE = (type, types.ModuleType, types.BuiltinFunctionType, torch.dtype, torch.device)


def _reach(value: Any, found: list, depth: int) -> bool:
    """Collect the tensors ``value`` holds (every reference counts); False where it
    may hold tensors this cannot see."""
    if isinstance(value, torch.Tensor):
        found.append(value)
        return True
    if _pure(value) or isinstance(value, _BY_REFERENCE):
        return True
    kind = type(value)
    if kind in (list, tuple, set, frozenset) and depth < _DEPTH and len(value) <= _ITEMS:
        return all(_reach(item, found, depth + 1) for item in value)
    if kind is dict and depth < _DEPTH and len(value) <= _ITEMS:
        return all(_reach(k, found, depth + 1) and _reach(v, found, depth + 1) for k, v in value.items())
    return False


#: The pickles made so far in the current :func:`one_pickle_per_block` (None: outside one).
_PICKLES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("vllm_nnsight_pickles", default=None)
#: The compact copies made so far in the current :func:`one_pickle_per_block`.
_COPIES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("vllm_nnsight_copies", default=None)
_PLAIN = (int, float, complex, bool, str, bytes, type(None))


def pickle_memo() -> tuple[dict, dict]:
    """A memo for :func:`one_pickle_per_block` that outlives one part of a trace's
    attach (``model._Sealing``)."""
    return {}, {}


@contextlib.contextmanager
def one_pickle_per_block(memo: tuple[dict, dict] | None = None) -> Iterator[None]:
    """Within this, invokes that carry the same block share one pickle (module docstring).

    Meant for the span of one trace's attach, where no user code runs between
    two invokes' pickles, so a captured object cannot change in between; a trace
    attached in parts as vLLM reads its requests (``model._Sealing``) keeps one
    ``memo`` across them, and between them only vLLM's ``add_request`` runs.
    """
    pickles, copies = memo or pickle_memo()
    token, copies_token = _PICKLES.set(pickles), _COPIES.set(copies)
    try:
        yield
    finally:
        _COPIES.reset(copies_token)
        _PICKLES.reset(token)


def _pure(value: Any) -> bool:
    """Whether ``value``'s pickle is a function of the value alone."""
    kind = type(value)
    return (
        kind in _PLAIN
        or kind is torch.Tensor
        or "_persistent_id" in getattr(value, "__dict__", {})  # pickled as a reference
        or reference_of(value) is not None
        or isinstance(value, Tracer)
    )


def _pickle_key(mediator: Any) -> tuple[tuple | None, dict]:
    """What identifies a block's pickle (its source, flags and captured objects;
    None when a captured value's pickle may be more than its value), and the
    state it was read from (the one its pickle is made of)."""
    state = mediator.__getstate__()
    source, glbls, lcls = state["reduced"]
    scopes = (glbls or {}, lcls or {})
    if not all(_pure(value) for scope in scopes for value in scope.values()):
        return None, state
    captured = tuple(tuple((name, id(value)) for name, value in scope.items()) for scope in scopes)
    return (source, state["copy"], frozenset(state["presaved"]), captured), state


def _dumps_memo(original: Any) -> Any:
    @functools.wraps(original)
    def dumps(obj: Any, *args: Any, **kwargs: Any) -> bytes:
        pickles = _PICKLES.get()
        if pickles is None or args or kwargs or type(obj) is not Mediator:
            return original(obj, *args, **kwargs)
        key, state = _pickle_key(obj)
        if key is None:
            return original(obj, state=state)
        kept = pickles.get(key)
        if kept is None:
            # The state (its captured objects) is held with its bytes, so no id
            # in the key is reused while the memo lives.
            kept = pickles[key] = (original(obj, state=state), state)
        return kept[0]

    return dumps


#: Kinds that are never a reference nor tagged with one (no ``__dict__``, no envoy).
_NO_ID = (str, int, float, bool, type(None), bytes, tuple, list, dict, set, frozenset)


class _CanonicalPickler(serialization.CustomCloudPickler):
    """nnsight's pickler, with each storage's bytes named by value (module docstring),
    and the model's envoys as references where ``envoys_as_references`` says so.

    Given a block and its state (``Mediator.__getstate__``, already read for the
    memo's key), it pickles that state rather than reading it again. A tensor that
    owns its storage goes as its bytes (``wire/canonical.py``): what torch's own
    pickle gives too, a storage of its own (torch keeps no sharing between two
    pickled tensors), without the save and the renaming.
    """

    def __init__(self, file: Any, protocol: int, block: Any = None, state: dict | None = None) -> None:
        super().__init__(file, protocol=protocol)
        self._block, self._state = block, state

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) in _NO_ID:
            return None
        found = super().persistent_id(obj)
        return found if found is not None else reference_of(obj)

    def reducer_override(self, obj: Any) -> Any:
        if obj is self._block:  # what ``object.__reduce_ex__`` gives, with the state read once
            return copyreg.__newobj__, (type(obj),), self._state
        if type(obj) is torch.Tensor:
            args = tensor_args(obj)
            if args is not None:
                return rebuild_tensor, args
        if isinstance(obj, torch.storage.TypedStorage | torch.UntypedStorage):
            rebuild, args = obj.__reduce__()
            if rebuild is torch.storage._load_from_bytes and len(args) == 1:
                return rebuild, (canonical_storage(args[0]),)
            return rebuild, args
        return super().reducer_override(obj)


def canonical_dumps(
    obj: Any, protocol: int = serialization.DEFAULT_PROTOCOL, state: dict | None = None
) -> bytes:
    """``serialization.dumps`` with :class:`_CanonicalPickler`; a block's ``state``
    where its caller has read it already."""
    buffer = io.BytesIO()
    if type(obj) is Mediator:
        _CanonicalPickler(buffer, protocol, obj, obj.__getstate__() if state is None else state).dump(obj)
    else:
        _CanonicalPickler(buffer, protocol).dump(obj)
    return buffer.getvalue()


#: nnsight's own functions, as they were before :func:`reduce_once` (for tests).
ORIGINALS: dict[str, Any] = {}


def reduce_once() -> None:
    """Install the memoized reductions and pickles in this process (idempotent)."""
    if getattr(serialization, _INSTALLED, False):
        return
    for name in ("reduce_block", "_referenced_names", "_function_referenced_names"):
        ORIGINALS[name] = getattr(serialization, name)
    ORIGINALS["dumps"] = nnsight_vllm.dumps
    serialization._referenced_names = _names_memo(serialization._referenced_names)
    serialization._function_referenced_names = _names_memo(serialization._function_referenced_names)
    serialization.reduce_block = _reduce_block
    nnsight_vllm.dumps = _dumps_memo(canonical_dumps)
    setattr(serialization, _INSTALLED, True)


def reattach_caches(saves: dict, root: Any) -> None:
    """Give each ``tracer.cache`` view that came home the client's module tree.

    A cache drops its tree when it is pickled (nnsight's ``Cache.__getstate__``),
    so a view read back from the engine answers by path only. With the tree
    again it navigates as it does on a local model (``cache.model.layers[10]``).
    """
    from nnsight.intervention.cache import CacheView

    for value in saves.values():
        if isinstance(value, CacheView):
            cache = object.__getattribute__(value, "_cache")  # CacheView's own state
            if cache.model is None:
                cache.model = root
