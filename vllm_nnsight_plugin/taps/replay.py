"""Blocks that only read taps, whatever they compute from them: served at the sampler.

Such a block need not run inside the forward. The tables keep its request's rows
of each tap it reads (both outputs, every step, into a region of the store per
tap that each step reuses), the forward stays compiled and graphed, and at the
sampler the worker hands the block each tap's value for that step, rebuilt from
the kept rows, in model order, before the logits (``worker/runtime.py``). The
block then runs as Python there, as a block on ``model.logits`` does, and
computes exactly what it computes on the Python path: the kept rows are the
taps' values, bit for bit.

A block is served so only where that is certain:

- it writes nothing into the forward (``worker/writes.py``: its edits would
  come too late);
- every use of the model in it is ``<tap>.output`` of a tap whose value is a
  tuple (a decoder layer's hidden state and residual) or one tensor (the worker
  checks it is as wide as the hidden state), ``<child>.input`` where the
  child's parent hands it a tapped operation's value (``TapTables.handed``:
  ``self_attn.o_proj.input``), ``<module>.inputs`` (or ``.input``) where each
  value its parent hands it is a tap (``TapTables.inputs``), ``model.logits``,
  ``model.samples``, ``model.tokenizer``, or a call of one of its modules (or a
  module handed to such a call: ``model.lm_head`` to ``model.logits_processor``)
  that holds no attention layer and no experts, which need the step's forward
  (the worker runs the call with the kernels of a Python step); a loop over a
  list of the model's modules (``for layer in model.model.layers``) names each,
  every one a tap (or the module below each that the block reads); a parameter, buffer or number a module holds
  (``model.lm_head.weight``, ``norm.variance_epsilon``), read as it is on the
  Python path; a module named once by a name of the block's own
  (``norm = model.model.norm``) stands for that module; no other ``.input``,
  no other ``.inputs``, no ``.source``, and no location of a module reached other than
  by its name on the model;
- no view of a tap's value (``h = layer.output[0]``, ``h[-1]``) is saved,
  kept in a container, handed to a call that may keep or write it, or used after
  a later location is read: on the Python path it is the step's own buffer, which
  the next layer of a Python step may overwrite in place (vLLM's fused residual
  add and norm), where served here it is a copy (``_aliasing``); a view
  assigned into a tensor the block made itself (``alone[:, :64] = h[:, :64]``
  after ``alone = torch.zeros_like(h)``: ``fresh.py``) is copied there, not kept;
- no layer is named by a name the block binds itself, and it keeps no
  ``tracer.cache`` (a cache observes every location of the forward); the worker
  also checks that each tap returns exactly the two values it keeps.
"""

from __future__ import annotations

import ast
import functools
import types
from typing import Any

from .forms import Index, _module_path
from .fresh import fresh_tensors, indexed_name
from .lower import Unlowered, _is_envoy, _site
from .meaning import does_nothing
from .spec import input_site, split_site

#: Stands for the root of a location read on something that is not a name.
_STRAY = "\x00"

#: The kind of reason of a block that reads only what could be served, and runs as
#: Python for how it keeps or uses a tap's value (``_aliasing``).
VIEW = "view"

#: What a block may name on the model besides the tap's output.
_AT_THE_SAMPLER = frozenset({"logits", "samples", "tokenizer"})


@functools.lru_cache(maxsize=1024)
def _stores(source: str) -> dict[str, int]:
    """How often the block binds each name (a function's argument counts twice:
    it is never one assignment's alone)."""
    stores: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            stores[node.id] = stores.get(node.id, 0) + 1
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for arg in node.args.args + node.args.kwonlyargs:
                stores[arg.arg] = stores.get(arg.arg, 0) + 2
    return stores


