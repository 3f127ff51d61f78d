"""Dependencies point one way: no import circle among the package's modules,
counting imports inside functions too (a lazy import hides a circle from Python,
not from a reader); imports inside functions only where they keep a package out
of a process (the edges); and only the adapters (``seams/``) read vLLM's engines
and configs. Reads the source; no engine."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_nnsight_plugin"

#: What the adapters to vLLM (``seams/``) may import of the package besides
#: themselves: the wire formats they recognise a request by. The policy (``front``,
#: ``edits``, ``returns``, ``server``, ``taps``, ``worker``) is handed to them.
SEAMS_MAY_IMPORT = frozenset({"wire.envelope", "wire.trust"})


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imported(module: str, path: Path, node: ast.AST, modules: dict) -> set[str]:
    """The package's modules one import statement names (relative or absolute)."""
    if isinstance(node, ast.Import):
        names = [alias.name.removeprefix("vllm_nnsight_plugin.") for alias in node.names]
        return {n for n in names if n in modules and n != module}
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)] if module else []
        target = ".".join([*base, *([node.module] if node.module else [])])
    elif (node.module or "").startswith("vllm_nnsight_plugin"):
        target = node.module.removeprefix("vllm_nnsight_plugin").lstrip(".")
    else:
        return set()
    found = set()
    for alias in node.names:
        child = f"{target}.{alias.name}" if target else alias.name
        found.add(child if child in modules else target)
    return {n for n in found if n in modules and n != module}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(module, path, node, modules)
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(frozenset(group))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_reading_finds_a_circle_where_there_is_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [frozenset({"a", "b", "c"})]
    assert "client.model" in import_graph()[""]  # a function's import is read


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, f"import circles: {[sorted(group) for group in found]}"


#: The modules where the package meets a process that must stay light: vLLM
#: imports the package and ``plugin`` in every process it starts (no client, no
#: nnsight there), and the command line answers ``--help`` without vLLM. Their
#: imports inside functions are those edges.
EDGES = frozenset({"", "plugin", "__main__"})


def _statements(tree: ast.Module, inside_functions: bool) -> list[ast.Import | ast.ImportFrom]:
    """The module's import statements inside functions, or those it runs when
    imported (not under ``if TYPE_CHECKING``)."""
    found: list = []

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                if in_function == inside_functions:
                    found.append(child)
            walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    walk(tree, False)
    return found


def _outside(node: ast.Import | ast.ImportFrom) -> str | None:
    """The package outside this one an import names (None: this package's own)."""
    if isinstance(node, ast.ImportFrom):
        if node.level or (node.module or "").startswith("vllm_nnsight_plugin"):
            return None
        return (node.module or "").split(".")[0]
    top = node.names[0].name.split(".")[0]
    return None if top == "vllm_nnsight_plugin" else top


def loaded_when_imported() -> dict[str, set[str]]:
    """Per module, the packages outside this one (not the standard library) that
    importing it loads: its own imports at import time, and its modules'."""
    import sys

    modules = _modules()
    direct: dict[str, tuple[set[str], set[str]]] = {}
    for module, path in modules.items():
        outside, ours = set(), set()
        for node in _statements(ast.parse(path.read_text()), inside_functions=False):
            name = _outside(node)
            if name is None:
                ours |= _imported(module, path, node, modules)
            elif name not in sys.stdlib_module_names and name != "__future__":
                outside.add(name)
        parents = module.split(".")[:-1] if module else []
        ours |= {".".join(parents[:i]) for i in range(len(parents) + 1)} - {module}
        direct[module] = (outside, ours)
    loaded = {module: set(outside) for module, (outside, _) in direct.items()}
    grew = True
    while grew:  # to a fixed point: a package's __init__ and its modules import each other
        grew = False
        for module, (_, ours) in direct.items():
            found = set().union(loaded[module], *(loaded[other] for other in ours))
            if found != loaded[module]:
                loaded[module], grew = found, True
    return loaded


def needless_lazy_imports() -> list[str]:
    """Imports inside functions that need not be: outside :data:`EDGES`, one of
    the standard library's, or of a module of this package whose import loads
    nothing outside it that the importing module does not load already. (A lazy
    import of vLLM, nnsight, torch... keeps it out of a process that must not
    load it, or does not need it yet: those are the edges.)"""
    import sys

    modules = _modules()
    loaded = loaded_when_imported()
    found = []
    for module, path in modules.items():
        if module in EDGES:
            continue
        for node in _statements(ast.parse(path.read_text()), inside_functions=True):
            name = _outside(node)
            if name is not None:
                if name in sys.stdlib_module_names:
                    found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
                continue
            if all(loaded[target] <= loaded[module] for target in _imported(module, path, node, modules)):
                found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return found


def test_lazy_imports_only_at_the_process_edges():
    assert not needless_lazy_imports(), needless_lazy_imports()


def test_the_seams_import_no_policy():
    graph = import_graph()
    ours = {m for m in graph if m == "seams" or m.startswith("seams.")}
    reached = {m: sorted(graph[m] - ours - SEAMS_MAY_IMPORT) for m in ours}
    assert not {m: r for m, r in reached.items() if r}, reached


#: The attributes of vLLM's engines and configs by which a module would reach into
#: vLLM: ``seams/`` reads them and hands the rest of the package views
#: (``seams.frontend.processor_of``, ``config_of``, ``served_engine``...), so a vLLM
#: that moves one is a change there alone.
VLLM_ATTRIBUTES = frozenset(
    {
        "llm_engine",
        "engine_core",
        "engine_client",
        "input_processor",
        "vllm_config",
        "model_config",
        "parallel_config",
    }
)


def vllm_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Where a module reads one of :data:`VLLM_ATTRIBUTES`: ``x.name`` or
    ``getattr(x, "name", ...)`` (a name bound or a keyword given is not a read)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in VLLM_ATTRIBUTES:
            found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in VLLM_ATTRIBUTES
        ):
            found.append((node.lineno, node.args[1].value))
    return found


def test_only_the_seams_read_vllms_engines_and_configs():
    outside = {
        f"{module}:{line} {name}"
        for module, path in _modules().items()
        if module != "seams" and not module.startswith("seams.")
        for line, name in vllm_reads(ast.parse(path.read_text()))
    }
    assert not outside, sorted(outside)


def test_the_reading_finds_a_read_of_vllms_engine():
    code = 'a = llm.llm_engine\nb = getattr(engine, "vllm_config", None)\nmodel_config = 1\nf(engine_core=2)'
    assert vllm_reads(ast.parse(code)) == [(1, "llm_engine"), (2, "vllm_config")]
