"""Which blocks run on the tap tables instead of as Python, and what they become.

A block is lowered only when its whole source is one of these forms, and its
values pass the checks below; anything else, down to a second statement, runs
as Python:

    for _ in tracer.iter[a:b]:          # or tracer.all(); a, b whole numbers or absent
        <tap>.output[0][:] += <vector>
    out = tracer.result.save()          # optional

``<tap>`` is the model's own path to a tapped module (``model.model.layers[10]``,
or ``[layer]`` with ``layer`` a captured whole number) or a captured node of the
tree at one. ``<vector>`` is built only from numbers
and captured tensors with ``+ - * /``, so it has the same value at every step:
it is evaluated once, here. It must be a tensor of the tap's width (``[width]``
or ``[1, width]``) on the model's device, in the model's dtype or float32 (where
adding it in float32 and rounding once is exactly what ``+=`` does), and the loop
variable must go unused. Then the block's whole effect is: on steps ``a`` to
``b - 1`` of its request, every row of that request at that tap gets the vector
added, and the finished output is saved under ``out`` if the request lived
through step ``b - 1`` (as Python, the line after the loop runs only then; after
``tracer.all()``, never).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from typing import Any

import torch

_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div)


@dataclass(frozen=True)
class _Index:
    """A whole number written as a name (``layers[layer]``, ``iter[:steps]``), read at admission."""

    name: str


@dataclass(frozen=True)
class SteerForm:
    """A steering block's shape, read from its source alone (cached per source)."""

    tracer: str
    start: Any  # a whole number, or an _Index naming one
    stop: Any  # the same, or None: every step
    tap: tuple  # the module path as written: a root name, then attributes and indices
    vector: ast.Expression
    names: frozenset[str]  # names the vector reads
    result: str | None


@dataclass(frozen=True)
class Steer:
    """A lowered block: what the tap tables need."""

    site: str  # module path relative to the model, as in the taps
    vector: torch.Tensor
    start: int
    stop: int | None
    result: str | None


@functools.lru_cache(maxsize=1024)
def steer_form(source: str) -> SteerForm | None:
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return None
    if not body or len(body) > 2:
        return None
    loop, rest = body[0], body[1:]
    result = _result_save(rest[0]) if rest else None
    if rest and result is None:
        return None
    if (
        not isinstance(loop, ast.For)
        or loop.orelse
        or len(loop.body) != 1
        or not isinstance(loop.target, ast.Name)
    ):
        return None
    steps = _steps(loop.iter)
    if steps is None:
        return None
    tracer, start, stop = steps
    if result is not None and result[0] != tracer:
        return None
    edit = loop.body[0]
    if not (
        isinstance(edit, ast.AugAssign)
        and isinstance(edit.op, ast.Add)
        and _is_full_slice(edit.target)
        and _is_first_output(edit.target.value)
    ):
        return None
    tap = _module_path(edit.target.value.value.value)
    names = _vector_names(edit.value)
    if tap is None or names is None:
        return None
    read = names | {part.name for part in (*tap, start, stop) if isinstance(part, _Index)}
    if loop.target.id in read or tracer in read:
        return None
    vector = ast.Expression(body=edit.value)
    ast.fix_missing_locations(vector)
    return SteerForm(tracer, start, stop, tap, vector, frozenset(names), result[1] if result else None)


def _result_save(node: ast.stmt) -> tuple[str, str] | None:
    """``out = tracer.result.save()`` -> (tracer, out)."""
    if not (
        isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    ):
        return None
    call = node.value
    if not (isinstance(call, ast.Call) and not call.args and not call.keywords):
        return None
    func = call.func
    if not (
        isinstance(func, ast.Attribute) and func.attr == "save" and isinstance(func.value, ast.Attribute)
    ):
        return None
    if func.value.attr != "result" or not isinstance(func.value.value, ast.Name):
        return None
    return func.value.value.id, node.targets[0].id


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
    if isinstance(node, ast.Name):
        return _Index(node.id)
    return None


def _is_full_slice(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Slice)
        and node.slice.lower is None
        and node.slice.upper is None
        and node.slice.step is None
    )


def _is_first_output(node: ast.expr) -> bool:
    """``<module>.output[0]``."""
    return (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and type(node.slice.value) is int
        and node.slice.value == 0
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "output"
    )


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
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Name):
            parts.append(_Index(node.slice.id))  # a captured whole number, read at admission
            node = node.value
        else:
            return None


def _vector_names(node: ast.expr) -> set[str] | None:
    """The names an arithmetic expression of names and numbers reads; None otherwise."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Constant):
        return set() if type(node.value) in (int, float) else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return _vector_names(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, _ARITHMETIC):
        left, right = _vector_names(node.left), _vector_names(node.right)
        return None if left is None or right is None else left | right
    return None


def lower(
    source: str | None,
    scope: dict[str, Any],
    model: Any,
    tracer_type: type,
    sites: dict[str, int],
    width: int,
    dtype: torch.dtype,
    device: torch.device,
) -> Steer | None:
    """The lowered form of a block, or None when it must run as Python."""
    form = steer_form(source) if source else None
    if form is None or not isinstance(scope.get(form.tracer), tracer_type):
        return None
    site = _site(form.tap, scope, model)
    start, stop = _number(form.start, scope), _number(form.stop, scope)
    if site is None or site not in sites or start is None or (form.stop is not None and stop is None):
        return None
    values = {}
    for name in form.names:
        value = scope.get(name)
        if not (type(value) is torch.Tensor or type(value) in (int, float)):
            return None  # an unbound name, or anything whose arithmetic could be more than arithmetic
        values[name] = value
    if not any(isinstance(v, torch.Tensor) for v in values.values()):
        return None
    try:
        with torch.no_grad():
            vector = eval(compile(form.vector, "<steer>", "eval"), {"__builtins__": {}}, values)
    except Exception:
        return None  # the Python path raises the same error, on the request
    if not (
        type(vector) is torch.Tensor
        and tuple(vector.shape) in ((width,), (1, width))
        and vector.device == device
        and vector.dtype in (dtype, torch.float32)
        and dtype in (torch.float32, torch.bfloat16, torch.float16)
    ):
        return None
    return Steer(site, vector, start, stop, form.result)


def _number(value: Any, scope: dict[str, Any]) -> int | None:
    if isinstance(value, _Index):
        value = scope.get(value.name)
    return value if type(value) is int and value >= 0 else None


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
        if isinstance(part, _Index):
            part = scope.get(part.name)
            if type(part) is not int or part < 0:
                return None
        parts.append(str(part))
    return ".".join([*prefix, *parts])


def _is_envoy(value: Any) -> bool:
    from nnsight.intervention.envoy import Envoy

    return isinstance(value, Envoy)