@functools.lru_cache(maxsize=1024)
def _loops(source: str) -> dict[str, tuple] | None:
    """The names a ``for`` loop or comprehension binds to each item of a chain
    (``for layer in model.model.layers``), where the block binds that name
    nowhere else: name -> the chain. None where the source does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    stores = _stores(source)
    found: dict[str, tuple] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name):
            chain = _chain(node.iter)
            if chain is not None and stores.get(node.target.id) == 1:
                found[node.target.id] = chain
    return found


@functools.lru_cache(maxsize=1024)
def _uses(source: str) -> tuple[tuple[tuple, bool, tuple | None, str | None], ...] | None:
    """Each maximal chain of attributes and indices in the block that starts at a
    name, as (the chain, whether it is called, the chain of the call it is a
    positional argument of, the name it is assigned to where it is the whole value
    of ``name = <chain>``); None where the source does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    uses = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Name) or not isinstance(node.ctx, ast.Load):
            continue  # a name bound here (an assignment's, a loop's) is not a use
        top: ast.AST = node
        while True:
            parent = parents.get(id(top))
            if isinstance(parent, ast.Attribute) or (
                isinstance(parent, ast.Subscript) and parent.value is top
            ):
                top = parent
            else:
                break
        path = _chain(top)
        if path is None:
            continue
        parent = parents.get(id(top))
        called = isinstance(parent, ast.Call) and parent.func is top
        argument_of = None
        if isinstance(parent, ast.Call) and any(arg is top for arg in parent.args):
            argument_of = _chain(parent.func)
        assigned = None
        if isinstance(parent, ast.Assign) and parent.value is top and len(parent.targets) == 1:
            target = parent.targets[0]
            assigned = target.id if isinstance(target, ast.Name) else None
        uses.append((path, called, argument_of, assigned))
    for node in ast.walk(tree):  # a location on something that is not a chain from a name
        if isinstance(node, ast.Attribute) and node.attr in _READS:
            if _chain(node) is None:
                uses.append(((_STRAY, node.attr), False, None, None))
    return tuple(uses)


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


