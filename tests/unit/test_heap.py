"""The tracing process's heap frozen for the span of a trace (``client/heap.py``)."""

from __future__ import annotations

import gc

import pytest

from vllm_nnsight_plugin import settings
from vllm_nnsight_plugin.client import heap
from vllm_nnsight_plugin.client.heap import frozen


@pytest.fixture(autouse=True)
def _thawed(monkeypatch):
    gc.unfreeze()
    monkeypatch.setattr(heap, "_theirs", False)
    yield
    gc.unfreeze()


def test_what_was_alive_is_frozen_while_a_trace_runs_and_thawed_after(monkeypatch):
    monkeypatch.delenv(settings.FREEZE_HEAP, raising=False)
    before = object.__new__(type("Before", (), {}))  # alive before the trace
    with frozen():
        assert gc.get_freeze_count() > 0
        made = [[]]  # made during it: not frozen, a collection still walks it
        assert gc.is_tracked(made)
        with frozen():  # a second trace in flight changes nothing
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0  # the first still runs
    assert gc.get_freeze_count() == 0
    assert before is not None


def test_the_heap_thaws_when_the_trace_raises(monkeypatch):
    monkeypatch.delenv(settings.FREEZE_HEAP, raising=False)
    with pytest.raises(RuntimeError), frozen():
        raise RuntimeError("the block failed")
    assert gc.get_freeze_count() == 0


def test_garbage_made_during_a_trace_is_collected_during_it(monkeypatch):
    monkeypatch.delenv(settings.FREEZE_HEAP, raising=False)

    class Cycle:
        pass

    with frozen():
        a, b = Cycle(), Cycle()
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2


def test_a_heap_frozen_by_someone_else_stays_frozen(monkeypatch):
    monkeypatch.delenv(settings.FREEZE_HEAP, raising=False)
    gc.freeze()  # as vLLM's engine core does after start-up, in this process
    count = gc.get_freeze_count()
    with frozen():
        pass
    # still frozen (a thaw empties it; a frozen object freed meanwhile leaves it)
    assert gc.get_freeze_count() > count // 2


def test_off_leaves_the_collector_as_it_is(monkeypatch):
    monkeypatch.setenv(settings.FREEZE_HEAP, "0")
    with frozen():
        assert gc.get_freeze_count() == 0


def test_a_freeze_not_ours_is_counted_once(monkeypatch):
    """Counting the frozen objects walks all of them: once another's freeze is
    seen, later traces neither count them again nor freeze on top of it."""
    monkeypatch.delenv(settings.FREEZE_HEAP, raising=False)
    counted = []
    count = gc.get_freeze_count

    def counting() -> int:
        counted.append(1)
        return count()

    monkeypatch.setattr(gc, "get_freeze_count", counting)
    gc.freeze()  # someone else's
    frozen_before = count()
    for _ in range(3):
        with frozen():
            pass
    assert len(counted) == 1
    assert count() > frozen_before // 2  # theirs, still in force
