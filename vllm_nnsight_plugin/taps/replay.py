"""Blocks that only read one tap, whatever they compute from it: served at the sampler.

Such a block need not run inside the forward. The tables keep its request's rows
of the tap (both outputs, every step, into a region of the store it reuses each
step), the forward stays compiled and graphed, and at the sampler the worker
hands the block the tap's value for that step, rebuilt from the kept rows,
before the logits (``worker/runtime.py``). The block then runs as Python there,
as a block on ``model.logits`` does, and computes exactly what it computes on
the Python path: the kept rows are the tap's values, bit for bit.

A block is served so only where that is certain:

- it writes nothing into the forward (``worker/writes.py``: its edits would
  come too late);
- every use of the model in it is ``<tap>.output`` of one tap, whose value is a
  tuple (a decoder layer's hidden state and residual), or ``model.logits``,
  ``model.samples`` or ``model.tokenizer``; no module call, parameter,
  ``.input`` or ``.source`` (those would run or read the model at the sampler);
- it keeps no ``tracer.cache`` (checked by the worker: a cache observes every
  location of the forward).
"""

from __future__ import annotations

import ast
import functools
from typing import Any

from .forms import _module_path
from .lower import Unlowered, _site

#: What a block may name on the model besides the tap's output.
_AT_THE_SAMPLER = frozenset({"logits", "samples", "tokenizer"})


@functools.lru_cache(maxsize=1024)
def _uses(source: str) -> tuple[tuple[tuple, str | None], ...] | None:
    """Each maximal chain of attributes and constant or named indices in the block,
    as (path, the attribute after it or None), for every chain with a root name;
    None where the source does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Name):
            continue
        top: ast.AST = node
        while True:
            parent = parents.get(id(top))
            if isinstance(parent, ast.Attribute) or (
                isinstance(parent, ast.Subscript) and parent.value is top
            ):
                top = parent
            else:
                break
        found.append((top, parents.get(id(top))))
    uses = []
    for top, parent in found:
        called = isinstance(parent, ast.Call) and parent.func is top
        uses.append((_chain(top), called))
    return tuple((path, "()" if called else None) for path, called in uses if path is not None)


def _chain(node: ast.AST) -> tuple | None:
    """``model.model.layers[3].output[0]`` -> ("model", "model", "layers", 3, "output", [0]):
    names and attributes as strings, indices as they are (None where one is not a
    plain constant or name)."""
    parts: list = []
    while True:
        if isinstance(node, ast.Name):
            return (node.id, *reversed(parts))
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
        elif isinstance(node, ast.Subscript):
            parts.append(node.slice)
        else:
            return None
        node = node.value


def replayable(source: str | None, scope: dict[str, Any], model: Any, tables: Any) -> int | Unlowered:
    """The tap site a read-only block reads, if it can be served at the sampler;
    otherwise why not."""
    if not source:
        return Unlowered("form", "its source could not be read")
    uses = _uses(source)
    if uses is None:
        return Unlowered("form", "its source could not be read")
    sites: set[int] = set()
    for path, called in uses:
        head = scope.get(path[0])
        if head is not model and not _is_envoy(head):
            continue  # not the model: a plain value
        if head is model and len(path) >= 2 and path[1] in _AT_THE_SAMPLER:
            continue
        if "output" not in path[1:]:
            if called is not None:
                return Unlowered("form", "it calls a module of the model, which runs in the forward")
            return Unlowered("form", "it uses the model other than through a tap's output")
        at = path.index("output", 1)
        module = _module_path(_rebuilt(path[:at]))
        where = None if module is None else _site(module, scope, model)
        site = None if where is None else tables.site_of.get(where)
        if site is None:
            shown = where if where is not None else ".".join(str(p) for p in path[:at])
            return Unlowered("not_a_tap", f"it reads `model.{shown}`, which is not a tap on this engine")
        if site not in tables.tuple_sites:
            return Unlowered("form", "it reads a tap whose value is not a (hidden, residual) pair")
        sites.add(site)
    if len(sites) != 1:
        return Unlowered("form", "it works on more than one location in a step")
    return sites.pop()


def _rebuilt(path: tuple) -> ast.expr:
    """The expression a chain came from, for :func:`forms._module_path`."""
    node: ast.expr = ast.Name(path[0])
    for part in path[1:]:
        if isinstance(part, str):
            node = ast.Attribute(node, part)
        else:
            node = ast.Subscript(node, part)
    return node


def _is_envoy(value: Any) -> bool:
    from nnsight.intervention.envoy import Envoy

    return isinstance(value, Envoy)
