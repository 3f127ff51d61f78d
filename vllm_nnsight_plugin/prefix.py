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
request's). Installed edits are read the same way, by the workers when each is
installed (``worker/admit.edit_claim``, ``edits.py``).

What qualifies, read from the source and the values the block captured: every
module location it names is ``<module>.output[0][-1...]`` or
``<module>.output[1][-1...]`` of a module the block names on the model, whose
forward returns a tuple (``install.returns_tuple``: a decoder layer's
``(hidden, residual)``, each one row per token); no ``.input``, ``.inputs``,
``.source``, ``tracer.cache``, nor a location reached through a loop's variable;
and nothing written (``worker/writes.may_write``). Reads of ``model.logits`` and
``model.samples`` qualify (the sampler sees the last row only).

A block that edits can share too, with the requests that make the same edit
(:data:`SAME_EDIT`): the KV of a row computed under an edit that does the same
to every row at every step depends on the row's tokens and the edit alone, so
any request carrying that very block computes the same KV for it. The front end
salts such a request's KV with its block (:func:`edit_salt`: the same block,
the same salt; never a plain request's, never another edit's) and lets it read
the cache. What qualifies (:func:`one_edit_every_step`): inside a top-level
``for _ in tracer.all():`` (or ``tracer.iter[:]``), each write is
``<value>[:] op= c`` or ``<value>[:, a:b] op= c`` (``op`` one of ``+ - * /`` or
plain assignment) on ``<module>.output[0]`` or ``[1]`` of a tuple-returning
module, written directly or through a name assigned that value in the loop;
``c`` is made of numbers and captured numbers or vectors, ``+ - * /``, and
``.to(<that value>)``; no ``break``, ``continue`` or ``return`` in the loop;
and the block without its edits reads only the last rows (as above). A bounded
loop does not qualify: a row that is one request's prompt and another's drawn
token would be edited in one and not the other.

