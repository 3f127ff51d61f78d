"""The shapes of block that the tap tables can run, read from a block's source alone.

A block is lowered when its whole source is one of these, statement for
statement, or computes one of them (``meaning.py`` rewrites it as the form);
anything else, down to one more statement, runs as Python:

    for _ in tracer.iter[a:b]:          # steering (or tracer.all())
        <tap>.output[0][:] += <vector>

    for _ in tracer.iter[a:b]:          # the same, through a name
        hidden = <tap>.output[0]
        hidden[:] += <vector>           # or hidden += <vector>

    either on one row of each step: hidden[-1] += <vector> (the prompt's last
    row on the first step, then the new token's), or hidden[0]

    for _ in tracer.iter[a:b]:          # steering several layers
        for i in <layers>:              # (8, 10), range(8, 12), or a captured list
            <either body above, on model.model.layers[i]>

    hidden = <tap>.output[0]            # either, with no loop: the first step only
    hidden[:] += <vector>

    rows = list().save()                # keeping a tap's rows every step
    for _ in tracer.iter[a:b]:
        rows.append(<kept>)             # or one row of them: <kept>[-1], <kept>[0]

    rows = list().save()                # the same at several layers (a probe's rows)
    for _ in tracer.iter[a:b]:
        for i in <layers>:
            rows.append(<kept on model.model.layers[i]>)

    first = <kept>[<index>].save()      # a read on the first step only (index optional)

    cache = tracer.cache(modules=[<tap>])   # the tap's whole output, every step

each optionally followed by ``out = tracer.result.save()``. ``<tap>`` is a module
path (``model.model.layers[10]``, ``[layer]`` with a captured whole number, or a
captured node of the tree), or an operation of one
(``model.model.layers[10].self_attn.source.self_attn_0``); ``<kept>`` is
``<tap>.output[0].clone()``, ``<tap>.output[1].clone()`` or
``<tap>.output[0] + <tap>.output[1]`` (the residual stream, optionally
``.clone()``d) for a tap whose value is a tuple, and ``<tap>.output.clone()``
for one whose value is a tensor (which steers as ``<tap>.output[:] += ...``);
``<vector>`` is ``+ - * /`` over numbers and captured names, each of which may be
moved with ``.to(...)`` to a captured dtype, device or tensor, or to the tap's
own (``.to(hidden)``, ``.to(hidden.dtype)``, ``.to(hidden.device)``, where
``hidden`` names the tap's value). Forms are cached per source; what the names
hold is checked at admission (``lower.py``).

A block that is none of these may still be one of them beside statements on what
the sampler serves (``split``): the first part is lowered, the rest runs as
Python at the sampler.
"""

from __future__ import annotations

import ast
import builtins
import functools
from dataclasses import dataclass
from typing import Any

from .ops import KEEP_BOTH, KEEP_FIRST, KEEP_SECOND, KEEP_SUM

_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_COMPOUND = (ast.For, ast.AsyncFor, ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try)


@dataclass(frozen=True)
class Index:
    """A whole number written as a name (``layers[layer]``, ``iter[:steps]``) or an
    attribute of one (``iter[:cfg.steps]``), read at admission."""

    name: str
    attrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Form:
    """A lowerable block's shape."""

    tracer: str | None  # None: a body read, which needs no tracer
    start: Any  # a whole number, or an Index naming one
    stop: Any  # the same, or None: every step
    tap: tuple  # the module path as written: a root name, then attributes and indices
    result: str | None  # the name ``tracer.result.save()`` is assigned to
    # steering
    vector: ast.Expression | None = None
    names: frozenset[str] = frozenset()  # names the vector reads
    # keeping
    code: int = 0
    kept: str | None = None  # the name the kept rows are saved under
    select: Any = None  # a body read's index (an int or a slice), or None
    single: bool = False
    whole: bool = False  # the block uses ``output`` itself, not ``output[0]``/``output[1]``
    alias: str | None = None  # the name a steering loop gives the tap's value
    #: steering several layers: (the inner loop's name, the whole numbers it takes:
    #: a tuple of them, a ``range`` of them, or an Index naming a captured sequence)
    over: tuple[str, Any] | None = None
    #: it unpacks the tap's output into two names (``meaning.py``): the tap's value
    #: must always be exactly two
    unpacks: bool = False
    #: the vector is a direction removed or clamped, not added (``meaning.py``):
    #: (reads the stream, lower bound, upper bound as written, clamped)
    project: tuple | None = None
    #: the value is scaled or filled, not added to: ("scale" or "fill", the
    #: columns or None for all: ("slice", low, high) or ("index", i), each an
    #: ``ast.Expression`` or None); ``vector`` is then the number
    change: tuple | None = None
    #: its rows were chosen with a mask built by ``torch.zeros`` (``meaning.py``):
    #: ``torch`` must be torch itself
    masks: bool = False
    #: it edits ``<tap>.input``, what the module is handed (an operation's value
    #: in its parent's forward, where that is a tap: ``TapTables.handed``)
    entry: bool = False
    #: it sets one row of the prompt to captured values (activation patching):
    #: (the name of the hidden state's row or None, the residual's or None); the
    #: row is ``select`` (a whole number, or an Index naming one)
    patch: tuple[str | None, str | None] | None = None

    @property
    def cache(self) -> bool:
        """A ``tracer.cache`` of the tap: both outputs, every step."""
        return self.code == KEEP_BOTH


