"""``vllm-nnsight doctor``: what this install would do, without starting an engine.

Each line is one fact and what it means: the versions, whether vLLM will load the
plugin (its entry point), whether this vLLM has every seam the plugin relies on,
whether a server here would take blocks from the network, and the model runner
and compile mode an engine gets. Nothing here starts a process or loads a model.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from importlib.metadata import entry_points

from .plugin import _disabled, switched_off
from .settings import CLIENT, blocks_off, problems, value
from .versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT, TESTED_VLLM, installed, vllm_version


def _entry_point() -> str | None:
    for entry in entry_points(group="vllm.general_plugins"):
        if entry.value == "vllm_nnsight_plugin.plugin:register":
            return entry.name
    return None


def _trust() -> str:
    from .wire.trust import MIN_KEY_CHARS, OPERATOR_KEY_ENV, OPERATOR_KEY_FILE_ENV, operator_key

    key = operator_key()
    if key is None:
        where = OPERATOR_KEY_FILE_ENV if value(OPERATOR_KEY_FILE_ENV) else OPERATOR_KEY_ENV
        return f"no operator key ({where} unset or empty): a server here runs no block from the network"
    if len(key) < MIN_KEY_CHARS:
        return f"an operator key shorter than {MIN_KEY_CHARS} characters: a server here refuses every block"
    return "an operator key is set: a server here runs blocks (and edits) signed with it"


def _runner() -> str:
    from .seams.check import installed_root, runners_in

    root = installed_root()
    have = [] if root is None else runners_in(root)
    names = {"v1": "V1", "v2": "V2", "v2-cpu": "standalone CPU (V2 family)"}
    shown = ", ".join(names[name] for name in have) or "none the plugin knows"
    value = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    chosen = f"VLLM_USE_V2_MODEL_RUNNER={value} chooses" if value not in (None, "") else "vLLM chooses"
    return f"this vLLM has {shown}; {chosen} which an engine builds, and the plugin runs on each"


def _compile() -> str:
    try:
        from vllm.platforms import current_platform

        device = current_platform.device_name
    except Exception as error:  # no usable platform: say so rather than fail
        return f"unknown ({error!r})"
    return (
        f"{device}: VLLM(path, dispatch=True) builds an eager engine (every step Python); a "
        "stock LLM or `vllm serve` keeps vLLM's default (CUDA graphs and torch.compile on a "
        "GPU), where a step with a block runs as Python and every other step stays compiled"
    )


def report() -> Iterator[tuple[str, str]]:
    """``(what, finding)`` pairs, in the order they are printed."""
    yield "plugin", PLUGIN_VERSION
    off, others = blocks_off(), problems(reader=CLIENT)
    if off:
        yield "settings", f"wrong: {off} (vLLM starts and serves plain requests)"
    elif others:
        yield "settings", "wrong, for the client or the demo only: " + " ".join(others)
    else:
        yield "settings", "every VLLM_NNSIGHT_* value is usable"
    yield "python", platform.python_version()
    yield "torch", installed("torch") or "not installed"
    nnsight = installed("nnsight")
    if nnsight == SUPPORTED_NNSIGHT:
        yield "nnsight", nnsight
    else:
        yield (
            "nnsight",
            f"{nnsight}, but blocks are nnsight {SUPPORTED_NNSIGHT}'s: pip install nnsight=={SUPPORTED_NNSIGHT}",
        )
    try:
        version = vllm_version()
    except ImportError:
        yield "vllm", "not installed: this machine can be a client of a server only"
        return
    tested = "tested" if version.startswith(TESTED_VLLM) else "not a tested release"
    yield "vllm", f"{version} ({tested})"
    name = _entry_point()
    yield (
        "entry point",
        f"registered as {name!r}: vLLM loads the plugin" if name else "missing: reinstall the plugin",
    )
    if _disabled():
        yield "plugin state", "off: VLLM_NNSIGHT_DISABLE is set"
    else:
        from .seams import FACTS, SEAMS
        from .seams.check import installed_root, missing

        reason = switched_off()
        root = installed_root()
        lacking = [] if root is None else missing(root, SEAMS, FACTS)
        if reason is not None:
            yield "seams", f"off: {reason}"
        elif lacking:
            yield "seams", f"lacking (the plugin will fail where it needs it): {'; '.join(lacking)}"
        else:
            yield "seams", f"all {len(SEAMS) + len(FACTS)} the plugin relies on are in this vLLM's source"
    yield "trust", _trust()
    yield "model runner", _runner()
    yield "compile", _compile()


def main() -> int:
    width = 13
    wrong = 0
    for what, finding in report():
        print(f"{what:<{width}} {finding}")
        wrong += finding.startswith(("off:", "missing", "lacking", "wrong")) or "but blocks are" in finding
    return 1 if wrong else 0
