"""Which blocks run on the tap tables instead of as Python, and what they become.

A block's source must be one of the forms in ``forms.py``, or compute one
(``meaning.py`` rewrites it, a function it calls on the tap inlined from its
source); then, at admission, the values it captured must pass the checks here,
or it runs as Python:

- the location it names is a tap, read as the tap's value is: ``output[0]`` and
  ``output[1]`` on a module whose forward returns a tuple (the hidden state and
  the residual, for every call), ``output`` itself on a module that returns a
  tensor or on an operation (``.source``), one row per token, as wide as the
  hidden state, in the model's dtype (``TapTables.means``);
- step bounds and indices named by variables hold whole numbers; one named as
  an attribute (``cfg.steps``) is read only where reading it runs no code of
  the object's own (an attribute it holds, or a plain one of its class: not a
  property, nor a class that overrides attribute lookup);
- a steering vector, built only from numbers and captured tensors with
  ``+ - * /`` and ``.to(...)`` (to a captured dtype, device or tensor, or to the
  tap's value, whose dtype and device are the model's), has the same value at
  every step, so it is evaluated once, here, on the same device with the same
  operations.
  It must be a tensor of the tap's width (``[width]`` or ``[1, width]``) on the
  model's device, in the model's dtype or float32 (where adding it in float32
  and rounding once is exactly what ``+=`` does);
- a read on the first step indexes the prompt's rows within range (out of range,
  Python raises on that step, and so it must run as Python);
- a cache names the tap alone, with nnsight's defaults (its values on the host,
  the output only);
- a direction removed or clamped is one tensor ``[width]`` in the model's dtype
  (the block's product needs it so), its bounds numbers, rounded to that dtype as
  ``clamp`` rounds them.

Then the block's whole effect is known. Steering: on steps ``a`` to ``b - 1`` of
its request, every row of that request at that tap gets the vector added (or
the one row of each step it names, which must then be ``[width]``), or the
direction removed from every row, or its coefficient clamped.
Keeping: on those steps the request's rows at the tap (at each of its layers)
are copied out, and come back as the list the loop would have built (for a first-step read, the one
value; for a cache, the view nnsight's ``tracer.cache`` saves). Either way, the
finished output is saved under ``out`` if the request lived through step
``b - 1`` (as Python, the line after the loop runs only then; after
``tracer.all()``, never; after a cache or a first-step read, always).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch

from .forms import Form, Index, block_form, outline
from .kept import Lowered
from .meaning import canonical, inlined
from .ops import FILL, KEEP_FIRST, PATCH, PATCH_COLUMNS, SCALE


@dataclass(frozen=True)
class LoweredBlock:
    """A lowered block: the tap it works on, its request's entry, its vector if it steers."""

    site: str  # module path relative to the model, as in the taps
    lowered: Lowered
    vector: torch.Tensor | None
    #: several layers: the other taps the vector is added at, or whose rows are
    #: kept, in model order
    also: tuple[int, ...] = ()
    #: what the bank makes of the vector (``ops.steer``'s ``how``): (0, 0, 0) added;
    #: (1 or 2, lower, upper) a direction removed or clamped; (3 or 4, the number,
    #: first column, column after the last) the value scaled or filled
    how: tuple[float, ...] = (0.0, 0.0, 0.0)
    #: patching the residual's row too: its value (the hidden state's is ``vector``)
    residual: torch.Tensor | None = None

    @property
    def form(self) -> str:
        """The form's name in ``nnsight_stats`` and on the output."""
        code, lowered = self.lowered.code, self.lowered
        if not code:
            return _EDITS[int(self.how[0])]
        return "read" if lowered.single else "cache" if lowered.cache else "keep"


#: Each edit's name by ``how[0]``: added, a direction removed or clamped (of the
#: value or of the stream), the value scaled or filled.
_EDITS = ("steer", "project", "project", "scale", "fill", "patch", "patch")


@dataclass(frozen=True)
class Unlowered:
    """Why a block runs as Python: a short kind (counted in ``nnsight_stats``) and
    the reason in words (on the request's output)."""

    kind: str
    reason: str