@functools.lru_cache(maxsize=1024)
def block_form(source: str) -> Form | None:
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return None
    result = None
    if len(body) >= 2:
        result = _result_save(body[-1])
        if result is not None:
            body = body[:-1]
    form = _steering(body) or _keeping(body) or _first_read(body) or _cached(body) or _patching(body)
    if form is None:
        return None
    if result is not None:
        if form.tracer is not None and result[0] != form.tracer:
            return None
        if result[1] in (form.kept, form.tracer):
            return None
        form = Form(**{**form.__dict__, "tracer": result[0], "result": result[1]})
    return form


def _steering(body: list[ast.stmt]) -> Form | None:
    loop = _loop(body[0], 2) if len(body) == 1 else None
    over = None
    if loop is not None:
        tracer, start, stop, target, statements = loop
        if len(statements) == 1 and isinstance(statements[0], ast.For):
            inner = _layers_loop(statements[0])
            if inner is None:
                return None
            over, statements = inner
    elif 1 <= len(body) <= 2 and not any(isinstance(s, _COMPOUND) for s in body):
        tracer, start, stop, target, statements = None, 0, 1, None, body  # the first step only
    else:
        return None
    alias = None
    if len(statements) == 2:  # hidden = <tap>.output[0]; hidden[:] += <vector>
        alias, statement = _assigned(statements[0]), statements[1]
        if alias is None:
            return None
        read = statements[0].value
        edit = _edit(statement, bare=True) or _replaced(statement, read, alias)
        if edit is None or not (isinstance(edit[0], ast.Name) and edit[0].id == alias):
            return None
    else:
        edit = _edit(statements[0], bare=False)
        if edit is None:
            return None
        read = edit[0]
    _, select, change, number = edit
    entry = isinstance(read, ast.Attribute) and read.attr == "input"  # what a module is handed
    whole = _is_output(read) or entry
    if not whole and _output(read) != 0:
        return None
    tap = _module_path(read.value if whole else read.value.value)
    names = _vector_names(number, alias)
    if change is not None and names is not None:
        if alias in names or _moved_anywhere(number):
            return None  # a number: never the tap's value, nor moved
        for part in _columns(change[1]):
            more = _vector_names(part.body)
            names = None if more is None or _moved_anywhere(part.body) else names | more
            if names is None:
                break
    if tap is None or names is None:
        return None
    if _reads(tap, start, stop) & {target, tracer, alias} or names & {target, tracer, alias}:
        return None
    bounds = {part.name for part in (start, stop) if isinstance(part, Index)}
    if over is not None and (
        over[0] in names | bounds | {target, tracer, alias}
        or not _indexes_layers(tap, over[0])
        or _layers_read(over) & {over[0], target, tracer, alias}
    ):
        return None  # the vector or the steps read the layer, or the loop is not over the layers
    vector = ast.Expression(body=number)
    ast.fix_missing_locations(vector)
    return Form(
        tracer,
        start,
        stop,
        tap,
        None,
        vector=vector,
        names=frozenset(names),
        select=select,
        whole=whole,
        alias=alias,
        over=over,
        change=change,
        entry=entry,
    )


def _edit(statement: ast.stmt, bare: bool) -> tuple[ast.expr, Any, tuple | None, ast.expr] | None:
    """What one statement does to a value -> (the value, the row of each step or
    None, the change or None for an addition, the vector or number):
    ``X[:] += v`` (see :func:`_edited`), ``X[<rows>, <columns>] *= s`` (scaled)
    or ``X[<rows>, <columns>] = c`` (filled), where ``<rows>`` is ``:``, ``-1``
    or ``0`` and ``<columns>`` a slice or one index, optional for ``X[:]``."""
    if isinstance(statement, ast.AugAssign) and isinstance(statement.op, ast.Add):
        edited = _edited(statement.target, bare)
        return None if edited is None else (*edited, None, statement.value)
    if isinstance(statement, ast.AugAssign) and isinstance(statement.op, ast.Mult):
        found, kind = _edited_columns(statement.target, bare), "scale"
    elif isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        found, kind = _edited_columns(statement.targets[0], False), "fill"
    else:
        return None
    if found is None:
        return None
    value, select, columns = found
    return value, select, (kind, columns), statement.value


