"""A lowered ``tracer.cache(modules=[tap])`` on its way home, and the cache it becomes.

As Python, nnsight's cache records the tap's whole output (a decoder layer's
``(hidden, residual)``) once per step, moved to the host, and the block saves a
``CacheView`` over it. Lowered, the tap's operation writes both outputs of
every row into the request's region of the store (``taps/ops.py``, code 4), and
the worker sends them as two stacked lists (:class:`CachedSteps`), which pool
and travel like any kept rows. The front end builds the same view from them:
the same keys, one entry per step, each output a tuple of host tensors. A tap
whose value is one tensor (an MLP's output) keeps that tensor alone (code 1):
one list, each entry's output a host tensor.

nnsight is imported only when such a value arrives, which is when the Python
path's pickled view would have imported it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: nnsight's names used here that are not documented API
#: (``tests/unit/test_nnsight_seams.py`` resolves each).
TOUCHES: tuple[tuple[str, str], ...] = (
    ("nnsight.intervention.cache", "Cache.__init__"),
    ("nnsight.intervention.cache", "Cache.__getstate__"),  # what a cache that travelled holds
    ("nnsight.intervention.cache", "CacheView.__init__"),
    ("nnsight.intervention.cache", "Entry"),
)


@dataclass(frozen=True)
class CachedSteps:
    """A tap's outputs at each step of one request: two stacked lists, or one for
    a tap whose value is one tensor (``residual`` None)."""

    path: str  # the module's path, the cache's key (``model.model.layers.10``)
    hidden: Any  # Stacked (or its pooled reference): ``output[0]`` of each step, or ``output``
    residual: Any = None  # the same for ``output[1]``; None where the output is one tensor

    def parts(self) -> tuple[Any, ...]:
        return (self.hidden,) if self.residual is None else (self.hidden, self.residual)

    def replaced(self, hidden: Any, residual: Any = None) -> CachedSteps:
        return CachedSteps(self.path, hidden, residual)


def cache_view(path: str, hidden: list, residual: list | None = None) -> Any:
    """The view the Python path's ``tracer.cache`` saves, over these steps' outputs
    (host tensors, as nnsight's cache keeps them: ``Resolver`` moves them there):
    each a (hidden, residual) pair, or the one tensor."""
    from nnsight.intervention.cache import Cache, CacheView, Entry

    cache = Cache(None, modules=[path])  # no tree, as a cache that travelled has none
    if hidden:
        outputs = hidden if residual is None else zip(hidden, residual, strict=True)
        cache.entries[path] = [Entry(output=output) for output in outputs]
    return CacheView(cache, None)