The worker reads the block again at admission. The verdict depends on the
block's bytes alone, and every request under one salt carries the same bytes
(the salt is a hash of them):
either all of them qualify, or all of them fail before their blocks run (and
what they wrote under that salt is then only ever read by each other).
"""

from __future__ import annotations

import ast
import functools
import hashlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from .errors import PluginError

#: Where a request says its blocks read only the last rows (``extra_args``).
CLAIM_KEY = "nnsight_prefix"
#: The claim's value (a string: served requests carry ``vllm_xargs`` values).
LAST_ROWS = "last-rows"
#: The claim of a block whose edit is the same for every row at every step.
SAME_EDIT = "same-edit"
#: What an edit's salt starts with (the rest: :func:`edit_salt`).
EDIT_SALT = "vllm-nnsight-edit:"


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
def _stored(source: str) -> Counter:
    """How often a block's source binds each name (read only: shared by every
    invoke of the block)."""
    return Counter(
        node.id
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load)
    )


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


def edit_salt(payload: str, key: str) -> str:
    """The salt of the KV a :data:`SAME_EDIT` request writes: a hash of its block's
    bytes (the envelope's payload), keyed with the engine's local key. The same
    block, the same salt, however often it was sealed; no one without the key can
    name it, so no request of another user reads that KV."""
    digest = hashlib.blake2b(
        payload.encode("ascii"), key=key.encode("utf-8")[:64], digest_size=16, person=b"nnsight-salt"
    )
    return EDIT_SALT + digest.hexdigest()


def one_edit_every_step(
    source: str | None,
    scope: dict[str, Any],
    model: Any,
    module_at: Callable[[str], Any],
    tracer_type: type,
) -> bool:
    """Whether a block's writes are one edit, the same for every row at every
    step, and the rest of it reads only the last rows (the module docstring);
    any doubt is False."""
    if not source:
        return False
    from .taps.meaning import folded

    source = folded(source, scope) or source
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    stored = _stored(source)
    edits: list[ast.stmt] = []
    named: list[ast.stmt] = []  # the assignments of the names the edits write through
    for loop in tree.body:
        if not isinstance(loop, ast.For) or not _every_step(loop, scope, tracer_type):
            continue
        if any(isinstance(node, (ast.Break, ast.Continue, ast.Return)) for node in ast.walk(loop)):
            return False
        aliases: dict[str, ast.stmt] = {}  # a name given a value the loop edits: its assignment
        for statement in loop.body:
            value = _edited_value(statement, scope, model, module_at, stored)
            if value is not None:
                aliases[statement.targets[0].id] = statement  # type: ignore[attr-defined]
            elif _edit(statement, aliases, scope, model, module_at, stored):
                edits.append(statement)
                if isinstance(target := _target(statement).value, ast.Name):
                    named.append(aliases[target.id])
    if not edits:
        return False
    rest = _without(tree, edits, named)
    if rest is None:
        return False
    return last_rows_only(rest, scope, model, module_at, tracer_type)


def _every_step(loop: ast.For, scope: dict[str, Any], tracer_type: type) -> bool:
    """``for <name> in tracer.all():`` or ``tracer.iter[:]``, its name unused."""
    if not isinstance(loop.target, ast.Name) or loop.orelse:
        return False
    it = loop.iter
    if isinstance(it, ast.Call) and not it.args and not it.keywords:
        head, attr = it.func, "all"
    elif isinstance(it, ast.Subscript):
        whole = it.slice
        if not (isinstance(whole, ast.Slice) and whole.lower is whole.upper is whole.step is None):
            return False
        head, attr = it.value, "iter"
    else:
        return False
    if not (isinstance(head, ast.Attribute) and head.attr == attr and isinstance(head.value, ast.Name)):
        return False
    if not isinstance(scope.get(head.value.id), tracer_type):
        return False
    name = loop.target.id
    return not any(isinstance(n, ast.Name) and n.id == name for s in loop.body for n in ast.walk(s))


def _module_value(
    node: ast.AST, scope: dict, model: Any, module_at: Callable, stored: Counter
) -> tuple | None:
    """``<module>.output[0]`` or ``[1]`` of a tuple-returning module of the model,
    named from a captured value (not a name the block binds): its chain."""
    from .taps.install import returns_tuple
    from .taps.replay import _chain, _where

    path = _chain(node) if isinstance(node, ast.Subscript) else None
    if path is None or len(path) < 3 or path[-2] != "output" or path[0] in stored:
        return None
    index = path[-1]
    if not (isinstance(index, ast.Constant) and type(index.value) is int and index.value in (0, 1)):
        return None
    if any(part in _OTHER_ROWS or part == "output" for part in path[1:-2] if isinstance(part, str)):
        return None
    _, where = _where(path[:-2], scope, model)
    module = None if where is None else module_at(where)
    if module is None or not returns_tuple(type(module)):
        return None
    return path


def _edited_value(
    statement: ast.stmt, scope: dict, model: Any, module_at: Callable, stored: Counter
) -> tuple | None:
    """``name = <module>.output[k]`` (the name assigned nowhere else): the chain."""
    if not (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and isinstance(statement.targets[0], ast.Name)
    ):
        return None
    if stored[statement.targets[0].id] != 1:
        return None
    return _module_value(statement.value, scope, model, module_at, stored)


def _edit(
    statement: ast.stmt, aliases: dict, scope: dict, model: Any, module_at: Callable, stored: Counter
) -> bool:
    """``<value>[:] op= c`` or ``<value>[:, a:b] op= c`` (see the module docstring)."""
    if isinstance(statement, ast.AugAssign) and not isinstance(
        statement.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)
    ):
        return False
    target = _target(statement)
    if not isinstance(target, ast.Subscript) or not _every_row(target.slice):
        return False
    edited = target.value
    if isinstance(edited, ast.Name):
        if edited.id not in aliases:
            return False
    elif _module_value(edited, scope, model, module_at, stored) is None:
        return False
    return _constant(statement.value, edited, scope, stored)


def _target(statement: ast.stmt) -> Any:
    """What an assignment (plain, with one target, or augmented) writes to, or None."""
    if isinstance(statement, ast.AugAssign):
        return statement.target
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        return statement.targets[0]
    return None


def _every_row(index: ast.AST) -> bool:
    """``[:]``, or ``[:, a:b]`` with ``a`` and ``b`` whole numbers or left out."""

    def whole(node: ast.AST) -> bool:
        return isinstance(node, ast.Slice) and node.lower is node.upper is node.step is None

    def bound(node: ast.AST | None) -> bool:
        return node is None or (isinstance(node, ast.Constant) and type(node.value) is int)

    if whole(index):
        return True
    if not (isinstance(index, ast.Tuple) and len(index.elts) == 2 and whole(index.elts[0])):
        return False
    columns = index.elts[1]
    return (
        isinstance(columns, ast.Slice)
        and bound(columns.lower)
        and bound(columns.upper)
        and columns.step is None
    )


def _constant(node: ast.AST, edited: ast.AST, scope: dict, stored: Counter) -> bool:
    """A value the same at every row and step: numbers and captured numbers or
    vectors, ``+ - * /``, and ``<that>.to(<the edited value>)``."""
    import torch

    if isinstance(node, ast.Constant):
        return type(node.value) in (int, float)
    if isinstance(node, ast.Name):
        if node.id in stored or node.id not in scope:
            return False
        found = scope[node.id]  # a number, or a vector (a tensor of rows would be by position)
        return type(found) in (int, float) or (type(found) is torch.Tensor and found.dim() <= 1)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)) and all(
            _constant(side, edited, scope, stored) for side in (node.left, node.right)
        )
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.USub, ast.UAdd)) and _constant(node.operand, edited, scope, stored)
    if isinstance(node, ast.Call):
        func = node.func
        return (
            isinstance(func, ast.Attribute)
            and func.attr == "to"
            and not node.keywords
            and len(node.args) == 1
            and ast.dump(node.args[0]) == ast.dump(edited)
            and _constant(func.value, edited, scope, stored)
        )
    return False


def _without(tree: ast.Module, edits: list[ast.stmt], named: list[ast.stmt]) -> str | None:
    """The block's source without its edits, and without the assignments of the
    names they write through; None where such a name is read elsewhere too (it
    is every row of the value)."""

    def strip(body: list[ast.stmt], gone: set[int]) -> list[ast.stmt]:
        kept = []
        for statement in body:
            if id(statement) in gone:
                continue
            for field in ("body", "orelse", "finalbody"):
                inner = getattr(statement, field, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    setattr(statement, field, strip(inner, gone) or [ast.Pass()])
            kept.append(statement)
        return kept

    body = strip(list(tree.body), {id(statement) for statement in edits})
    used = Counter(
        n.id for s in body for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    )
    if any(used[s.targets[0].id] for s in named):  # type: ignore[attr-defined]
        return None
    rest = ast.Module(body=strip(body, {id(s) for s in named}), type_ignores=[])
    try:
        return ast.unparse(ast.fix_missing_locations(rest))
    except Exception:  # noqa: BLE001 - any doubt: it does not qualify
        return None