def _edited_columns(target: ast.expr, bare: bool) -> tuple[ast.expr, Any, tuple | None] | None:
    """:func:`_edited`, or ``X[<rows>, <columns>]`` -> (X, the row or None, the columns)."""
    found = _edited(target, bare)
    if found is not None:
        return (*found, None)
    if not (isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Tuple)):
        return None
    if len(target.slice.elts) != 2:
        return None
    rows, columns = target.slice.elts
    select = None if _every_row(rows) else _int(rows)
    if not _every_row(rows) and select not in _EVERY_STEP_ROWS:
        return None
    if isinstance(columns, ast.Slice):
        if columns.step is not None:
            return None
        return target.value, select, ("slice", _expression(columns.lower), _expression(columns.upper))
    if isinstance(columns, (ast.Starred, ast.Tuple, ast.List)):
        return None
    return target.value, select, ("index", _expression(columns))


def _expression(node: ast.expr | None) -> ast.Expression | None:
    if node is None:
        return None
    found = ast.Expression(body=node)
    ast.fix_missing_locations(found)
    return found


def _columns(columns: tuple | None) -> list[ast.Expression]:
    """The expressions a change's columns are written with."""
    return [] if columns is None else [part for part in columns[1:] if part is not None]


def _moved_anywhere(node: ast.expr) -> bool:
    """A ``.to(...)`` call anywhere in an expression."""
    return any(_moved(n) is not None for n in ast.walk(node))


def _replaced(statement: ast.stmt, read: ast.expr, alias: str) -> tuple | None:
    """``<tap>.output = out * s`` after ``out = <tap>.output``: the tensor a module
    returns replaced by itself scaled (``s * out`` the same), as ``out[:] *= s``."""
    if not (
        isinstance(statement, ast.Assign)
        and len(statement.targets) == 1
        and _is_output(statement.targets[0])
        and _is_output(read)
        and ast.unparse(statement.targets[0]) == ast.unparse(read)
    ):
        return None
    value = statement.value
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult)):
        return None
    for mine, other in ((value.left, value.right), (value.right, value.left)):
        if isinstance(mine, ast.Name) and mine.id == alias:
            return ast.Name(id=alias, ctx=ast.Load()), None, ("scale", None), other
    return None


def _patching(body: list[ast.stmt]) -> Form | None:
    """Rows of the prompt set to captured values, on the first step::

        out = <tap>.output                  # optional: or <tap>.output[0][p] = a
        out[0][p] = a                       # the hidden state's row p
        out[1][p] = b                       # and (optional) the residual's

    ``p`` a whole number written out or a captured name; ``a``, ``b`` captured
    names (checked at admission: rows of the tap's width)."""
    if not 1 <= len(body) <= 3 or any(isinstance(s, _COMPOUND) for s in body):
        return None
    alias = _assigned(body[0]) if len(body) >= 2 else None
    read = body[0].value if alias is not None else None
    if alias is not None and not _is_output(read):
        alias, read = None, None
    halves = _unpacked(body[0]) if alias is None and len(body) >= 2 else None  # hidden, residual = ...
    sets = body[1:] if alias is not None or halves is not None else body
    if not 1 <= len(sets) <= 2:
        return None
    tap, values, rows = None, {}, set()
    for statement in sets:
        if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
            return None
        target, value = statement.targets[0], statement.value
        if not (isinstance(target, ast.Subscript) and isinstance(value, ast.Name)):
            return None
        part = target.value  # out[i], <tap>.output[i], or a half's name
        if halves is not None:
            if not (isinstance(part, ast.Name) and part.id in halves[0]):
                return None
            index, holder = halves[0].index(part.id), halves[1]
        else:
            if not (isinstance(part, ast.Subscript) and isinstance(part.slice, ast.Constant)):
                return None
            index, holder = part.slice.value, part.value
        if type(index) is not int or index not in (0, 1) or index in values:
            return None
        if alias is not None:
            if not (isinstance(holder, ast.Name) and holder.id == alias):
                return None
            holder = read
        if not _is_output(holder):
            return None
        path = _module_path(holder.value)
        if path is None or (tap is not None and path != tap):
            return None
        tap = path
        row = _int(target.slice)
        row = row if row is not None else _named(target.slice)
        if row is None or isinstance(row, Index) and row.attrs:
            return None
        rows.add(row)
        values[index] = value.id
    if len(rows) != 1:
        return None
    (row,) = rows
    names = set(values.values()) | ({row.name} if isinstance(row, Index) else set())
    own = {alias} | set(halves[0] if halves is not None else ())
    if names & (own | _reads(tap, 0, 1)) or len(set(values.values())) != len(values):
        return None
    return Form(
        None,
        0,
        1,
        tap,
        None,
        names=frozenset(names),
        select=row,
        patch=(values.get(0), values.get(1)),
        unpacks=halves is not None,  # the tap's value must always be exactly two
    )