_VECTOR = Unlowered(
    "vector",
    "its vector is not built from captured numbers and tensors into one tensor of the "
    "tap's width, on the model's device, in the model's dtype or float32",
)


def lower(
    source: str | None,
    scope: dict[str, Any],
    model: Any,
    tracer_type: type,
    tables: Any,
    dtype: torch.dtype,
) -> LoweredBlock | Unlowered:
    """The lowered form of a block, or why it must run as Python.

    It depends on the block and the engine only, never on the request, so one
    result serves every request that carries the same block (see :func:`fits`).
    """
    form = read_form(source) if source else None
    if form is None and source:  # a function of the user's called on the tap: its body
        found = inlined(source, scope)
        form = None if found is None else read_form(found[0])
        if form is not None:
            scope = found[1]
    if form is None:
        return _not_a_form(source, scope, model, tables)
    if form.tracer is not None and not isinstance(scope.get(form.tracer), tracer_type):
        return Unlowered("form", f"`{form.tracer}` is not the trace's tracer")
    if form.masks and scope.get("torch") is not torch:
        return Unlowered("form", "it builds its row mask with a `torch` that is not torch")
    also: tuple[int, ...] = ()
    if form.over is not None:
        found = _layers(form, scope, model, tables)
        if isinstance(found, Unlowered):
            return found
        scope, also = found
    path = _site(form.tap, scope, model)
    if path is None:
        return Unlowered(
            "form", f"`{_written(form.tap)}` is not a module of the model found by plain attributes"
        )
    start, stop = _number(form.start, scope), _number(form.stop, scope)
    if start is None or (form.stop is not None and stop is None):
        return Unlowered("form", "its steps are not whole numbers read without running code")
    site = _tap_site(form, path, tables)
    if site is None:
        return _not_a_tap(path, form.entry)
    if form.entry:
        path = tables.sites[site]
    # a cache takes the tap's whole output: a pair, or one tensor (kept alone)
    tensor_cache = form.cache and site not in tables.tuple_sites
    # a value scaled or filled reads no bank row: a tap of any width takes it (an MLP's neurons)
    changes = form.change is not None and not form.code and form.project is None and not also
    if not tables.means(site, form.whole or tensor_cache, any_width=changes):
        return Unlowered("form", f"it reads `model.{path}.output` other than as the tap's value")
    width = tables.width(site)
    if form.unpacks and not {site, *also} <= tables.pair_sites:
        return _UNPACKED
    lowered = Lowered(site, start, stop, form.result)
    if form.code:
        lowered.code, lowered.name = (KEEP_FIRST if tensor_cache else form.code), form.kept
        lowered.select, lowered.single = form.select, form.single
        if form.cache:
            lowered.cache = f"{model.path}.{path}"  # the key nnsight's cache files it under
        return LoweredBlock(path, lowered, None, also)
    lowered.select = form.select  # one row of each step, or None: every row
    form = _patch_of(form, scope)
    if width != tables.hidden and (form.patch is not None or form.change is None):
        return Unlowered("form", f"it sets rows of `model.{path}.output`, wider or narrower than the bank")
    if form.patch is not None:
        return _patched(form, scope, path, site, lowered, also, tables)
    if form.change is not None:
        how = _change(form, scope, width, dtype)
        if isinstance(how, Unlowered):
            return how
        zeros = torch.zeros(tables.hidden, dtype=torch.float32, device=tables.device)
        return LoweredBlock(path, lowered, zeros, also, how)  # its bank row is not read
    vector = _vector(form, scope, tables.hidden, dtype, tables.device)
    if vector is None:
        return _VECTOR
    if form.project is None:
        return LoweredBlock(path, lowered, vector, also)
    how = _projection(form, scope, vector, dtype)
    return how if isinstance(how, Unlowered) else LoweredBlock(path, lowered, vector, also, how)


_DIRECTION = Unlowered(
    "vector",
    "the direction it removes or clamps is not one tensor of the tap's width in the model's dtype, "
    "or its bounds are not numbers",
)


