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
import builtins
import copy
import dis
import functools
import inspect
import textwrap
import types
from dataclasses import dataclass
from typing import Any

from .forms import _assigned, _every_row, _is_empty_list_saved, _module_path, _moved, _result_save, _steps

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
    #: it removes or clamps a direction rather than adding it (the source adds
    #: the direction, for ``forms`` to read the loop, the tap and the vector):
    #: (whether it reads the stream, the lower and upper bound as written, or
    #: None for none; both None and not clamped: removed)
    project: tuple[bool, ast.expr | None, ast.expr | None, bool] | None = None
    #: it chose rows with a mask built by ``torch.zeros`` (``rows[-2:] = True``):
    #: ``torch`` must be torch itself
    masks: bool = False


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


@dataclass(frozen=True)
class _Coefficient:
    """``s @ u``: ``read`` the value measured (``stream``: plus the residual)."""

    read: _Tap
    stream: bool
    u: ast.expr

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Coefficient)
            and _alike(self.read, other.read)
            and self.stream == other.stream
            and ast.dump(self.u) == ast.dump(other.u)
        )

    __hash__ = None  # type: ignore[assignment]


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
    masks = _Masks()
    try:
        rewritten = _Rewrite(masks.statements(body)).block()
    except _Unfollowed:
        return None
    if rewritten is None:
        return None
    statements, unpacks, project = rewritten
    module = ast.Module(body=[*statements, *tail], type_ignores=[])
    ast.fix_missing_locations(module)
    return Canonical(ast.unparse(module) + "\n", unpacks, project, masks.found)


