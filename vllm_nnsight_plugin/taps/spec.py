"""Tap patterns: nnsight's spelling, resolved against a module tree.

A pattern is a module path relative to the model (the root's own ``model.`` is
implied) ending in ``.output``, where ``*`` stands for one path segment:
``"model.layers.*.output"`` is every decoder layer's output, as nnsight writes it.
An operation inside a module's forward is tapped as nnsight names it:
``"model.layers.*.self_attn.source.self_attn_0.output"``. What a module is
handed is tapped as ``"model.layers.*.self_attn.attn.inputs"``: one site per
value its parent hands it, where every call hands the same plain values (read
from the parent's source). A site is the module path,
``<module path>.source.<operation>`` or ``<module path>.inputs.<i>``; a pattern
that names nothing is refused with what exists instead, never ignored.

Two words stand for lists: ``"layers"`` is every decoder layer's output, wherever
the model keeps its layers (the default where each tap runs as one kernel), and
``"none"`` is no taps.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from ..settings import TAP_KERNEL, TAPS, value
from .patterns import LAYERS, TapError, parse

#: Where an engine's taps travel: vLLM's ``additional_config`` (hashed into the
#: compile cache's key, so a tapped and an untapped engine never share graphs).
CONFIG_KEY = "nnsight_taps"
#: Beside them, the plugin release and the release of the tap operations that
#: built the graphs (also hashed).
VERSION_KEY = "nnsight_taps_plugin"
#: The release of the tap operations (``ops.py``): a graph that calls an earlier
#: release's operations is never reused.
OPERATIONS = 5
#: Where a worker keeps its runner's tap tables (on the runner).
RUNNER_ATTR = "_vllm_nnsight_taps"


#: Where vLLM's models keep their decoder layers, tried in this order.
LAYER_LISTS = (
    "model.layers",
    "model.language_model.layers",
    "language_model.model.layers",
    "model.decoder.layers",
    "transformer.h",
    "gpt_neox.layers",
)


def from_env() -> tuple[str, ...] | None:
    """``VLLM_NNSIGHT_TAPS``; None when unset (the default applies)."""
    found = value(TAPS)
    return None if found is None else tuple(found)


def defaults(kernel: bool) -> tuple[str, ...]:
    """The taps of an engine nobody gave any: every decoder layer where each tap
    runs as one kernel (what that costs an idle engine was measured, below 1%:
    ``benchmarks/RESULTS.md``), none where taps run as tensor operations."""
    return (LAYERS,) if kernel else ()


def taps_for(extra: dict | None, cuda_with_triton: Callable[[], bool]) -> tuple[tuple[str, ...], bool]:
    """The taps an engine built with this ``additional_config`` gets, and whether
    each runs as one kernel (``VLLM_NNSIGHT_TAP_KERNEL``; unset, where
    ``cuda_with_triton()``, the platform's answer): its own list (``"none"`` or
    empty: none), else ``VLLM_NNSIGHT_TAPS``, else :func:`defaults`."""
    kernel = value(TAP_KERNEL)
    if kernel is None:
        kernel = cuda_with_triton()
    if extra is not None and CONFIG_KEY in extra:
        return parse(extra[CONFIG_KEY]), kernel
    taps = from_env()
    return (defaults(kernel) if taps is None else taps), kernel


def decoder_layers(module_names: Iterable[str]) -> str | None:
    """The pattern of every decoder layer's output (:data:`LAYER_LISTS`), or None
    for a model that keeps them nowhere known."""
    names = set(module_names)
    for path in LAYER_LISTS:
        if f"{path}.0" in names:
            return f"{path}.*.output"
    return None


def resolve(
    patterns: Iterable[str],
    module_names: Iterable[str],
    operations_of: Callable[[str], list[str]] | None = None,
    inputs_of: Callable[[str], int] | None = None,
) -> tuple[str, ...]:
    """The sites the patterns name, in model order, each once.

    ``operations_of(path)`` lists the operations of that module's forward (for
    ``.source`` patterns); ``inputs_of(path)``, how many values the module is
    handed (for ``.inputs`` patterns: one site each, ``<path>.inputs.<i>``);
    either may raise ``ValueError`` with the reason it cannot.
    """
    names = [name for name in module_names if name]
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern == LAYERS:  # a model without known decoder layers: none from it
            pattern = decoder_layers(names)
            if pattern is None:
                continue
        path, dot, side = pattern.rpartition(".")
        module, source, operation = path.partition(".source.")
        malformed = (source and (not operation or "." in operation)) or module.endswith(".source")
        if side == "inputs" and not source and dot and not malformed:
            _inputs(pattern, module, names, inputs_of, chosen)
            continue
        if not dot or side != "output" or malformed:
            raise TapError(
                f"tap {pattern!r}: a tap is a module's output, 'model.layers.10.output' or "
                "'model.layers.*.output' (* is one path segment), an operation of its "
                "forward, 'model.layers.*.self_attn.source.self_attn_0.output', or the "
                "values its parent hands it, 'model.layers.*.self_attn.attn.inputs'."
            )
        matched = _matched(pattern, module, names)
        if not source:
            chosen.update(matched)
            continue
        for name in matched:
            known = _read(pattern, name, operations_of)
            if operation not in known:
                raise TapError(
                    f"tap {pattern!r}: the forward of {name!r} has no operation {operation!r}. "
                    f"Its operations: {', '.join(known)}."
                )
            chosen.add(f"{name}.source.{operation}")
    order = {name: i for i, name in enumerate(names)}
    return tuple(sorted(chosen, key=lambda site: (order[module_of(site)], site)))


def _inputs(
    pattern: str, module: str, names: list[str], inputs_of: Callable[[str], int] | None, chosen: set[str]
) -> None:
    """The sites of an ``.inputs`` pattern: one per value each matched module is handed."""
    for name in _matched(pattern, module, names):
        chosen.update(f"{name}{INPUTS}{i}" for i in range(_read(pattern, name, inputs_of)))


def _matched(pattern: str, module: str, names: list[str]) -> list[str]:
    """The modules a pattern's path names (``*`` is one path segment); none is an error."""
    regex = re.escape(module).replace(r"\*", r"[^.]+")
    matched = [name for name in names if re.fullmatch(regex, name)]
    if not matched:
        raise TapError(f"tap {pattern!r} names no module of this model. {_what_exists(names)}")
    return matched


