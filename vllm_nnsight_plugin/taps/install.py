"""The worker's side of taps: the operations on each tapped module, and their tables.

Installed right after vLLM loads the model and before it compiles the forward or
captures a CUDA graph, so every compiled and graphed step contains the
operations. The tables are allocated once and never replaced (a CUDA graph holds
their addresses); before each step only their contents change:

- ``slots[site, row]``: the bank row to add at that tap to that token row of the
  step's slab, or -1 (most rows, always the padding);
- ``bank[slot]``: one steering vector per lowered request, in float32;
- ``codes[site, row]``: what to keep of that row at that tap (``ops.keep``), or 0;
- ``arena[row]``: where the kept rows of the step land, in the model's dtype.

The rows a step's requests occupy come from the runner's persistent batch (the
same reading as the Python path's, ``seams.StepLayout``). ``slots`` and
``codes`` are two halves of one table, staged on the host (double-buffered, so
filling the next step never races the upload of the last one) and uploaded in
one copy; nothing is uploaded while no request is lowered. The rows kept in a
step leave the arena in one copy right after the forward (``kept.py``).
"""

from __future__ import annotations

import ast
import inspect
import logging
import textwrap
from typing import Any

import torch

from . import ops  # noqa: F401  (registers torch.ops.vllm_nnsight)
from .kept import Kept, Lowered
from .spec import engine_taps, resolve

logger = logging.getLogger("vllm_nnsight_plugin")

__all__ = ["Lowered", "TapTables", "install"]


class TapTables:
    """The per-row tables every tap reads, and the requests lowered onto them."""

    def __init__(
        self,
        sites: tuple[str, ...],
        max_tokens: int,
        hidden: int,
        bank_rows: int,
        device: Any,
        dtype: torch.dtype = torch.float32,
        tuple_sites: frozenset[int] | None = None,
    ):
        self.sites = sites
        self.site_of = {path: i for i, path in enumerate(sites)}
        #: Sites whose module's forward returns a tuple, by its source: only there
        #: is ``output[0]`` the whole hidden state a lowered block means.
        self.tuple_sites = frozenset(range(len(sites))) if tuple_sites is None else tuple_sites
        self.hidden = hidden
        self.device = torch.device(device)
        table = torch.full((2, len(sites), max_tokens), -1, dtype=torch.int32, device=self.device)
        table[1].zero_()
        self._table = table
        self.slots, self.codes = table[0], table[1]
        self.bank = torch.zeros((bank_rows, hidden), dtype=torch.float32, device=self.device)
        self.arena = torch.zeros((max_tokens, hidden), dtype=dtype, device=self.device)
        pin = self.device.type == "cuda"
        self._staging = [table.cpu().pin_memory() if pin else table.clone() for _ in range(2)]
        self._turn = 0
        self._dirty = [0, 0]  # per staging buffer: rows [0, n) may hold entries
        self._uploaded = 0  # the device table may hold entries in rows [0, n)
        self.free = list(range(bank_rows - 1, -1, -1))
        self.requests: dict[str, Lowered] = {}
        self.kept = Kept(self.arena)

    # ------------------------------------------------------------ requests
    def add(self, request_id: str, lowered: Lowered, vector: torch.Tensor | None = None) -> bool:
        """Put a request on the tables; False when there is no room (it runs as Python)."""
        if request_id in self.requests or lowered.site not in self.tuple_sites:
            return False
        if vector is not None:
            if not self.free:
                return False
            lowered.slot = self.free.pop()
            self.bank[lowered.slot].copy_(vector.detach().reshape(-1).to(torch.float32))
        self.requests[request_id] = lowered
        return True

    def forget(self, request_id: str) -> Lowered | None:
        lowered = self.requests.pop(request_id, None)
        if lowered is not None and lowered.slot >= 0:
            self.free.append(lowered.slot)
        return lowered

    # ------------------------------------------------------------ each step
    def fill(self, req_ids: list[str], starts: list[int], counts: list[int]) -> None:
        """Point this step's rows at their requests' bank rows and codes, then upload."""
        staging = self._staging[self._turn]
        table = staging.numpy()
        dirty = self._dirty[self._turn]
        if dirty:
            table[0, :, :dirty] = -1
            table[1, :, :dirty] = 0
        used = 0
        requests = self.requests
        keeping = self.kept.now = []  # rows a failed step never took are stale
        for request_id, start, count in zip(req_ids, starts, counts):
            lowered = requests.get(request_id)
            if lowered is None:
                continue
            if lowered.active():
                if lowered.code:
                    table[1, lowered.site, start : start + count] = lowered.code
                    keeping.append((lowered, start, count))
                else:
                    table[0, lowered.site, start : start + count] = lowered.slot
                used = max(used, start + count)
            lowered.steps += 1
        self._dirty[self._turn] = used
        rows = max(used, self._uploaded)
        if rows:
            self._table[:, :, :rows].copy_(staging[:, :, :rows], non_blocking=True)
            self._turn ^= 1
        self._uploaded = used

    def after_forward(self) -> None:
        """The forward is queued: take this step's kept rows out of the arena."""
        self.kept.take()

    def idle(self) -> bool:
        """Nothing lowered and nothing left in the device table: no fill, no upload."""
        return not self.requests and not self._uploaded

    def stats(self) -> dict[str, Any]:
        return {"taps": list(self.sites), "lowered_now": len(self.requests), **self.kept.stats()}


