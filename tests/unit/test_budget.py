"""The time budget's watchdog, without an engine: it stops code that runs over,
never raises outside the code it times, and counts per step. An engine whose
blocks loop forever is in ``test_hostile_blocks.py``."""

from __future__ import annotations

import ctypes
import functools
import random
import time

import pytest

from vllm_nnsight_plugin.worker.budget import (
    StepBudgetError,
    StepMemoryError,
    StepStop,
    Watchdog,
    resident_bytes,
)


def watchdog(budget_s: float) -> Watchdog:
    return Watchdog(budget_s, StepStop, StepBudgetError, f"over {budget_s} s")


def run(watch: Watchdog, owner, body):
    """``body`` as the runtime runs request code: a stop becomes the request's error."""
    return watch.run(owner, body)


class Owner:
    pass


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_loop_that_never_ends_is_stopped_with_the_budget_named():
    watch, owner = watchdog(0.3), Owner()

    def forever():
        while True:
            pass

    started = time.monotonic()
    with pytest.raises(StepBudgetError, match="over 0.3 s"):
        run(watch, owner, forever)
    assert 0.3 <= time.monotonic() - started < 2.0


def test_except_exception_does_not_swallow_the_stop():
    watch = watchdog(0.2)

    def careless():
        while True:
            try:
                sum(range(1000))
            except Exception:
                pass

    with pytest.raises(StepBudgetError):
        run(watch, Owner(), careless)


def test_a_stop_never_lands_outside_the_code_it_times():
    """Stretches that straddle the deadline, thousands of times: every stop is
    raised inside a stretch, none in the code between them."""
    watch = watchdog(0.002)
    inside = outside = 0
    rng = random.Random(0)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        owner = Owner()
        watch.new_step()

        try:
            run(watch, owner, functools.partial(spin, rng.uniform(0.0, 0.004)))
        except StepBudgetError:
            inside += 1
        try:
            spin(0.001)
        except BaseException:
            outside += 1
    assert inside > 10
    assert outside == 0


def test_the_budget_is_per_step_and_per_owner():
    watch, owner, other = watchdog(0.5), Owner(), Owner()
    run(watch, owner, lambda: time.sleep(0.3))
    run(watch, other, lambda: time.sleep(0.3))  # its own budget
    with pytest.raises(StepBudgetError):  # 0.3 + 0.3 > 0.5 within one step
        run(watch, owner, lambda: [time.sleep(0.05) for _ in range(10)])
    watch.new_step()
    run(watch, owner, lambda: time.sleep(0.3))


def test_a_long_native_call_is_stopped_when_it_returns():
    watch = watchdog(0.2)
    started = time.monotonic()
    with pytest.raises(StepBudgetError):
        run(watch, Owner(), lambda: [time.sleep(0.5), sum(range(10))])
    assert time.monotonic() - started >= 0.5


def test_off_times_nothing():
    watch = watchdog(0)
    assert run(watch, Owner(), lambda: 3) == 3
    assert watch._watcher is None


def test_an_owner_that_cannot_be_weakly_referenced_is_timed_too():
    watch = watchdog(0.2)
    assert run(watch, {"saves": 1}, lambda: 3) == 3
    with pytest.raises(StepBudgetError):
        run(watch, {"saves": 1}, lambda: [time.sleep(0.3), 1])


def test_an_idle_watchdog_does_not_wake():
    """Between requests the watcher thread sleeps until it is needed (no timeout),
    so it never takes the interpreter from the engine's thread."""
    watch = watchdog(0.5)
    run(watch, Owner(), lambda: 1)
    deadline = time.monotonic() + 2.0
    while watch._sleeping_until is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch._sleeping_until is None  # waiting to be woken, not for a time
    watch._wake.put(None)  # a spurious wake-up finds nothing to do and sleeps again
    time.sleep(0.05)
    assert watch._sleeping_until is None and watch.stopped == 0