def _read(pattern: str, name: str, reader: Callable[[str], Any] | None) -> Any:
    """What ``reader`` finds in a matched module's forward, its refusal as a TapError."""
    if reader is None:
        raise TapError(f"tap {pattern!r}: this engine cannot read its modules' forwards")
    try:
        return reader(name)
    except ValueError as error:
        raise TapError(f"tap {pattern!r}: {error}") from None


#: Between a module's path and the place of a value it is handed, in a site's name.
INPUTS = ".inputs."


def input_site(site: str) -> tuple[str, int] | None:
    """An input site -> (its module's path, which of the values it is handed); None
    for any other site."""
    module, inputs, index = site.rpartition(INPUTS)
    return (module, int(index)) if inputs and index.isdigit() else None


def module_of(site: str) -> str:
    """The path of the module a site belongs to."""
    found = input_site(site)
    return found[0] if found is not None else site.partition(".source.")[0]


def split_site(site: str) -> tuple[str, str | None]:
    """A site that is not an input site (:func:`input_site`) -> (its module's path,
    the operation or None for the module's output)."""
    module, source, operation = site.partition(".source.")
    return module, (operation if source else None)


def _what_exists(names: list[str]) -> str:
    """The module paths, with numbered children collapsed to ``*``, bounded."""
    shapes = list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", name) for name in names))
    shown = ", ".join(f"{shape}.output" for shape in shapes[:40])
    more = f" and {len(shapes) - 40} more" if len(shapes) > 40 else ""
    return f"Modules it has: {shown}{more}."


#: In ``VERSION_KEY``'s value: the engine runs each tap as one operation (``ops.tap``).
KERNEL_MARK = "+kernel"


def version_value(plugin: str, kernel: bool) -> str:
    """``VERSION_KEY``'s value: the plugin, the operations' release, and whether
    each tap runs as one operation (graphs built either way are never shared)."""
    return f"{plugin}+ops{OPERATIONS}" + (KERNEL_MARK if kernel else "")


def _built_with(vllm_config: Any, key: str) -> Any:
    """One entry of the engine's ``additional_config``, or None."""
    extra = getattr(vllm_config, "additional_config", None)
    return extra.get(key) if isinstance(extra, dict) else None


def kernel_chosen(vllm_config: Any) -> bool:
    """Whether the engine was built to run each tap as one operation (where its
    config was made: CUDA with Triton, or ``VLLM_NNSIGHT_TAP_KERNEL=1``)."""
    value = _built_with(vllm_config, VERSION_KEY)
    return isinstance(value, str) and value.endswith(KERNEL_MARK)


def engine_taps(vllm_config: Any) -> tuple[str, ...]:
    """The patterns an engine was built with (its ``additional_config``)."""
    return parse(_built_with(vllm_config, CONFIG_KEY))