def _unpacked(statement: ast.stmt) -> tuple[list[str], ast.expr] | None:
    """``hidden, residual = <tap>.output`` -> (the two names, the output)."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1):
        return None
    target = statement.targets[0]
    if not (isinstance(target, ast.Tuple) and len(target.elts) == 2 and _is_output(statement.value)):
        return None
    names = [e.id for e in target.elts if isinstance(e, ast.Name)]
    if len(names) != 2 or names[0] == names[1] or "_" in names:
        return None
    return names, statement.value


def _layers_loop(node: ast.For) -> tuple[tuple[str, Any], list[ast.stmt]] | None:
    """``for i in <layers>:`` with one or two statements -> ((``i``, the layers), its
    body). ``<layers>`` is a tuple or list of whole numbers written out,
    ``range(...)`` of them or of captured names (``range(layers)``), or a
    captured name (each read at admission)."""
    if node.orelse or not 1 <= len(node.body) <= 2 or not isinstance(node.target, ast.Name):
        return None
    found: Any = None
    if isinstance(node.iter, (ast.Tuple, ast.List)):
        numbers = [_int(e) for e in node.iter.elts]
        found = tuple(numbers) if numbers and None not in numbers else None
    elif (
        isinstance(node.iter, ast.Call)
        and isinstance(node.iter.func, ast.Name)
        and node.iter.func.id == "range"
        and 1 <= len(node.iter.args) <= 3
        and not node.iter.keywords
    ):
        # whole numbers written out, or captured names read at admission
        numbers = [_int(a) if _int(a) is not None else _named(a) for a in node.iter.args]
        found = ("range", *numbers) if None not in numbers else None
    elif isinstance(node.iter, ast.Name):
        found = Index(node.iter.id)
    return None if found is None else ((node.target.id, found), list(node.body))


def _layers_read(over: tuple[str, Any]) -> set[str]:
    """The names a loop over layers reads for its layers (``range(first, last)``,
    a captured list): they must be the captured ones, not the loop's own."""
    spec = over[1]
    parts = (spec,) if isinstance(spec, Index) else spec[1:] if spec[0] == "range" else ()
    return {part.name for part in parts if isinstance(part, Index)}


def _indexes_layers(tap: tuple, name: str) -> bool:
    """The module path picks a decoder layer by ``name`` (``...layers[name]...``):
    the layers run one after the other in their order, so the loop's edits run
    in the order the model reaches them."""
    return any(
        isinstance(part, Index) and part == Index(name) and before == "layers"
        for before, part in zip(tap, tap[1:])
    )


def _edited(target: ast.expr, bare: bool) -> tuple[ast.expr, Any] | None:
    """What an in-place addition writes -> (the value, the rows of each step or None
    for every row): ``X[:]`` (or ``X`` itself, where ``bare``) every row,
    ``X[-1]`` or ``X[0]`` one row of each step, which every step has, ``X[-k:]``
    the last ``k`` rows of each step (all of a step with fewer)."""
    if _is_full_slice(target):
        return target.value, None
    if isinstance(target, ast.Subscript):
        index = _constant_index(target.slice)
        if type(index) is int and index in _EVERY_STEP_ROWS:
            return target.value, index
        if type(index) is slice and index.stop is None and type(index.start) is int and index.start < 0:
            return target.value, index
        return None
    return (target, None) if bare else None


def _keeping(body: list[ast.stmt]) -> Form | None:
    if len(body) != 2:
        return None
    kept = _assigned(body[0])
    if kept is None or not _is_empty_list_saved(body[0].value):
        return None
    loop = _loop(body[1])
    if loop is None:
        return None
    tracer, start, stop, target, (statement,) = loop
    over = None
    if isinstance(statement, ast.For):  # keeping several layers
        inner = _layers_loop(statement)
        if inner is None or len(inner[1]) != 1:
            return None
        over, (statement,) = inner
    call = statement.value if isinstance(statement, ast.Expr) else None
    if not (
        isinstance(call, ast.Call)
        and len(call.args) == 1
        and not call.keywords
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "append"
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == kept
    ):
        return None
    value, select = _kept_value(call.args[0]), None
    if value is None:
        found = _kept_row(call.args[0])
        if found is None:
            return None
        value, select = found
    tap, code, whole = value
    if _reads(tap, start, stop) & {target, tracer, kept}:
        return None
    if over is not None:
        bounds = {part.name for part in (start, stop) if isinstance(part, Index)}
        if (
            over[0] in bounds | {target, tracer, kept}
            or not _indexes_layers(tap, over[0])
            or _layers_read(over) & {over[0], target, tracer, kept}
        ):
            return None  # the steps read the layer, or the loop is not over the layers
    return Form(tracer, start, stop, tap, None, code=code, kept=kept, select=select, whole=whole, over=over)


