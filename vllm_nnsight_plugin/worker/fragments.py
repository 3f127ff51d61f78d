"""Fused projections under tensor parallelism, in the order one device has them.

nnsight gathers a column-parallel layer's output by concatenating the ranks'
pieces, which is the whole tensor for a plain layer. A fused layer is several
projections side by side (``qkv_proj``: queries, keys, values; ``gate_up_proj``:
gate, up), and each rank holds its slice *of each*, so the ranks' concatenation
comes out rank by rank (``q0 k0 v0 | q1 k1 v1``), not as the one-device tensor
(``q0 q1 | k0 k1 | v0 v1``). :class:`FusedFragments` reorders the gathered tensor
into the one-device layout before a block sees it, and takes this rank's slices
back out of it (an edit included) before vLLM goes on. Keys and values that
vLLM replicates over ranks (fewer key/value heads than ranks) appear once, as
on one device.

The MLP's activation (``mlp.act_fn.output``) is no parallel layer's, but each
rank computes it from its own slice of ``gate_up_proj``: its columns of the
intermediate features, which the ranks' concatenation puts in one device's
order. It is gathered and split like a column-parallel output. So are the
attention kernel's arguments (``self_attn.attn.input``: the rotated queries,
keys and values, each rank's own heads), where each rank holds key/value heads
of its own; where vLLM repeats them over ranks (fewer key/value heads than
ranks) they stay each rank's.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from nnsight.modeling.vllm.fragments import VLLMFragments
from nnsight.util import apply

from .. import seams


def one_device(gathered: torch.Tensor, widths: list[int], replicas: list[int], tp: int) -> torch.Tensor:
    """The ranks' concatenation (rank by rank) in one device's layout (piece by piece)."""
    per_rank = gathered.reshape(*gathered.shape[:-1], tp, sum(widths))
    pieces = per_rank.split(widths, dim=-1)
    whole = []
    for piece, copies in zip(pieces, replicas):
        kept = piece[..., ::copies, :]  # one rank of each group that holds the same slice
        whole.append(kept.reshape(*gathered.shape[:-1], -1))
    return torch.cat(whole, dim=-1)


def this_rank(
    whole: torch.Tensor, widths: list[int], replicas: list[int], tp: int, rank: int
) -> torch.Tensor:
    """This rank's slices of a one-device tensor, side by side as the rank holds them."""
    totals = [width * tp // copies for width, copies in zip(widths, replicas)]
    pieces = whole.split(totals, dim=-1)
    mine = [
        piece.narrow(-1, (rank // copies) * width, width)
        for piece, width, copies in zip(pieces, widths, replicas)
    ]
    return torch.cat(mine, dim=-1).contiguous()


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous()


#: The side recorded for a value computed from a column-parallel layer's output
#: (gathered and split as that layer's output, with no fused layout).
ACTIVATION = "activation"


class FusedFragments(VLLMFragments):
    """nnsight's gathering, with fused projections laid out as on one device, and
    the MLP's activation gathered too."""

    def instrument(self, envoy: Any) -> None:
        super().instrument(envoy)
        for path, layer in seams.sliced_values(envoy._module):
            self.rules[f"{envoy.path}.{path}"] = (layer, ACTIVATION)
            self.enabled = True

    def _layout(self, location: str) -> tuple[list[int], list[int]] | None:
        module, side = self.rules[location]
        return seams.fused_layout(module) if side == "output" else None

    def whole(self, location: str, value: Any) -> tuple[Any, Any]:
        # vLLM's CPU all-gather (its shared-memory path) takes contiguous tensors
        # only, and the attention's q, k and v are views into one qkv output.
        value = apply(value, _contiguous, torch.Tensor)
        gathered, undo = super().whole(location, value)  # undo is this class's split
        layout = self._layout(location)
        if layout is None:
            return gathered, undo
        module = self.rules[location][0]
        reorder = partial(one_device, widths=layout[0], replicas=layout[1], tp=module.tp_size)
        return apply(gathered, reorder, torch.Tensor), undo

    def split(self, location: str, whole: Any) -> Any:
        layout = self._layout(location)
        if layout is None:
            return super().split(location, whole)
        module = self.rules[location][0]
        cut = partial(this_rank, widths=layout[0], replicas=layout[1], tp=module.tp_size, rank=module.tp_rank)
        return apply(whole, cut, torch.Tensor)
