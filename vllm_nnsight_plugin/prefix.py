"""Which traced requests may share the prefix cache.

A traced request skips prefix-cache reads and salts its KV blocks with its own id
(``seams/frontend.py``): a block that reads or edits a prompt row the cache would
have supplied must see that row computed, and KV computed under an edit must
reach no other request. A block that reads a module's value only at the last row
of each step, and writes nothing, sees the same values either way: vLLM always
computes a prompt's last token, and a step's last row is that token's.

Such a request says so: the client reads each block of a trace before it goes
(:func:`last_rows_only`) and, where every block of the trace qualifies, puts
:data:`CLAIM_KEY` in each request's ``extra_args``. The front end then lets the
request read and write the cache as a plain one does; the worker reads the
block again at admission with the same function and, where the claim does not
hold, fails the request before its block runs (so the KV it writes is a plain
request's). A request that also runs installed edits keeps the old way.

What qualifies, read from the source and the values the block captured: every
module location it names is ``<module>.output[0][-1...]`` or
``<module>.output[1][-1...]`` of a module the block names on the model, whose
forward returns a tuple (``install.returns_tuple``: a decoder layer's
``(hidden, residual)``, each one row per token); no ``.input``, ``.inputs``,
``.source``, ``tracer.cache``, nor a location reached through a loop's variable;
and nothing written (``worker/writes.may_write``). Reads of ``model.logits`` and
``model.samples`` qualify (the sampler sees the last row only).
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from typing import Any

from .errors import PluginError

#: Where a request says its blocks read only the last rows (``extra_args``).
CLAIM_KEY = "nnsight_prefix"
#: The claim's value (a string: served requests carry ``vllm_xargs`` values).
LAST_ROWS = "last-rows"


class PrefixClaimError(PluginError, RuntimeError):
    """A request said its blocks read only the last rows, and one does not."""


#: Names that reach rows other than the last: what a module is handed, a
#: forward's operations, and a cache of the whole forward.
_OTHER_ROWS = frozenset({"input", "inputs", "source", "cache"})


def last_rows_only(
    source: str | None,
    scope: dict[str, Any],
    model: Any,
    module_at: Callable[[str], Any],
    tracer_type: type,
) -> bool:
    """Whether a block reads each module location only at the last row of each
    step and writes nothing (see the module docstring); any doubt is False."""
    if not source:
        return False
    from .taps.install import returns_tuple
    from .taps.meaning import folded
    from .taps.replay import _bound, _uses, _where
    from .worker.writes import may_write

    # an ``if`` on captured plain values takes one branch for the whole request
    source = folded(source, scope) or source
    uses = _uses(source)
    if uses is None:
        return False
    bound = _bound(source)
    for path, _, _, _ in uses:
        names = [part for part in path if isinstance(part, str)]
        if _OTHER_ROWS.intersection(names[1:]):
            return False
        ends = [i for i, part in enumerate(path) if i and part == "output"]
        if not ends:
            continue
        end = ends[0]
        if path[0] in bound or not _last_row(path[end + 1 :]):
            return False
        _, where = _where(path[:end], scope, model)
        module = None if where is None else module_at(where)
        if module is None or not returns_tuple(type(module)):
            return False
    return not may_write(source, scope, model, tracer_type)


@functools.lru_cache(maxsize=256)
def names_used(source: str | None) -> tuple[str, ...]:
    """The names a block's source reads (what of its captured values can matter)."""
    try:
        tree = ast.parse(source or "")
    except SyntaxError:
        return ()
    return tuple(sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}))


def _last_row(rest: tuple) -> bool:
    """``[0][-1...]`` or ``[1][-1...]``: a value of the tuple, at its last row."""
    if len(rest) < 2 or not isinstance(rest[0], ast.Constant) or rest[0].value not in (0, 1):
        return False
    if type(rest[0].value) is not int:
        return False
    row = rest[1]
    if isinstance(row, ast.Tuple):
        row = row.elts[0] if row.elts else None
    return _minus_one(row)


def _minus_one(node: Any) -> bool:
    if isinstance(node, ast.Constant):
        return type(node.value) is int and node.value == -1
    return (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) is int
        and node.operand.value == 1
    )
