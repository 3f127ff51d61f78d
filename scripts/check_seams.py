"""Check a vLLM release's source for every seam the plugin relies on, without
installing or importing it.

    python scripts/check_seams.py PATH [PATH ...]

PATH is a vLLM wheel (``vllm-0.33.0-...whl``, e.g. from ``pip download vllm==0.33.0
--no-deps``) or an unpacked ``vllm`` package folder. For each, this prints every
seam the plugin wraps (with its leading parameters) and every line of vLLM's source
it reads, and whether that release has it: the same reading ``plugin.register``
makes on an untested release before it lets the plugin run. The exit status is the
number of releases that lack something.
"""

from __future__ import annotations

import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_nnsight_plugin import seams  # noqa: E402
from vllm_nnsight_plugin.seams.check import missing  # noqa: E402


def package_folder(path: Path, scratch: Path) -> Path:
    """The ``vllm`` folder of a wheel (its ``.py`` files unpacked) or of a source tree."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as wheel:
            for name in wheel.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    wheel.extract(name, scratch)
        return scratch / "vllm"
    return path / "vllm" if (path / "vllm" / "__init__.py").is_file() else path


def version_of(folder: Path) -> str:
    import re

    version = folder / "_version.py"
    found = (
        re.search(r"^__version__ = (?:version = )?['\"]([^'\"]+)", version.read_text(), re.M)
        if version.is_file()
        else None
    )
    return found.group(1) if found else "?"


def main(paths: list[str]) -> int:
    failed = 0
    for given in paths:
        with tempfile.TemporaryDirectory() as scratch:
            folder = package_folder(Path(given), Path(scratch))
            problems = missing(folder, seams.SEAMS, seams.FACTS)
            checked = len(seams.SEAMS) + len(seams.FACTS)
            verdict = "has every seam" if not problems else f"lacks {len(problems)}"
            print(f"vLLM {version_of(folder)} ({given}): {checked} checked, {verdict}")
            for problem in problems:
                print(f"  - {problem}")
            failed += bool(problems)
    return failed


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    raise SystemExit(main(sys.argv[1:]))
