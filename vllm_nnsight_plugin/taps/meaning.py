"""Blocks spelled otherwise than the forms, brought to them by what they compute.

People name a tap's value the way their habits go: unpacked
(``hidden, residual = layer.output``), through the output itself
(``out = layer.output; out[0][-1] += v``), with the vector built over a few
lines first, subtracted (``hidden -= v``), or with a method
(``hidden.add_(v)``). Each of these computes what one of the forms computes;
:func:`canonical` follows the block's names from the tap to its one effect and
writes that effect as the form it is, which ``forms.block_form`` then reads (and
``lower.py`` checks at admission, as for any form). Anything it cannot follow,
down to a name bound twice, gives None and the block runs as Python.

What each rewrite keeps exact:

- a name bound to ``<tap>.output``, ``<tap>.output[i]`` or unpacked from
  ``<tap>.output`` is that value itself (Python binds the same object), so it is
  replaced by the expression it names; an unpacked pair needs a tap whose value
  is always exactly two (``Canonical.unpacks``: otherwise Python raises);
- a vector named in the block is the expression it was bound to, over captured
  values and numbers only, evaluated with the same operations;
- ``x -= e`` adds ``-(e)``: negation is exact, and ``a - b`` and ``a + (-b)``
  round alike (in the tap's float32 addition as in Python's);
- ``x.add_(e)`` and ``x.sub_(e)`` are ``x += e`` and ``x -= e``;
- ``.to(...)`` of a vector to the edited value, its dtype or its device is
  ``.to(...)`` of the form's own name for it.

An assignment (``hidden[:] = hidden + v``) is left to Python: it computes the
same, but it is how a block is written to run as Python on purpose.
"""

from __future__ import annotations

import ast
import copy
import functools
from dataclasses import dataclass

from .forms import _is_empty_list_saved, _module_path, _result_save, _steps

#: The name the canonical source gives the edited value (never a user's: a block
#: that uses it is not rewritten).
VALUE = "__tap_value__"


@dataclass(frozen=True)
class Canonical:
    """A block rewritten as one of the forms."""

    source: str
    #: it unpacks a tap's output into two names: the tap's value must always be
    #: exactly two (``TapTables.pair_sites``)
    unpacks: bool


@dataclass(frozen=True)
class _Tap:
    """``<module>.output`` (``part`` None) or ``<module>.output[part]``."""

    module: ast.expr
    part: int | None

    def node(self) -> ast.expr:
        output = ast.Attribute(value=copy.deepcopy(self.module), attr="output", ctx=ast.Load())
        if self.part is None:
            return output
        return ast.Subscript(value=output, slice=ast.Constant(self.part), ctx=ast.Load())


class _Unfollowed(Exception):
    """The block does something :func:`canonical` does not follow."""


@functools.lru_cache(maxsize=1024)
def canonical(source: str) -> Canonical | None:
    """``source`` written as one of the forms, or None."""
    if VALUE in source:
        return None
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return None
    tail: list[ast.stmt] = []
    if len(body) >= 2 and _result_save(body[-1]) is not None:
        body, tail = body[:-1], [body[-1]]
    try:
        rewritten = _Rewrite(body).block()
    except _Unfollowed:
        return None
    if rewritten is None:
        return None
    statements, unpacks = rewritten
    module = ast.Module(body=[*statements, *tail], type_ignores=[])
    ast.fix_missing_locations(module)
    return Canonical(ast.unparse(module) + "\n", unpacks)