@functools.lru_cache(maxsize=1024)
def _bound(source: str) -> frozenset[str]:
    """Every name the block binds itself (assigned, looped over, an argument)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            names.update(a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs])
            names.update(a.arg for a in (args.vararg, args.kwarg) if a is not None)
    return frozenset(names)


def modules_of(root: Any) -> Any:
    """A ``module_at`` for a model's root module: its module at a path relative
    to it, or None where it has none."""

    def module_at(path: str) -> Any:
        try:
            return root.get_submodule(path) if path else root
        except AttributeError:
            return None

    return module_at


def replayable(
    source: str | None, scope: dict[str, Any], model: Any, tables: Any, module_at: Any = None
) -> tuple[int, ...] | Unlowered:
    """The tap sites a read-only block reads, in model order, if it can be served
    at the sampler; otherwise why not. ``module_at(path)``: the model's module at
    that path, or None (without it, no module call is served)."""
    if not source:
        return Unlowered("form", "its source could not be read")
    uses, loops = _uses(source), _loops(source)
    if uses is None or loops is None:
        return Unlowered("form", "its source could not be read")
    bound = _bound(source)
    if "cache" in _attributes(source):
        return Unlowered("form", "it keeps a cache, which records the whole forward")
    layers: dict[str, tuple[str, int]] = {}  # a loop's name -> the list it takes the modules of
    for name, chain in loops.items():
        head = None if chain[0] in bound else scope.get(chain[0])
        if head is model or _is_envoy(head):
            taken = _children(chain, scope, model, tables, module_at)
            if isinstance(taken, Unlowered):
                return taken
            layers[name] = taken
    iterated = {loops[name] for name in layers}
    # names the block gives a module of the model once (``norm = model.model.norm``)
    stores = _stores(source)
    named = {
        assigned: path
        for path, called, _, assigned in uses
        if assigned is not None
        and stores.get(assigned) == 1
        and not called
        and path[0] not in bound
        and (scope.get(path[0]) is model or _is_envoy(scope.get(path[0])))
        and not _LOCATIONS.union(_READS).intersection(p for p in path if isinstance(p, str))
        and _module_at(path, scope, model, module_at) is not None
    }
    sites: set[int] = set()
    for path, called, argument_of, assigned in uses:
        if assigned is not None and named.get(assigned) == path:
            continue  # the naming itself: its uses are followed as the module's
        if path[0] in named:
            path = named[path[0]] + path[1:]
        if path[0] in layers:  # a layer of a loop over the model's layers (or one of its modules)
            taken = _each(layers[path[0]], path[1:], tables)
            if isinstance(taken, Unlowered):
                return taken
            sites.update(taken)
            continue
        if path in iterated:
            continue  # the loop's own iteration over the layers
        head = None if path[0] in bound else scope.get(path[0])  # a name it binds is its own
        if head is not model and not _is_envoy(head):
            if _READS.intersection(p for p in path[1:] if isinstance(p, str)):
                # a module reached some other way (a captured list of them, a function's result)
                return Unlowered("form", "it reads a location of a module it does not name from the model")
            continue  # not the model: a plain value
        if head is model and len(path) >= 2 and path[1] in _AT_THE_SAMPLER:
            continue
        parts = [part for part in path[1:] if isinstance(part, str)]
        entry = "output" not in parts and bool({"input", "inputs"} & set(parts)) and "source" not in parts
        if "output" not in parts and not entry:
            if _LOCATIONS.intersection(parts):
                return Unlowered("form", "it reads a location other than a tap's output")
            module = _module_at(path, scope, model, module_at)
            if module is None and _held(path, scope, model, module_at):
                continue  # a parameter, buffer or number of a module: read as Python reads it
            if module is None:
                return Unlowered("form", "it uses the model other than through a tap's output")
            if not (called or _is_model_call(argument_of, scope, model, module_at)):
                return Unlowered("form", "it uses a module of the model other than by calling it")
            if not _self_contained(module):
                return Unlowered("form", "it calls a module that needs the forward (attention or experts)")
            continue
        # ``.input``/``.inputs``: what a module is handed, where that is a tap's value
        end = ("inputs" if "inputs" in parts else "input") if entry else "output"
        at = path.index(end, 1)
        module_path, where = _where(path[:at], scope, model)
        if module_path is not None and any(isinstance(p, Index) and p.name in bound for p in module_path):
            return Unlowered("form", "it names a layer by a name it binds itself")
        found = () if where is None else _taps_of(tables, where, end)
        if not found:
            shown = where if where is not None else ".".join(str(p) for p in path[:at])
            if entry:
                return Unlowered(
                    "not_a_tap", f"it reads `model.{shown}.{end}`, which is no tap's value on this engine"
                )
            return Unlowered("not_a_tap", f"it reads `model.{shown}`, which is not a tap on this engine")
        if not entry and split_site(where)[1] is not None:
            return Unlowered("form", "it reads an operation's value other than as what a module is handed")
        sites.update(found)
    if not sites:
        return Unlowered("form", "it reads no tap")
    hazard = _aliasing(source, scope, model)
    if hazard is not None:  # every location it reads is served: this is the reason
        return Unlowered(VIEW, hazard)
    return tuple(sorted(sites))


def untapped(source: str | None, scope: dict[str, Any], model: Any, tables: Any) -> tuple[str, ...]:
    """The module locations a block names on the model that no tap of this engine
    serves (``model.<path>.output``, ``.input``, ``.inputs``), each once.
    Locations reached through a loop's variable or a value it did not capture from
    the model are not followed (the worker decides those)."""
    uses = _uses(source) if source else None
    if uses is None:
        return ()
    bound = _bound(source)
    found: list[str] = []
    for path, _, _, _ in uses:
        head = None if path[0] in bound else scope.get(path[0])
        if head is not model and not _is_envoy(head):
            continue
        ends = [i for i, part in enumerate(path) if i and part in ("output", "input", "inputs")]
        if not ends or "source" in path[: ends[0]]:
            continue
        end = path[ends[0]]
        _, where = _where(path[: ends[0]], scope, model)
        if where is not None and not _taps_of(tables, where, end):
            shown = f"model.{where}.{end}" if where else f"model.{end}"
            if shown not in found:
                found.append(shown)
    return tuple(found)


#: Attributes of a module that are locations, or steer the run, besides ``output``.
_LOCATIONS = frozenset({"input", "inputs", "source", "skip", "next", "all", "iter"})
#: A module's locations: on anything but the model's own names, a module reached
#: some other way (a captured list of them, a function's result).
_READS = frozenset({"output", "input", "inputs", "source"})


#: What a served value is: a (hidden, residual) pair, (value, None), one tensor,
#: or the values a module is handed (``<module>.inputs`` taps, served together).
PAIR, FIRST, ONE, HANDED = "pair", "first", "one", "handed"


def served(sites: Any, tables: Any) -> list[tuple[int, str, str]]:
    """How the sampler hands a replayed block the taps it reads, in the order the
    forward reaches them: (site, the location's path relative to the model and its
    end, what the value is: ``PAIR``, ``FIRST``, ``ONE`` or ``HANDED``). An
    operation's site is served as what its parent's forward hands a child
    (``<child>.input``, where ``replayable`` found it read); a module's input
    taps, once, as its ``.input``, under the first of them; a module's output, as
    its output."""
    children = {site: child for child, site in tables.handed.items()}
    pairs, firsts = tables.pair_sites, tables.first_sites
    found = []
    for site in sites:
        handed = input_site(tables.sites[site])
        if handed is not None:
            if handed[1] == 0:
                found.append((site, f"{handed[0]}.input", HANDED))
            continue
        path, operation = split_site(tables.sites[site])
        if operation is not None:
            found.append((site, f"{children[site]}.input", ONE))
        else:
            kind = PAIR if site in pairs else FIRST if site in firsts else ONE
            found.append((site, f"{path}.output", kind))
    reached = getattr(tables, "reached", {})
    return sorted(found, key=functools.cmp_to_key(lambda a, b: _reached(a, b, reached)))


def _reached(a: tuple[int, str, str], b: tuple[int, str, str], calls: dict | None = None) -> int:
    """The forward's order of two locations: a module's input comes before anything
    of its children, its output after; two modules' inputs that one parent's
    forward hands them, the order of its calls (``calls``: where it first calls
    each, ``TapTables.reached``); otherwise the order of the modules (the tree's
    order, in which a forward calls them: ``spec.resolve``)."""
    (site_a, where_a, _), (site_b, where_b, _) = a, b
    path_a, _, end_a = where_a.rpartition(".")
    path_b, _, end_b = where_b.rpartition(".")
    if path_a == path_b:
        return (end_a == "output") - (end_b == "output")
    if path_b.startswith(path_a + "."):  # a is b's ancestor
        return -1 if end_a == "input" else 1
    if path_a.startswith(path_b + "."):
        return 1 if end_b == "input" else -1
    calls = calls or {}
    if path_a.rpartition(".")[0] == path_b.rpartition(".")[0] and path_a in calls and path_b in calls:
        return -1 if calls[path_a] < calls[path_b] else 1
    return -1 if site_a < site_b else 1 if site_a > site_b else 0


def _children(
    chain: tuple, scope: dict[str, Any], model: Any, tables: Any, module_at: Any
) -> tuple[str, int] | Unlowered:
    """A loop over ``chain`` (a list of the model's modules): the list's path
    relative to the model, and how many modules it takes."""
    module = _module_at(chain, scope, model, module_at)
    _, where = _where(chain, scope, model)
    if module is None or where is None or not hasattr(module, "__len__"):
        return Unlowered("form", "it loops over something of the model other than a list of its modules")
    return where, len(module)


def _tap_of(tables: Any, path: str, end: str) -> int | None:
    """The tap site serving ``<path>.output``, or ``<path>.input`` where the module's
    parent hands it a tapped operation's value (``TapTables.handed``)."""
    return tables.handed.get(path) if end == "input" else tables.site_of.get(path)


def _taps_of(tables: Any, path: str, end: str) -> tuple[int, ...]:
    """The tap sites serving a location: :func:`_tap_of`'s, or for what a module is
    handed (``.input``, ``.inputs``) by a parent whose values are each a tap
    (``TapTables.inputs``), all of them: the location is all of them together."""
    if end == "inputs" or (end == "input" and path not in tables.handed):
        return tuple(getattr(tables, "inputs", {}).get(path, ()))
    site = _tap_of(tables, path, end)
    return () if site is None else (site,)


def _each(taken: tuple[str, int], rest: tuple, tables: Any) -> tuple[int, ...] | Unlowered:
    """The tap sites a use of a loop's module reads at each module it takes:
    ``layer.output``, ``layer.mlp.output`` (its module's output) or
    ``layer.self_attn.o_proj.input`` (what a child is handed, where that is a
    tap's value)."""
    where, count = taken
    ends = [i for i, part in enumerate(rest) if part in ("output", "input")]
    if not ends or not all(isinstance(part, str) for part in rest[: ends[0]]):
        return Unlowered("form", "it uses a module of its loop other than through an output or an input")
    end = ends[0]
    below = "".join(f".{part}" for part in rest[:end])
    if _LOCATIONS.intersection(rest[:end]):
        return Unlowered("form", "it uses a module of its loop other than through an output or an input")
    sites = []
    for i in range(count):
        path = f"{where}.{i}{below}" if where else f"{i}{below}"
        site = _tap_of(tables, path, rest[end])
        if site is None:
            return Unlowered(
                "not_a_tap", f"it reads `model.{path}.{rest[end]}`, which is no tap on this engine"
            )
        sites.append(site)
    return tuple(sites)


def _held(path: tuple, scope: dict[str, Any], model: Any, module_at: Any) -> bool:
    """Whether a chain reads a parameter, buffer or number a module of the model
    holds (``model.lm_head.weight.T``, ``model.model.norm.variance_epsilon``):
    the same object on the Python path, and nothing the forward computes."""
    for end in range(len(path) - 1, 1, -1):
        name = path[end]
        if not isinstance(name, str):
            continue
        module = _module_at(path[:end], scope, model, module_at)
        if module is None:
            continue
        if name in getattr(module, "_parameters", {}) or name in getattr(module, "_buffers", {}):
            return True
        held = vars(module).get(name)
        return type(held) in (int, float, bool)
    return False


def _module_at(path: tuple, scope: dict[str, Any], model: Any, module_at: Any) -> Any:
    """The model's module a chain names (constant or captured indices only), or None."""
    if module_at is None:
        return None
    module_path, where = _where(path, scope, model)
    if module_path is not None and any(isinstance(p, Index) for p in module_path):
        return None  # a module named by an index: only taps are named so
    return None if where is None else module_at(where)


def _where(path: tuple, scope: dict[str, Any], model: Any) -> tuple[tuple | None, str | None]:
    """A chain as a module path (``forms._module_path``), and the module's path
    relative to the model that it names (``lower._site``), each None where none."""
    module_path = _module_path(_rebuilt(path))
    return module_path, None if module_path is None else _site(module_path, scope, model)


def _is_model_call(chain: tuple | None, scope: dict[str, Any], model: Any, module_at: Any) -> bool:
    """Whether a chain names a module of the model (a module passed to it is then
    its argument: ``model.lm_head`` handed to ``model.logits_processor``)."""
    if chain is None or (scope.get(chain[0]) is not model and not _is_envoy(scope.get(chain[0]))):
        return False
    return _module_at(chain, scope, model, module_at) is not None


#: Parts of the class names of modules whose call needs the step's forward.
_NEEDS_THE_STEP = ("Attention", "MoE", "Expert", "Mamba")


def _self_contained(module: Any) -> bool:
    """A module whose call needs nothing of the forward: no attention layer (it
    reads and writes the step's KV cache), no mixture of experts (its routing
    reads the step's context), no state-space layer (its state is the step's)."""
    return all(
        "kv_cache" not in vars(m) and not any(part in type(m).__name__ for part in _NEEDS_THE_STEP)
        for m in module.modules()
    )


def _rebuilt(path: tuple) -> ast.expr:
    """The expression a chain came from, for :func:`forms._module_path`."""
    node: ast.expr = ast.Name(path[0])
    for part in path[1:]:
        if isinstance(part, str):
            node = ast.Attribute(node, part)
        else:
            node = ast.Subscript(node, part)
    return node


@functools.lru_cache(maxsize=1024)
def _attributes(source: str) -> frozenset[str]:
    return frozenset(node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute))


