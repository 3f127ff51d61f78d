"""A Python environment with no vLLM in it, for the client a laptop would run.

A virtual environment whose site-packages holds links to every package of the
test environment except vLLM (and the plugin's own install, which it gets from
the source tree instead): the same CPU torch, nnsight, transformers and httpx a
``pip install vllm-nnsight-plugin`` brings, and ``import vllm`` fails there.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LEFT_OUT = ("vllm", "__editable__", "_vllm")


def python_without_vllm(folder: Path) -> str:
    """Make the environment in ``folder``; its Python."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(folder)
    python = folder / "bin" / "python"
    site = Path(sysconfig.get_paths()["purelib"])
    packages = folder / "packages"
    packages.mkdir()
    for entry in os.listdir(site):
        if entry.lower().startswith(_LEFT_OUT) or entry.endswith(".pth"):
            continue
        (packages / entry).symlink_to(site / entry)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    own_site = folder / "lib" / version / "site-packages"
    (own_site / "without_vllm.pth").write_text(f"{packages}\n{ROOT}\n")
    return str(python)