def _projection(
    form: Form, scope: dict[str, Any], vector: torch.Tensor, dtype: torch.dtype
) -> tuple[float, float, float] | Unlowered:
    """``ops.steer``'s ``how`` for a direction removed or clamped: the direction as
    the block's matrix product takes it (``[width]``, in the model's dtype: another
    dtype, Python raises), and the bounds as ``clamp`` rounds them to that dtype
    (a bound of None: none; both None: the block raises, so not lowered)."""
    stream, low, high, clamped = form.project
    if vector.dim() != 1 or vector.dtype != dtype:
        return _DIRECTION
    if not clamped:
        return (2.0 if stream else 1.0, 0.0, 0.0)  # c - clamp(c, 0, 0) is c: removed
    bounds = []
    for bound, none in ((low, -float("inf")), (high, float("inf"))):
        value = None
        if bound is not None:
            value = scope.get(bound.id, _MISSING) if isinstance(bound, ast.Name) else ast.literal_eval(bound)
            if value is not None and type(value) not in (int, float):
                return _DIRECTION
        bounds.append(none if value is None else torch.tensor(value, dtype=dtype).item())
    if bounds == [-float("inf"), float("inf")]:
        return _DIRECTION  # ``clamp()`` of no bound raises
    return (2.0 if stream else 1.0, *bounds)


_ROWS = Unlowered(
    "vector",
    "the rows it patches in are not captured tensors of the tap's width, in float32, bfloat16 or "
    "float16, or its row is not a whole number",
)


def _patch_of(form: Form, scope: dict[str, Any]) -> Form:
    """``<value>[p] = a`` with ``a`` a captured tensor: a patch of that row, not a
    fill with a number (the source alone cannot tell the two apart)."""
    if (
        form.change is not None
        and form.change[0] == "fill"
        and type(form.select) is int
        and isinstance(form.vector.body, ast.Name)
        and type(scope.get(form.vector.body.id)) is torch.Tensor
    ):
        # ``change`` keeps the columns (None: all of them)
        return dataclasses.replace(form, patch=(form.vector.body.id, None))
    return form


def _patched(
    form: Form, scope: dict[str, Any], path: str, site: int, lowered: Lowered, also: tuple, tables: Any
) -> LoweredBlock | Unlowered:
    """Rows of the prompt set to captured values: each a tensor ``[width]`` in a
    dtype float32 holds exactly (``x[p] = a`` rounds it once to the model's dtype,
    as the bank's float32 copy is rounded), the residual's only on a tap whose
    value is always (hidden, residual)."""
    hidden_name, residual_name = form.patch
    columns = None if form.change is None else form.change[1]
    low, high = 0, tables.hidden
    if columns is not None:  # ``x[p, a:b] = v``: those columns, from a tensor as wide as them
        bounds = _columns(columns, {name: scope.get(name, _MISSING) for name in form.names}, tables.hidden)
        if isinstance(bounds, Unlowered):
            return bounds
        low, high = bounds
        if residual_name is not None or low >= high:
            return _ROWS
    values = []
    for name in (hidden_name, residual_name):
        value = None if name is None else scope.get(name)
        if name is not None and not (
            type(value) is torch.Tensor
            and tuple(value.shape) == (high - low,)
            and value.dtype in (torch.float32, torch.bfloat16, torch.float16)
        ):
            return _ROWS
        values.append(value)
    if residual_name is not None and site not in tables.pair_sites:
        return _UNPACKED
    row = _read(form.select, scope) if isinstance(form.select, Index) else form.select
    if type(row) is not int:
        return _ROWS
    lowered.select = row
    hidden, residual = values
    if columns is not None:
        vector = torch.zeros(tables.hidden, dtype=torch.float32)
        vector[low:high] = hidden.detach().to(device="cpu", dtype=torch.float32)
        how = (float(PATCH_COLUMNS), 1.0, float(low), float(high))
        return LoweredBlock(path, lowered, vector, also, how)
    how = (float(PATCH), 1.0 if hidden is not None else -1.0, 1.0 if residual is not None else -1.0)
    vector = torch.zeros(tables.hidden) if hidden is None else hidden
    return LoweredBlock(path, lowered, vector.detach(), also, how, residual)


_NUMBER = Unlowered(
    "vector",
    "the number it scales or fills with is not one Python number read without running code "
    "(a fill: one float32 holds exactly), or its columns are not whole numbers",
)


