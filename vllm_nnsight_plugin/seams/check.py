"""Whether a vLLM release has every seam the plugin relies on, read from its source.

The plugin is tested end to end on two release lines (``versions.TESTED_VLLM``).
On any other release from 0.25 on, ``plugin.register`` reads the source of the
modules that hold the seams (:data:`~vllm_nnsight_plugin.seams.SEAMS`: each
wrapped method with its leading parameters) and the facts the plugin reads
(:data:`~vllm_nnsight_plugin.seams.FACTS`: a line it relies on in a function's
or class's source), without importing any of them. If one is missing, the
plugin switches itself off with one warning naming it, and vLLM runs as if the
plugin were not installed. ``scripts/check_seams.py`` runs the same reading on
another release's source tree.

Everything here reads files with :mod:`ast`; nothing imports vLLM.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

#: The model runners the plugin runs on, by the module that defines each: the V1
#: runner (0.25 to 0.33), the V2 runner (0.25 on) and the standalone CPU runner of
#: the V2 family (0.34 on; x86 CPUs without Triton and other CPUs).
RUNNERS: dict[str, str] = {
    "v1": "vllm.v1.worker.gpu_model_runner",
    "v2": "vllm.v1.worker.gpu.model_runner",
    "v2-cpu": "vllm.v1.worker.cpu.standalone_model_runner",
}


def installed_root() -> Path | None:
    """The installed ``vllm`` package's folder, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def module_file(root: Path, module: str) -> Path | None:
    """The file of ``module`` (``vllm.x.y``) under a ``vllm`` package folder."""
    parts = module.split(".")[1:]
    base = root.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=256)
def _parsed(path: Path) -> tuple[ast.Module, str] | None:
    try:
        text = path.read_text(encoding="utf-8")
        return ast.parse(text), text
    except (OSError, SyntaxError, ValueError):
        return None


def _tree(root: Path, module: str) -> tuple[ast.Module, str] | None:
    path = module_file(root, module)
    return None if path is None else _parsed(path)


def _imported_from(root: Path, module: str, tree: ast.Module, name: str) -> str | None:
    """The module ``name`` is imported from at ``module``'s top level, if it is."""
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == name and not a.asname for a in node.names):
            if not node.level:
                return node.module
            path = module_file(root, module)
            package = module if path is not None and path.name == "__init__.py" else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            return f"{package}.{node.module}" if node.module else package
    return None


def definition(root: Path, module: str, qualname: str, depth: int = 0) -> tuple[ast.AST, str] | None:
    """The ``def`` or ``class`` node of ``qualname`` (``Class.method``, ``Class`` or
    ``function``) in ``module``, and the text of the file that defines it, following
    a top-level import to where it is defined."""
    parsed = _tree(root, module)
    if parsed is None:
        return None
    tree, text = parsed
    head, _, rest = qualname.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == head:
            if not rest:
                return node, text
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == rest:
                        return item, text
            return None
    source = _imported_from(root, module, tree, head)
    if source is None or depth > 4:
        return None
    return definition(root, source, qualname, depth + 1)


def source_of(root: Path, module: str, qualname: str) -> str | None:
    """The source text of a definition (see :func:`definition`)."""
    found = definition(root, module, qualname)
    return None if found is None else ast.get_source_segment(found[1], found[0])


def parameters(root: Path, module: str, qualname: str) -> list[str] | None:
    """The positional parameter names of a function or method, or None if it is gone."""
    found = definition(root, module, qualname)
    if found is None or not isinstance(found[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    node = found[0]
    return [arg.arg for arg in (*node.args.posonlyargs, *node.args.args)]


def calls_by_name(root: Path, module: str, name: str) -> bool:
    """Whether a function in ``module`` calls ``name`` by its module-global name (the
    module a wrap of that global must be made in)."""
    parsed = _tree(root, module)
    if parsed is None:
        return False
    for node in ast.walk(parsed[0]):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name:
            return True
    return False


def runners_in(root: Path) -> list[str]:
    """The model runners (:data:`RUNNERS`) a source tree has."""
    return [name for name, module in RUNNERS.items() if module_file(root, module) is not None]


def missing(root: Path, seams: tuple, facts: tuple, platform: str | None = None) -> list[str]:
    """What of ``seams`` and ``facts`` this source tree lacks, each with the reason
    (empty: every one is there). ``platform`` (``"cpu"``, ``"cuda"``) leaves out the
    seams made only on another platform; None checks them all. A runner's seams
    and facts are checked where the tree has that runner, and must then be whole:
    the plugin runs on whichever runner vLLM builds."""
    present = set(runners_in(root))
    problems: list[str] = [] if present else ["it has none of the model runners the plugin knows"]
    families: dict[str, list] = {}
    for seam in seams:
        if seam.platform is not None and platform is not None and seam.platform != platform:
            continue
        if seam.runner is not None and seam.runner not in present:
            continue
        if not seam.owner:  # a module's function: made where its caller calls it by name
            families.setdefault(seam.name, []).append(seam)
            continue
        params = parameters(root, seam.module, f"{seam.owner}.{seam.name}")
        if params is None:
            problems.append(f"{seam.label} is gone")
        elif tuple(params[: len(seam.leading)]) != seam.leading:
            problems.append(f"{seam.label} now takes {params[: len(seam.leading)]}, not {list(seam.leading)}")
    for name, family in families.items():
        callers = [s for s in family if calls_by_name(root, s.module, name)]
        if not callers:
            problems.append(f"no known module calls {name} by name any more")
        for seam in callers:
            params = parameters(root, seam.module, seam.name)
            if params is None or tuple(params[: len(seam.leading)]) != seam.leading:
                problems.append(f"{seam.label} now takes {params}")
    for fact in facts:
        if fact.runner is not None and fact.runner not in present:
            continue
        text = source_of(root, fact.module, fact.qualname)
        if text is None:
            problems.append(f"{fact.module}.{fact.qualname} is gone")
        elif not fact.found_in(text):
            problems.append(f"{fact.module}.{fact.qualname} no longer has {fact.text!r} ({fact.why})")
    return problems