def test_a_stop_taken_back_leaves_nothing_pending():
    """A stop sent and taken back before it was raised: nothing is raised later,
    and the interpreter runs at its usual speed afterwards (taking it back by
    sending NULL would leave CPython checking for it at every bytecode boundary)."""
    import threading

    from vllm_nnsight_plugin.worker.budget import _raise_in, _withdraw

    def loop() -> float:
        started = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i
        return time.perf_counter() - started

    before = min(loop() for _ in range(3))
    try:  # as leave() does: a stop still in flight may be raised on the way in; it is caught
        _raise_in(threading.get_ident(), StepStop)
        _withdraw()
    except StepStop:
        pass
    for _ in range(1000):  # nothing left to be raised
        _ = [1]
    after = min(loop() for _ in range(3))
    assert after < 1.5 * before + 0.01


def memory_watchdog(budget_s: float, limit_bytes: int) -> Watchdog:
    return Watchdog(
        budget_s,
        StepStop,
        StepBudgetError,
        "over time",
        memory_bytes=limit_bytes,
        memory_message="over memory",
    )


def test_a_block_that_allocates_without_end_is_stopped_before_the_host_runs_out():
    """Without the memory budget a trusted block that keeps allocating grows the
    worker until Linux kills the engine; with it, the block gets its error a look
    or two past the limit, and what it built is freed."""
    watch, limit = memory_watchdog(0, 256 << 20), 256 << 20
    before = resident_bytes()
    grown = []

    def hoard():
        kept = []
        while True:
            kept.append(bytearray(1 << 20))  # 1 MiB, touched
            grown[:] = [resident_bytes() - before]

    with pytest.raises(StepMemoryError, match="over memory"):
        run(watch, Owner(), hoard)
    assert limit < grown[0] < limit + (2 << 30)  # stopped within a look or two of the limit
    ctypes.CDLL(None).malloc_trim(0)  # give back what the allocator keeps for reuse
    assert resident_bytes() - before < limit  # the block's list was freed with it


def test_the_memory_budget_leaves_long_blocks_that_do_not_allocate_and_small_allocations_alone():
    watch = memory_watchdog(0, 64 << 20)
    assert run(watch, Owner(), lambda: [spin(0.2), len(bytearray(8 << 20))][1]) == 8 << 20
    assert watch.stopped == 0
    assert run(watch, Owner(), lambda: 5) == 5


def test_the_time_budget_still_holds_with_the_memory_budget_on():
    watch = memory_watchdog(0.2, 1 << 30)
    with pytest.raises(StepBudgetError, match="over time") as caught:
        run(watch, Owner(), functools.partial(spin, 5))
    assert not isinstance(caught.value, StepMemoryError)


def test_short_stretches_in_quick_succession_do_not_wake_the_watcher():
    """A block's code runs in many short stretches (one per switch into it), with
    the engine's own work between them; each wake of the watcher takes the
    interpreter from the engine's thread. So while stretches keep coming the
    watcher wakes on its timer only (a tick: an eighth of the budget, or the
    memory look's interval), never once per stretch."""
    for watch in (watchdog(0.3), memory_watchdog(0.3, 1 << 30)):
        owner = Owner()
        started = time.monotonic()
        stretches = 0
        while time.monotonic() - started < 1.5:
            run(watch, owner, lambda: 1)
            spin(0.0002)  # the engine's work between two switches
            stretches += 1
            if stretches % 100 == 0:
                watch.new_step()
        ticks = (time.monotonic() - started) / watch._tick_s
        assert stretches > 1000
        assert watch.wakeups <= 1.5 * ticks + 3, (watch.wakeups, ticks, stretches)


def test_a_finished_blocks_saved_ids_are_forgotten():
    """``worker/_nnsight.OwnedSaves``: ids saved while a block runs are that
    block's, and leave nnsight's save set with it, whatever other blocks saved."""
    from vllm_nnsight_plugin.worker._nnsight import OwnedSaves

    saves, first, second = OwnedSaves({1}), Owner(), Owner()
    saves.owner = first
    saves.add(10)
    saves.add(11)
    saves.owner = second
    saves.add(20)
    saves.add(11)  # the same id saved by two blocks stays while either holds it
    saves.owner = None
    saves.add(30)  # saved outside any block: kept until the set is cleared
    saves.forget(first)
    assert saves == {1, 11, 20, 30}
    saves.forget(second)
    saves.forget(second)
    assert saves == {1, 30}
    third = Owner()
    saves.owner = third
    saves.add(40)
    saves.owner = None
    del third  # a block nobody collects (an installed edit's copy): freed with its mediator
    import gc

    gc.collect()
    assert saves == {1, 30}