class _Masks:
    """Rows chosen by a mask of the last ``k`` (``rows = torch.zeros(hidden.shape[0],
    dtype=torch.bool)``, then ``rows[-k:] = True``, used only as ``hidden[rows]``)
    become ``hidden[-k:]``: the same rows (on a step of fewer than ``k`` rows, all
    of them), and the same arithmetic on each element."""

    def __init__(self) -> None:
        self.found = False

    def statements(self, body: list[ast.stmt]) -> list[ast.stmt]:
        out: list[ast.stmt] = []
        i = 0
        while i < len(body):
            statement = body[i]
            if isinstance(statement, ast.For):
                statement = copy.copy(statement)
                statement.body = self.statements(statement.body)
            found = self._mask(statement, body[i + 1]) if i + 1 < len(body) else None
            if found is None:
                out.append(statement)
                i += 1
                continue
            name, value, last = found
            rest = body[i + 2 :]
            uses = [n for s in rest for n in ast.walk(s) if isinstance(n, ast.Name) and n.id == name]
            picks = [
                n
                for s in rest
                for n in ast.walk(s)
                if isinstance(n, ast.Subscript)
                and isinstance(n.value, ast.Name)
                and n.value.id == value
                and isinstance(n.slice, ast.Name)
                and n.slice.id == name
                and isinstance(n.ctx, ast.Store)  # edited (a read would be a copy, not a view)
            ]
            if not picks or len(picks) != len(uses) or any(isinstance(n.ctx, ast.Store) for n in uses):
                raise _Unfollowed  # the mask is used some other way
            for pick in picks:
                pick.slice = ast.Slice(lower=ast.UnaryOp(op=ast.USub(), operand=ast.Constant(last)))
            self.found = True
            i += 2
        return out

    @staticmethod
    def _mask(first: ast.stmt, second: ast.stmt) -> tuple[str, str, int] | None:
        """(the mask's name, the value it is as long as, k) for the two statements."""
        name = _assigned(first)
        call = first.value if name is not None else None
        if not (
            isinstance(call, ast.Call)
            and ast.unparse(call.func) == "torch.zeros"
            and len(call.args) == 1
            and len(call.keywords) == 1
            and call.keywords[0].arg == "dtype"
            and ast.unparse(call.keywords[0].value) == "torch.bool"
        ):
            return None
        length = call.args[0]
        if not (
            isinstance(length, ast.Subscript)
            and isinstance(length.slice, ast.Constant)
            and length.slice.value == 0
            and isinstance(length.value, ast.Attribute)
            and length.value.attr == "shape"
            and isinstance(length.value.value, ast.Name)
        ):
            return None
        if not (
            isinstance(second, ast.Assign)
            and len(second.targets) == 1
            and isinstance(second.targets[0], ast.Subscript)
            and isinstance(second.targets[0].value, ast.Name)
            and second.targets[0].value.id == name
            and isinstance(second.value, ast.Constant)
            and second.value.value is True
        ):
            return None
        rows = second.targets[0].slice
        if not (isinstance(rows, ast.Slice) and rows.upper is None and rows.step is None):
            return None
        low = rows.lower
        if not (
            isinstance(low, ast.UnaryOp)
            and isinstance(low.op, ast.USub)
            and isinstance(low.operand, ast.Constant)
            and type(low.operand.value) is int
            and low.operand.value > 0
        ):
            return None
        return name, length.value.value.id, low.operand.value


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
        self.coefficients: dict[str, _Coefficient] = {}  # names bound to ``s @ u``
        self.project: tuple[bool, ast.expr | None, ast.expr | None, bool] | None = None
        self.lists: set[str] = set()  # ``rows = list().save()``
        self.bound: set[str] = set()
        self.unpacks = False
        self.effect: list[ast.stmt] | None = None
        #: ``_``, where the block never reads it: a name for what it does not use,
        #: which may then be bound any number of times
        self.discard = None if any(_reads_name(s, "_") for s in body) else "_"

    def block(self) -> tuple[list[ast.stmt], bool, tuple | None] | None:
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
        if self.effect is None or set(self.vectors) - self.used or set(self.coefficients) - self.used:
            return None  # no effect, or a value it never uses (whose arithmetic may raise)
        return out, self.unpacks, self.project

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
        if self._names_tap(statement) or self._binds_coefficient(statement) or self._binds_vector(statement):
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
        name = _assigned(statement)
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
        name = _assigned(statement)
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
        projected = self._projection(value, tap) if negate else None
        if projected is not None:
            if select is not None and not _every_row(select):
                return None  # a direction removed from some rows: Python
            vector, select, negate = projected, None, False
        else:
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
        name = _assigned(statement)
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

    def _binds_coefficient(self, statement: ast.stmt) -> bool:
        """``c = (hidden + residual) @ u`` (or ``hidden @ u``): a direction's
        coefficient, for the statement that removes or clamps it."""
        name = _assigned(statement)
        if name is None:
            return False
        try:
            coefficient = self._coefficient(statement.value)
        except _Unfollowed:
            return False
        if coefficient is None:
            return False
        self._bind(name)
        self.coefficients[name] = coefficient
        return True

    def _coefficient(self, node: ast.expr) -> _Coefficient | None:
        """``s @ u`` with ``s`` a tap's value or its stream (``hidden + residual``),
        ``u`` a vector; or a name bound to one."""
        if isinstance(node, ast.Name) and node.id in self.coefficients:
            self.used.add(node.id)
            return self.coefficients[node.id]
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult)):
            return None
        read, stream = self._tap(node.left), False
        if read is None and isinstance(node.left, ast.BinOp) and isinstance(node.left.op, ast.Add):
            parts = (self._tap(node.left.left), self._tap(node.left.right))
            if (
                None in parts
                or {p.part for p in parts} != {0, 1}
                or not _alike(_Tap(parts[0].module, 0), _Tap(parts[1].module, 0))
            ):
                return None
            read, stream = _Tap(parts[0].module, 0), True
        if read is None or read.part == 1:
            return None
        return _Coefficient(read, stream, self._vector(node.right, read))

    def _projection(self, value: ast.expr, edited: _Tap) -> ast.expr | None:
        """``hidden -= <value>`` removing or clamping a direction: ``value`` is
        ``c[:, None] * u`` or ``(c - c.clamp(min=a, max=b))[:, None] * u`` with ``c``
        the coefficient of the same ``u`` on the edited value (or its stream).
        Returns ``u`` (and notes the projection); None where it is not one."""
        if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)):
            return None
        for column, direction in ((value.left, value.right), (value.right, value.left)):
            if not _is_column(column):
                continue
            found = self._held(column.value)
            if found is None:
                return None
            coefficient, bounds = found
            if any(isinstance(b, ast.Name) and b.id in self.bound for b in bounds[:2]):
                return None  # a bound the block computes: not read at admission
            if not _alike(coefficient.read, edited):
                return None  # read at one value, removed from another
            u = self._vector(direction, edited)
            if ast.dump(u) != ast.dump(coefficient.u):
                return None  # removed along another vector than it was measured on
            self.project = (coefficient.stream, *bounds)
            return u
        return None

    def _held(self, node: ast.expr) -> tuple[_Coefficient, tuple] | None:
        """``c`` -> (c, removed), or ``c - c.clamp(...)`` -> (c, its bounds)."""
        try:
            coefficient = self._coefficient(node)
        except _Unfollowed:
            return None
        if coefficient is not None:
            return coefficient, (None, None, False)
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)):
            return None
        call = node.right
        if not (
            isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "clamp"
        ):
            return None
        first, second = self._coefficient(node.left), self._coefficient(call.func.value)
        if first is None or first != second:
            return None
        bounds = _bounds(call)
        if bounds is None:
            return None
        return first, (*bounds, True)

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
        found = _moved(node)
        if found is not None:
            moved = self._vector(found[0], edited)
            return ast.Call(
                func=ast.Attribute(value=moved, attr="to", ctx=ast.Load()),
                args=[self._where(found[1], edited)],
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


def _is_column(node: ast.expr) -> bool:
    """``x[:, None]``."""
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Tuple)
        and len(node.slice.elts) == 2
        and _every_row(node.slice.elts[0])
        and isinstance(node.slice.elts[1], ast.Constant)
        and node.slice.elts[1].value is None
    )


