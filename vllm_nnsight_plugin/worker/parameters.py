"""Parameters read whole under tensor parallelism.

Each rank holds a slice of a parallel layer's weight: a column-parallel layer
(``qkv_proj``, ``gate_up_proj``, ``lm_head``, ``embed_tokens``) its rows, a
row-parallel one (``o_proj``, ``down_proj``) its columns. A block that reads
``model.lm_head.weight[token]`` for a direction, or the whole matrix for a logit
lens, would silently get one rank's rows. Here a block's read of such a
parameter returns the whole tensor a one-device engine holds: the ranks' slices
gathered over the tensor-parallel group (every rank runs the same block, so
every rank makes the same read at the same point), fused projections laid out
as on one device (``fragments.py``).

The whole tensor is a copy made for that read, the size of the whole parameter
on each rank, and freed with it; writing into it changes nothing in the model.
Where the layout is not a plain slice (quantized, packed, or a vocabulary with
added rows), the read is this rank's own slice, as vLLM holds it.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import seams
from .fragments import one_device


def whole(module: Any, split: str, value: torch.Tensor, dim: int) -> torch.Tensor:
    """The whole parameter, gathered from every rank's slice along ``dim``."""
    gathered = seams.tensor_parallel_gather(value.detach().contiguous(), dim)
    layout = seams.fused_layout(module) if split == "column" else None
    if layout is None or dim != 0:
        return gathered
    # A fused weight's (or bias's) rows come rank by rank; one device has them piece by piece.
    rows_last = gathered.movedim(0, -1)
    return (
        one_device(rows_last, layout[0], layout[1], seams.tensor_parallel_size(module))
        .movedim(-1, 0)
        .contiguous()
    )


def read(module: Any, name: str, value: Any) -> Any:
    """What a block reading ``module.<name>`` gets: ``value``, whole."""
    if not isinstance(value, torch.nn.Parameter):
        return value
    split = seams.parallel_split(module)
    dim = seams.sharded_dim(split, name, value)
    return value if dim is None else whole(module, split, value, dim)


def read_whole(envoy_type: type) -> None:
    """Make a block's parameter reads through ``envoy_type`` (nnsight's ``Envoy``)
    whole on this worker. Once per process; only where the engine is sharded."""
    original = envoy_type.__getattr__
    if getattr(original, "_vllm_nnsight_whole", False):
        return

    def __getattr__(self: Any, name: str) -> Any:
        value = original(self, name)
        if isinstance(value, torch.nn.Parameter):
            return read(self.__dict__.get("_module"), name, value)
        return value

    __getattr__._vllm_nnsight_whole = True  # type: ignore[attr-defined]
    envoy_type.__getattr__ = __getattr__
