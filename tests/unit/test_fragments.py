"""Fused projections under tensor parallelism (``worker/fragments.py``): the ranks'
pieces, gathered rank by rank, come out in one device's layout, and each rank's
slices come back out of it, an edit included. No engine: the layouts are vLLM's."""

from __future__ import annotations

import torch

from vllm_nnsight_plugin.seams.worker import fused_layout
from vllm_nnsight_plugin.worker.fragments import one_device, this_rank


def ranks_of(whole: torch.Tensor, totals: list[int], tp: int, replicas: list[int]) -> list[torch.Tensor]:
    """How vLLM holds a one-device fused output over ``tp`` ranks."""
    pieces = whole.split(totals, dim=-1)
    return [
        torch.cat([p.chunk(tp // r, dim=-1)[rank // r] for p, r in zip(pieces, replicas)], dim=-1)
        for rank in range(tp)
    ]


def test_qkv_over_two_ranks_comes_back_as_on_one_device():
    tokens, q, kv, tp = 5, 256, 128, 2
    whole = torch.randn(tokens, q + 2 * kv)
    held = ranks_of(whole, [q, kv, kv], tp, [1, 1, 1])
    gathered = torch.cat(held, dim=-1)  # what nnsight's all-gather gives
    assert not torch.equal(gathered, whole)
    widths = [q // tp, kv // tp, kv // tp]
    assert torch.equal(one_device(gathered, widths, [1, 1, 1], tp), whole)
    for rank in range(tp):
        assert torch.equal(this_rank(whole, widths, [1, 1, 1], tp, rank), held[rank])


def test_keys_and_values_replicated_over_ranks_appear_once():
    tokens, head, tp = 3, 64, 4
    q, kv = 4 * head, 2 * head  # four query heads, two key/value heads, four ranks
    whole = torch.randn(tokens, q + 2 * kv)
    held = ranks_of(whole, [q, kv, kv], tp, [1, 2, 2])
    gathered = torch.cat(held, dim=-1)
    widths, replicas = [head, head, head], [1, 2, 2]
    assert torch.equal(one_device(gathered, widths, replicas, tp), whole)
    edited = whole.clone()
    edited[:, q : q + head] = 0  # the first key head, held by ranks 0 and 1
    for rank in range(tp):
        mine = this_rank(edited, widths, replicas, tp, rank)
        assert torch.equal(mine, ranks_of(edited, [q, kv, kv], tp, replicas)[rank])


def test_which_modules_are_fused():
    class Merged:
        output_sizes, tp_size = [1536, 1536], 2

    class QKV:
        output_sizes, tp_size, num_kv_head_replicas = [256, 128, 128], 4, 2

    class Plain:
        output_sizes, tp_size = [576], 2

    assert fused_layout(Merged()) == ([768, 768], [1, 1])
    assert fused_layout(QKV()) == ([64, 32, 32], [1, 2, 2])
    assert fused_layout(Plain()) is None
