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
import types
from typing import Any

import torch

#: What of a tracer a block may use and still not read its result.
_STEPS = frozenset({"iter", "all", "invoke", "stop", "cache", "next"})


def reads_result(source: str | None, scope: dict[str, Any], tracer_type: type, envoy_type: type) -> bool:
    """Whether a block may read ``tracer.result``; any doubt is True."""
    if not source or "result" in source:
        return True
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True
    tracers = {name for name, value in scope.items() if isinstance(value, tracer_type)}
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in tracers and node.attr in _STEPS:
                used.add(id(node.value))
    plain = (types.ModuleType, torch.Tensor, envoy_type)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in tracers and id(node) not in used:
            return True
        if isinstance(node, ast.Call):
            root = _root(node.func)
            if root is not None and root in scope and root not in tracers:
                if not isinstance(scope[root], plain):
                    return True
    return False


def _root(node: ast.expr) -> str | None:
    """The name an expression starts from (``a`` of ``a.b[0].c``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None
