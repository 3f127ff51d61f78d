"""Dependencies point one way: no import circle among the package's modules,
counting imports inside functions too (a lazy import hides a circle from Python,
not from a reader). Reads the source; no engine."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_nnsight_plugin"

#: The one circle left: the front end's seam calls policy it should be handed
#: (the edit book, the return path, the server's gate and routes), and those reach
#: back into the seams. It may only shrink.
FRONT_END_CIRCLE = frozenset(
    {
        "edits",
        "prefix",
        "returns.outputs",
        "seams",
        "seams.check",
        "seams.engine",
        "seams.frontend",
        "seams.runner_v1",
        "seams.runner_v2",
        "seams.worker",
        "server.commands",
        "server.edits",
        "server.gate",
        "server.tree",
        "taps.install",
        "versions",
    }
)


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
    assert "settings" in import_graph()["taps.spec"]  # a function's import is read


def test_no_import_circle_but_the_front_end_s_and_that_one_only_shrinks():
    found = circles(import_graph())
    outside = [sorted(group) for group in found if not group <= FRONT_END_CIRCLE]
    assert not outside, f"import circles: {outside}"
