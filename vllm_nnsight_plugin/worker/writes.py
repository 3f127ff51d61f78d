"""Which blocks may write into the model's forward.

A request vLLM preempts is recomputed from its tokens (``resume.py``). That
rebuilds the keys and values exactly when the request's block never changed an
activation; a block that did would see, and leave behind, a different model.
Whether a block *may* write is read once, at admission, from its source and the
values it captured, and only a block that certainly does not is taken to be a
reader. The forward runs under ``torch.inference_mode``, where tensors keep no
version counter, so a write cannot be seen after the fact; the source is what
there is.

A block may write when its source:

- assigns to a subscript or an attribute (``h[:] = 0``, ``layer.output = t``),
  or augments one (``h[:, 5] += v``), or augments a bare name (``h += v`` is in
  place when ``h`` is a tensor, which the source cannot tell from a counter),
  unless into a tensor the block made itself (``alone = torch.zeros_like(h)``:
  ``taps/fresh.py``);
- calls a method named like an in-place one (``add_``, ``zero_``, ``copy_``, an
  ``__i*__`` or ``__setitem__``), passes ``out=`` or ``inplace=``, or skips a
  module (``skip``);
- reaches memory around the tensor API (``.data``, ``.numpy()``, storages);
- calls a function or object it captured, unless it is a plain function that
  itself only reads (:func:`reads_only`: its source, as nnsight rebuilt it on the
  worker, read the same way, and what it captured); plain data, the model's
  tree, the tracer and torch's functions are fine; or reaches names indirectly
  (``getattr``, ``exec``, an import, ...).

Writes to ``model.logits`` and ``model.samples`` (the model's own names for
them, on the object that is the model) do not count: they choose tokens, and
a recompute rebuilds from the tokens.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from typing import Any

from ..taps.fresh import fresh_tensors, indexed_name
from ..taps.meaning import does_nothing
from .reach import INDIRECT, _library, _plain, name_uses

#: What a block may write on the model and still be replayed by a recompute.
SAMPLER = frozenset({"logits", "samples"})
#: Attribute names that reach a tensor's memory around its API.
ESCAPES = frozenset({"data", "numpy", "untyped_storage", "storage", "data_ptr", "__array__", "set_"})
#: Dunder methods that mutate their object.
MUTATING_DUNDERS = frozenset(
    {"__setitem__", "__delitem__", "__setattr__", "__delattr__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
     "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}
)  # fmt: skip


def _in_place(name: str) -> bool:
    # ``add_``, and torch's private in-place kernels (``_foreach_add_``); dunders by the list
    return (name.endswith("_") and not name.endswith("__")) or name in MUTATING_DUNDERS


def _root(node: ast.AST) -> ast.AST:
    """The expression a chain of subscripts and attributes starts from."""
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node


def _sampler_target(node: ast.AST, models: frozenset[str]) -> bool:
    """Whether an assignment target is ``model.logits``/``model.samples`` or a
    subscript of one (the chain's first attribute off the model's name)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    return (
        isinstance(node, ast.Attribute)
        and node.attr in SAMPLER
        and isinstance(node.value, ast.Name)
        and node.value.id in models
    )


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    flat: list[ast.AST] = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            flat.append(target)
    return flat