#: The rows a step-by-step keep may pick: one every step of any request has.
_EVERY_STEP_ROWS = (-1, 0)


def _kept_row(node: ast.expr) -> tuple[tuple[tuple, int, bool], int] | None:
    """One row of a new tensor holding a tap's output, each step: ``<kept>[-1]`` or
    ``<kept>[0]`` (see :func:`_indexed`). Another row is not there on every step (a
    decode step has one), so Python raises there: not lowered."""
    found = _indexed(node)
    if found is None or type(found[1]) is not int or found[1] not in _EVERY_STEP_ROWS:
        return None
    return found


def _indexed(node: ast.expr) -> tuple[tuple[tuple, int, bool], Any] | None:
    """Part of a new tensor holding a tap's output: ``<tap>.output[0][i].clone()``
    (indexed, then copied) or ``<kept>[i]`` (copied, then indexed), with ``i`` a
    constant index or slice -> (what :func:`_kept_value` gives, the index)."""
    if _is_clone(node) and isinstance(node.func.value, ast.Subscript):
        indexed, part = node.func.value, _tap_value
    elif isinstance(node, ast.Subscript):
        indexed, part = node, _kept_value
    else:
        return None
    select = _constant_index(indexed.slice)
    value = None if select is None else part(indexed.value)
    return None if value is None else (value, select)


def _first_read(body: list[ast.stmt]) -> Form | None:
    """``first = <kept>[<index>].save()``: the body runs on the first step only."""
    found = _assigned_call(body, "save")
    if found is None or found[1].args or found[1].keywords:
        return None
    kept, call = found
    node, select = call.func.value, None  # what ``.save()`` is called on
    value = _kept_value(node)
    if value is None:
        found = _indexed(node)
        if found is None:
            return None
        value, select = found
    tap, code, whole = value
    if kept in _reads(tap, 0, 1):
        return None
    return Form(None, 0, 1, tap, None, code=code, kept=kept, select=select, single=True, whole=whole)


def _cached(body: list[ast.stmt]) -> Form | None:
    """``cache = tracer.cache(modules=[<tap>])`` (or ``tracer.cache([<tap>])``), nothing else."""
    found = _assigned_call(body, "cache")
    if found is None or not isinstance(found[1].func.value, ast.Name):
        return None
    kept, call = found
    if call.args and not call.keywords and len(call.args) == 1:
        modules = call.args[0]
    elif not call.args and len(call.keywords) == 1 and call.keywords[0].arg == "modules":
        modules = call.keywords[0].value
    else:
        return None  # any other argument (device, dtype, inputs) runs as Python
    if not (isinstance(modules, ast.List) and len(modules.elts) == 1):
        return None
    tap, tracer = _module_path(modules.elts[0]), call.func.value.id
    if tap is None or kept in _reads(tap, 0, None) | {tracer}:
        return None
    return Form(tracer, 0, None, tap, None, code=KEEP_BOTH, kept=kept)


# ---------------------------------------------------------------- parts
def _loop(node: ast.stmt, most: int = 1) -> tuple[str, Any, Any, str, list[ast.stmt]] | None:
    """``for <name> in tracer.iter[a:b]:`` with up to ``most`` statements -> its parts."""
    if (
        not isinstance(node, ast.For)
        or node.orelse
        or not 1 <= len(node.body) <= most
        or not isinstance(node.target, ast.Name)
    ):
        return None
    steps = _steps(node.iter)
    if steps is None:
        return None
    tracer, start, stop = steps
    return tracer, start, stop, node.target.id, list(node.body)


def _assigned_call(body: list[ast.stmt], method: str) -> tuple[str, ast.Call] | None:
    """A body of one statement, ``name = <something>.<method>(...)`` -> (name, the call)."""
    if len(body) != 1:
        return None
    name = _assigned(body[0])
    call = body[0].value if name is not None else None
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == method:
        return name, call
    return None


def _assigned(node: ast.stmt) -> str | None:
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    return None


def _is_empty_list_saved(node: ast.expr) -> bool:
    """``list().save()``."""
    return (
        isinstance(node, ast.Call)
        and not node.args
        and not node.keywords
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "save"
        and isinstance(node.func.value, ast.Call)
        and isinstance(node.func.value.func, ast.Name)
        and node.func.value.func.id == "list"
        and not node.func.value.args
        and not node.func.value.keywords
    )


