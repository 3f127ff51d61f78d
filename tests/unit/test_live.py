"""Blocks at the taps, without an engine: what each tap hands the interleaver, in
which order, and how a replacement reaches the forward's own tensors
(``worker/live.py``; the engine's side is in ``tests/engine/test_compiled.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_nnsight_plugin.taps import ops
from vllm_nnsight_plugin.worker.live import AtTaps, _write_back


def tables():
    sites = [
        "model.layers.10",
        "model.layers.10.self_attn.attn.inputs.0",
        "model.layers.10.self_attn.attn.inputs.1",
        "model.layers.10.self_attn.attn.inputs.2",
        "model.layers.12.mlp",
        "model.layers.4.self_attn.qkv_proj",
    ]
    return SimpleNamespace(
        sites=sites,
        handed={},
        pair_sites={0},
        first_sites={5},
        inputs={"model.layers.10.self_attn.attn": [1, 2, 3]},
        reached={},
    )


class Interleaver:
    """Records each hand-off; replaces the MLP's output with twice itself."""

    def __init__(self):
        self.handed = []

    def handle(self, location, value):
        self.handed.append((location, value))
        if location.endswith("mlp.output"):
            return value * 2
        if location.endswith("layers.10.output"):
            value[0][:] += 1  # an edit in place
        return value


def test_each_tap_hands_its_locations_value_as_the_module_returns_it():
    interleaver = Interleaver()
    live = AtTaps(tables(), {0, 1, 2, 3, 4, 5}, interleaver, "root", None)
    hidden, residual = torch.ones(2, 4), torch.zeros(2, 4)
    q, k, v, mlp, qkv = (torch.full((2, 4), float(i)) for i in range(5))
    live(5, qkv, None)
    live(1, q, None)
    live(2, k, None)
    assert [location for location, _ in interleaver.handed] == [
        "root.model.layers.4.self_attn.qkv_proj.output"
    ]
    live(3, v, None)  # the last of attention's inputs: all three are handed, once
    live(0, hidden, residual)
    live(4, mlp, None)
    locations = [location for location, _ in interleaver.handed]
    assert locations == [
        "root.model.layers.4.self_attn.qkv_proj.output",
        "root.model.layers.10.self_attn.attn.input",
        "root.model.layers.10.output",
        "root.model.layers.12.mlp.output",
    ]
    values = [value for _, value in interleaver.handed]
    # the blocks get copies, which outlive the forward's buffers (a CUDA graph's)
    assert torch.equal(values[0][0], qkv) and values[0][0] is not qkv and values[0][1] is None
    assert values[1][1] == {} and all(
        torch.equal(a, b) and a is not b for a, b in zip(values[1][0], (q, k, v))
    )
    assert values[2][0] is not hidden and values[2][1] is not residual
    # what the blocks left in them goes back into the forward's own tensors
    assert torch.equal(hidden, torch.full((2, 4), 2.0)) and torch.equal(residual, torch.zeros(2, 4))
    assert torch.equal(mlp, torch.full((2, 4), 6.0))  # the replacement, in the forward's own tensor
    assert live.handed == 4 and live.failure is None
    hidden.fill_(7.0)  # the forward's buffer reused: a value a block kept is its own
    assert torch.equal(values[2][0], torch.full((2, 4), 2.0))


def test_a_tap_no_block_reads_hands_nothing_and_a_block_calling_a_tapped_module_is_not_reentered():
    interleaver = Interleaver()
    live = AtTaps(tables(), {4}, interleaver, "root", None)
    live(0, torch.ones(2, 4), torch.ones(2, 4))
    assert interleaver.handed == []
    live.busy = True  # inside a hand-off
    live(4, torch.ones(2, 4), None)
    assert interleaver.handed == []


def test_a_failing_hand_off_is_kept_for_the_step_not_raised_into_the_forward():
    class Broken:
        def handle(self, location, value):
            raise RuntimeError("boom")

    live = AtTaps(tables(), {4}, Broken(), "root", None)
    live(4, torch.ones(2, 4), None)
    assert isinstance(live.failure, RuntimeError) and not live.busy


def test_a_replacement_is_copied_into_the_tensors_it_replaces():
    hidden, residual = torch.zeros(2, 3), torch.zeros(2, 3)
    _write_back((hidden, residual), (torch.ones(2, 3), residual))
    assert torch.equal(hidden, torch.ones(2, 3)) and torch.equal(residual, torch.zeros(2, 3))
    q = torch.zeros(1, 2)
    _write_back(((q,), {}), ((torch.full((1, 2), 3.0),), {}))
    assert torch.equal(q, torch.full((1, 2), 3.0))
    try:
        _write_back(hidden, torch.ones(3, 3))
    except ValueError as error:
        assert "(3, 3)" in str(error)
    else:
        raise AssertionError("a replacement of another shape was copied")


def test_the_tap_operations_hand_their_value_only_while_a_hook_is_set():
    seen = []
    hidden, second = torch.ones(3, 4), torch.zeros(3, 4)
    slots = torch.full((1, 3), -1, dtype=torch.int32)
    bank, how = torch.zeros(1, 4), torch.zeros(1, 4)
    ops.at_taps(lambda site, out, pair: seen.append((site, out, pair)))
    try:
        out = torch.ops.vllm_nnsight.steer_pair(hidden, second, slots, bank, how, 0)
        single = torch.ops.vllm_nnsight.steer(hidden, hidden, slots, bank, how, 0)
    finally:
        ops.at_taps(None)
    torch.ops.vllm_nnsight.steer(hidden, hidden, slots, bank, how, 0)
    assert len(seen) == 2
    assert seen[0][1] is out and seen[0][2] is second and seen[1][1] is single and seen[1][2] is None


def test_a_batch_padded_for_a_graph_hands_the_blocks_the_steps_rows_only():
    interleaver = Interleaver()
    live = AtTaps(tables(), {0, 4}, interleaver, "root", None, rows=3)
    hidden, residual = torch.ones(4, 4), torch.zeros(4, 4)  # 3 rows and one of padding
    live(0, hidden, residual)
    mlp = torch.ones(4, 4)
    live(4, mlp, None)
    (_, (got, got_residual)), (_, got_mlp) = interleaver.handed
    assert got.shape == (3, 4) and got_residual.shape == (3, 4) and got_mlp.shape == (3, 4)
    assert torch.equal(hidden[:3], torch.full((3, 4), 2.0)) and torch.equal(hidden[3], torch.ones(4))
    assert torch.equal(mlp[:3], torch.full((3, 4), 2.0)) and torch.equal(mlp[3], torch.ones(4))
