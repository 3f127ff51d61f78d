"""Taps on the operations inside a module's forward (``.source`` locations).

nnsight names every call and every assignment in a forward (``self_attn_0`` is
the first ``self.attn(...)``); a tap ``model.layers.*.self_attn.source.self_attn_0.output``
puts the tap operations on that value. The forward is rewritten once per class
and set of names: the named value passes through ``nnsight_tap(self, name, value)``,
everything else is the forward as written. The names are nnsight's own, computed
by its instrumenter, so a tap and a block's ``.source`` read always agree.

The rewritten forward is written to a file (named by its hash, in the user's
cache folder) and compiled from it. vLLM's compile cache reads the files a compiled
forward came from; nnsight's ``.source`` on a tapped module instruments it, tap
included, so a block run as Python sees the model's operations by their usual
names plus one ``nnsight_tap_N`` per tap, and the lowered requests beside it keep
their taps on that step too.
"""

from __future__ import annotations

import ast
import atexit
import hashlib
import inspect
import linecache
import logging
import os
import shutil
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import PluginError
from ..folders import UnsafeFolderError, private_folder, read_own, write_own
from ..models.smollm2 import cache_root

#: nnsight's private names used here (checked by ``tests/unit/test_nnsight_seams.py``).
TOUCHES: tuple[tuple[str, str], ...] = (
    ("nnsight.intervention.source", "Instrument"),
    ("nnsight.intervention.source", "OP"),
    ("nnsight.intervention.source", "BIND"),
)

TAP = "nnsight_tap"
_SHELL = "__vllm_nnsight_shell__"


class SourceTapError(PluginError, ValueError):
    """A ``.source`` tap on a forward that cannot be read or has no such operation."""


def forward_definition(cls: type) -> ast.FunctionDef:
    """The parsed ``def`` of ``cls.forward``, or :class:`SourceTapError`."""
    try:
        text = textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))
        definition = ast.parse(text).body[0]
    except (OSError, TypeError, SyntaxError, IndexError) as error:
        raise SourceTapError(f"{cls.__name__}.forward has no readable source") from error
    if not isinstance(definition, ast.FunctionDef):
        raise SourceTapError(f"{cls.__name__}.forward is not a plain method")
    return definition


def _definition(cls: type) -> tuple[ast.FunctionDef, Callable]:
    """The ``def`` of a forward whose operations can be tapped, and the function."""
    forward = inspect.unwrap(cls.forward)
    definition = forward_definition(cls)
    if not definition.args.args:
        raise SourceTapError(f"{cls.__name__}.forward is not a plain method")
    free = set(forward.__code__.co_freevars) - {"__class__"}
    if free:
        raise SourceTapError(
            f"{cls.__name__}.forward closes over {', '.join(sorted(free))}: its operations cannot be tapped"
        )
    return definition, forward


def operations(cls: type) -> list[str]:
    """The names nnsight gives the operations of ``cls.forward``, in order."""
    from nnsight.intervention.source import Instrument

    definition, _ = _definition(cls)
    instrument = Instrument()
    instrument.visit(ast.Module(body=[definition], type_ignores=[]))
    return list(instrument.names)


def operations_in(model: Any) -> Callable[[str], list[str]]:
    """``path -> the operations of that module's forward`` for ``spec.resolve``."""
    return lambda path: operations(type(model.get_submodule(path)))


class _Restore(ast.NodeTransformer):
    """Undo nnsight's instrumentation, routing the tapped names through the tap."""

    def __init__(self, tapped: frozenset[str], receiver: str):
        from nnsight.intervention.source import BIND, OP

        self.op, self.bind = OP, BIND
        self.tapped, self.receiver = tapped, receiver

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if not (isinstance(node.func, ast.Name) and node.func.id == self.op):
            return node
        label, fn, *args = node.args
        name = label.value.removeprefix("source.")
        if isinstance(fn, ast.Name) and fn.id == self.bind:
            value: ast.expr = args[0]
        else:
            value = ast.Call(func=fn, args=args, keywords=node.keywords)
        if name in self.tapped:
            receiver = ast.Name(id=self.receiver, ctx=ast.Load())
            value = ast.Call(
                func=ast.Name(id=TAP, ctx=ast.Load()), args=[receiver, ast.Constant(name), value], keywords=[]
            )
        return ast.copy_location(value, node)


