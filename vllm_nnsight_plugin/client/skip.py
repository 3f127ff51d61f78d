"""How a block's body is skipped where it is written, without slowing the interpreter.

nnsight runs a ``with`` block's body itself, later, so where it is written the body
must not run: as ``__enter__`` returns, nnsight sets a global trace function so
Python calls a per-frame hook at the body's first line, and the hook raises. On
Python 3.12 and later, turning a global trace function on or off re-instruments
every function the interpreter runs next, once per switch, and nnsight switches
twice per invoke: a trace of 1,024 invokes on 3.12 took 38.5 ms to build its
invokes on a 2-core CPU, against 8 ms on 3.11 (``benchmarks/invoke_build.py``).

From 3.12 the interpreter can watch the lines of one function instead
(``sys.monitoring``'s local events): :func:`install` puts in nnsight's place a
skip that arms a line event on the code of the frame the block is written in,
raises nnsight's own ``ExitTracingException`` from it at the body's first line,
and disarms that code again. Nothing global changes, so nothing is
re-instrumented: 14 ms for the same trace.

A debugger's or coverage's trace function stays set throughout (nnsight's own
skip displaces it for the span of each ``__enter__``). nnsight still refuses the
shapes of block it cannot skip, in its own words, and keeps its skip on Python
3.11 (no local events there, and no global cost to save). Installed for the
process on first use, like the memos of ``_nnsight.py``, and never removed.
"""

from __future__ import annotations

import sys
import threading
from types import CodeType, FrameType
from typing import Any

import nnsight.tracing.tracer as nnsight_tracer

#: ``(module, attribute)`` of every private nnsight name used here, checked by
#: ``tests/unit/test_nnsight_seams.py``.
TOUCHES: tuple[tuple[str, str], ...] = (
    ("nnsight.tracing.tracer", "skip_context"),
    ("nnsight.tracing.tracer", "ExitTracingException"),
    ("nnsight.tracing.tracer", "TRY_STATEMENTS"),
)

#: The tool ids ``sys.monitoring`` leaves to other tools (0-2 and 5 are named for
#: debuggers, coverage, profilers and optimizers); the first free one is taken.
_TOOLS = (4, 3)
_NAME = "vllm-nnsight-skip"

#: nnsight's own skip, as it was before :func:`install`.
ORIGINAL: Any = nnsight_tracer.skip_context

#: code -> {frame: the line its block's body starts on}, for each armed frame
_armed: dict[CodeType, dict[FrameType, int]] = {}
_lock = threading.Lock()
_tool: int | None = None


def install() -> bool:
    """Put the line-event skip in nnsight's place, where this Python has local
    events and a tool id is free (idempotent). Whether it is in place."""
    global _tool
    if _tool is not None:
        return True
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        return False
    with _lock:
        if _tool is not None:
            return True
        for tool in _TOOLS:
            if monitoring.get_tool(tool) is None:
                monitoring.use_tool_id(tool, _NAME)
                monitoring.register_callback(tool, monitoring.events.LINE, _at_line)
                _tool = tool
                nnsight_tracer.skip_context = skip_body
                return True
    return False


def skip_body(tracer: Any) -> None:
    """Arm the skip of ``tracer``'s body in the frame that entered it (nnsight's
    ``skip_context``, two frames up)."""
    first = tracer.node.body[0]
    if first.lineno == tracer.node.lineno or isinstance(first, nnsight_tracer.TRY_STATEMENTS):
        return ORIGINAL(tracer)  # refuses these shapes, in its own words, before arming anything
    frame = sys._getframe(2)
    code = frame.f_code
    with _lock:
        frames = _armed.setdefault(code, {})
        frames[frame] = first.lineno
        if len(frames) == 1:
            sys.monitoring.set_local_events(_tool, code, sys.monitoring.events.LINE)


def _at_line(code: CodeType, line: int) -> None:
    """A line of an armed function: raise where an armed frame reaches its body.

    The line of a ``with`` header written over several lines comes before the
    body and leaves the skip armed; so does another frame running the same code
    (recursion, or another thread at the same site)."""
    frame = sys._getframe(1)
    frames = _armed.get(code)
    body = None if frames is None else frames.get(frame)
    if body is None or line < body:
        return
    with _lock:
        del frames[frame]
        if not frames:
            del _armed[code]
            sys.monitoring.set_local_events(_tool, code, 0)
    # what nnsight puts back as it catches this: the thread's trace function, as it is
    raise nnsight_tracer.ExitTracingException(sys.gettrace())
