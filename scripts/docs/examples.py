"""Run every docs page's Python examples, keep what each printed and the pictures
it drew, for the site (``mkdocs build`` puts the output under each example).

    python scripts/docs/examples.py [--paths FILE] [PAGE.md ... | --in-two]

- Pages run in the order of ``mkdocs.yml``'s nav (or the ones named), in one
  process, each in a namespace of its own, its blocks one after the other,
  except that pages building engines with taps of their own run after all the
  others (:func:`engines_together`). A block's standard output is what the site
  shows under it.
- Pages are written as a user would write them, each building its own engine. An
  engine built with the same model and settings as the one before is that one;
  one with other settings shuts the earlier one down first. So the pages share
  one engine per model and settings, and never hold two.
- With no accelerator (:func:`cpu_engines`), an engine a page builds without a
  ``dtype`` runs in float32: vLLM's ``auto`` runs a float32 checkpoint in bfloat16
  on a CPU, which a CPU without bfloat16 units computes tens of times slower. Every
  engine runs eager (torch.compile takes over a minute per engine on a CPU; the
  compiled CPU engine has tests of its own, ``tests/engine/test_compiled.py``, and which
  path a block takes does not depend on it) with a KV cache of 1 GiB (vLLM's CPU
  default is a share of the machine's memory, written at start: gigabytes for
  pages that need a few MiB). A compiled engine runs a forward before it serves,
  which is where the taps learn their values' widths; each eager engine here runs
  one plain request when built (:meth:`_Engines.warm_up`) so that the first block
  on it takes the path it takes on a compiled one.
- Writes ``docs/_outputs/<page>.json`` (each block's hash and output), and runs
  with ``docs/img/`` as the working directory, where pictures are saved.

- With ``--paths FILE``: per example, how many of its traced requests ran
  lowered onto the taps and, by reason, how many ran as Python (the shared
  engine's ``nnsight_stats`` before and after it), written to FILE. Run with
  ``VLLM_NNSIGHT_TAPS`` set, every engine a page builds without taps of its own
  gets those: the docs' examples as written, on a tapped engine. Engines a page
  builds in other processes (a server, the async engine) are not counted.

- With ``--in-two``: every page, in two processes side by side (:func:`in_two`).

The exit status is the number of pages that failed; each failure is printed
with its traceback.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import json
import linecache
import os
import re
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
OUTPUTS = DOCS / "_outputs"
IMAGES = DOCS / "img"
#: A page's runnable examples: its ```python blocks, in order.
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(markdown: str) -> list[str]:
    return BLOCK.findall(markdown)


def digest(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]


def nav_pages() -> list[str]:
    """The pages of the site, in nav order (``mkdocs.yml``)."""
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    found: list[str] = []

    def walk(item: object) -> None:
        if isinstance(item, str) and item.endswith(".md"):
            found.append(item)
        elif isinstance(item, dict):
            for value in item.values():
                walk(value)
        elif isinstance(item, list):
            for value in item:
                walk(value)

    walk(config.get("nav", []))
    return found


class _Engines:
    """``vllm.LLM``, built once per model and settings, one alive at a time."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.llm = None
        self.built = 0

    def install(self) -> None:
        import vllm

        engines = self
        base = vllm.LLM

        class Sharing(type(base)):
            def __call__(cls, *args, **kwargs):
                key = repr((args, sorted(kwargs.items(), key=lambda item: item[0])))
                if key == engines.key:
                    return engines.llm
                engines.close()
                engines.llm = super().__call__(*args, **kwargs)
                engines.key = key
                engines.warm_up()
                engines.built += 1
                print("ENGINE", key[:300], file=sys.stderr)
                return engines.llm

        shared = Sharing("LLM", (base,), {"__module__": base.__module__, "__doc__": base.__doc__})
        vllm.LLM = shared

    def warm_up(self) -> None:
        """On a CPU (eager, :func:`cpu_engines`), one plain one-token request: a
        compiled or graphed engine runs a forward before it serves, and the taps learn
        their values' widths from it (``taps/install.py``, ``Tables.means``), so
        the first block on an engine takes the path it takes on the engines users get."""
        import torch
        from vllm import SamplingParams

        if torch.accelerator.current_accelerator() is None:
            self.llm.generate(["Warm up."], SamplingParams(max_tokens=1), use_tqdm=False)

    def close(self) -> None:
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.llm_engine.engine_core.shutdown()
        self.llm = self.key = None
        gc.collect()


#: The KV cache of every engine on a CPU, in GiB (vLLM's own setting for it, which
#: the servers and async engines pages start in other processes inherit).
CPU_KV_GIB = "1"


def cpu_engines() -> None:
    """See the module's docstring: on a CPU, ``auto`` becomes float32, every
    engine runs eager, and the KV cache is :data:`CPU_KV_GIB`."""
    import torch
    from vllm.engine.arg_utils import EngineArgs

    if torch.accelerator.current_accelerator() is not None:
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_GIB)
    original = EngineArgs.__post_init__

    def __post_init__(self, *args, **kwargs):
        if self.dtype == "auto":
            self.dtype = "float32"
        self.enforce_eager = True
        return original(self, *args, **kwargs)

    EngineArgs.__post_init__ = __post_init__


def _stats(engines: _Engines) -> dict | None:
    """The shared engine's ``nnsight_stats`` (None without an engine or the plugin)."""
    if engines.llm is None:
        return None
    try:
        (stats,) = engines.llm.collective_rpc("nnsight_stats")
    except Exception:
        return None
    return stats if isinstance(stats, dict) and "lowered" in stats else None