def _change(
    form: Form, scope: dict[str, Any], width: int, dtype: torch.dtype
) -> tuple[float, float, float, float] | Unlowered:
    """``ops.steer``'s ``how`` for a value scaled (``*= s``) or filled (``= c``) on
    some columns: (mode, the number, first column, column after the last).

    The number is a Python ``int`` or ``float`` computed from the captured ones
    (arithmetic only). A tensor times a Python number rounds the number to
    float32 first (the bank's type) then the product to the value's dtype; a fill
    rounds the number straight to the dtype, so a fill takes only numbers float32
    holds exactly (then both round alike). Columns are whole numbers: a slice as
    Python clips it, one index within the width (outside, Python raises)."""
    kind, columns = form.change
    values = {name: scope.get(name, _MISSING) for name in form.names}
    number = _captured_number(form, values, dtype)
    if number is None:
        return _NUMBER
    if kind == "fill" and float(torch.tensor(number, dtype=torch.float32).item()) != number:
        return _NUMBER
    bounds = _columns(columns, values, width)
    if isinstance(bounds, Unlowered):
        return bounds
    low, high = bounds
    return (float(SCALE if kind == "scale" else FILL), float(number), float(low), float(high))


def _columns(columns: tuple | None, values: dict[str, Any], width: int) -> tuple[int, int] | Unlowered:
    """The columns an edit names, ``[low, high)``: all (None), a slice as Python
    clips it, or one index within the width (outside, Python raises)."""
    if columns is None:
        return 0, width
    parts = [None if part is None else _evaluated(part, values) for part in columns[1:]]
    if any(part is not None and type(part) is not int for part in parts):
        return _NUMBER
    if columns[0] == "index":
        (index,) = parts
        if not -width <= index < width:
            return Unlowered("form", f"it indexes column {index} of a value {width} wide (Python raises)")
        return index % width, index % width + 1
    low, high, _ = slice(*parts).indices(width)
    return low, max(high, low)


def _captured_number(form: Form, values: dict[str, Any], dtype: torch.dtype) -> int | float | None:
    """The form's number (``form.vector``), computed from captured numbers alone, on
    a model whose dtype the bank's float32 serves; None for anything else."""
    if any(type(v) not in (int, float) for v in values.values()):
        return None
    number = _evaluated(form.vector, values)
    if type(number) not in (int, float) or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return number


def _evaluated(expression: ast.Expression, values: dict[str, Any]) -> Any:
    """An arithmetic expression of numbers (``forms`` read it so), or None where it raises."""
    try:
        return eval(compile(expression, "<number>", "eval"), {"__builtins__": {}}, dict(values))
    except Exception:  # noqa: BLE001 - Python raises the same on the request
        return None


_UNPACKED = Unlowered(
    "form", "it unpacks a tap's output into two names, and that tap's value is not always exactly two"
)


def read_form(source: str) -> Form | None:
    """The form a block is, as written or as :mod:`.meaning` rewrites it."""
    form = block_form(source)
    if form is None:
        found = canonical(source)
        form = None if found is None else block_form(found.source)
        if form is not None:
            form = dataclasses.replace(form, unpacks=found.unpacks, project=found.project, masks=found.masks)
    return form


def _layers(
    form: Form, scope: dict[str, Any], model: Any, tables: Any
) -> tuple[dict[str, Any], tuple[int, ...]] | Unlowered:
    """Steering or keeping over several layers: the scope with the loop's name at
    its first layer, and the taps of the others. The layers must be taps the model reaches
    one after the other: whole numbers, each once, in increasing order (Python
    would add twice, or wait for a layer already run)."""
    name, spec = form.over
    if isinstance(spec, Index):
        value = scope.get(spec.name)
        numbers = list(value) if type(value) in (list, tuple, range) else None
    elif spec[0] == "range":
        bounds = [_read(b, scope) if isinstance(b, Index) else b for b in spec[1:]]
        if "range" in scope or any(type(b) is not int for b in bounds):
            numbers = None  # the builtin only, over whole numbers
        else:
            numbers = list(range(*bounds))
    else:
        numbers = list(spec)
    if not numbers or any(type(n) is not int or n < 0 for n in numbers) or numbers != sorted(set(numbers)):
        return Unlowered("form", "its layers are not whole numbers, each once, in increasing order")
    sites = []
    for number in numbers:
        path = _site(form.tap, {**scope, name: number}, model)
        if path is None:
            return Unlowered(
                "form", f"`{_written(form.tap)}` is not a module of the model found by plain attributes"
            )
        site = _tap_site(form, path, tables)
        if site is None:
            return _not_a_tap(path, form.entry)
        if not tables.means(site, form.whole):
            return Unlowered("form", f"it reads `model.{path}.output` other than as the tap's value")
        sites.append(site)
    if sites != sorted(set(sites)):
        return Unlowered("form", "its layers are not taps in the order the model runs them")
    return {**scope, name: numbers[0]}, tuple(sites[1:])