@functools.lru_cache(maxsize=1024)
def _reading(
    source: str, models: frozenset[str], fresh: frozenset[str] = frozenset()
) -> tuple[bool, frozenset[str]]:
    """``(no write seen, names called)`` of a source, before the captured values
    are looked at; ``models`` are the names the model is captured under, ``fresh``
    those bound only to tensors of new memory (``taps/fresh.py``), which it may
    fill in place."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False, frozenset()
    called: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal)):
            return False, frozenset()
        for target in _targets(node):
            if indexed_name(target) in fresh:
                continue  # into a tensor of its own
            if isinstance(target, (ast.Subscript, ast.Attribute)) and not _sampler_target(target, models):
                return False, frozenset()
            if isinstance(node, ast.AugAssign) and isinstance(target, ast.Name) and target.id not in fresh:
                return False, frozenset()
        if isinstance(node, ast.Attribute) and node.attr in ESCAPES:
            return False, frozenset()
        if isinstance(node, ast.Call):
            func = node.func
            into_fresh = (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and func.value.id in fresh
            )
            if isinstance(func, ast.Attribute) and (
                (_in_place(func.attr) and not into_fresh) or func.attr == "skip"
            ):
                return False, frozenset()
            if any(keyword.arg in ("out", "inplace") for keyword in node.keywords):
                return False, frozenset()
            root = _root(node.func)
            if isinstance(root, ast.Name):
                called.add(root.id)
        if isinstance(node, ast.Name) and node.id in INDIRECT:
            return False, frozenset()
    return True, frozenset(called)


def may_write(source: str | None, scope: dict[str, Any], model: Any, tracer_type: type) -> bool:
    """Whether a block (its source, the values it captured) may write into the forward."""
    if source is None:
        return True
    from ..taps.lower import _is_envoy

    models = frozenset(name for name, value in scope.items() if value is model)
    # the model's tree: the model, or a module of it the block captured
    # (``attention = model.model.layers[12].self_attn``), whose methods it may call
    tree = models | frozenset(name for name, value in scope.items() if _is_envoy(value))
    reading, called = _reading(source, models, fresh_tensors(source, scope))
    if not reading:
        return True
    budget = [10_000]
    for name in called:
        if name not in scope:
            continue  # a builtin, or a function the block defines (its body was read)
        value = scope[name]
        if name in tree or isinstance(value, tracer_type) or _library(value) or _plain(value, budget):
            continue  # the tree's and the tracer's methods, torch's functions, data's methods
        if reads_only(value, budget):
            continue  # a helper of the user's that computes on what it is handed
        return True
    return False


#: What a helper may not name at all: the model's locations and the tracer's
#: steps, which only the block itself may use (the model never reaches it).
_NOT_IN_A_HELPER = frozenset(
    {"output", "input", "inputs", "source", "cache", "iter", "stop", "next", "skip", "result",
     "logits", "samples", "save", "edit", "invoke", "trace"}
)  # fmt: skip


@functools.lru_cache(maxsize=256)
def _helper_reads(source: str, name: str) -> frozenset[str] | None:
    """The names a helper's source uses, where it is one undecorated ``def name``
    that writes nothing, reaches no name indirectly and names no location;
    otherwise None."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    definition = tree.body[0]
    if definition.name != name or definition.decorator_list:
        return None
    text = ast.unparse(definition)
    reading, _ = _reading(text, frozenset())
    uses = name_uses(text)
    if not reading or uses is None or uses.keys() & INDIRECT:
        return None
    if any(isinstance(n, ast.Attribute) and n.attr in _NOT_IN_A_HELPER for n in ast.walk(tree)):
        return None
    return frozenset(uses)


def reads_only(value: Any, budget: list[int], depth: int = 0) -> bool:
    """Whether a captured function only computes on what it is handed: a plain
    function whose source (``inspect``: nnsight registers a rebuilt function's
    source) writes nothing and names no location, and whose every captured value
    (globals, closure, defaults) is data, a library, or such a function. The
    model, its modules and the tracer are none of these, so it cannot reach
    them; and whatever the block hands it, its source neither writes into it nor
    names a location or a tracer step on it."""
    if type(value) is not types.FunctionType or depth > 3:
        return False
    if does_nothing(value):
        return True  # ``lambda hidden, residual: None``: whatever its source reads like
    try:
        source = inspect.getsource(value)
    except (OSError, TypeError):
        return False  # no source: its body cannot be read
    names = _helper_reads(source, value.__code__.co_name)
    if names is None:
        return False
    cells = dict(zip(value.__code__.co_freevars, value.__closure__ or ()))
    captured = []
    for name in names:
        if name in cells:
            try:
                captured.append(cells[name].cell_contents)
            except ValueError:  # a cell not filled yet
                return False
        elif name in value.__globals__:
            captured.append(value.__globals__[name])
    captured += [*(value.__defaults__ or ()), *(value.__kwdefaults__ or {}).values()]
    return all(
        _library(item) or _plain(item, budget) or reads_only(item, budget, depth + 1) for item in captured
    )


def writes(mediator: Any) -> bool:
    """What admission found for a loaded block (a block loaded any other way may write)."""
    return getattr(mediator, "may_write", True)
