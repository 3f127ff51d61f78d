"""Every docs page's Python examples run, in order, as one script per page."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(DOCS.glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def page_script(page: Path) -> str:
    """The page's blocks, in a ``main()`` (engines start worker processes, which
    re-import the main module)."""
    body = "\n".join(BLOCK.findall(page.read_text()))
    return "def main():\n" + textwrap.indent(body, "    ") + '\n\nif __name__ == "__main__":\n    main()\n'


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_examples_run(page, tmp_path):
    script = page_script(page)
    if "def main():\n\n" in script:
        pytest.fail(f"{page.name} has no python example")
    path = tmp_path / f"{page.stem}_examples.py"
    path.write_text(script)
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"{page.name}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