def _bounds(call: ast.Call) -> tuple[ast.expr | None, ast.expr | None] | None:
    """``clamp(min=a, max=b)``, ``clamp(a, b)`` or ``clamp(a)`` -> (a, b); each a
    number or a captured name (read at admission)."""
    if len(call.args) > 2:
        return None
    given: dict[str, ast.expr] = dict(zip(("min", "max"), call.args))
    for keyword in call.keywords:
        if keyword.arg not in ("min", "max") or keyword.arg in given:
            return None
        given[keyword.arg] = keyword.value
    bounds = (given.get("min"), given.get("max"))
    for bound in bounds:
        if bound is None or isinstance(bound, ast.Name):
            continue
        inner = bound.operand if isinstance(bound, ast.UnaryOp) and isinstance(bound.op, ast.USub) else bound
        if not (
            isinstance(inner, ast.Constant) and (inner.value is None or type(inner.value) in (int, float))
        ):
            return None
    return bounds


def _reads_name(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(node)
    )


# ---------------------------------------------------------------- functions
def inlined(source: str, scope: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """``source`` with each call of a captured function as a statement
    (``change(layer.output[0], layer.output[1])``) replaced by that function's
    body, its parameters bound to the arguments and its own names renamed apart;
    the scope gains the values its body reads from its closure and globals. None
    where no call is a plain function of yours whose source reads as one
    ``def`` of straight statements (no return, no nested function, no
    ``global``). It only rewrites: nothing runs, and :func:`canonical` then
    follows the result as any block."""
    if VALUE in source:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    added: dict[str, Any] = {}
    found = False

    class Inline(ast.NodeTransformer):
        def generic_visit(self, node: ast.AST) -> ast.AST:
            nonlocal found
            for field in ("body", "orelse"):
                statements = getattr(node, field, None)
                if not isinstance(statements, list):
                    continue
                replaced: list[ast.stmt] = []
                for statement in statements:
                    body = _call_inlined(statement, scope, added, len(added))
                    if body is None:
                        replaced.append(statement)
                    else:
                        found = True
                        replaced.extend(body)
                setattr(node, field, replaced)
            return super().generic_visit(node)

    Inline().visit(tree)
    if not found:
        return None
    ast.fix_missing_locations(tree)
    return ast.unparse(tree) + "\n", {**scope, **added}


def _call_inlined(
    statement: ast.stmt, scope: dict[str, Any], added: dict[str, Any], serial: int
) -> list[ast.stmt] | None:
    call = statement.value if isinstance(statement, ast.Expr) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.keywords):
        return None
    function = scope.get(call.func.id)
    definition = _definition(function) if type(function) is types.FunctionType else None
    if definition is None:
        return None
    params = [a.arg for a in definition.args.args]
    if len(params) != len(call.args) or any(isinstance(a, ast.Starred) for a in call.args):
        return None
    local = set(params) | {
        n.id for n in ast.walk(definition) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    code = function.__code__
    cells = dict(zip(code.co_freevars, function.__closure__ or ()))
    renamed: dict[str, str] = {}
    source_names = {n.id for n in ast.walk(call) if isinstance(n, ast.Name)}
    for name in {n.id for n in ast.walk(definition) if isinstance(n, ast.Name)}:
        new = f"{name}__{code.co_name}{serial}"
        if new in scope or new in source_names:
            return None  # the block has a name of that spelling already
        if name in local:
            renamed[name] = new
            continue
        if name in cells:
            try:
                value = cells[name].cell_contents
            except ValueError:  # a cell not filled yet
                return None
        elif name in function.__globals__:
            value = function.__globals__[name]
        elif hasattr(builtins, name):
            continue  # a builtin, as the block sees it
        else:
            return None
        renamed[name] = new
        added[new] = value

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.Name:  # noqa: N802
            return ast.Name(id=renamed.get(node.id, node.id), ctx=node.ctx)

    bound = [
        ast.Assign(targets=[ast.Name(id=renamed[p], ctx=ast.Store())], value=a, lineno=statement.lineno)
        for p, a in zip(params, call.args)
    ]
    body = [Rename().visit(copy.deepcopy(s)) for s in definition.body]
    return [*bound, *body]


def _definition(function: types.FunctionType) -> ast.FunctionDef | None:
    """A function's ``def``, where its source is one undecorated ``def`` of
    positional parameters and straight statements."""
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return None
    return _straight_def(textwrap.dedent(source), function.__code__.co_name)


@functools.lru_cache(maxsize=256)
def _straight_def(source: str, name: str) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        return None
    definition = tree.body[0]
    args = definition.args
    if (
        definition.name != name
        or definition.decorator_list
        or args.vararg
        or args.kwarg
        or args.kwonlyargs
        or args.defaults
        or args.posonlyargs
    ):
        return None
    forbidden = (
        ast.Return, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Global,
        ast.Nonlocal, ast.Yield, ast.YieldFrom, ast.Await, ast.Try, ast.With, ast.Import, ast.ImportFrom,
    )  # fmt: skip
    if any(isinstance(n, forbidden) for s in definition.body for n in ast.walk(s)):
        return None
    return definition


#: What a condition decided at admission may be built from.
_DECIDABLE = (
    ast.Expression, ast.Compare, ast.BoolOp, ast.UnaryOp, ast.Name, ast.Constant, ast.Load,
    ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Is, ast.IsNot, ast.In, ast.NotIn,
    ast.And, ast.Or, ast.Not, ast.Tuple,
)  # fmt: skip
#: Captured values such a condition may read: immutable, compared without code of their own.
_SETTLED = (type(None), bool, int, float, str)


def folded(source: str, scope: dict[str, Any]) -> str | None:
    """``source`` with each ``if`` whose condition reads only captured plain
    values (None, booleans, numbers, strings) that the block never rebinds
    replaced by the branch it takes (``if index is not None:`` inside a loop of
    invokes over ``[None, *range(layers)]``). Such a condition has one value for
    the whole request, the one it has now, so the block does what the branch
    does. None where no ``if`` is decided so."""
    if "if" not in source:  # most blocks: nothing to parse for
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    changed = False

    def decided(test: ast.expr) -> bool | None:
        expression = ast.Expression(body=test)
        if not all(isinstance(n, _DECIDABLE) for n in ast.walk(expression)):
            return None
        names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
        if names & stored or any(type(scope.get(n, _UNSET)) not in _SETTLED for n in names):
            return None
        if any(isinstance(n, ast.Constant) and type(n.value) not in _SETTLED for n in ast.walk(test)):
            return None
        try:
            value = eval(
                compile(expression, "<condition>", "eval"), {"__builtins__": {}}, {n: scope[n] for n in names}
            )
        except Exception:  # noqa: BLE001 - Python raises the same on the request
            return None
        return value if type(value) is bool else None

    class Fold(ast.NodeTransformer):
        def visit_If(self, node: ast.If) -> Any:  # noqa: N802
            nonlocal changed
            self.generic_visit(node)
            taken = decided(node.test)
            if taken is None:
                return node
            changed = True
            return node.body if taken else node.orelse  # a branch not there: the ``if`` goes

    tree = Fold().visit(tree)
    if not changed:
        return None
    for node in ast.walk(tree):  # a loop or ``with`` left with no statement still needs one
        if not isinstance(node, ast.Module) and getattr(node, "body", None) == []:
            node.body = [ast.Pass()]
    ast.fix_missing_locations(tree)
    return ast.unparse(tree) + "\n"


_UNSET = object()


#: All a function that returns one constant and does nothing else executes.
_RETURNS_A_CONSTANT = frozenset({"RESUME", "NOP", "CACHE", "LOAD_CONST", "RETURN_VALUE", "RETURN_CONST"})
#: Code flags of a function that runs later, or otherwise than called.
_DEFERRED = (
    inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
)


def does_nothing(value: types.FunctionType) -> bool:
    """Whether a plain function only returns a constant (a placeholder such as
    ``lambda hidden, residual: None``): read from its bytecode, which needs no
    source (a lambda's ``getsource`` is the whole line around it). It loads no
    name, global or attribute and calls nothing, so it reads and writes nothing."""
    code = value.__code__
    if code.co_names or code.co_freevars or code.co_cellvars or code.co_flags & _DEFERRED:
        return False
    try:
        return {i.opname for i in dis.get_instructions(code)} <= _RETURNS_A_CONSTANT
    except Exception:  # noqa: BLE001 - bytecode this reading does not know: it may do anything
        return False