def _paths(before: dict | None, after: dict | None) -> dict | None:
    """What one example's traced requests did: lowered, and as Python by reason."""
    if after is None:
        return None
    before = before or {}
    lowered = after["lowered"] - before.get("lowered", 0)
    was = before.get("python_why", {})
    python = {
        k: n - was.get(k, 0) for k, n in sorted(after.get("python_why", {}).items()) if n > was.get(k, 0)
    }
    return {"lowered": lowered, "python": python} if lowered or python else None


def run_page(name: str, engines: _Engines, paths: dict | None = None) -> bool:
    text = (DOCS / name).read_text()
    found = blocks(text)
    code = "\n".join(found)
    if 'mode="async"' in code or "api_server" in code:
        engines.close()  # the page's code builds engines of its own: make room
    namespace: dict = {"__name__": "__docs__"}
    results = []
    ok = True
    started = time.time()
    for number, source in enumerate(found, 1):
        captured = io.StringIO()
        filename = f"<{name} example {number}>"
        # nnsight reads a with-block's body back from its source, as for any file.
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        built, before = engines.built, _stats(engines) if paths is not None else None
        try:
            with contextlib.redirect_stdout(captured):
                exec(compile(source, filename, "exec"), namespace)
        except BaseException:  # a page's failure is reported, and the next page runs
            print(f"FAILED {name}, example {number}:\n{traceback.format_exc()}", file=sys.stderr)
            ok = False
            break
        if paths is not None:  # an engine built by this example counts from nothing
            took = _paths(before if engines.built == built else None, _stats(engines))
            if took is not None:
                paths.setdefault(name, {})[str(number)] = took
        results.append({"sha": digest(source), "stdout": captured.getvalue()})
    OUTPUTS.mkdir(parents=True, exist_ok=True)
    target = OUTPUTS / (name[:-3] + ".json")
    if ok:
        target.write_text(json.dumps({"page": name, "blocks": results}, indent=1))
    else:
        target.unlink(missing_ok=True)
    print(
        f"{'ok' if ok else 'FAILED':6} {name}: {len(results)}/{len(found)} examples, {time.time() - started:.0f} s"
    )
    return ok


def coverage(paths: dict) -> str:
    """How many examples that work at module locations ran lowered throughout (a
    block on the sampler's values alone runs as Python there and keeps the graphs,
    so it is left out), and the same over their traced requests."""
    examples = [took for page in paths.values() for took in page.values()]
    python = [sum(n for k, n in took["python"].items() if k != "sampler") for took in examples]
    at_modules = [(took["lowered"], p) for took, p in zip(examples, python) if took["lowered"] or p]
    whole = sum(1 for lowered, p in at_modules if not p)
    lowered = sum(lowered for lowered, _ in at_modules)
    requests = lowered + sum(p for _, p in at_modules)
    return (
        f"{whole} of {len(at_modules)} examples at module locations lowered throughout "
        f"({whole / max(len(at_modules), 1):.0%}); {lowered} of {requests} of their traced requests"
    )


def own_taps(pages: list[str]) -> list[str]:
    """The pages whose examples build an engine with taps of their own."""
    return [page for page in pages if "taps=[" in "\n".join(blocks((DOCS / page).read_text()))]


def engines_together(pages: list[str]) -> list[str]:
    """The pages, those whose examples build an engine with taps of their own last:
    the pages on the default engine then run one after another on one engine, which
    starts once instead of again after each page with taps between them."""
    own = own_taps(pages)
    return [page for page in pages if page not in own] + own


def in_two(target: Path | None) -> int:
    """Every page, as two processes side by side: the pages on the default engine,
    and those whose engines have taps of their own (about half the time each). A
    vLLM CPU engine computes on one core, and vLLM gives every engine the first
    one, so on a CPU of two or more cores the second process's engines take the
    second core; the first keeps vLLM's choice (one of its pages builds two
    tensor-parallel ranks). Their paths are written to ``target`` as one."""
    import subprocess
    import tempfile

    sys.path.insert(0, str(ROOT))
    from tests.engines import CORE_BIND, core_of

    pages = nav_pages()
    own = own_taps(pages)
    groups = [[page for page in pages if page not in own], own]
    with tempfile.TemporaryDirectory() as scratch:
        running = []
        for number, group in enumerate(groups):
            env = {name: value for name, value in os.environ.items() if name != CORE_BIND}
            if core_of(number) is not None:
                env[CORE_BIND] = core_of(number)
            command = [sys.executable, __file__]
            if target is not None:
                command += ["--paths", str(Path(scratch) / f"{number}.json")]
            running.append(subprocess.Popen(command + group, env=env))
        failed = sum(process.wait() for process in running)
        if target is not None:
            paths: dict = {}
            for number in range(len(groups)):
                part = Path(scratch) / f"{number}.json"
                if part.exists():
                    paths.update(json.loads(part.read_text()))
            target.write_text(json.dumps(paths, indent=1, sort_keys=True) + "\n")
            print(coverage(paths))
    return failed


def main(argv: list[str]) -> int:
    # vLLM's logs (and the engine processes') go to stderr, never into an example's output.
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    target = None
    if argv[:1] == ["--paths"]:
        target, argv = Path(argv[1]).resolve(), argv[2:]
    if argv == ["--in-two"]:
        return in_two(target)
    paths: dict | None = {} if target is not None else None
    pages = argv or engines_together(nav_pages())
    IMAGES.mkdir(parents=True, exist_ok=True)
    os.chdir(IMAGES)
    cpu_engines()
    engines = _Engines()
    engines.install()
    failed = 0
    try:
        for name in pages:
            failed += not run_page(name, engines, paths)
    finally:
        engines.close()
    print(f"{len(pages) - failed} of {len(pages)} pages ran; {engines.built} shared engines built")
    if target is not None:
        target.write_text(json.dumps(paths, indent=1, sort_keys=True) + "\n")
        print(coverage(paths))
    return failed


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
