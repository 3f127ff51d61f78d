"""Blocks that run as Python at the taps, while the rest of the forward stays compiled.

A block the tables cannot run, but whose every location is a tap (what
``taps/replay.py`` serves: a tap's output, what a module is handed, logits and
samples), need not take its step's forward off the compiled path. Such a step
replays, for a decode batch on a GPU engine, the graph of the whole forward
captured broken at the taps (``taps/broken.py``); where the graph is split at the
taps (``VLLM_NNSIGHT_SPLIT_AT_TAPS``), the graphs of the pieces between them; both
padded to a captured batch size. Otherwise it runs vLLM's compiled code without a
CUDA graph (a replayed graph runs no Python). In each, every tap's operation
hands its value here (``taps/ops.py``, ``at_taps``):
the interleaver runs the blocks parked at that location on their rows, and the
forward goes on with what they left. An in-place edit changes the operation's
own output (or the residual it declares it mutates): the blocks are handed
copies of the step's rows, and what they leave there, or a replacement, is
copied back. Every module between the taps runs compiled and unhooked for every
request of the step, so a plain neighbour computes what it computes without a
traced request beside it.

Blocks served at the sampler (``replay.py``) that share the step are served
here too, from the same values, so each location is handed once, in the
forward's order.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..taps.replay import FIRST, HANDED, PAIR, served

logger = logging.getLogger("vllm_nnsight_plugin")


class AtTaps:
    """One step's hand-offs: for each tap site, the locations it serves, in order."""

    def __init__(
        self, tables: Any, sites: set[int], interleaver: Any, root: str, kernels: Any, rows: int | None = None
    ) -> None:
        self.interleaver = interleaver
        self.kernels = kernels
        #: the step's token rows: a forward replaying piece graphs runs on a batch
        #: padded to a captured size, whose last rows are nobody's
        self.rows = rows
        #: site -> [(location, kind, the input sites a HANDED value is built from)]
        self.plan: dict[int, list[tuple[str, str, tuple[int, ...]]]] = {}
        #: input sites whose values a later hand-off gathers
        self.kept: set[int] = set()
        for site, where, kind in served(sites, tables):
            inputs: tuple[int, ...] = ()
            if kind == HANDED:  # handed once all of the module's inputs have passed their taps
                inputs = tuple(tables.inputs[where.rpartition(".")[0]])
                site = inputs[-1]
                self.kept.update(inputs)
            self.plan.setdefault(site, []).append((f"{root}.{where}", kind, inputs))
        self.values: dict[int, torch.Tensor] = {}
        self.busy = False
        self.handed = 0
        self.failure: BaseException | None = None

    def __call__(self, site: int, out: torch.Tensor, second: torch.Tensor | None) -> None:
        if self.busy:  # a block's own call of a tapped module (``model.model.norm(h)``)
            return
        wanted = self.plan.get(site)
        if not wanted and site not in self.kept:  # (most taps of such a step)
            return
        rows = self.rows
        if rows is not None and out.dim() and out.shape[0] > rows:  # the step's own rows
            if second is not None and second.dim() and second.shape[0] == out.shape[0]:
                second = second[:rows]
            out = out[:rows]
        if site in self.kept:
            self.values[site] = out
        if not wanted:
            return
        self.busy = True
        kernels = self.kernels
        if kernels is not None:  # a module a block calls runs as in a Python step
            kernels.use()
        try:
            for location, kind, inputs in wanted:
                value = _value(kind, location, out, second, [self.values.get(i) for i in inputs])
                # The blocks get copies: a value a block saves must outlive the
                # step, and where the taps split the graph the forward's buffers
                # are a CUDA graph's, which its next replay overwrites. What the
                # blocks leave in them goes back into the forward's buffers.
                handed = _copied(value)
                _write_back(handed, self.interleaver.handle(location, handed))
                _put_back(value, handed)
                self.handed += 1
        except Exception as error:  # noqa: BLE001 - the step's blocks fail, never the forward
            logger.exception("vllm-nnsight: a hand-off at a tap failed")
            self.failure = error
        finally:
            if kernels is not None:
                kernels.restore()
            self.busy = False


def _value(kind: str, location: str, out: torch.Tensor, second: Any, handed: list) -> Any:
    """The location's value as the module's forward returns (or is handed) it."""
    if kind == PAIR:
        return (out, second)
    if kind == FIRST:
        return (out, None)
    if kind == HANDED:
        return (tuple(handed), {})
    return ((out,), {}) if location.endswith(".input") else out


def _copied(value: Any) -> Any:
    """``value`` with each tensor in it cloned (the tuples, lists and dicts rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(part) for part in value)
    if isinstance(value, dict):
        return {key: _copied(part) for key, part in value.items()}
    return value


def _put_back(value: Any, handed: Any) -> None:
    """Copy each tensor of ``handed`` into the tensor of ``value`` it was cloned from."""
    if isinstance(value, torch.Tensor):
        value.copy_(handed)
    elif isinstance(value, (tuple, list)):
        for a, b in zip(value, handed):
            _put_back(a, b)
    elif isinstance(value, dict):
        for key in value:
            _put_back(value[key], handed[key])


def _write_back(given: Any, returned: Any) -> None:
    """Copy a replacement into the tensor it replaces (the batcher checked its
    shape), so the forward's own buffers carry it."""
    if returned is given:
        return
    if isinstance(given, torch.Tensor):
        if isinstance(returned, torch.Tensor) and returned is not given:
            if returned.shape != given.shape:
                raise ValueError(f"a replacement of shape {tuple(returned.shape)} for {tuple(given.shape)}")
            given.copy_(returned)
        return
    if isinstance(given, (tuple, list)) and isinstance(returned, (tuple, list)):
        for a, b in zip(given, returned):
            _write_back(a, b)
    elif isinstance(given, dict) and isinstance(returned, dict):
        for key in given:
            if key in returned:
                _write_back(given[key], returned[key])
