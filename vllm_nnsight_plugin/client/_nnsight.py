"""The client's touches of nnsight's internals (the worker's are in ``worker/_nnsight.py``).

One today: serializing a block reduces it to source text plus the names it
reads (``nnsight.intervention.serialization.reduce_block``), and nnsight redoes
that for every invoke: it unparses the block's AST and parses the result again
to find the names, although the invokes of a loop share one AST node (nnsight's
tracer caches it per call site) and so one source. :func:`reduce_once` installs
memoized versions, keyed by the node and by the source text: the same results,
computed once per ``with`` block instead of once per request.

Installed for the process on first use and never removed (a swap per trace
would race between threads); both memos are bounded.
"""

from __future__ import annotations

import ast
import functools
from typing import Any

import nnsight.intervention.serialization as serialization

#: ``(module, attribute)`` of every private nnsight name used here, checked by
#: ``tests/test_nnsight_seams.py``.
TOUCHES: tuple[tuple[str, str], ...] = (
    ("nnsight.intervention.serialization", "reduce_block"),
    ("nnsight.intervention.serialization", "code_reduce"),
    ("nnsight.intervention.serialization", "_referenced_names"),
    ("nnsight.intervention.serialization", "_function_referenced_names"),
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


def _reduce_block(node: Any, globals: dict, locals: dict) -> tuple:
    """``reduce_block`` with the unparse done once per AST node (held, so its id
    cannot be reused by another node while it is in the memo)."""
    kept = _SOURCES.get(id(node))
    if kept is None or kept[0] is not node:
        if len(_SOURCES) >= _MEMO_SIZE:
            _SOURCES.clear()
        kept = _SOURCES[id(node)] = (node, _block_source(node))
    return serialization.code_reduce(kept[1], globals, locals)


#: nnsight's own functions, as they were before :func:`reduce_once` (for tests).
ORIGINALS: dict[str, Any] = {}


def reduce_once() -> None:
    """Install the memoized reductions in this process (idempotent)."""
    if getattr(serialization, _INSTALLED, False):
        return
    for name in ("reduce_block", "_referenced_names", "_function_referenced_names"):
        ORIGINALS[name] = getattr(serialization, name)
    serialization._referenced_names = _names_memo(serialization._referenced_names)
    serialization._function_referenced_names = _names_memo(serialization._function_referenced_names)
    serialization.reduce_block = _reduce_block
    setattr(serialization, _INSTALLED, True)