#: What may return a tensor sharing memory with the one it is called on.
_ALIASING = frozenset(
    {"view", "view_as", "reshape", "reshape_as", "squeeze", "unsqueeze", "t", "T", "mT", "H", "mH",
     "transpose", "permute", "narrow", "select", "expand", "expand_as", "detach", "flatten",
     "unflatten", "contiguous", "to", "float", "half", "bfloat16", "double", "type", "type_as",
     "split", "chunk", "unbind", "tensor_split", "as_strided", "movedim", "moveaxis", "swapaxes",
     "swapdims", "real", "imag", "data", "diagonal", "unfold", "cpu", "cuda", "view_as_real"}
)  # fmt: skip
#: What keeps a value past the statement that made it.
_KEEPING = frozenset({"save", "append", "extend", "insert", "add", "update", "setdefault"})


def _aliasing(source: str, scope: Any = None, model: Any = None) -> str | None:
    """Why serving the block at the sampler could differ from the Python path, where
    a tap's value is the step's own buffer, which the next layer of a Python step
    may overwrite in place (vLLM's fused residual add and norm): a view of a tap's
    value used after a later location is read, or kept past its statement; a call
    that writes in place. None where neither can happen."""
    tree = ast.parse(source)
    state = _Views(scope or {}, model, fresh_tensors(source, scope or {}))
    try:
        state.statements(tree.body)
    except _Hazard as hazard:
        return str(hazard)
    return None


