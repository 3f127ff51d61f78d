"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process it starts (the front end, the
engine core, each worker, the model-inspection subprocess), sometimes more than
once, before any engine config exists, and it does not catch what a plugin
raises. So it must be cheap, idempotent, never raise, and be side-effect free
beyond this: it checks that this vLLM has every seam the plugin relies on
(``versions.why_off``: at once on a tested release, from the source on any other),
then hands the front-end seams their policy (``front.FrontEnd``) and arranges
for the front-end and engine-core seams (``seams.INSTALLERS``) to be installed
when, and only when, the vLLM module that holds each one is imported in this
process. Worker seams are installed by the worker extension,
which only workers import. On a vLLM it cannot run on, it logs one warning
saying why and what to do, and leaves vLLM as it is.

It never starts anything, never imports torch models, and never changes a
request that carries no block.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm_nnsight_plugin")

_DONE = False
_PENDING: dict[str, list[Callable[[], None]]] = {}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module finishes importing."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            _run(name)

        spec.loader = _Loader(loader, exec_module)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, exec_module: Callable[[Any], None]) -> None:
        self._inner = inner
        self.exec_module = exec_module  # type: ignore[method-assign]

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _run(name: str) -> None:
    for callback in _PENDING.pop(name, ()):
        callback()


def when_imported(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback`` now if ``name`` is imported, else right after it is."""
    if name in sys.modules:
        callback()
        return
    _PENDING.setdefault(name, []).append(callback)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def _disabled() -> bool:
    from .settings import disabled

    return disabled()


def switched_off() -> str | None:
    """Why the plugin is off in this process (None: it runs). Decided once per
    process tree: the engine processes inherit the decision of the one that
    started them."""
    from . import versions

    if _disabled():
        return "disabled by VLLM_NNSIGHT_DISABLE"
    from .settings import value

    inherited = value(versions.SWITCHED_OFF_ENV)
    if inherited:
        return inherited
    try:
        reason = versions.why_off()
    except Exception as error:  # reading vLLM's source must never stop vLLM
        reason = f"vLLM's seams could not be checked ({error!r})."
    if reason:
        os.environ[versions.SWITCHED_OFF_ENV] = reason
    return reason


def register() -> None:
    """Entry point: see the module docstring."""
    global _DONE
    if _DONE:
        return
    _DONE = True
    from . import versions
    from .settings import known_to_vllm, value

    known_to_vllm()  # the plugin's variables are never "unknown vLLM variables"
    if _disabled():  # first: the off switch works whatever else is set
        logger.info("vllm-nnsight: disabled by VLLM_NNSIGHT_DISABLE")
        return
    if _first_process():
        _report_settings()
    decided_here = not value(versions.SWITCHED_OFF_ENV)
    reason = switched_off()
    if reason:
        if decided_here:  # one warning, from the process that decided
            logger.warning("vllm-nnsight: switched off, vLLM runs without it: %s", reason)
        return
    from . import seams
    from .front import FrontEnd

    seams.frontend.serve_with(FrontEnd())  # the policy every front-end wrap hands its request to
    version = versions.vllm_version()
    if not version.startswith(versions.TESTED_VLLM):
        logger.info("vllm-nnsight: vLLM %s is not a tested release; every seam is in its source", version)
    for module, install in seams.INSTALLERS.items():
        when_imported(module, install)
    arranged = [seam.label for seam in seams.SEAMS if seam.module in seams.INSTALLERS]
    logger.info("vllm-nnsight: %d seams arranged: %s", len(arranged), ", ".join(arranged))
    logger.debug("vllm-nnsight: registered on vLLM %s (pid %d)", version, os.getpid())


def _first_process() -> bool:
    """Whether this is the process vLLM started in (its engine-core and worker
    processes are its children, and say nothing it already said)."""
    import multiprocessing

    return multiprocessing.parent_process() is None


def _report_settings() -> None:
    """One line for settings the engine cannot use (blocks stay off, vLLM starts as
    usual), a warning for bad ones only a client or the demo reads."""
    from .settings import CLIENT, KEY, KEY_FILE, blocks_off, problems, value

    off = blocks_off()
    if off:
        logger.error("vllm-nnsight: %s; vLLM serves requests without blocks.", off)
    for problem in problems(reader=CLIENT):
        logger.warning("vllm-nnsight: %s (read by the client or the demo only, not by this engine)", problem)
    key_file = value(KEY_FILE)
    if key_file and not value(KEY) and not os.path.isfile(key_file):
        logger.warning(
            "vllm-nnsight: VLLM_NNSIGHT_KEY_FILE names %s, which is not there: blocks from the "
            "network are off until it is.",
            key_file,
        )
