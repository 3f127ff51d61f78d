"""Graphs of the whole forward broken at the taps, without a GPU: which batches the
V2 runner's wraps replay broken (``seams/runner_v2.py``), that vLLM's own capture
still gets fresh inputs, and that a tap's hand-off becomes a break while such a
graph is captured (``taps/ops.py``). The graphs themselves, their replay and what
blocks see in them: ``tests/gpu/test_gpu_taps.py``."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from vllm.config.compilation import CUDAGraphMode

from vllm_nnsight_plugin.seams import runner_v2
from vllm_nnsight_plugin.seams.runner_v2 import V2Runner
from vllm_nnsight_plugin.seams.worker import BREAKS, BROKEN_STEP, StepHooks
from vllm_nnsight_plugin.taps import broken, ops

NONE, FULL, PIECEWISE = CUDAGraphMode.NONE, CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE


@dataclass(frozen=True)
class Desc:
    """A batch descriptor: frozen and hashable, as vLLM's ``BatchExecutionDescriptor``."""

    cg_mode: CUDAGraphMode
    num_tokens: int


def _dispatch(mode: CUDAGraphMode):
    calls = []

    def dispatch_cg_and_sync_dp(
        cudagraph_manager, num_reqs, num_tokens, uniform_token_count, dp_size, dp_rank, need_eager=False
    ):
        calls.append(need_eager)
        return (Desc(NONE if need_eager else mode, num_tokens), None)

    return dispatch_cg_and_sync_dp, calls


def test_a_step_at_the_taps_replays_its_broken_graph_where_one_was_captured_else_runs_without():
    runner = SimpleNamespace()
    manager = SimpleNamespace(**{runner_v2.BROKEN: {Desc(FULL, 64): "broken 64"}})
    runner_v2._RUNNING.append(runner)
    try:
        V2Runner().ask_broken(runner, True)
        assert runner.__dict__[BROKEN_STEP] is True
        original, calls = _dispatch(FULL)
        desc, _ = runner_v2._dispatching(original)(manager, 64, 64, 1, 1, 0)
        assert desc == Desc(FULL, 64) and calls == [False]
        # a batch with no broken graph (another size, or a prefill's pieces): no graph
        original, calls = _dispatch(FULL)
        desc, _ = runner_v2._dispatching(original)(manager, 8, 8, 1, 1, 0)
        assert desc.cg_mode is NONE and calls == [False, True]
        original, calls = _dispatch(PIECEWISE)
        desc, _ = runner_v2._dispatching(original)(manager, 64, 64, None, 1, 0)
        assert desc.cg_mode is NONE and calls == [False, True]
        # data parallel: ranks agree on the dispatch, asked once, without a graph
        original, calls = _dispatch(FULL)
        desc, _ = runner_v2._dispatching(original)(manager, 64, 64, 1, 2, 0)
        assert desc.cg_mode is NONE and calls == [True]
        assert runner.__dict__["_nnsight_graph_modes"] == {"BROKEN": 1, "NONE": 3}
        V2Runner().ask_broken(runner, False)
        original, calls = _dispatch(FULL)
        desc, _ = runner_v2._dispatching(original)(manager, 64, 64, 1, 1, 0)
        assert desc == Desc(FULL, 64) and calls == [False]
    finally:
        runner_v2._RUNNING.pop()


class Replayed:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def replay(self) -> None:
        self.log.append(self.name)


def test_the_broken_graph_is_replayed_in_the_whole_ones_place_for_that_step_only():
    log: list = []
    whole, broken_64 = Replayed("whole", log), Replayed("broken", log)
    desc, other = Desc(FULL, 64), Desc(FULL, 8)
    manager = SimpleNamespace(graphs={desc: whole, other: Replayed("whole 8", log)})
    manager.__dict__[runner_v2.BROKEN] = {desc: broken_64}

    def run_fullgraph(self, desc):  # vLLM's: replay the graph of that batch
        self.graphs[desc].replay()
        return "hidden"

    replays = []
    hooks = StepHooks(*[lambda *a: None] * 4, on_replay=replays.append)
    run = runner_v2._replaying(hooks)(run_fullgraph)
    runner = SimpleNamespace()
    runner_v2._RUNNING.append(runner)
    try:
        assert run(manager, desc) == "hidden" and log == ["whole"] and replays == []
        runner.__dict__[BROKEN_STEP] = True
        assert run(manager, desc) == "hidden" and log[-1] == "broken" and replays == [runner]
        assert manager.graphs[desc] is whole  # put back
        run(manager, other)  # none captured broken: the whole graph
        assert log[-1] == "whole 8" and replays == [runner]
    finally:
        runner_v2._RUNNING.pop()