def _is_clone(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call)
        and not node.args
        and not node.keywords
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "clone"
    )


def _kept_value(node: ast.expr) -> tuple[tuple, int, bool] | None:
    """A new tensor holding a tap's output -> (module path, ``ops.keep`` code, whole):
    ``<tap>.output[i].clone()``, ``<tap>.output.clone()``, or the sum of its two
    outputs (``.clone()`` or not)."""
    if _is_clone(node):
        return _tap_value(node.func.value)
    value = _tap_value(node)
    return value if value is not None and value[1] == KEEP_SUM else None


def _tap_value(node: ast.expr) -> tuple[tuple, int, bool] | None:
    """``<tap>.output[0]``, ``<tap>.output[1]``, their sum, or ``<tap>.output`` ->
    (module path, code, whole)."""
    if _is_output(node):
        tap = _module_path(node.value)
        return None if tap is None else (tap, KEEP_FIRST, True)
    if _output(node) in (0, 1):
        tap = _module_path(node.value.value)
        return None if tap is None else (tap, KEEP_FIRST if _output(node) == 0 else KEEP_SECOND, False)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = node.left, node.right
        if {_output(left), _output(right)} == {0, 1}:
            tap, other = _module_path(left.value.value), _module_path(right.value.value)
            if tap is not None and tap == other:
                return tap, KEEP_SUM, False
    return None


def _is_output(node: ast.expr) -> bool:
    """``<location>.output`` itself."""
    return isinstance(node, ast.Attribute) and node.attr == "output"


def _output(node: ast.expr) -> int | None:
    """``<module>.output[i]`` -> i."""
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and type(node.slice.value) is int
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "output"
    ):
        return node.slice.value
    return None


def _constant_index(node: ast.expr) -> Any:
    """``-1``, ``3`` or ``a:b`` of whole-number constants -> the index; None otherwise."""
    if isinstance(node, ast.Slice):
        if node.step is not None:
            return None
        bounds = [None if part is None else _int(part) for part in (node.lower, node.upper)]
        if any(part is not None and bound is None for part, bound in zip((node.lower, node.upper), bounds)):
            return None
        return slice(*bounds)
    return _int(node)


def _int(node: ast.expr) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int(node.operand)
        return None if inner is None else -inner
    return None


def _result_save(node: ast.stmt) -> tuple[str, str] | None:
    """``out = tracer.result.save()`` -> (tracer, out)."""
    name = _assigned(node)
    call = node.value if name is not None else None
    if not (isinstance(call, ast.Call) and not call.args and not call.keywords):
        return None
    func = call.func
    if not (
        isinstance(func, ast.Attribute) and func.attr == "save" and isinstance(func.value, ast.Attribute)
    ):
        return None
    if func.value.attr != "result" or not isinstance(func.value.value, ast.Name):
        return None
    return func.value.value.id, name


def _steps(node: ast.expr) -> tuple[str, Any, Any] | None:
    """``tracer.iter[a:b]`` or ``tracer.all()`` -> (tracer, first step, stop)."""
    if isinstance(node, ast.Call) and not node.args and not node.keywords:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "all" and isinstance(func.value, ast.Name):
            return func.value.id, 0, None
        return None
    if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)):
        return None
    if node.value.attr != "iter" or not isinstance(node.value.value, ast.Name):
        return None
    window = node.slice
    if not isinstance(window, ast.Slice) or window.step is not None:
        return None
    start = _whole(window.lower, 0)
    stop = _whole(window.upper, None)
    if start is None or (window.upper is not None and stop is None):
        return None
    return node.value.value.id, start, stop


def _whole(node: ast.expr | None, default: int | None) -> Any:
    """A whole number, or a name to read one from at admission (``tracer.iter[:steps]``)."""
    if node is None:
        return default
    if isinstance(node, ast.Constant) and type(node.value) is int and node.value >= 0:
        return node.value
    return _named(node)


def _named(node: ast.expr) -> Index | None:
    """``steps`` or ``cfg.steps`` (attributes of a name, any depth) -> an Index."""
    attrs: list[str] = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return Index(node.id, tuple(reversed(attrs))) if isinstance(node, ast.Name) else None


def _is_full_slice(node: ast.expr) -> bool:
    """``x[:]``."""
    return isinstance(node, ast.Subscript) and _every_row(node.slice)


def _every_row(node: ast.expr) -> bool:
    """``:`` alone, as an index."""
    return isinstance(node, ast.Slice) and node.lower is None and node.upper is None and node.step is None