def _not_a_tap(path: str, entry: bool = False) -> Unlowered:
    if entry:
        return Unlowered(
            "not_a_tap", f"it edits `model.{path}.input`, which is no tapped operation's value on this engine"
        )
    return Unlowered("not_a_tap", f"it reads `model.{path}`, which is not a tap on this engine")


def _tap_site(form: Form, path: str, tables: Any) -> int | None:
    """The tap a block works on: the module's output, or for ``.input`` the
    operation of its parent's forward whose value the module is handed."""
    return tables.handed.get(path) if form.entry else tables.site_of.get(path)


def _not_a_form(source: str | None, scope: dict[str, Any], model: Any, tables: Any) -> Unlowered:
    """The first reason a block that is none of the forms runs as Python."""
    seen = outline(source) if source else None
    if seen is None:
        return Unlowered("form", "its source could not be read")
    for module, _ in seen.locations:
        path = _site(module, scope, model)
        if path is not None and path not in tables.site_of:
            return _not_a_tap(path)
    if seen.branches:
        return Unlowered("branch", "a Python `if` or `while` decides what it does")
    if seen.sampler and not seen.locations:
        return Unlowered(
            "sampler", "it works on `model.logits` or `model.samples`, which run as Python at the sampler"
        )
    if len(seen.locations) > 1:
        return Unlowered("form", "it works on more than one location in a step")
    return Unlowered("form", "its statements are not one of the forms the taps run (see the taps page)")


def _written(path: tuple) -> str:
    """A module path as the block wrote it."""
    text = str(path[0])
    for part in path[1:]:
        if isinstance(part, Index):
            text += f"[{'.'.join((part.name, *part.attrs))}]"
        elif isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}"
    return text


def fits(block: LoweredBlock, prompt_len: int) -> bool:
    """Whether a request whose prompt has ``prompt_len`` rows can run ``block``
    lowered: a read on the first step must index a row of that prompt (out of
    range, Python raises on that step, and so it must run as Python)."""
    select = block.lowered.select
    first_step = block.lowered.single or block.how[0] in (PATCH, PATCH_COLUMNS)
    return not (first_step and type(select) is int and not -prompt_len <= select < prompt_len)


def for_request(block: LoweredBlock) -> LoweredBlock:
    """A fresh copy of ``block`` for one more request (its entry, region and row
    counts are the request's own; the vector, never written, is shared).

    ``dataclasses.replace`` with the fields as they are, done as a copy of the two
    instances' fields (neither class computes anything at construction), which
    costs an admission a fifth as much."""
    lowered = object.__new__(Lowered)
    lowered.__dict__.update(block.lowered.__dict__)
    lowered.irregular = {}
    copy = object.__new__(LoweredBlock)
    copy.__dict__.update(block.__dict__)
    copy.__dict__["lowered"] = lowered  # (frozen: set as its constructor would)
    return copy