def install(runner: Any, model: Any) -> TapTables | None:
    """Put the operations on every tapped module of ``model``; None when the engine has no taps."""
    from .. import seams

    patterns = engine_taps(runner.vllm_config)
    if not patterns:
        return None
    sites = resolve(patterns, (name for name, _ in model.named_modules()))
    max_tokens, hidden, max_seqs, device = seams.tap_table_sizes(runner)
    modules = [model.get_submodule(path) for path in sites]
    tuples = frozenset(i for i, module in enumerate(modules) if returns_tuple(type(module)))
    tables = TapTables(
        sites, max_tokens, hidden, 2 * max_seqs + 16, device, seams.model_dtype(runner), tuples
    )
    for site, module in enumerate(modules):
        _tap(module, site, tables)
    logger.info("vllm-nnsight: taps on %d module(s): %s", len(sites), ", ".join(sites))
    return tables


def returns_tuple(cls: type) -> bool:
    """Whether every ``return`` of the class's ``forward`` is a tuple display of two
    or more values (a decoder layer's ``return hidden_states, residual``).

    Read from the source, so it holds for every call; anything unreadable or less
    certain is False, and blocks on that tap run as Python.
    """
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))
        function = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    if not isinstance(function, ast.FunctionDef):
        return False
    returns: list[ast.Return] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
                continue  # their returns are not this forward's
            if isinstance(child, ast.Return):
                returns.append(child)
            visit(child)

    visit(function)
    return bool(returns) and all(
        isinstance(r.value, ast.Tuple)
        and len(r.value.elts) >= 2
        and not any(isinstance(e, ast.Starred) for e in r.value.elts)
        for r in returns
    )


def _tap(module: Any, site: int, tables: TapTables) -> None:
    """Run the operations on the module's output.

    The module's class is swapped for a subclass whose ``forward`` adds them, and
    the site and tables are attributes of the module. Compiled code reads them
    from there on every call, so they stay reachable when nnsight later puts its
    own callable in the module's instance ``forward`` (a closure over the
    original would not: compiled code fetches a closure's cells through the
    instance's ``forward``).
    """
    module.__dict__[_SITE] = site
    module.__dict__[_TABLES] = tables
    module.__class__ = _tapped_class(type(module))


_SITE = "_vllm_nnsight_tap_site"
_TABLES = "_vllm_nnsight_tap_tables"
_TAPPED: dict[type, type] = {}


def _tapped_class(base: type) -> type:
    found = _TAPPED.get(base)
    if found is not None:
        return found

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = base.forward(self, *args, **kwargs)
        tables, site = self.__dict__[_TABLES], self.__dict__[_SITE]
        steer, keep = torch.ops.vllm_nnsight.steer, torch.ops.vllm_nnsight.keep
        if isinstance(out, tuple) and len(out) >= 2:
            hidden = steer(out[0], tables.slots, tables.bank, site)
            keep(hidden, out[1], tables.codes, tables.arena, site)
            return (hidden, *out[1:])
        if isinstance(out, tuple):
            return (steer(out[0], tables.slots, tables.bank, site), *out[1:])
        return steer(out, tables.slots, tables.bank, site)

    found = _TAPPED[base] = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})
    return found
