"""Which requests drew the token that ends them, before vLLM says so.

With async scheduling (vLLM's default on GPU, on either runner) the scheduler
lays out step N+1 before it has read step N's samples. A request that drew its
ending token at step N (its end-of-sequence token, or one of its
``stop_token_ids``) is therefore in step N+1 too, and vLLM throws that step's
sample away. Its block must not see that step, as it would not without async
scheduling:

- a block run as Python sits the step out. The samples of a step that runs
  Python blocks are read as they are drawn, so this is known before the next
  forward starts;
- a lowered block keeps rows on the device every step; which of them count is
  settled when it is collected. Its steps' samples are copied to the host
  without waiting, and read once they have arrived, so a graphed step never
  waits for the device.

Only a token that ends the request on every supported vLLM counts. With
``min_tokens`` set, or where vLLM decides elsewhere (stop strings, in the front
end; repetition detection), nothing is assumed and the block sees the steps
vLLM runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def ending_tokens(params: Any) -> frozenset[int]:
    """The tokens whose draw certainly ends a request with these sampling params."""
    if params is None or getattr(params, "min_tokens", 0):
        return frozenset()
    tokens = {int(t) for t in getattr(params, "stop_token_ids", None) or ()}
    eos = getattr(params, "eos_token_id", None)
    if eos is not None:
        tokens.add(int(eos))
    return frozenset(tokens)


class Stops:
    """The ending tokens of the requests a worker tracks, and who drew one."""

    def __init__(self, enabled: bool) -> None:
        #: Off where vLLM reads each step's samples before it schedules the next.
        self.enabled = enabled
        self.tokens: dict[str, frozenset[int]] = {}
        #: Requests that drew an ending token; vLLM still runs them until it reads it.
        self.ended: set[str] = set()
        #: Lowered requests: how many of their steps count (the one that drew included).
        self.counted: dict[str, int] = {}
        self._pending: list[tuple[Any, torch.Tensor, list[tuple[str, int, int]]]] = []
        #: how many steps' samples have been noted (``lowered_drew``) in all
        self.noted = 0
        self._buffers: list[torch.Tensor] = []

    def admit(self, request_id: str, params: Any) -> None:
        if self.enabled:
            tokens = ending_tokens(params)
            if tokens:
                self.tokens[request_id] = tokens

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self.tokens.pop(request_id, None)
            self.ended.discard(request_id)
            self.counted.pop(request_id, None)

    def keep_only(self, tracked: Any) -> None:
        """Drop what is known of requests no longer tracked."""
        for request_id in [r for r in self.tokens if r not in tracked]:
            self.forget([request_id])

    # ------------------------------------------------------------ Python blocks
    def drew(self, sampled: torch.Tensor, rows: dict[str, int], skip: Iterable[str] = ()) -> None:
        """Read a step's samples now (its ``[requests, 1]`` token ids): requests in
        ``rows`` that drew an ending token are :attr:`ended`. ``skip``: rows whose
        sample vLLM throws away (a chunk before the prompt's end)."""
        skip = set(skip)
        wanted = [(r, row) for r, row in rows.items() if r in self.tokens and r not in skip]
        if not wanted:
            return
        drawn = sampled.reshape(sampled.shape[0], -1)[:, 0].tolist()
        for request_id, row in wanted:
            if drawn[row] in self.tokens[request_id]:
                self.ended.add(request_id)

    # ------------------------------------------------------------ lowered blocks
    def lowered_drew(self, sampled: torch.Tensor, rows: list[tuple[str, int, int]]) -> None:
        """Note a step's samples for lowered requests without waiting for them:
        ``rows`` are ``(request id, row, the request's step)``."""
        rows = [r for r in rows if r[0] in self.tokens and r[0] not in self.counted]
        if not rows:
            return
        flat = sampled.reshape(sampled.shape[0], -1)[:, 0]
        if flat.device.type != "cuda":
            self._read(flat, rows)
            return
        host = self._buffer(flat)
        host[: flat.shape[0]].copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, host, rows))
        self.noted += 1
        self.settle(wait=False)

    def settle(self, wait: bool = True, upto: int | None = None) -> None:
        """Read the lowered samples that have arrived (all of them with ``wait``;
        with ``upto``, those of the first ``upto`` steps noted, waiting for them,
        and any later ones that have arrived)."""
        first = self.noted - len(self._pending)  # the ordinal of the oldest pending
        while self._pending:
            event, host, rows = self._pending[0]
            must = wait if upto is None else first < upto
            if not must and not event.query():
                return
            event.synchronize()
            self._pending.pop(0)
            first += 1
            self._read(host, rows)
            self._buffers.append(host)

    def _read(self, flat: torch.Tensor, rows: list[tuple[str, int, int]]) -> None:
        drawn = flat.tolist()
        for request_id, row, step in rows:
            if request_id not in self.counted and drawn[row] in self.tokens.get(request_id, ()):
                self.counted[request_id] = step + 1

    def _buffer(self, flat: torch.Tensor) -> torch.Tensor:
        for i, host in enumerate(self._buffers):
            if host.shape[0] >= flat.shape[0] and host.dtype == flat.dtype:
                return self._buffers.pop(i)
        return torch.empty(max(flat.shape[0], 256), dtype=flat.dtype, pin_memory=True)
