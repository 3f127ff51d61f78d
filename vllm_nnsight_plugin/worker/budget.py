"""A time budget for the code a request brings: its block, each step, and the
packing of its saves.

A block runs in the engine's own thread (nnsight's greenlets), so one that never
returns holds the whole engine. :class:`Watchdog` times every stretch of a
request's code (:meth:`Watchdog.running`), adds the stretches of one step up per
request, and when a request is over its budget, a watchdog thread raises a
:class:`BudgetStop` in the engine's thread, where the request's code is running.
A ``BaseException``, so an ``except Exception`` in the block does not swallow it;
where the request's code was called from, it becomes a :class:`BudgetError`,
that request's error like any its block raises: the request fails, its
co-tenants carry on.

The step's watchdog also keeps a memory budget: while a block's stretch runs
longer than a look's interval (100 ms), it reads the worker's resident memory at
each look, and stops the block the same way once that has grown past
``VLLM_NNSIGHT_STEP_MEMORY_BYTES`` since its first look. On a GPU, device
memory needs no such guard: torch raises its out-of-memory error in the block.
On the host, Linux would instead kill the whole engine.

What this cannot stop: code inside one long native call (a ``time.sleep``, a
huge matrix product, a blocking read) gets the error only when that call
returns, since Python raises it between bytecodes; and a bare ``except:`` that
swallows it and carries on is not stopped, nor code whose stop Python happened to
raise inside a finalizer (which prints it and goes on): the stop is raised once
per stretch of code, which is what lets :meth:`Watchdog.run` catch it wherever it
lands. Operators who need a hard stop run the engine under a supervisor that
restarts it (vLLM exits when its engine core stops answering).
"""

from __future__ import annotations

import ctypes
import math
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import PluginError
from ..settings import PACK_BUDGET_S, STEP_BUDGET_S, STEP_MEMORY_BYTES, value


class BudgetStop(BaseException):
    """Raised in the engine's thread inside the request's code (by class: Python's
    asynchronous raise takes no instance); :meth:`Watchdog.error` turns it into
    the request's :class:`BudgetError` where that code was called."""


class StepStop(BudgetStop):
    pass


class PackStop(BudgetStop):
    pass


class BudgetError(PluginError, RuntimeError):
    """A request's code ran past one of the engine's time budgets and was stopped."""


class StepBudgetError(BudgetError):
    """A block ran past ``VLLM_NNSIGHT_STEP_BUDGET_S`` within one step."""


class PackBudgetError(BudgetError):
    """Packing a request's saves ran past ``VLLM_NNSIGHT_PACK_BUDGET_S``."""


class StepMemoryStop(StepStop):
    pass


class StepMemoryError(StepBudgetError):
    """A block grew its worker's memory past ``VLLM_NNSIGHT_STEP_MEMORY_BYTES``."""


#: How often a running block's memory is looked at.
MEMORY_EVERY_S = 0.1
#: The size of the pages ``/proc/self/statm`` counts.
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident memory now (None where ``/proc`` is not there)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class _Withdrawn(BaseException):
    """Replaces a stop that was sent but not raised yet, and is raised (and caught)
    at once in :func:`_withdraw`."""


