"""The worker's side of taps: the operation on each tapped module, and its tables.

Installed right after vLLM loads the model and before it compiles the forward or
captures a CUDA graph, so every compiled and graphed step contains the operation.
The tables are allocated once and never replaced (a CUDA graph holds their
addresses); before each step only their contents change:

- ``slots[site, row]``: the bank row to add at that tap to that token row of the
  step's slab, or -1 (most rows, always the padding);
- ``bank[slot]``: one steering vector per lowered request, in float32.

The rows a step's requests occupy come from the runner's persistent batch (the
same reading as the Python path's, ``seams.StepLayout``). The staging copy on the
host is double-buffered, so filling the next step never races the upload of the
last one, and nothing is uploaded while no request is lowered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from . import ops  # noqa: F401  (registers torch.ops.vllm_nnsight.steer)
from .spec import engine_taps, resolve

logger = logging.getLogger("vllm_nnsight_plugin")


@dataclass
class Lowered:
    """One request's lowered block: add its bank row at one tap, on some steps."""

    site: int
    slot: int
    start: int
    stop: int | None  # None: every step
    result: str | None  # the name ``tracer.result.save()`` was assigned to
    steps: int = 0  # forwards this request has been in

    def active(self) -> bool:
        return self.start <= self.steps and (self.stop is None or self.steps < self.stop)

    def finished_loop(self) -> bool:
        """Whether the block's loop ran to its end (``tracer.all()`` never does), so
        that the line after it ran too."""
        return self.stop is not None and self.steps >= self.stop


class TapTables:
    """The per-row tables every tap reads, and the requests lowered onto them."""

    def __init__(self, sites: tuple[str, ...], max_tokens: int, hidden: int, bank_rows: int, device: Any):
        self.sites = sites
        self.site_of = {path: i for i, path in enumerate(sites)}
        self.hidden = hidden
        self.device = torch.device(device)
        self.slots = torch.full((len(sites), max_tokens), -1, dtype=torch.int32, device=self.device)
        self.bank = torch.zeros((bank_rows, hidden), dtype=torch.float32, device=self.device)
        pin = self.device.type == "cuda"
        self._staging = [
            torch.full((len(sites), max_tokens), -1, dtype=torch.int32, pin_memory=pin) for _ in range(2)
        ]
        self._turn = 0
        self._dirty = [0, 0]  # per staging buffer: rows [0, n) may hold slots
        self._uploaded = 0  # the device table may hold slots in rows [0, n)
        self.free = list(range(bank_rows - 1, -1, -1))
        self.requests: dict[str, Lowered] = {}

    # ------------------------------------------------------------ requests
    def add(
        self,
        request_id: str,
        site_path: str,
        vector: torch.Tensor,
        start: int,
        stop: int | None,
        result: str | None,
    ) -> bool:
        """Give a request a bank row; False when the bank is full (it runs as Python)."""
        if not self.free or request_id in self.requests:
            return False
        slot = self.free.pop()
        self.bank[slot].copy_(vector.detach().reshape(-1).to(torch.float32))
        self.requests[request_id] = Lowered(self.site_of[site_path], slot, start, stop, result)
        return True

    def forget(self, request_id: str) -> Lowered | None:
        lowered = self.requests.pop(request_id, None)
        if lowered is not None:
            self.free.append(lowered.slot)
        return lowered

    # ------------------------------------------------------------ each step
    def fill(self, req_ids: list[str], starts: list[int], counts: list[int]) -> None:
        """Point this step's rows at their requests' bank rows, then upload."""
        staging = self._staging[self._turn]
        table = staging.numpy()
        dirty = self._dirty[self._turn]
        if dirty:
            table[:, :dirty] = -1
        used = 0
        for request_id, start, count in zip(req_ids, starts, counts):
            lowered = self.requests.get(request_id)
            if lowered is None:
                continue
            if lowered.active():
                table[lowered.site, start : start + count] = lowered.slot
                used = max(used, start + count)
            lowered.steps += 1
        self._dirty[self._turn] = used
        rows = max(used, self._uploaded)
        if rows:
            self.slots[:, :rows].copy_(staging[:, :rows], non_blocking=True)
            self._turn ^= 1
        self._uploaded = used

    def idle(self) -> bool:
        """Nothing lowered and nothing left in the device table: no fill, no upload."""
        return not self.requests and not self._uploaded

    def stats(self) -> dict[str, Any]:
        return {"taps": list(self.sites), "lowered_now": len(self.requests)}


def install(runner: Any, model: Any) -> TapTables | None:
    """Put the operation on every tapped module of ``model``; None when the engine has no taps."""
    from .. import seams

    patterns = engine_taps(runner.vllm_config)
    if not patterns:
        return None
    sites = resolve(patterns, (name for name, _ in model.named_modules()))
    max_tokens, hidden, max_seqs, device = seams.tap_table_sizes(runner)
    tables = TapTables(sites, max_tokens, hidden, 2 * max_seqs + 16, device)
    for site, path in enumerate(sites):
        _tap(model.get_submodule(path), site, tables)
    logger.info("vllm-nnsight: taps on %d module(s): %s", len(sites), ", ".join(sites))
    return tables


def _tap(module: Any, site: int, tables: TapTables) -> None:
    """Run the operation on the module's output (the first element of a tuple).

    The module's class is swapped for a subclass whose ``forward`` adds the
    operation, and the site and tables are attributes of the module. Compiled
    code reads them from there on every call, so they stay reachable when nnsight
    later puts its own callable in the module's instance ``forward`` (a closure
    over the original would not: compiled code fetches a closure's cells through
    the instance's ``forward``).
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
        steer = torch.ops.vllm_nnsight.steer
        if isinstance(out, tuple):
            return (steer(out[0], tables.slots, tables.bank, site), *out[1:])
        return steer(out, tables.slots, tables.bank, site)

    found = _TAPPED[base] = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})
    return found
