"""Which blocks need the model's forward to run as Python.

On a compiled engine a step leaves its CUDA graph and compiled code only so that
module hooks can fire. A block that reads or writes nothing but ``model.logits``
and ``model.samples`` is served by the sampler's hooks, which fire on every step,
graphed or not; its steps can stay compiled. Whether a block is such a block is
decided once, when it is admitted, from its source and the values it captured,
and only when that is certain: a name the block reads through an attribute path
other than those two, a module-tree node it captured, a function or object it
captured (whose code could reach the tree), or a way of reaching names
indirectly (``getattr``, ``eval``, ``locals()``, an import) makes its steps run as
Python, as every block's did before.
"""

from __future__ import annotations

import ast
import functools
import types
from typing import Any

#: What a block may read off the model and still run beside a compiled forward.
SAMPLER_ONLY = frozenset({"logits", "samples", "tokenizer"})
#: What it may use of its tracer (stepping through generation, the finished output).
TRACER_SAFE = frozenset({"iter", "all", "stop", "result"})
#: Names through which a block could reach the model without naming it.
INDIRECT = frozenset(
    {
        "getattr",
        "setattr",
        "delattr",
        "vars",
        "locals",
        "globals",
        "eval",
        "exec",
        "compile",
        "__import__",
        "dir",
    }
)
#: Modules a block may use freely: their functions take tensors, not the model.
LIBRARIES = frozenset({"torch", "math", "numpy", "einops", "nnsight"})

_PLAIN = (type(None), bool, int, float, complex, str, bytes, slice, range, type(Ellipsis))


@functools.lru_cache(maxsize=1024)
def name_uses(source: str) -> dict[str, frozenset[str]] | None:
    """Each name the source uses, with the attributes it is read through ('' for
    any other use: bare, called, stored, passed). None when the source imports
    or rebinds names beyond its scope, which this reading cannot follow."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    uses: dict[str, set[str]] = {}
    read_through: set[int] = set()  # Name nodes that are the base of an attribute read
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal)):
            return None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            uses.setdefault(node.value.id, set()).add(node.attr)
            read_through.add(id(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and id(node) not in read_through:
            uses.setdefault(node.id, set()).add("")
    own = _loop_names(tree)
    return {name: frozenset(attrs) for name, attrs in uses.items() if name not in own}


def _loop_names(tree: ast.AST) -> frozenset[str]:
    """Names the block binds itself before every use: a loop's or a
    comprehension's variable used nowhere but in that loop's body or that
    comprehension (``for step in tracer.iter[:6]: if step == 0: ...``). A value of
    the same name captured from the caller's frame is never read by the block."""
    binders: dict[str, list[set[int]]] = {}  # name -> the Name nodes each binder covers

    def cover(name: str, nodes: list[ast.AST]) -> None:
        covered = {
            id(n) for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == name
        }
        binders.setdefault(name, []).append(covered)

    def targets(target: ast.AST) -> list[str]:
        if isinstance(target, ast.Name):
            return [target.id]
        if isinstance(target, (ast.Tuple, ast.List)):
            names = [targets(t) for t in target.elts]
            return [] if any(not n for n in names) else [x for n in names for x in n]
        return []  # a starred, attribute or subscript target: not followed

    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            for name in targets(node.target):  # its body, never its ``else``
                cover(name, [node.target, *node.body])
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            results = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            for i, generator in enumerate(node.generators):
                later = [g for g in node.generators[i + 1 :] for g in (g.iter, g.target, *g.ifs)]
                for name in targets(generator.target):
                    cover(name, [generator.target, *generator.ifs, *later, *results])
    own = set()
    for name, covers in binders.items():
        every = {id(n) for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name}
        deleted = any(
            isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Del) for n in ast.walk(tree)
        )
        if not deleted and every <= set().union(*covers):
            own.add(name)
    return frozenset(own)


def _library(value: Any) -> bool:
    """A library module, or one of its functions: they take tensors, not the model."""
    if isinstance(value, types.ModuleType):
        home = value.__name__
    elif isinstance(value, (types.BuiltinFunctionType, types.FunctionType)):
        home = getattr(value, "__module__", None) or ""
    else:
        return False
    return home.partition(".")[0] in LIBRARIES


def _plain(value: Any, budget: list[int], depth: int = 0) -> bool:
    """Data that cannot lead to the model: scalars, tensors, dtypes, and containers of them."""
    import torch

    budget[0] -= 1
    if budget[0] < 0 or depth > 8:
        return False
    if isinstance(value, torch.Tensor):  # a subclass may carry anything
        return type(value) in (torch.Tensor, torch.nn.Parameter)
    if isinstance(value, (*_PLAIN, torch.dtype, torch.device)):
        return True
    if type(value) in (list, tuple, set, frozenset):
        return all(_plain(item, budget, depth + 1) for item in value)
    if type(value) is dict:
        return all(_plain(k, budget, depth + 1) and _plain(v, budget, depth + 1) for k, v in value.items())
    return False


def needs_forward(source: str | None, scope: dict[str, Any], model: Any, tracer_type: type) -> bool:
    """Whether a block (its source, the values it captured) may ask for a module location."""
    if source is None:
        return True
    uses = name_uses(source)
    if uses is None or uses.keys() & INDIRECT:
        return True
    budget = [10_000]
    for name, attrs in uses.items():
        if name not in scope:
            continue  # a builtin, or a name the block binds from what it captured
        value = scope[name]
        if value is model:
            if attrs - SAMPLER_ONLY:
                return True
        elif isinstance(value, tracer_type):
            if attrs - TRACER_SAFE:
                return True
        elif not (_library(value) or _plain(value, budget)):
            return True
    return False