def test_each_full_graph_is_captured_broken_first_and_vllm_captures_from_fresh_inputs():
    made: list = []
    captured: list = []

    class Capture:
        def __init__(self, pool, weak):
            self.pool = pool

        def __enter__(self):
            captured.append(("enter", self.pool))
            return self

        def __exit__(self, *exc):
            captured.append(("exit",))

    def create_forward_fn(desc, warmup):
        made.append((desc, warmup))
        return (lambda mode: captured.append(("forward", desc, mode.name)), "attention state")

    def capture(self, create_forward_fn):  # vLLM's order: warm-up, then the capture's own inputs
        for desc in (Desc(PIECEWISE, 512), Desc(FULL, 64)):
            create_forward_fn(desc, warmup=True)[0](NONE)
            forward, _ = create_forward_fn(desc, warmup=False)
            forward(desc.cg_mode)  # (vLLM's capture)

    manager = SimpleNamespace(pool="pool")
    runner = SimpleNamespace(cudagraph_manager=manager)
    wrapped = runner_v2._capturing_graphs(capture)
    runner_v2._CAPTURING.append(runner)
    try:
        wrapped(manager, create_forward_fn)  # a runner that asked for nothing
        assert runner_v2.BROKEN not in manager.__dict__ and len(made) == 4
        made.clear(), captured.clear()
        runner.__dict__[BREAKS] = Capture
        wrapped(SimpleNamespace(pool="another"), create_forward_fn)  # another manager (a drafter's)
        assert ("enter", "another") not in captured
        made.clear(), captured.clear()
        wrapped(manager, create_forward_fn)
    finally:
        runner_v2._CAPTURING.pop()
    full = Desc(FULL, 64)
    assert made == [
        (Desc(PIECEWISE, 512), True),
        (Desc(PIECEWISE, 512), False),
        (full, True),
        (full, False),
        (full, False),
    ]
    assert captured[-5:] == [
        ("forward", full, "NONE"),  # warm-up
        ("enter", "pool"),
        ("forward", full, "NONE"),  # the broken capture, as vLLM captures a full graph
        ("exit",),
        ("forward", full, "FULL"),  # vLLM's own, from the inputs made after
    ]
    assert list(manager.__dict__[runner_v2.BROKEN]) == [full]


def test_a_taps_hand_off_is_a_break_of_the_graph_being_captured():
    paused: list = []

    class Capture:
        def pause(self, fn, *args):
            paused.append((fn, args))

    table = torch.zeros((4, 3, 2), dtype=torch.int32)
    table[:, 0].fill_(-1)
    hidden = torch.randn(4, 8)
    bank, how, store = torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(4, 8)
    handed = []
    ops.at_taps(lambda site, out, second: handed.append(site))
    try:
        ops.tap_in_place(hidden, table, bank, how, store, 1, 0)
        assert handed == [1] and paused == []
        broken._CAPTURING[0] = Capture()
        ops.tap_in_place(hidden, table, bank, how, store, 1, 0)
        ((fn, args),) = paused
        assert handed == [1] and args[0] == 1 and args[1] is hidden and args[2] is None
        fn(*args)  # what a replay runs between the two graphs
        assert handed == [1, 1]
    finally:
        broken._CAPTURING[0] = None
        ops.at_taps(None)


def test_one_broken_graph_is_captured_at_a_time():
    capture = broken.BrokenGraph(None, lambda t: t)
    broken._CAPTURING[0] = capture
    try:
        with pytest.raises(RuntimeError, match="already"), broken.BrokenGraph(None, lambda t: t):
            pass
    finally:
        broken._CAPTURING[0] = None


def test_a_broken_capture_that_fails_leaves_vllms_own_capture_and_no_broken_graph(caplog):
    tried: list = []

    class Failing:
        def __init__(self, pool, weak):
            pass

        def __enter__(self):
            tried.append("capture")
            raise RuntimeError("operation not permitted when stream is capturing")

        def __exit__(self, *exc):
            return False

    captured: list = []

    def create_forward_fn(desc, warmup):
        return (lambda mode: captured.append((desc.num_tokens, mode.name)), None)

    def capture(self, create_forward_fn):
        for desc in (Desc(FULL, 64), Desc(FULL, 8)):
            create_forward_fn(desc, warmup=True)[0](NONE)
            create_forward_fn(desc, warmup=False)[0](FULL)

    manager = SimpleNamespace(pool=None)
    runner = SimpleNamespace(cudagraph_manager=manager)
    runner.__dict__[BREAKS] = Failing
    runner_v2._CAPTURING.append(runner)
    try:
        runner_v2._capturing_graphs(capture)(manager, create_forward_fn)
    finally:
        runner_v2._CAPTURING.pop()
    assert tried == ["capture"]  # not tried again for the next size
    assert captured == [(64, "NONE"), (64, "FULL"), (8, "NONE"), (8, "FULL")]
    assert manager.__dict__[runner_v2.BROKEN] == {}
    assert "broken at the taps failed" in caplog.text
