"""The docs site: every page's Python examples run (one process, the pages sharing
one engine per model and settings), and the site builds with ``--strict`` with
each example's real output under it (a broken link, a missing page or picture,
or an example changed since it ran fails the build).

The examples run on engines that tap every decoder layer (``VLLM_NNSIGHT_TAPS``,
for the engines a page builds without taps of its own), and which path each
example's requests took, lowered or Python and why, must be the checked-in
``tests/docs_paths.json``: an example that stops lowering fails here, and one
that starts is written down (``scripts/docs/examples.py --paths``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "docs"))

import examples  # noqa: E402  (scripts/docs/examples.py)

#: Pages that hold no example (prose and tables only).
PROSE = frozenset({"comparisons.md"})


def test_every_page_is_on_the_site_and_shows_an_example():
    pages = examples.nav_pages()
    on_disk = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(pages) == on_disk
    for page in pages:
        if page not in PROSE:
            assert examples.blocks((ROOT / "docs" / page).read_text()), f"{page} has no python example"


#: The taps every docs engine gets, unless a page declares its own.
DOCS_TAPS = "layers"  # every decoder layer, as the default taps on CUDA


def test_every_example_runs_and_the_site_builds_strict_with_their_outputs(tmp_path):
    import json
    import os

    paths = tmp_path / "paths.json"
    ran = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "docs" / "examples.py"), "--paths", str(paths), "--in-two"],
        capture_output=True,
        text=True,
        timeout=3000,
        cwd=ROOT,
        env={**os.environ, "VLLM_NNSIGHT_TAPS": DOCS_TAPS},  # the runner places its engines on cores
    )
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-8000:]
    expected = json.loads((ROOT / "tests" / "docs_paths.json").read_text())
    assert json.loads(paths.read_text()) == expected, (
        "the docs' examples took other paths than tests/docs_paths.json records "
        f"(lowered, or Python and why); now: {paths.read_text()}"
    )
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    # The first example's own output, under it on the built page.
    page = (tmp_path / "site" / "index.html").read_text()
    assert "torch.Size([5, 576]) &#39; Paris&#39;" in page or "torch.Size([5, 576]) ' Paris'" in page
