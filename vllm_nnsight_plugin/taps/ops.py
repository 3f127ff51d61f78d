"""The operation at each tap: add each row's steering vector, if it has one.

``torch.ops.vllm_nnsight.steer(hidden, slots, bank, site)`` returns ``hidden``
with ``bank[slots[site, row]]`` added to every row whose slot is not -1; other
rows are copied bit for bit. It is a ``torch.library`` custom op with a fake
implementation, so torch.compile keeps it whole (one opaque call in the graph)
and a CUDA graph records its kernels, which read the tables' current contents at
every replay. The addition is what ``hidden[:] += vector`` does in a block: in
float32, rounded once to ``hidden``'s dtype (the bank holds the vector's values
exactly, in float32).
"""

from __future__ import annotations

import torch

NAMESPACE = "vllm_nnsight"


@torch.library.custom_op(f"{NAMESPACE}::steer", mutates_args=())
def steer(hidden: torch.Tensor, slots: torch.Tensor, bank: torch.Tensor, site: int) -> torch.Tensor:
    index = slots[site, : hidden.shape[0]]
    hit = (index >= 0).unsqueeze(-1)
    added = hidden.float() + bank.index_select(0, index.clamp(min=0).long())
    return torch.where(hit, added.to(hidden.dtype), hidden)


@steer.register_fake
def _(hidden: torch.Tensor, slots: torch.Tensor, bank: torch.Tensor, site: int) -> torch.Tensor:
    return torch.empty_like(hidden)