class Racing:
    """A thread that looks as the watcher does, as fast as it can, with the
    interpreter handed between threads every microsecond: stops land at every
    point of the engine thread's code, not only at the watcher's ticks."""

    def __init__(self, watch: Watchdog) -> None:
        import threading

        self.watch, self.done = watch, False
        self.thread = threading.Thread(target=self._race, daemon=True)

    def _race(self) -> None:
        while not self.done:
            self.watch.look()

    def __enter__(self) -> Racing:
        import sys

        self.interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        import sys

        self.done = True
        self.thread.join()
        sys.setswitchinterval(self.interval)


def test_a_hundred_thousand_stops_racing_the_switch_each_become_the_blocks_error():
    """nnsight's own ``Mediator.switch`` into a block's greenlet, wrapped as the
    worker wraps it, with every stretch over its budget and stops sent at random
    points: each stop raised becomes that block's ``StepBudgetError`` (the rest
    were taken back unraised, the block having left), none comes out as a bare
    stop (which would end the engine), and the saves' owner is always restored."""
    from greenlet import getcurrent, greenlet
    from nnsight.intervention.interleaver import Mediator

    from vllm_nnsight_plugin.worker._nnsight import owned_saves, timed_switch

    watch = watchdog(1e-9)
    switch = timed_switch(Mediator.switch, watch)
    saves = owned_saves()

    class Block:  # what Mediator.switch reads: the block's greenlet
        def __init__(self) -> None:
            self.worker = greenlet(self.body)

        def body(self) -> int:
            total = 0
            for step in range(3):
                total += step
                getcurrent().parent.switch(total)  # parks at a location, as a block does
            return total

    errors, escaped, owner_changed, finished = 0, [], 0, []
    with Racing(watch):
        while watch.stopped < 100_000:
            block = Block()
            while not block.worker.dead:
                try:
                    switch(block)
                except StepBudgetError:
                    errors += 1
                    break
                except BaseException as error:  # noqa: BLE001 - what must never happen
                    escaped.append(error)
                    break
                finally:
                    owner_changed += saves.owner is not None
            finished.append(block)
            if len(finished) > 1000:  # freed outside any stretch: finalizers swallow nothing
                finished.clear()
    finished.clear()
    assert escaped == [] and owner_changed == 0
    assert errors + watch.withdrawn == watch.stopped >= 100_000
    assert errors > 0.9 * watch.stopped
    for _ in range(10_000):  # nothing is left pending in this thread
        _ = [1]


def test_stops_racing_the_packing_of_saves_each_become_the_requests_error():
    """``collect.pack`` times the pickling of a request's saves the same way: a stop
    anywhere is that request's ``PackBudgetError`` in its reply, never a bare stop."""
    import pickle

    import torch

    from vllm_nnsight_plugin.returns.pool import Pooler
    from vllm_nnsight_plugin.wire.envelope import Limits
    from vllm_nnsight_plugin.worker.budget import PackBudgetError, PackStop
    from vllm_nnsight_plugin.worker.collect import pack

    watch = Watchdog(1e-9, PackStop, PackBudgetError, "packing ran over")
    limits, saves = Limits(), {"rows": torch.ones(4, 8), "names": [str(n) for n in range(50)]}
    errors = sent = 0
    with Racing(watch):
        while watch.stopped < 20_000:
            entry = {"saves": dict(saves), "error": None, "sequences": {}, "edits": {}}
            reply = pickle.loads(pack("r", entry, limits, None, Pooler(), watch))
            error = reply["r"]["error"]
            if error is None:
                sent += 1
            else:
                assert error["type_name"] == "PackBudgetError", error
                errors += 1
    assert errors + watch.withdrawn == watch.stopped >= 20_000