def _module_path(node: ast.expr) -> tuple | None:
    """``model.model.layers[10]`` -> ("model", "model", "layers", 10); None otherwise."""
    parts: list = []
    while True:
        if isinstance(node, ast.Name):
            return (node.id, *reversed(parts))
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            index = node.slice.value
            if type(index) is not int or index < 0:
                return None
            parts.append(index)
            node = node.value
        elif isinstance(node, ast.Subscript) and _named(node.slice) is not None:
            parts.append(_named(node.slice))  # a captured whole number, read at admission
            node = node.value
        else:
            return None


def _reads(tap: tuple, start: Any, stop: Any) -> set[str]:
    """The names a module path and a step window read."""
    return {tap[0]} | {part.name for part in (*tap[1:], start, stop) if isinstance(part, Index)}


def _vector_names(node: ast.expr, alias: str | None = None) -> set[str] | None:
    """The names an arithmetic expression of names and numbers reads; None otherwise.
    A name moved with ``.to(...)`` counts, moved to a captured name (checked at
    admission: a dtype, a device or a tensor) or to the tap's value (``alias``),
    its dtype or its device; the alias itself is not among the names."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Constant):
        return set() if type(node.value) in (int, float) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _vector_names(node.operand, alias)
    if isinstance(node, ast.BinOp) and isinstance(node.op, _ARITHMETIC):
        left, right = _vector_names(node.left, alias), _vector_names(node.right, alias)
        return None if left is None or right is None else left | right
    found = _moved(node)
    if found is not None:
        moved, where = _vector_names(found[0], alias), found[1]
        if moved is None:
            return None
        if alias is not None and _of_alias(where, alias):
            return moved
        return moved | {where.id} if isinstance(where, ast.Name) else None
    return None


def _moved(node: ast.expr) -> tuple[ast.expr, ast.expr] | None:
    """``x.to(where)`` (one argument, no keywords) -> (x, where)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "to"
        and len(node.args) == 1
        and not node.keywords
    ):
        return node.func.value, node.args[0]
    return None


def _of_alias(node: ast.expr, alias: str) -> bool:
    """``hidden``, ``hidden.dtype`` or ``hidden.device`` for the alias ``hidden``."""
    if isinstance(node, ast.Attribute) and node.attr in ("dtype", "device"):
        node = node.value
    return isinstance(node, ast.Name) and node.id == alias


#: The parts of a module a block can name: what a block that names any other
#: attribute does is not one of the forms, but these say where it works.
_LOCATIONS = frozenset({"output", "input", "inputs"})


@dataclass(frozen=True)
class Outline:
    """What a block that is not one of the forms touches, for saying why it runs as
    Python: the locations it names, as (module path, ``output``/``input``/``inputs``),
    each once, in the order found; whether it names the sampler's values, and whether it branches."""

    locations: tuple[tuple, ...]
    sampler: bool
    branches: bool


@functools.lru_cache(maxsize=1024)
def outline(source: str) -> Outline | None:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    locations: list[tuple] = []
    sampler = branches = False
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            branches = True
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr in _LOCATIONS:
            path = _module_path(node.value)
            if path is not None and (path, node.attr) not in locations:
                locations.append((path, node.attr))
        elif node.attr in ("logits", "samples") and isinstance(node.value, ast.Name):
            sampler = True
    return Outline(tuple(locations), sampler, branches)


@dataclass(frozen=True)
class Split:
    """A block in two parts: ``taps``, its statements on locations, and ``rest``,
    every other statement (on ``model.logits``, ``model.samples``,
    ``tracer.result``, or plain values), each keeping its loops. When ``taps`` is
    one of the forms, it runs on the tables and ``rest`` as Python at the sampler,
    which runs outside the compiled forward: the block computes what it computes
    whole, because a step's forward comes before its sampler either way and no
    value passes between the parts."""

    taps: str
    rest: str


_BUILTINS = frozenset(dir(builtins))
#: What a statement of the rest may wait for: the sampler's values, the run's steps.
_RUN = frozenset({"logits", "samples", "result", "stop", "iter", "all", "next", "cache", "invoke"})


