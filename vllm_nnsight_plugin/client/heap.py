"""The tracing process's heap, out of the collector's walks while a trace runs.

A full collection of Python's cyclic collector walks every object the process
holds: with vLLM, torch and nnsight loaded, several hundred thousand, about
0.35 s a walk on this project's CPU machine. A trace of many invokes makes
enough objects to set one off every few traces, in the middle of a call. vLLM
freezes its engine core's heap after start-up, and its server's, for this
reason; a ``vllm.LLM`` whose engine core runs in a process of its own (the
default) leaves the caller's process as it is.

While a trace runs, what was alive before it is frozen (``gc.freeze()``): a
collection then walks only what the call made. Freezing and thawing move whole
lists, so both are cheap, and the heap is thawed as the call ends: whatever
became garbage meanwhile is collected as before.

Whether someone else froze the heap is asked once: counting the frozen objects
walks every one of them (``gc.get_freeze_count``: about 80 ms a trace on this
project's CPU machine, with vLLM's engine core in the process). A freeze that is
not this module's is kept, as whoever made it meant, so once one is seen the
question is not asked again.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

from .. import settings

_lock = threading.Lock()
_calls = 0  # traces running now in this process (the first freezes, the last thaws)
_ours = False  # whether the freeze in force is this module's
_theirs = False  # a freeze not this module's was seen (and is taken to stay)


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """Within this, the objects alive as the first running trace began are frozen
    (unless ``VLLM_NNSIGHT_FREEZE_HEAP`` is 0, or some were frozen already)."""
    global _calls, _ours, _theirs
    with _lock:
        if _calls == 0 and not _theirs and settings.value(settings.FREEZE_HEAP):
            # Frozen already (vLLM's engine core in this process froze its start-up):
            # whoever froze it keeps it so, and this leaves it alone.
            _theirs = gc.get_freeze_count() > 0
            _ours = not _theirs
            if _ours:
                gc.freeze()
        _calls += 1
    try:
        yield
    finally:
        with _lock:
            _calls -= 1
            if _calls == 0 and _ours:
                gc.unfreeze()
                _ours = False
