"""A request that drew its ending token, as the worker learns it (no engine: the
CPU build of vLLM reads each step's samples before it schedules the next, so an
engine here never runs a request past that token; ``tests/gpu`` checks it on an
engine that does)."""

from __future__ import annotations

import torch
from vllm import SamplingParams

from vllm_nnsight_plugin.taps.install import Lowered, TapTables
from vllm_nnsight_plugin.taps.kept import rows_kept
from vllm_nnsight_plugin.taps.ops import KEEP_FIRST
from vllm_nnsight_plugin.worker.lowering import Lowering
from vllm_nnsight_plugin.worker.stops import Stops, ending_tokens


def params(**kwargs) -> SamplingParams:
    """Sampling params as the engine hands them to the worker: the end-of-sequence
    token filled in from the model's generation config unless ``ignore_eos``."""
    sampling = SamplingParams(**kwargs)
    sampling.update_from_generation_config({}, eos_token_id=2)
    return sampling


def test_the_ending_tokens_are_those_that_end_a_request_on_every_vllm():
    assert ending_tokens(params()) == {2}
    assert ending_tokens(params(stop_token_ids=[7, 9])) == {2, 7, 9}
    assert ending_tokens(params(ignore_eos=True, stop_token_ids=[7])) == {7}
    assert ending_tokens(params(ignore_eos=True)) == frozenset()
    # vLLM releases differ on whether end-of-sequence ends a request under its
    # min_tokens (a block can force the token): nothing is assumed there.
    assert ending_tokens(params(min_tokens=3, stop_token_ids=[7])) == frozenset()
    assert ending_tokens(None) == frozenset()


def test_a_python_block_sits_out_the_step_after_its_ending_token():
    stops = Stops(enabled=True)
    stops.admit("a", params())
    stops.admit("b", params(stop_token_ids=[7]))
    stops.admit("c", params(ignore_eos=True))  # nothing ends it on a token
    stops.admit("d", params())
    assert set(stops.tokens) == {"a", "b", "d"}
    sampled = torch.tensor([[5], [7], [2], [2]])
    stops.drew(sampled, {"a": 0, "b": 1, "c": 2, "d": 3}, skip=["d"])  # d's chunk is thrown away
    assert stops.ended == {"b"}
    stops.drew(torch.tensor([[2]]), {"a": 0})
    assert stops.ended == {"a", "b"}
    stops.keep_only({"a": None})
    assert stops.ended == {"a"} and set(stops.tokens) == {"a"}


def test_off_where_vllm_reads_samples_before_it_schedules():
    stops = Stops(enabled=False)
    stops.admit("a", params())
    stops.drew(torch.tensor([[2]]), {"a": 0})
    assert not stops.tokens and not stops.ended


def test_a_lowered_block_counts_its_steps_up_to_the_ending_token():
    stops = Stops(enabled=True)
    for name in "abc":
        stops.admit(name, params(stop_token_ids=[7]))
    stops.lowered_drew(torch.tensor([[5], [7], [3]]), [("a", 0, 0), ("b", 1, 0), ("c", 2, 0)])
    stops.lowered_drew(torch.tensor([[7], [9], [3]]), [("a", 0, 1), ("b", 1, 1), ("c", 2, 1)])
    stops.settle()
    assert stops.counted == {"b": 1, "a": 2}  # the first ending token counts, with its step
    stops.forget(["a"])
    assert stops.counted == {"b": 1} and "a" not in stops.tokens


def test_rows_kept_past_the_counted_steps_are_left_out():
    """The rows a keeping block kept in the step vLLM ran past the ending token
    are not among its saves, nor does the line after its loop run."""
    tables = TapTables(("model.layers.0",), max_tokens=8, hidden=3, entries=4, device="cpu", store_size=32)
    keep = Lowered(0, 0, 4, "out", code=KEEP_FIRST, name="rows")
    assert tables.add("k", keep, room=3 + 4)
    hidden = []
    for step, counts in enumerate([3, 1, 1]):
        tables.fill(["k"], [0, counts])
        assert tables.steps("k") == step + 1
        h = torch.randn(8, 3)
        torch.ops.vllm_nnsight.keep(h, torch.zeros(8, 3), tables.codes, tables.dest, tables.store, 0)
        hidden.append(h)
    assert rows_kept(keep, 3, 3) == 5 and rows_kept(keep, 2, 3) == 4 and rows_kept(keep, 0, 3) == 0
    whole = [t.clone() for t in tables.saves(keep)["rows"].unstack()]
    assert [t.shape[0] for t in whole] == [3, 1, 1]
    two = tables.saves(keep, counted=2)["rows"].unstack()
    assert len(two) == 2 and all(torch.equal(a, b) for a, b in zip(two, whole))
    assert torch.equal(two[1], hidden[1][:1])

    class Request:
        engine_id, error = "k", None

    class Index:
        def answering(self, asked):
            return [asked]

    class Book:
        requests = {"k": Request()}

    # The loop asked for 4 steps: with all 3 run it has not ended either way, so
    # no result; with a loop of 3 it ends only if the third step counts.
    keep.stop = 3
    tables._stop[keep.entry] = 3
    saved = Lowering(runner=None).forget(tables, Index(), Book(), ["k"], {"k": 2})
    assert list(saved["k"]) == ["rows"] and len(saved["k"]["rows"].unstack()) == 2


class _Arrival:
    """A device event as ``Stops`` reads one: arrived or not, and whether it was waited for."""

    def __init__(self, arrived: bool) -> None:
        self.arrived, self.waited = arrived, False

    def query(self) -> bool:
        return self.arrived

    def synchronize(self) -> None:
        self.waited = self.waited or not self.arrived  # a wait for one still on its way
        self.arrived = True


def test_beside_the_step_in_flight_only_the_earlier_steps_samples_are_waited_for():
    """A collect beside the step in flight (``worker/ready.py``) waits for the
    samples of the steps before it, which say where its requests ended, and reads
    the in-flight step's only if they have arrived."""
    stops = Stops(enabled=True)
    for name in "ab":
        stops.admit(name, params(stop_token_ids=[7]))
    steps = [(_Arrival(False), torch.tensor([7, 5]), [("a", 0, 0), ("b", 1, 0)])]
    steps.append((_Arrival(False), torch.tensor([9, 7]), [("b", 1, 1)]))  # the step in flight
    for step in steps:  # as lowered_drew notes a GPU step's samples
        stops._pending.append(step)
        stops.noted += 1
    stops.settle(upto=1)
    assert steps[0][0].waited and not steps[1][0].waited
    assert stops.counted == {"a": 1} and len(stops._pending) == 1
    steps[1][0].arrived = True
    stops.settle(upto=1)  # arrived since: read without a wait
    assert not steps[1][0].waited and stops.counted == {"a": 1, "b": 2} and not stops._pending