class _Rewrite:
    """One pass over a block: names followed in Python's order, one effect written out."""

    def __init__(self, body: list[ast.stmt]):
        self.body = body
        self.taps: dict[str, _Tap] = {}  # names bound to a tap's value
        #: names bound to a vector's expression, with the taps whose dtype or device
        #: it moves to (which must be the value it is added to)
        self.vectors: dict[str, tuple[ast.expr, tuple[_Tap, ...]]] = {}
        self.used: set[str] = set()  # vectors the effect reads
        self._moved_to: list[_Tap] = []
        self.lists: set[str] = set()  # ``rows = list().save()``
        self.bound: set[str] = set()
        self.unpacks = False
        self.effect: list[ast.stmt] | None = None
        #: ``_``, where the block never reads it: a name for what it does not use,
        #: which may then be bound any number of times
        self.discard = None if any(_reads_name(s, "_") for s in body) else "_"

    def block(self) -> tuple[list[ast.stmt], bool] | None:
        loops = [s for s in self.body if isinstance(s, ast.For)]
        if len(loops) > 1:
            return None
        out: list[ast.stmt] = []
        for statement in self.body:
            if isinstance(statement, ast.For):
                out.append(self._step_loop(statement))
            elif self._declares_list(statement):
                out.append(statement)
            elif self._binds_vector(statement):
                continue
            elif loops:
                return None  # a tap read outside the loop is the first step's, not each step's
            else:
                self._in_step(statement, out)
        if self.effect is None or set(self.vectors) - self.used:
            return None  # no effect, or a vector it never uses (whose arithmetic may raise)
        return out, self.unpacks

    # ------------------------------------------------------------ statements
    def _step_loop(self, loop: ast.For) -> ast.For:
        if loop.orelse or _steps(loop.iter) is None or not isinstance(loop.target, ast.Name):
            raise _Unfollowed
        self._bind(loop.target.id)
        body: list[ast.stmt] = []
        for statement in loop.body:
            if isinstance(statement, ast.For):
                body.append(self._layers_loop(statement))
            else:
                self._in_step(statement, body)
        return ast.For(target=loop.target, iter=loop.iter, body=body, orelse=[], lineno=loop.lineno)

    def _layers_loop(self, loop: ast.For) -> ast.For:
        """``for i in <layers>:`` inside the step loop: its statements the same way
        (``forms`` checks what it loops over)."""
        if loop.orelse or not isinstance(loop.target, ast.Name) or self.effect is not None:
            raise _Unfollowed
        self._bind(loop.target.id)
        body: list[ast.stmt] = []
        for statement in loop.body:
            self._in_step(statement, body)
        return ast.For(target=loop.target, iter=loop.iter, body=body, orelse=[], lineno=loop.lineno)

    def _in_step(self, statement: ast.stmt, out: list[ast.stmt]) -> None:
        """A statement of a step: naming a tap's value, naming a vector, or the effect."""
        if self.effect is not None:
            raise _Unfollowed  # the effect comes last
        if self._names_tap(statement) or self._binds_vector(statement):
            return
        effect = self._edit(statement) or self._keep(statement) or self._first_read(statement)
        if effect is None:
            raise _Unfollowed
        self.effect = effect
        out.extend(effect)

    def _bind(self, name: str) -> None:
        if name == self.discard:
            return
        if name in self.bound or name == VALUE:
            raise _Unfollowed  # a name bound twice: its uses would have to be told apart
        self.bound.add(name)

    def _declares_list(self, statement: ast.stmt) -> bool:
        name = _assigned_name(statement)
        if name is None or not _is_empty_list_saved(statement.value):
            return False
        self._bind(name)
        self.lists.add(name)
        return True

    def _names_tap(self, statement: ast.stmt) -> bool:
        """``h = <tap>.output[0]``, ``out = <tap>.output``, ``h, r = <tap>.output``."""
        if not isinstance(statement, ast.Assign) or len(statement.targets) != 1:
            return False
        target, value = statement.targets[0], self._tap(statement.value)
        if value is None:
            return False
        if isinstance(target, ast.Name) and target.id != self.discard:
            self._bind(target.id)
            self.taps[target.id] = value
            return True
        if (
            isinstance(target, ast.Tuple)
            and len(target.elts) == 2
            and all(isinstance(e, ast.Name) for e in target.elts)
            and value.part is None
        ):
            for part, name in enumerate(target.elts):
                self._bind(name.id)
                if name.id != self.discard:
                    self.taps[name.id] = _Tap(value.module, part)
            self.unpacks = True
            return True
        return False

    def _binds_vector(self, statement: ast.stmt) -> bool:
        """``v = <arithmetic on captured values>``: the expression, for its uses."""
        name = _assigned_name(statement)
        if name is None or self._tap(statement.value) is not None:
            return False
        if _is_empty_list_saved(statement.value):
            return False
        self._moved_to = []
        try:
            expression = self._vector(statement.value, None)
        except _Unfollowed:
            return False
        self._bind(name)
        self.vectors[name] = (expression, tuple(self._moved_to))
        return True

    # ------------------------------------------------------------ effects
    def _edit(self, statement: ast.stmt) -> list[ast.stmt] | None:
        """``x[...] += e``, ``x -= e``, ``x.add_(e)``, ``x[-1].sub_(e)`` on a tap's
        value -> the alias form: ``VALUE = <tap>; VALUE[...] += <e or -(e)>``."""
        if isinstance(statement, ast.AugAssign) and isinstance(statement.op, (ast.Add, ast.Sub)):
            target, negate, value = statement.target, isinstance(statement.op, ast.Sub), statement.value
        else:
            call = statement.value if isinstance(statement, ast.Expr) else None
            if not (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr in ("add_", "sub_")
                and len(call.args) == 1
                and not call.keywords
            ):
                return None
            target, negate, value = call.func.value, call.func.attr == "sub_", call.args[0]
        if isinstance(target, ast.Name):
            tap, select = self.taps.get(target.id), None  # the value itself, in place
        elif isinstance(target, ast.Subscript):
            tap, select = self._tap(target.value), target.slice
        else:
            return None
        if tap is None or tap.part == 1:
            return None
        vector = self._vector(value, tap)
        if negate:
            vector = ast.UnaryOp(op=ast.USub(), operand=vector)
        name = ast.Name(id=VALUE, ctx=ast.Store())
        edited: ast.expr = ast.Name(id=VALUE, ctx=ast.Store())
        if select is not None:
            edited = ast.Subscript(value=ast.Name(id=VALUE, ctx=ast.Load()), slice=select, ctx=ast.Store())
        return [
            ast.Assign(targets=[name], value=tap.node(), lineno=statement.lineno),
            ast.AugAssign(target=edited, op=ast.Add(), value=vector, lineno=statement.lineno),
        ]

    def _keep(self, statement: ast.stmt) -> list[ast.stmt] | None:
        """``rows.append(<a copy of a tap's value, or part of one>)``, with the tap's
        names written out."""
        call = statement.value if isinstance(statement, ast.Expr) else None
        if not (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "append"
            and isinstance(call.func.value, ast.Name)
            and call.func.value.id in self.lists
            and len(call.args) == 1
            and not call.keywords
        ):
            return None
        kept = ast.Call(func=call.func, args=[self._written_out(call.args[0])], keywords=[])
        return [ast.Expr(value=kept, lineno=statement.lineno)]

    def _first_read(self, statement: ast.stmt) -> list[ast.stmt] | None:
        """``first = <part of a tap's value>.save()``, with the tap's names written out."""
        name = _assigned_name(statement)
        call = statement.value if name is not None else None
        if not (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "save"
            and not call.args
            and not call.keywords
        ):
            return None
        self._bind(name)
        saved = ast.Call(
            func=ast.Attribute(value=self._written_out(call.func.value), attr="save", ctx=ast.Load()),
            args=[],
            keywords=[],
        )
        return [
            ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=saved, lineno=statement.lineno)
        ]

    # ------------------------------------------------------------ values
    def _tap(self, node: ast.expr) -> _Tap | None:
        """What a tap's value node names: a name bound to one, ``<module>.output``, or
        ``[0]``/``[1]`` of either (where not already a part)."""
        if isinstance(node, ast.Name):
            return self.taps.get(node.id)
        if isinstance(node, ast.Attribute) and node.attr == "output":
            path = _module_path(node.value)
            if path is None or path[0] in self.bound - self.taps.keys() or path[0] in self.taps:
                return None
            return _Tap(node.value, None)
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Constant)
            and type(node.slice.value) is int
            and node.slice.value in (0, 1)
        ):
            whole = self._tap(node.value)
            if whole is not None and whole.part is None:
                return _Tap(whole.module, node.slice.value)
        return None

    def _vector(self, node: ast.expr, edited: _Tap | None) -> ast.expr:
        """A vector's expression with the block's names for vectors replaced by what
        they name, and the edited value (only as ``.to(x)``, ``.to(x.dtype)``,
        ``.to(x.device)``) by :data:`VALUE`. ``forms`` checks the rest."""
        if isinstance(node, ast.Name):
            if node.id in self.vectors:
                expression, moved_to = self.vectors[node.id]
                if edited is not None and not all(_alike(tap, edited) for tap in moved_to):
                    raise _Unfollowed  # moved to another tap's value
                self._moved_to.extend(moved_to)
                self.used.add(node.id)
                return copy.deepcopy(expression)
            if node.id in self.taps or node.id in self.lists or node.id in self.bound:
                raise _Unfollowed  # a tap's value, a list, or a loop's name in the vector
            return ast.Name(id=node.id, ctx=ast.Load())
        if isinstance(node, ast.Constant):
            return ast.Constant(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return ast.UnaryOp(op=node.op, operand=self._vector(node.operand, edited))
        if isinstance(node, ast.BinOp):
            return ast.BinOp(
                left=self._vector(node.left, edited), op=node.op, right=self._vector(node.right, edited)
            )
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "to"
            and len(node.args) == 1
            and not node.keywords
        ):
            moved = self._vector(node.func.value, edited)
            return ast.Call(
                func=ast.Attribute(value=moved, attr="to", ctx=ast.Load()),
                args=[self._where(node.args[0], edited)],
                keywords=[],
            )
        raise _Unfollowed

    def _where(self, node: ast.expr, edited: _Tap | None) -> ast.expr:
        """Where ``.to(...)`` moves a vector: the edited value (its dtype, its device)
        becomes :data:`VALUE`; a captured name stays."""
        attr = None
        if isinstance(node, ast.Attribute) and node.attr in ("dtype", "device"):
            attr, node = node.attr, node.value
        tap = self._tap(node)
        if tap is not None:
            if edited is None:
                self._moved_to.append(tap)  # a vector named before its edit: checked there
            elif not _alike(tap, edited):
                raise _Unfollowed  # another value: Python would read it, not just its dtype
            where: ast.expr = ast.Name(id=VALUE, ctx=ast.Load())
        elif isinstance(node, ast.Name) and node.id not in self.bound:
            where = ast.Name(id=node.id, ctx=ast.Load())
        else:
            raise _Unfollowed
        return where if attr is None else ast.Attribute(value=where, attr=attr, ctx=ast.Load())

    def _written_out(self, node: ast.expr) -> ast.expr:
        """An expression with every name bound to a tap's value replaced by the
        value's own expression; any other name of the block's is not followed."""

        class Substitute(ast.NodeTransformer):
            def visit_Name(inner, name: ast.Name) -> ast.expr:  # noqa: N805
                if name.id in self.taps:
                    return self.taps[name.id].node()
                if name.id in self.bound:
                    raise _Unfollowed
                return name

        return Substitute().visit(copy.deepcopy(node))


def _alike(one: _Tap, other: _Tap) -> bool:
    """The same value of the same module, however each was reached."""
    return one.part == other.part and ast.dump(one.module) == ast.dump(other.module)


def _reads_name(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(node)
    )


def _assigned_name(node: ast.stmt) -> str | None:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None