def _raise_in(thread_id: int, exception: type[BaseException]) -> None:
    """Raise ``exception`` in the thread, at its next bytecode boundary."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exception))


def _noop() -> None:
    pass


def _withdraw() -> None:
    """Take back a stop sent to this thread and not raised yet.

    Not by sending NULL: CPython then keeps the interpreter's "asynchronous
    exception pending" flag set, and every thread pays a slow check at every
    bytecode boundary from then on. A stand-in is sent in its place and raised
    here, which clears the flag."""
    try:
        _raise_in(threading.get_ident(), _Withdrawn)
        while True:  # raised at the next check: a call's entry
            _noop()
    except _Withdrawn:
        pass


class Watchdog:
    """Times request code and stops what runs over; one per budget per worker.

    The hot path (:meth:`run`, around every switch into a block) takes one
    uncontended lock on the way in and one on the way out. The lock is what makes
    the raise safe: the watcher raises only while it holds it and request code is
    running, and leaving withdraws a raise not yet delivered before it lets go, so
    the stop never lands in the engine's own code after that; one that lands
    before it is caught by :meth:`run`. Everything the engine's thread
    runs while holding the lock, and everything it uses to wake the watcher, is C
    (a plain lock, a ``SimpleQueue``): Python code there could take the stop
    half-way through and leave the lock held.
    """

    def __init__(
        self,
        budget_s: float,
        stop: type[BudgetStop],
        error: type[BudgetError],
        message: str,
        *,
        memory_bytes: int = 0,
        memory_stop: type[BudgetStop] = StepMemoryStop,
        memory_error: type[BudgetError] = StepMemoryError,
        memory_message: str = "",
    ) -> None:
        self.budget_s = budget_s
        self.stop = stop
        self._error, self._message = error, message
        self.memory_bytes = memory_bytes if resident_bytes() is not None else 0
        self._memory_stop, self._memory_error, self._memory_message = (
            memory_stop,
            memory_error,
            memory_message,
        )
        if budget_s <= 0:
            self.budget_s = float("inf")  # no time limit; the memory one may still be on
        self.on = budget_s > 0 or self.memory_bytes > 0
        #: How long the watcher stays on a timer after a stretch starts.
        self._horizon_s = self.budget_s if math.isfinite(self.budget_s) else 60.0
        #: How often it looks while stretches keep starting.
        self._tick_s = max(0.001, min(self._horizon_s / 8, MEMORY_EVERY_S if self.memory_bytes else math.inf))
        self.wakeups = 0  # how often the watcher woke (its cost to the engine's thread)
        self._stretch = 0  # counts outermost entries: which stretch a look belongs to
        self._rss_at: int | None = None  # the running stretch's memory at its first look
        self._lock = threading.Lock()
        self._wake: queue.SimpleQueue = queue.SimpleQueue()
        self._spent: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        self._owner: Any = None  # whose code is running now (the outermost entry)
        self._thread = 0
        self._started = self._deadline = self._raised_at = 0.0
        self._depth = 0
        self._delivered = False  # the stop sent, if any, was raised
        self._sleeping_until: float | None = None  # the watcher's next look (None: until woken)
        self.stopped = 0  # how many times a stop was sent
        self.withdrawn = 0  # how many of those were taken back before they were raised (the code had left)
        self._watcher: threading.Thread | None = None

    def _spent_by(self, owner: Any) -> float:
        try:
            return self._spent.get(owner, 0.0)
        except TypeError:  # an owner that cannot be weakly referenced keeps no account
            return 0.0

    def error(self, stop: BudgetStop) -> BudgetError:
        """The request's error for a stop raised in its code, with the stop's traceback
        (which shows the line of the block it was stopped at)."""
        self._delivered = True
        if isinstance(stop, self._memory_stop):
            error = self._memory_error(self._memory_message)
        else:
            error = self._error(self._message)
        error.__intervention_tb__ = getattr(stop, "__intervention_tb__", stop.__traceback__)  # type: ignore[attr-defined]
        return error.with_traceback(stop.__traceback__)

    def new_step(self) -> None:
        """Budgets are per step: what each request spent so far is forgotten."""
        with self._lock:
            self._spent.clear()

    def run(self, owner: Any, code: Callable[..., Any], *args: Any) -> Any:
        """``code(*args)``, timed as ``owner``'s: what it returns, or what it raised,
        with a stop turned into the owner's :class:`BudgetError`.

        A stop is sent from another thread and lands at the engine thread's next
        check, which may already be past ``code``: in the code that switched back
        from a block, or at the entry of :meth:`_leave`, before it takes the lock
        that withdraws a stop not yet raised. So both are inside handlers here:
        everything from :meth:`enter` to the end of :meth:`_leave`. Between the two
        handlers are only instructions at which Python raises nothing (no call, no
        backward jump), and a stretch gets one stop at most, so a stop caught once
        cannot come again: none can leave this method as a stop."""
        if not self.on:
            return code(*args)
        raised: BaseException | None = None
        try:
            self.enter(owner)
            result = code(*args)
        except BudgetStop as stop:
            raised = stop
            self._delivered = True
        except BaseException as error:
            raised = error
        while True:
            try:
                self._leave()
                break
            except BudgetStop as stop:  # landed on the way out: the stretch ran over
                self._delivered = True
                if raised is None:
                    raised = stop
        try:
            if isinstance(raised, BudgetStop):
                raise self.error(raised) from None
            if raised is not None:
                raise raised
        finally:
            raised = None  # the error's traceback holds this frame: no cycle through it
        return result

    def enter(self, owner: Any) -> None:
        """``owner``'s code (a block's mediator, a request's saves) starts running.

        Use :meth:`run`, which also leaves: once this has set the deadline, the
        stop may come at any check, this method's own last ones included."""
        if not self.on:
            return
        if self._watcher is None:  # before the deadline is set: no stop can land in threading's code
            self._watcher = threading.Thread(target=self._watch, name="vllm-nnsight-budget", daemon=True)
            self._watcher.start()
        wake = False
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                now = time.monotonic()
                self._owner, self._thread, self._started = owner, threading.get_ident(), now
                self._deadline = now + self.budget_s - self._spent_by(owner)
                self._raised_at = 0.0
                self._delivered = False
                self._stretch += 1
                self._rss_at = None
                wake = self._sleeping_until is None  # asleep until woken; else its timer covers this
                if wake:
                    self._sleeping_until = now  # woken now: not idle until it has looked
        if wake:
            self._wake.put(None)

    def _leave(self) -> None:
        """The code :meth:`enter` announced returned (or raised)."""
        with self._lock:
            if self._raised_at and not self._delivered and self._thread == threading.get_ident():
                _withdraw()
                self._delivered = True
                self.withdrawn += 1
            if self._depth == 0:
                return  # already left, on a try a stop interrupted
            self._depth -= 1
            if self._depth:
                return
            owner, self._owner = self._owner, None
            try:
                self._spent[owner] = self._spent_by(owner) + time.monotonic() - self._started
            except TypeError:
                pass

    def _watch(self) -> None:
        """Looks at the running code on a timer while request code keeps running,
        and sleeps until woken once it has stopped for a while.

        Stretches of request code are short and many (one per switch into a
        block), and waking this thread takes the interpreter from the engine's
        thread, so an entry wakes it only from that long sleep. While stretches
        keep starting (one began within the last budget) it looks every tick (an
        eighth of the budget; the memory budget's interval when that is on), so a
        stretch is stopped at most a tick past its deadline. An idle engine (or a
        test process) pays nothing."""
        while True:
            until = self.look()
            try:
                self._wake.get(timeout=None if until is None else max(0.0, until - time.monotonic()))
            except queue.Empty:
                pass

    def look(self) -> float | None:
        """One look of the watcher's: stop the running stretch if it is over its
        budget; when to look next (None: when woken)."""
        look = None
        with self._lock:
            now = time.monotonic()
            self.wakeups += 1
            running = self._owner is not None and not self._raised_at
            if running and now >= self._deadline:
                self._stop(self.stop, now)
                running = False
            elif running and self.memory_bytes:
                look = self._stretch
            if self._owner is None and now >= self._started + self._horizon_s:
                self._sleeping_until = None  # idle: until an entry wakes it
            else:
                self._sleeping_until = min(now + self._tick_s, self._deadline if running else math.inf)
            until = self._sleeping_until
        if look is not None:
            until = self._look_at_memory(look, until)
        return until

    def _look_at_memory(self, stretch: int, until: float | None) -> float | None:
        """Read the process's memory (outside the lock: a file read), then stop the
        stretch it was read for if that grew past the budget since its first look."""
        resident = resident_bytes()
        with self._lock:
            if resident is None or stretch != self._stretch or self._owner is None or self._raised_at:
                return until
            if self._rss_at is None:
                self._rss_at = resident
            elif resident - self._rss_at > self.memory_bytes:
                self._stop(self._memory_stop, time.monotonic())
                return None
            return until

    def _stop(self, stop: type[BudgetStop], now: float) -> None:
        """Raise ``stop`` in the running code; once per stretch. Under the lock."""
        _raise_in(self._thread, stop)
        self._raised_at = now
        self.stopped += 1
        self._sleeping_until = None