#: Locations a block may assign a new value to.
_SWAPPED = frozenset({"output", "input", "inputs"})


def _swaps(node: ast.stmt) -> bool:
    """An assignment of a location's new value (``layer.output = (h * 0.5, layer.output[1])``)."""
    return isinstance(node, ast.Assign) and all(
        isinstance(target, ast.Attribute) and target.attr in _SWAPPED for target in node.targets
    )


class _Hazard(Exception):
    pass


class _Views:
    """Which names hold views of a tap's value, and when they were read, walking a
    block in the order Python runs it (a loop's body twice: a name read on one
    iteration may be used on the next)."""

    def __init__(self, scope: dict[str, Any], model: Any, fresh: frozenset[str] = frozenset()) -> None:
        self.scope, self.model = scope, model
        self.fresh = fresh  # names of tensors the block made (``fresh.py``)
        self.views: dict[str, int] = {}
        self.epoch = 0  # how many statements reading a location have run

    def statements(self, body: list[ast.stmt]) -> None:
        for statement in body:
            self.statement(statement)

    def statement(self, node: ast.stmt) -> None:
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            self.expression(node.iter if isinstance(node, (ast.For, ast.AsyncFor)) else node.test)
            if isinstance(node, (ast.For, ast.AsyncFor)):
                self.bind(node.target, self.is_view(node.iter))
            for _ in range(2):
                self.statements(node.body)
            self.statements(node.orelse)
            return
        if isinstance(node, (ast.If, ast.With, ast.AsyncWith, ast.Try)):
            for field in ("test",):
                if hasattr(node, field):
                    self.expression(getattr(node, field))
            for field in ("body", "orelse", "finalbody"):
                self.statements(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                self.statements(handler.body)
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            raise _Hazard("it defines a function, whose reads cannot be followed")
        if _swaps(node) and isinstance(node.value, (ast.Tuple, ast.List)):
            # a location's new value, built of its parts: the tuple is the forward's, not
            # kept; the location is reached first (a view of an earlier one is stale there)
            for part in [*node.targets, *node.value.elts]:
                self.expression(part)
            return
        self.expression(node)
        if isinstance(node, ast.Assign):
            view = self.is_view(node.value)
            for target in node.targets:
                if indexed_name(target) in self.fresh:
                    continue  # copied into a tensor the block made: nothing is kept
                # a location's new value is what the forward goes on with, on either path
                swap = isinstance(target, ast.Attribute) and target.attr in _SWAPPED
                if not isinstance(target, (ast.Name, ast.Tuple, ast.List, ast.Starred)) and view and not swap:
                    raise _Hazard("it keeps a view of a tap's value past its statement")
                self.bind(target, view)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            if indexed_name(node.target) not in self.fresh:
                self.bind(node.target, self.is_view(node.value))
        elif isinstance(node, ast.Return) and node.value is not None:
            if self.is_view(node.value):
                raise _Hazard("it keeps a view of a tap's value past its statement")

    def expression(self, node: ast.AST) -> None:
        if self.reads_a_location(node):
            self.epoch += 1
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                read_at = self.views.get(sub.id)
                if read_at is not None and read_at < self.epoch:  # a location was read since
                    raise _Hazard("it uses a view of a tap's value after a later location is read")
            if isinstance(sub, ast.Call):
                if any(k.arg in ("inplace", "out") for k in sub.keywords):
                    raise _Hazard("it calls a function that writes in place")
                func = sub.func
                keeps = isinstance(func, ast.Attribute) and func.attr in _KEEPING
                if keeps and func.attr == "save" and self.is_view(func.value):
                    raise _Hazard("it saves a view of a tap's value, not a copy")
                if keeps and any(self.is_view(arg) for arg in sub.args):
                    raise _Hazard("it keeps a view of a tap's value past its statement")
                handed = any(self.is_view(a) for a in [*sub.args, *(k.value for k in sub.keywords)])
                if handed and not keeps and not self.follows(func, len(sub.args)):
                    raise _Hazard("it hands a tap's value to a call that may keep or write into it")
            if isinstance(sub, (ast.List, ast.Tuple, ast.Set, ast.Dict)) and not isinstance(
                getattr(sub, "ctx", ast.Load()), ast.Store
            ):
                elements = sub.values if isinstance(sub, ast.Dict) else sub.elts
                if any(self.is_view(e) for e in elements):
                    raise _Hazard("it keeps a view of a tap's value past its statement")
            if isinstance(sub, (ast.ListComp, ast.SetComp, ast.GeneratorExp)) and self.is_view(sub.elt):
                raise _Hazard("it keeps a view of a tap's value past its statement")
            if isinstance(sub, ast.DictComp) and self.is_view(sub.value):
                raise _Hazard("it keeps a view of a tap's value past its statement")
            if isinstance(sub, (ast.Yield, ast.YieldFrom, ast.Await)):
                raise _Hazard("it yields or awaits, whose order cannot be followed")

    def follows(self, func: ast.AST, positional: int) -> bool:
        """Whether a call handed a tap's value is known to keep none of it and write
        none of it: a builtin that reads (``sum``, ``len``), one of torch's own
        functions (without ``out=``/``inplace=``, checked above), a method of the
        value itself, or a module of the model called on it alone (a norm with a
        residual adds into it in place)."""
        if isinstance(func, ast.Name):
            if func.id not in self.scope:
                return func.id in _READING_BUILTINS
            value = self.scope[func.id]  # a placeholder (``lambda hidden, residual: None``)
            return type(value) is types.FunctionType and does_nothing(value)
        if isinstance(func, ast.Attribute) and self.is_view(func.value):
            return not func.attr.endswith("_")
        root: ast.AST = func
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        value = self.scope.get(root.id) if isinstance(root, ast.Name) else None
        if type(value).__name__ == "module" and getattr(value, "__name__", "").split(".")[0] == "torch":
            return True
        if value is not None and (value is self.model or _is_envoy(value)):
            return positional <= 1
        return False

    def bind(self, target: ast.AST, view: bool) -> None:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                if view:
                    self.views[node.id] = self.epoch
                else:
                    self.views.pop(node.id, None)

    def reads_a_location(self, node: ast.AST) -> bool:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and sub.attr in (
                "output",
                "input",
                "logits",
                "samples",
                "result",
            ):
                return True
        return False

    def is_view(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self.views
        if isinstance(node, ast.Attribute):
            if node.attr in ("output", "input"):
                return True  # a tap's value itself
            return node.attr in _ALIASING and self.is_view(node.value)
        if isinstance(node, ast.Subscript):
            return self.is_view(node.value)
        if isinstance(node, ast.Starred):
            return self.is_view(node.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            return node.func.attr in _ALIASING and self.is_view(node.func.value)
        if isinstance(node, (ast.Tuple, ast.List)):
            return any(self.is_view(e) for e in node.elts)
        if isinstance(node, ast.IfExp):
            return self.is_view(node.body) or self.is_view(node.orelse)
        if isinstance(node, ast.NamedExpr):
            return self.is_view(node.value)
        return False


#: Builtins that read a value and keep nothing of it.
_READING_BUILTINS = frozenset({"sum", "len", "print", "str", "repr", "float", "int", "bool", "isinstance"})