def _written(text: str) -> str:
    """A file holding ``text``, named by its hash, in the user's cache folder
    (``VLLM_NNSIGHT_CACHE``; a stable path, so vLLM's compile cache still hits
    after a restart), whose text is also held in ``linecache``.

    nnsight reads a forward's source back through ``linecache`` and runs what it
    reads. The entry is held without a modification time, which ``linecache``
    never checks against the disk, so the text nnsight reads is the text written
    here; the folder is checked on every write (``folders.py``), so nobody else
    could have changed the disk copy either. A cache folder another user could
    change is not used: the file goes to a private folder of this process's."""
    name = hashlib.sha256(text.encode()).hexdigest()[:24] + ".py"
    data = text.encode()
    for folder in _taps_folders():
        try:
            with private_folder(*folder) as descriptor:
                if read_own(descriptor, name) != data:
                    write_own(descriptor, name, data)
        except UnsafeFolderError as unsafe:
            _refuse(folder, unsafe)
            continue
        path = os.path.join(*folder, name)
        linecache.cache[path] = (len(text), None, text.splitlines(True), path)
        return path
    raise SourceTapError("no private folder for an operation tap's forward")  # pragma: no cover


#: This process's own folder, used when the cache folder is not private (made once).
_FALLBACK: list[str] = []
_REFUSED: set[str] = set()


def _taps_folders() -> Iterator[tuple[str, ...]]:
    """Where a rewritten forward may go, in order: the cache folder's ``taps``,
    then a folder this process made for itself."""
    yield (str(cache_root()), "taps")
    if not _FALLBACK:
        made = tempfile.mkdtemp(prefix="vllm-nnsight-taps-")
        atexit.register(shutil.rmtree, made, ignore_errors=True)
        _FALLBACK.append(made)
    yield (_FALLBACK[0],)


def _refuse(folder: tuple[str, ...], unsafe: UnsafeFolderError) -> None:
    if folder == tuple(_FALLBACK):
        raise SourceTapError(f"no private folder for an operation tap's forward: {unsafe}") from None
    shown = os.path.join(*folder)
    if shown not in _REFUSED:  # once per folder and process
        _REFUSED.add(shown)
        logging.getLogger("vllm_nnsight_plugin").warning(
            "vllm-nnsight: not writing operation taps' forwards under %s (%s); using a private "
            "folder of this process's instead, which vLLM's compile cache does not keep across restarts",
            shown,
            unsafe,
        )


def _routed(definition: ast.FunctionDef, tapped: frozenset[str]) -> list[str]:
    """Rewrite ``definition`` in place as the forward it is, each value named in
    ``tapped`` passed through the tap (nnsight's instrumentation, undone by
    :class:`_Restore`); nnsight's names of its operations, in order."""
    from nnsight.intervention.source import Instrument

    definition.decorator_list = []
    tree = ast.Module(body=[definition], type_ignores=[])
    instrument = Instrument()
    instrument.visit(tree)
    _Restore(tapped, definition.args.args[0].arg).visit(tree)
    ast.fix_missing_locations(tree)
    return list(instrument.names)


def rewritten_forward(cls: type, tapped: frozenset[str], tap: Callable[[Any, str, Any], Any]) -> Callable:
    """``cls.forward`` with each value named in ``tapped`` passed through ``tap``."""
    definition, forward = _definition(cls)
    known = _routed(definition, tapped)
    missing = sorted(tapped - set(known))
    if missing:
        raise SourceTapError(
            f"{cls.__name__}.forward has no operation {', '.join(map(repr, missing))}. "
            f"Its operations: {', '.join(known)}."
        )
    free = forward.__code__.co_freevars
    params = ", ".join([*free, TAP])
    body = textwrap.indent(ast.unparse(definition), "    ")
    text = f"def {_SHELL}({params}):\n{body}\n    return {definition.name}\n"
    filename = _written(text)
    scope: dict[str, Any] = {}
    exec(compile(text, filename, "exec"), forward.__globals__, scope)  # noqa: S102
    cells = {name: cell.cell_contents for name, cell in zip(free, forward.__closure__ or ())}
    cells[TAP] = tap
    built = scope.pop(_SHELL)(*(cells[name] for name in (*free, TAP)))
    built.__qualname__ = forward.__qualname__
    built.__module__ = forward.__module__
    return built


