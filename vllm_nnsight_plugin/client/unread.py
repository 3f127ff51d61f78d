"""Whether a block may read ``tracer.result`` (``returns/outputs.RESULT_KEY``).

The front end sends a finished request's output to the workers only for a block
that may serve it as ``tracer.result``. Read from the block's source and what it
captured, with any doubt a read: the word ``result`` anywhere in the source, a
tracer used other than through its steps (``tracer.iter``, ``.all()``,
``.invoke``, ``.stop()``, ``.cache``, ``.next()``: handed on whole, it could be
read elsewhere), or a call on anything captured but a module, a tensor or the
model's modules (a function's or an object's code could hold a tracer).
"""

from __future__ import annotations

import ast
import functools
import types
from typing import Any

import torch

#: What of a tracer a block may use and still not read its result.
_STEPS = frozenset({"iter", "all", "invoke", "stop", "cache", "next"})


def reads_result(source: str | None, scope: dict[str, Any], tracer_type: type, envoy_type: type) -> bool:
    """Whether a block may read ``tracer.result``; any doubt is True."""
    read = _read(source or "")
    if read is None:
        return True
    bare, called = read
    for name in bare:
        if isinstance(scope.get(name), tracer_type):
            return True  # a tracer handed on whole
    plain = (types.ModuleType, torch.Tensor, envoy_type, tracer_type)
    return any(name in scope and not isinstance(scope[name], plain) for name in called)


@functools.lru_cache(maxsize=256)
def _read(source: str) -> tuple[frozenset[str], frozenset[str]] | None:
    """What of a block's source can reach a result, read once per source: the names
    used other than through a tracer's steps, and the names calls start from; None
    where the source names ``result`` or does not parse."""
    if not source or "result" in source:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    through_steps = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr in _STEPS
    }
    bare = {
        node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and id(node) not in through_steps
    }
    called = {_root(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    return frozenset(bare), frozenset(name for name in called if name is not None)


def _root(node: ast.expr) -> str | None:
    """The name an expression starts from (``a`` of ``a.b[0].c``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None
