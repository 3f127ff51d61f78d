"""Row narrowing for one request, with the replacement check vLLM needs.

nnsight's ``VLLMBatcher`` narrows the step's slab to a request's token span and
splices a replacement back with ``torch.cat``. A replacement with the wrong
number of rows would make that slab the wrong size, and the engine would fail
a few ops later for every request in the step. Checking the shape at the splice
turns it into an error of the one request that wrote it.
"""

from __future__ import annotations

import torch
from nnsight.modeling.vllm.batching import VLLMBatcher

from ..errors import PluginError


class ReplacementShapeError(PluginError, ValueError):
    """A block replaced a value with a tensor that does not fit its rows."""


class CheckedBatcher(VLLMBatcher):
    def _widen_tensor(self, full: torch.Tensor, group: list, edited: torch.Tensor) -> torch.Tensor:
        dim = self._token_dim(full)
        if dim is not None and isinstance(edited, torch.Tensor):
            expected = full.narrow(dim, group[0], group[1]).shape
            if tuple(edited.shape) != tuple(expected):
                raise ReplacementShapeError(
                    f"a replacement must have the shape of the value it replaces for this "
                    f"request, {tuple(expected)}, but has shape {tuple(edited.shape)}. Edit "
                    "in place (x[:] = ...) or build the new value from the old one."
                )
            edited = edited.to(device=full.device, dtype=full.dtype)
        return super()._widen_tensor(full, group, edited)