@functools.lru_cache(maxsize=1024)
def split(source: str) -> Split | None:
    """The two parts of a block, or None where it has no such split: every
    statement on a location comes before every statement of the rest that waits
    on the run (in Python's order), in the same loops, and no name one part binds
    is used by the other."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return None
    taps: list[tuple[int, ast.stmt]] = []
    rest: list[tuple[int, ast.stmt]] = []
    bound: set[str] = set()  # names the statements on locations bind (aliases, lists)
    waited = False  # a statement of the rest that waits on the run has come
    gone: list[ast.stmt] = []  # what leaves the source for the rest
    # A step loop gone whole to the taps: what follows it in Python waits for the
    # steps after that loop, and without the loop would wait for the first.
    moved = False
    for at, node in enumerate(body):
        if isinstance(node, ast.For) and not node.orelse and _steps(node.iter) is not None:
            on, off = [], []
            for statement in node.body:
                if _on_location(statement, bound):
                    if off or waited:
                        return None
                    on.append(statement)
                    bound |= _binds(statement)
                else:
                    off.append(statement)
            if on:
                taps.append((at, _with_body(node, on)))
                gone.extend(on if off else [node])
                moved = moved or not off
            if off:
                if moved:
                    return None
                rest.append((at, _with_body(node, off)))
                waited = True
        elif _on_location(node, bound):
            if waited:
                return None
            taps.append((at, node))
            gone.append(node)
            bound |= _binds(node)
        else:
            if moved and _waits(node, _RUN - {"result"}):
                return None
            rest.append((at, node))
            waited = waited or _waits(node)
    # A list the statements on locations fill is declared with them.
    declared = [(at, n) for at, n in rest if _assigned(n) in bound and _is_empty_list_saved(n.value)]
    rest = [(at, n) for at, n in rest if (at, n) not in declared]
    gone.extend(n for _, n in declared)
    taps = sorted(taps + declared, key=lambda pair: pair[0])
    if not taps or not rest:
        return None
    on_nodes, off_nodes = [n for _, n in taps], [n for _, n in rest]
    if any(isinstance(n, (ast.With, ast.AsyncWith)) for node in off_nodes for n in ast.walk(node)):
        return None  # an invoke or another block inside: not a sampler statement
    if any(isinstance(n, ast.Break) for node in off_nodes for n in ast.walk(node)):
        return None  # leaving a loop early would end the edits too: the tables would not
    # Both parts may use the roots of module paths and step loops (``model``,
    # ``tracer``) and what a loop's steps read, to name different things.
    shared = (
        _roots(on_nodes)
        | _BUILTINS
        | {
            n.id
            for node in body
            if isinstance(node, ast.For)
            for n in ast.walk(node.iter)
            if isinstance(n, ast.Name)
        }
    )
    used_on = _names(on_nodes) - shared
    used_off, bound_off = _names(off_nodes) - (shared - bound), _stored(off_nodes)
    if used_off & (bound | used_on) or bound_off & (_names(on_nodes) | bound):
        return None
    rest_source = _without(source, gone, off_nodes)
    return None if rest_source is None else Split(_unparse(on_nodes), rest_source)


def _on_location(node: ast.stmt, bound: set[str]) -> bool:
    """A statement that names a module location, or a name bound from one."""
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and n.attr in (*_LOCATIONS, "source"):
            return True
        if isinstance(n, ast.Name) and n.id in bound:
            return True
    return False


def _waits(node: ast.stmt, on: frozenset[str] = _RUN) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in on for n in ast.walk(node))


def _binds(node: ast.stmt) -> set[str]:
    """The names a statement binds, or fills (``rows.append(...)``)."""
    names = _stored([node])
    call = node.value if isinstance(node, ast.Expr) else None
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "append":
        if isinstance(call.func.value, ast.Name):
            names.add(call.func.value.id)
    return names


def _stored(nodes: list[ast.stmt]) -> set[str]:
    return {
        n.id
        for node in nodes
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }


def _names(nodes: list[ast.stmt]) -> set[str]:
    return {
        n.id
        for node in nodes
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }


def _roots(nodes: list[ast.stmt]) -> set[str]:
    """The names module paths and step loops start from (``model``, ``tracer``)."""
    roots: set[str] = set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute) and n.attr in (*_LOCATIONS, "iter", "all"):
                path = _module_path(n.value)
                if path is not None:
                    roots.add(path[0])
    return roots


def _with_body(loop: ast.For, body: list[ast.stmt]) -> ast.For:
    return ast.For(target=loop.target, iter=loop.iter, body=body, orelse=[], lineno=loop.lineno)


def _without(source: str, gone: list[ast.stmt], kept: list[ast.stmt]) -> str | None:
    """``source`` with the lines of the ``gone`` statements blanked, so that the rest
    keeps its line numbers (a traceback points where the user wrote it); None where
    a line holds statements of both parts."""
    blank = {line for node in gone for line in range(node.lineno - 1, node.end_lineno)}
    for node in kept:
        for statement in node.body if isinstance(node, ast.For) else [node]:
            if blank & set(range(statement.lineno - 1, statement.end_lineno)):
                return None
        if isinstance(node, ast.For) and node.lineno - 1 in blank:
            return None
    lines = source.splitlines(keepends=True)
    return "".join("\n" if i in blank else line for i, line in enumerate(lines))


def _unparse(nodes: list[ast.stmt]) -> str:
    module = ast.Module(body=nodes, type_ignores=[])
    ast.fix_missing_locations(module)
    return ast.unparse(module) + "\n"
