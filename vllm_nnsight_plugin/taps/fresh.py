"""Names a block binds only to tensors of new memory, which it may fill as it likes.

A block that rebuilds something piece by piece (one head's share of ``o_proj``,
a patched copy) writes into a tensor it made itself::

    alone = torch.zeros_like(heads_in)
    alone[:, h * 64 : (h + 1) * 64] = heads_in[:, h * 64 : (h + 1) * 64]

Such a write reaches no activation of the forward, and copies the values it is
given rather than keeping them. Admission reads it so (``worker/writes.py``: the
block is still a reader; ``replay.py``: a view assigned into it is copied, not
kept) only where that is certain from the source and the captured values:

- every binding of the name in the block is ``name = torch.<maker>(...)``, one
  of torch's functions that always allocate (:data:`MAKERS`), or an augmented
  assignment of the name itself (in place, into that same new tensor);
- ``torch`` there is torch itself (a captured value, checked at admission),
  which the block never binds;
- no function, lambda or comprehension of the block takes the name as an
  argument or loop target (its body would see another value under it).
"""

from __future__ import annotations

import ast
import functools
import types
from typing import Any

#: torch's functions that return a tensor of new memory on every call.
MAKERS = frozenset({"zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like", "full", "full_like"})


@functools.lru_cache(maxsize=1024)
def _made(source: str) -> tuple[tuple[str, frozenset[str]], ...]:
    """Per name bound only by makers (and augmented in place), the names the
    makers are called on (each must be torch)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    stores: dict[str, int] = {}
    good: dict[str, int] = {}
    roots: dict[str, set[str]] = {}
    arguments: set[str] = set()  # bound other than by assignment
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            stores[node.id] = stores.get(node.id, 0) + 1
        elif isinstance(node, ast.arg):
            arguments.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):  # names bound otherwise
            arguments.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            arguments.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            arguments.update(node.names)
        elif (
            isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        ):
            root = _maker_root(node.value)
            if root is not None:
                name = node.targets[0].id
                good[name] = good.get(name, 0) + 1
                roots.setdefault(name, set()).add(root)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            good[node.target.id] = good.get(node.target.id, 0) + 1
    bound = stores.keys() | arguments  # a maker's module rebound in the block is not torch
    return tuple(
        (name, frozenset(roots[name]))
        for name, count in stores.items()
        if name in roots and good.get(name) == count and name not in arguments and not roots[name] & bound
    )


def _maker_root(node: ast.AST) -> str | None:
    """``torch.zeros_like(x)`` -> "torch" (the name the maker is read from)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in MAKERS
        and isinstance(node.func.value, ast.Name)
    ):
        return node.func.value.id
    return None


def fresh_tensors(source: str | None, scope: dict[str, Any]) -> frozenset[str]:
    """The names a block binds only to tensors of new memory (see the module)."""
    if not source:
        return frozenset()
    import torch

    return frozenset(
        name
        for name, roots in _made(source)
        if all(isinstance(scope.get(r), types.ModuleType) and scope[r] is torch for r in roots)
    )


def indexed_name(node: ast.AST) -> str | None:
    """The name a chain of subscripts starts from (``alone[:, 3][0]`` -> "alone");
    None for any other target (an attribute keeps what is assigned to it)."""
    if not isinstance(node, ast.Subscript):
        return None
    while isinstance(node, ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None