def handed_to(cls: type, operation: str) -> str | None:
    """The child module ``cls.forward`` hands the value of ``operation`` to, by its
    attribute name, where that is certain from the source: the operation's value
    is assigned to one name, bound nowhere else in the forward, and read once, as
    the one argument of ``self.<child>(name)``. That child's ``.input`` is then
    the operation's value itself (the same tensor), so an edit of either is the
    same edit (``attention.o_proj.input`` is the attention kernel's output)."""
    try:
        definition, _ = _definition(cls)
    except SourceTapError:
        return None
    if operation not in _routed(definition, frozenset({operation})):
        return None
    tree, receiver = definition, definition.args.args[0].arg
    target = None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and node.value.func.id == TAP
            and node.value.args[1].value == operation
        ):
            if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name) or target is not None:
                return None
            target = node.targets[0].id
    if target is None:
        return None
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == target]
    if sum(isinstance(n.ctx, ast.Store) for n in uses) != 1 or len(uses) != 2:
        return None
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == receiver
            and len(node.args) == 1
            and not node.keywords
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == target
        ):
            return node.func.attr
    return None


def unpacked_in_two(cls: type, child: str) -> bool:
    """Whether ``cls.forward`` names ``self.<child>`` only to call it, each call's
    value unpacked into exactly two names (``qkv, _ = self.qkv_proj(x)``,
    ``hidden, _ = self.norm(hidden, residual)``): the child's output is then a
    sequence of two values on every call the forward makes, which its own source
    may not say (a norm returns one tensor or two by its arguments; a linear
    layer its output alone or with its bias, by how it was built)."""
    found = _calls_of(cls, child)
    if not found or not found[0]:
        return False
    calls, parents = found
    for call in calls:
        assign = parents.get(id(call))
        if not (
            isinstance(assign, ast.Assign)
            and assign.value is call
            and len(assign.targets) == 1
            and isinstance(assign.targets[0], ast.Tuple)
            and len(assign.targets[0].elts) == 2
            and all(isinstance(e, ast.Name) for e in assign.targets[0].elts)
        ):
            return False
    return True


def _calls_of(cls: type, child: str) -> tuple[list[ast.Call], dict[int, ast.AST]] | None:
    """Every call of ``self.<child>`` in ``cls.forward``, in source order, and each
    node's parent by ``id``; None where the forward is unreadable or names the
    child other than to call it."""
    try:
        definition = forward_definition(cls)
    except SourceTapError:
        return None
    if not definition.args.args:
        return None
    receiver = definition.args.args[0].arg
    parents = {id(c): n for n in ast.walk(definition) for c in ast.iter_child_nodes(n)}
    calls = []
    for node in ast.walk(definition):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == child
            and isinstance(node.value, ast.Name)
            and node.value.id == receiver
        ):
            call = parents.get(id(node))
            if not (isinstance(call, ast.Call) and call.func is node):
                return None
            calls.append(call)
    return sorted(calls, key=lambda c: (c.lineno, c.col_offset)), parents


def handed_positionally(cls: type, child: str) -> int | None:
    """How many values ``cls.forward`` hands ``self.<child>``, where every call hands
    the same number, each a plain positional argument (``self.attn(q, k, v)``: 3),
    and no keyword: the child's ``.inputs`` is then those values and ``{}`` on
    every call the forward makes. None otherwise."""
    found = _calls_of(cls, child)
    if not found or not found[0]:
        return None
    calls = found[0]
    counts = {len(c.args) for c in calls}
    if len(counts) != 1 or any(c.keywords or any(isinstance(a, ast.Starred) for a in c.args) for c in calls):
        return None
    (count,) = counts
    return count or None


def first_call(cls: type, child: str) -> tuple[int, int] | None:
    """Where in ``cls.forward``'s source ``self.<child>`` is first called (line,
    column), or None: the order in which the forward reaches its children."""
    found = _calls_of(cls, child)
    return (found[0][0].lineno, found[0][0].col_offset) if found and found[0] else None


def handed_in(model: Any) -> Callable[[str], int]:
    """``path -> how many values its parent hands that module on every call`` (for
    ``.inputs`` taps), raising ``ValueError`` where the source does not say."""

    def count(path: str) -> int:
        parent, _, child = path.rpartition(".")
        found = handed_positionally(type(model.get_submodule(parent)), child) if parent else None
        if found is None:
            raise ValueError(
                f"{path!r} is not handed the same plain values on every call its parent's forward "
                "makes, so what its inputs are cannot be read from the source"
            )
        return found

    return count