def watchdogs() -> tuple[Watchdog, Watchdog]:
    """The step budget's watchdog and the packing budget's, as the settings say."""
    step_s, pack_s = float(value(STEP_BUDGET_S)), float(value(PACK_BUDGET_S))
    memory = int(value(STEP_MEMORY_BYTES))
    step = Watchdog(
        step_s,
        StepStop,
        StepBudgetError,
        f"the block ran past this engine's budget of {step_s:g} s for one step "
        "(VLLM_NNSIGHT_STEP_BUDGET_S) and was stopped; the engine's other requests went on. "
        "A loop that never ends, or work too slow for one step: save the tensors and do "
        "the heavy work at home.",
        memory_bytes=memory,
        memory_message=f"the block grew this worker's memory by more than {memory / 2**20:g} MiB "
        "while it ran (VLLM_NNSIGHT_STEP_MEMORY_BYTES) and was stopped; the engine's other "
        "requests went on. Keep what a block builds small: save tensors rather than "
        "accumulating copies.",
    )
    pack = Watchdog(
        pack_s,
        PackStop,
        PackBudgetError,
        f"packing this request's saves ran past this engine's budget of {pack_s:g} s "
        "(VLLM_NNSIGHT_PACK_BUDGET_S), so they were dropped. Save tensors and plain "
        "values: an object whose pickling runs long cannot be sent back.",
    )
    return step, pack