def _vector(form: Form, scope: dict[str, Any], width: int, dtype: torch.dtype, device: Any) -> Any:
    values: dict[str, Any] = {}
    for name in form.names:
        value = scope.get(name)
        if not (type(value) is torch.Tensor or type(value) in (int, float, torch.dtype, torch.device)):
            return None  # an unbound name, or anything whose arithmetic could be more than arithmetic
        values[name] = value
    if not any(isinstance(v, torch.Tensor) for v in values.values()):
        return _number_added(form, values, width, dtype, device)
    if form.alias is not None:  # what ``.to(hidden)`` reads of the tap's value: its dtype and device
        values[form.alias] = torch.empty(0, dtype=dtype, device=device)
    try:
        with torch.no_grad():
            vector = eval(compile(form.vector, "<steer>", "eval"), {"__builtins__": {}}, values)
    except Exception:
        return None  # the Python path raises the same error, on the request
    if not (
        type(vector) is torch.Tensor
        # ``[1, width]`` added in place to one row does not broadcast: Python raises
        and tuple(vector.shape) in (((width,),) if type(form.select) is int else ((width,), (1, width)))
        and vector.device == device
        and vector.dtype in (dtype, torch.float32)
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
    ):
        return None
    return vector


def _number_added(
    form: Form, values: dict[str, Any], width: int, dtype: torch.dtype, device: Any
) -> torch.Tensor | None:
    """A number added (``hidden[:] += 4.0``), as the vector that adds the same (the
    bank's float32 row of it, the sum rounded once). A float32 value plus a Python
    number adds the number rounded to float32, on any device. A bfloat16 or
    float16 value does not say the same everywhere: a CPU rounds the number to
    the value's dtype first, a GPU to float32 (a product is float32 on both:
    ``_change``); so there only a number the dtype holds exactly, which every
    rounding leaves as it is. Arithmetic on captured numbers only."""
    if form.project is not None:  # a direction is a tensor
        return None
    number = _captured_number(form, values, dtype)
    if number is None:
        return None
    try:
        value = float(number)
    except OverflowError:  # an int past any float: Python raises on the request
        return None
    if dtype != torch.float32 and float(torch.tensor(value, dtype=torch.float64).to(dtype)) != number:
        return None
    return torch.full((width,), value, dtype=torch.float32, device=device)


def _number(value: Any, scope: dict[str, Any]) -> int | None:
    if isinstance(value, Index):
        value = _read(value, scope)
    return value if type(value) is int and value >= 0 else None


_MISSING = object()


def _read(index: Index, scope: dict[str, Any]) -> Any:
    """What ``cfg.steps`` holds, found without running code of ``cfg``'s own."""
    value = scope.get(index.name, _MISSING)
    for name in index.attrs:
        value = _plain_attribute(value, name)
    return None if value is _MISSING else value


def _plain_attribute(obj: Any, name: str) -> Any:
    """``obj.name`` as Python finds it, where that is an attribute the object holds
    or a plain value of its class; :data:`_MISSING` where finding it could run the
    object's code (a property or other descriptor, ``__getattr__``, an overridden
    ``__getattribute__``) or it is not there."""
    if obj is _MISSING or name.startswith("__"):
        return _MISSING
    cls = type(obj)
    lookup = inspect.getattr_static(cls, "__getattribute__", None)
    if lookup is not object.__getattribute__ and cls is not types.SimpleNamespace:
        return _MISSING  # (a namespace's own lookup is the generic one)
    held = inspect.getattr_static(cls, name, _MISSING)
    kind = type(held)
    if held is not _MISSING and kind not in (int, float, bool, str, type(None)):
        return _MISSING  # a descriptor, a method, or anything else the class defines
    try:
        own = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        own = None
    if type(own) is dict and name in own:
        return own[name]
    return held


def _site(path: tuple, scope: dict[str, Any], model: Any) -> str | None:
    """The module path, relative to the model, that an expression names."""
    head = scope.get(path[0])
    if head is model:
        prefix: list[str] = []
    else:
        envoy_path = getattr(head, "path", None)
        if not isinstance(envoy_path, str) or not envoy_path.startswith("model.") or not _is_envoy(head):
            return None
        prefix = envoy_path.split(".")[1:]
    parts = []
    for part in path[1:]:
        if isinstance(part, Index):
            part = _read(part, scope)
            if type(part) is not int or part < 0:
                return None
        parts.append(str(part))
    return ".".join([*prefix, *parts])


def _is_envoy(value: Any) -> bool:
    from nnsight.intervention.envoy import Envoy

    return isinstance(value, Envoy)
