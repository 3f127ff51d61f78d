"""Requests whose blocks run on the tap tables instead of as Python (``taps/``).

At admission a block whose source is one of the lowered forms, and whose captured
values pass its checks, is put on the tables and its mediator dropped: nothing of
it runs as Python. At collection its entry comes off the tables, and what it
saved (kept rows, the finished output) joins the request's reply as the Python
path would have built it.
"""

from __future__ import annotations

import ast
import logging
from collections import OrderedDict
from typing import Any

from .. import seams
from ..returns.stacked import Stacked
from ..taps.forms import split
from ..taps.kept import Lowered, picks_a_row
from ..taps.lower import Unlowered, fits, for_request, lower
from ..taps.meaning import folded
from ..taps.ops import KEEP_BOTH
from ..taps.replay import VIEW, modules_of, replayable
from .errors import KeptRowsError
from .paths import AT_SAMPLER, COPIES, NO_ROOM, OUT_OF_RANGE, SEQUENCES, SPECULATIVE, UNSIZED, Paths

logger = logging.getLogger("vllm_nnsight_plugin")

#: Stands in a lowered request's saves for its finished output (``tracer.result``)
#: until the output is at hand.
OUTPUT = object()


#: Why a block the tables do not run, and whose form was not read, runs as Python.
_WRITES = ("form", "it writes into the forward in a way the tap tables do not express")

#: How many distinct lowered blocks an engine remembers (:meth:`Lowering.lower_known`).
_KNOWN_LIMIT = 256


class Lowering:
    """Per-runner counts of lowered requests, and the two ends of their life.

    A lowered block's form depends on the block and the engine only, so it is
    remembered by the digest of the block's bytes: the next request that carries
    the same bytes (the invokes of one trace's loop share them: see the client's
    ``one_pickle_per_block``) goes on the tables without its block being loaded.
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.count = 0
        self.by_form = {
            "steer": 0, "project": 0, "scale": 0, "fill": 0, "patch": 0,
            "keep": 0, "read": 0, "cache": 0, "replay": 0,
        }  # fmt: skip
        self.known: OrderedDict[bytes, Any] = OrderedDict()
        #: blocks served at the sampler, by digest: the taps each reads (its
        #: source need not be read again for the next request that carries it)
        self.served: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        #: blocks that write and run as Python at the taps, by digest: the taps each
        #: reads and why the tables cannot run it (found once per block, not per
        #: request: the analysis costs more than the rest of a request's admission)
        self.writes_at_taps: OrderedDict[bytes, tuple[tuple[int, ...], str, str]] = OrderedDict()
        #: Blocks are served copies of what they read (``NNSIGHT_VLLM_CLONE_READS``):
        #: an in-place edit is then lost, as nnsight documents, so no steering
        #: block is lowered (the tables would apply it). Set with the worker's tree.
        self.reads_are_copies = False
        self.unloaded = 0  # requests lowered from a known block, never loaded
        self.taps_known = 0  # requests sent to the taps by a known block's verdict
        self.paths = Paths()
        #: Lowered requests with statements left to Python at the sampler.
        self.mixed: set[str] = set()
        #: Requests whose block reads a tap at the sampler (``taps/replay.py``).
        self.replays: dict[str, Any] = {}
        #: Blocks on taps the tables cannot run go to the compiled forward's taps
        #: (``live.py``): where the forward is compiled (an eager one serves them anyway).
        self.at_taps = runner is not None and not seams.engine_is_eager(seams.config_of(runner))

    def lower(
        self,
        request: Any,
        tables: Any,
        model: Any,
        rows: int,
        most: int,
        digest: bytes | None = None,
        split: bool = True,
    ) -> bool:
        """Put a request on the tap tables when its block is exactly a form they
        express; ``rows`` is how many token rows its first step has, ``most`` how
        many it can have (0: unknown); ``digest`` names its block's bytes;
        ``split``: a block may leave statements to Python at the sampler."""
        from . import _nnsight as nns

        mediator = request.mediator
        if mediator is None:
            return False
        if not getattr(mediator, "needs_forward", True):  # nothing on the taps to lower
            self.paths.python(request.id, *AT_SAMPLER)
            return False
        if not self._may_lower(request):
            return False
        if digest is not None and digest in self.served:
            self.served.move_to_end(digest)
            return self._replay(request, tables, model, most, None, digest, self.served[digest])
        if digest is not None and digest in self.writes_at_taps:
            self.writes_at_taps.move_to_end(digest)
            self.taps_known += 1
            return self._at_taps(request, *self.writes_at_taps[digest])
        source, scope = nns.block_source(mediator), nns.block_scope(mediator)
        source = (folded(source, scope) or source) if source else source  # its ``if``s decided
        block = lower(source, scope, model, nns.InterleavingTracer, tables, seams.model_dtype(self.runner))
        if isinstance(block, Unlowered):
            rest = self._split(request, tables, model, block, source) if split else block
            if isinstance(rest, Unlowered):
                return self._replay(request, tables, model, most, rest, digest, source=source)
            block, rest_mediator = rest
            if not self._add(request, tables, for_request(block), rows, most, rest_mediator):
                return False
            return True
        if digest is not None:  # kept as built: each request adds its own copy
            _remember(self.known, digest, block)
        return self._add(request, tables, for_request(block), rows, most)

    def lower_edit(self, request: Any, edit_id: str, tables: Any, model: Any, rows: int, most: int) -> bool:
        """Put the request's copy of an installed edit on the tables, where it is the
        one block of the request that needs the forward (its own runs at the
        sampler): lowered whole, or served at the sampler. What it keeps comes back
        as that edit's saves (:meth:`forget`)."""
        copy = request.copies[edit_id]
        alone = _EditCopy(request, copy)
        if _keeps_a_cache(getattr(copy, "source", None)):  # its view is built as Python builds it
            self.paths.python(request.id, "form", "an installed edit keeps a cache, which runs as Python")
            return False
        if not self.lower(alone, tables, model, rows, most, split=False):
            return False
        lowered = tables.requests[request.id]
        lowered.edit = edit_id
        if alone.mediator is None:  # all of it on the tables: nothing of it runs as Python
            del request.copies[edit_id]
        if request.mediator is not None or request.copies:  # the rest runs at the sampler
            self.mixed.add(request.id)
        return True

    def lower_known(self, request: Any, tables: Any, digest: bytes, rows: int, most: int) -> bool:
        """:meth:`lower` for a block already lowered once, without loading it."""
        block = self.known.get(digest)
        if block is None or not self._may_lower(request):
            return False
        self.known.move_to_end(digest)
        added = self._add(request, tables, for_request(block), rows, most)
        self.unloaded += added
        return added

    def _split(
        self, request: Any, tables: Any, model: Any, why: Any, source: str | None
    ) -> tuple[Any, Any] | Any:
        """A block (``source``: its own, or with its ``if``s decided) whose statements
        on taps are one of the forms, beside statements the sampler serves: the
        first part lowered, the rest left to Python there (``taps.forms.split``).
        Where it has no such split, why it runs as Python: ``why``, or its part on
        the taps' reason."""
        from . import _nnsight as nns
        from .admit import read

        mediator = request.mediator
        scope = nns.block_scope(mediator)
        parts = split(source) if source else None
        block = None
        if parts is not None:
            block = lower(
                parts.taps, scope, model, nns.InterleavingTracer, tables, seams.model_dtype(self.runner)
            )
        if parts is None or isinstance(block, Unlowered):
            # Where it splits, its part on the taps says more than the whole block.
            return block if isinstance(block, Unlowered) else why
        rest = nns.with_source(mediator, parts.rest)
        read(rest, model)
        if rest.needs_forward:  # the rest reaches the model after all
            return why
        return block, rest

    def _replay(
        self,
        request: Any,
        tables: Any,
        model: Any,
        most: int,
        why: Any,
        digest: bytes | None = None,
        sites: tuple[int, ...] | None = None,
        source: str | None = None,
    ) -> bool:
        """A block that reads taps and writes nothing into the forward: its rows
        are kept on the tables and it runs as Python at the sampler, served them
        there (``taps/replay.py``); else ``why`` is recorded. ``sites``: what an
        earlier request with the same block's bytes (``digest``) was found to read;
        ``source``: the block's, its ``if``s decided (``meaning.folded``)."""
        from . import _nnsight as nns

        mediator = request.mediator
        writes = getattr(mediator, "may_write", True)
        if sites is None and (not writes or self.at_taps) and not mediator.caches:
            sites = replayable(
                source or nns.block_source(mediator),
                nns.block_scope(mediator),
                model,
                tables,
                _modules(model),
            )
            if isinstance(sites, tuple) and not all(tables.served_whole(s) for s in sites):
                sites = None  # served as the values kept: a longer tuple, or another width, is not that
            if isinstance(sites, tuple) and digest is not None and not writes:
                _remember(self.served, digest, sites)
        if not isinstance(sites, tuple):
            if isinstance(sites, Unlowered) and sites.kind == VIEW and not writes:
                why = sites  # what it reads is all served: how it uses it is the reason
            self.paths.python(request.id, why.kind, why.reason)
            return False
        if writes:  # its edits must land in the forward: Python at the taps
            kind, reason = (why.kind, why.reason) if why is not None else _WRITES
            if digest is not None:
                _remember(self.writes_at_taps, digest, (sites, kind, reason))
            return self._at_taps(request, sites, kind, reason)
        lowered = Lowered(sites[0], 0, None, None, code=KEEP_BOTH, replay=True)
        # a whole recompute's rows fit: its prompt and tokens, at its widest tap
        lowered.widest = max(tables.replay_stride(site) for site in sites)
        room = most * lowered.widest
        if room <= 0:
            return self._at_taps(request, sites, *UNSIZED)
        if not tables.add(request.id, lowered, None, room, sites[1:]):
            return self._at_taps(request, sites, *NO_ROOM)
        mediator.needs_forward = False  # served at the sampler: the forward stays compiled
        self.replays[request.id] = lowered
        self.mixed.add(request.id)
        self.count += 1
        self.by_form["replay"] += 1
        self.paths.lowered(request.id, "replay")
        return True

    def _at_taps(self, request: Any, sites: tuple[int, ...], kind: str, reason: str) -> bool:
        """A block whose every location is a tap, and which the tables cannot run:
        on a compiled engine it runs as Python at those taps while the rest of its
        steps' forwards stay compiled (``live.py``); on an eager one, as Python.
        Either way it is not lowered (False)."""
        if self.at_taps and not isinstance(request, _EditCopy):
            if kind == "not_a_tap":  # every location it reads is served: the form is the reason
                kind, reason = _WRITES
            request.mediator.at_taps = sites
            self.paths.at_taps(request.id, kind, reason)
        else:
            self.paths.python(request.id, kind, reason)
        return False

    def _may_lower(self, request: Any) -> bool:
        wanting = any(getattr(copy, "needs_forward", True) for copy in request.copies.values())
        if wanting or request.index != 0 or request.engine_id != request.stem:
            self.paths.python(request.id, *SEQUENCES)  # registered copies, or an n > 1 sequence
            return False
        # Speculative decoding: a step's rows are then not the ones a block sees
        # step by step.
        if seams.speculates(self.runner):
            self.paths.python(request.id, *SPECULATIVE)
            return False
        return True

    def _add(self, request: Any, tables: Any, block: Any, rows: int, most: int, rest: Any = None) -> bool:
        """Put a request on the tables; ``rest``: the mediator of its statements left
        to Python at the sampler, which replaces its own (None: nothing is left)."""
        lowered = block.lowered
        why = None
        room = (rows if lowered.single else most) * lowered.stride if lowered.code else 0
        if lowered.code and picks_a_row(lowered) and lowered.stop is not None:
            # one row a step, and none after its window's last step (a recompute's
            # forwards count as steps): the window's rows are all it can keep
            room = min(room, max(1, lowered.stop - lowered.start) * lowered.stride)
        if not fits(block, rows):
            why = OUT_OF_RANGE
        elif not lowered.code and self.reads_are_copies:
            why = COPIES
        elif lowered.code and room <= 0:
            why = UNSIZED
        elif not tables.add(request.id, lowered, block.vector, room, block.also, block.how, block.residual):
            why = NO_ROOM
        if why is not None:
            self.paths.python(request.id, *why)
            return False
        request.mediator = rest  # None: nothing of it runs as Python
        if rest is not None or request.copies:  # it, or an edit's copy, runs at the sampler
            self.mixed.add(request.id)
        self.count += 1
        form = block.form
        self.by_form[form] += 1
        self.paths.lowered(request.id, form if rest is None else f"{form}, Python at the sampler")
        return True

    def forget(
        self, tables: Any, index: Any, requests: Any, request_ids: list[str], counted: Any = None
    ) -> dict[str, dict]:
        """Take the lowered requests asked about off the tables; per engine id, what
        their blocks saved: kept rows, and :data:`OUTPUT` under the result's name
        for a block that got that far (as Python, the line after the loop runs only
        once the loop's last step has). ``counted``: request id -> how many of its
        steps count, where vLLM ran it past the token that ended it (``stops.py``)."""
        from . import _nnsight as nns

        if tables is None or not tables.requests:
            return {}
        saved: dict[str, dict[str, Any]] = {}
        taken_all = []
        for asked in request_ids:
            for internal in index.answering(asked):
                taken = tables.forget(internal)
                if taken is not None:
                    lowered, steps = taken
                    taken_all.append((internal, lowered, min(steps, (counted or {}).get(internal, steps))))
        try:  # the single reads among them in one copy (a sweep's thousand)
            read = tables.reads(
                [(lowered, steps) for internal, lowered, steps in taken_all if internal in requests.requests]
            )
        except Exception:  # each asks on its own below, failing alone
            logger.exception("vllm-nnsight: the collect's reads could not be gathered together")
            read = {}
        for internal, lowered, steps in taken_all:
            self.mixed.discard(internal)
            self.replays.pop(internal, None)
            request = requests.requests.get(internal)
            try:
                if request is None:
                    continue
                if tables.overflowed(lowered):
                    _failed(request, lowered, nns.capture_exception(_overflow(lowered, internal)))
                    continue
                saves = read.get(id(lowered))
                try:
                    if saves is None:
                        saves = tables.saves(lowered, steps)
                except Exception as error:  # that request's failure, no other's
                    _failed(request, lowered, nns.capture_exception(error))
                    continue
                loop_ended = lowered.stop is not None and steps >= lowered.stop
                whole = lowered.single or lowered.cache is not None  # no loop to end
                if lowered.edit is not None:  # an installed edit's: collected as its saves,
                    # unless it was cleared meanwhile (its copies are dropped with theirs); an
                    # edit is never served ``tracer.result``, as on the Python path
                    if saves and lowered.edit in requests.templates:
                        # as the Python path's copy saved them (a trace's ``tracer.result``
                        # shows them before they are packed): lists, not stacked rows
                        _harvested(request, lowered.edit)["saves"].update(
                            {name: _as_saved(value) for name, value in saves.items()}
                        )
                    continue
                if lowered.result is not None and (loop_ended or whole):
                    saves[lowered.result] = OUTPUT
                if saves:
                    saved.setdefault(request.engine_id, {}).update(saves)
            finally:
                tables.release(lowered)
        return saved

    def stats(self) -> dict[str, Any]:
        return {
            "lowered": self.count,
            "lowered_by": dict(self.by_form),
            "lowered_unloaded": self.unloaded,
            "at_taps_known": self.taps_known,
            **self.paths.stats(),
        }


def _remember(memo: OrderedDict, digest: bytes, value: Any) -> None:
    """Keep what a block's bytes were found to be, the least recently used of
    more than ``_KNOWN_LIMIT`` blocks forgotten."""
    memo[digest] = value
    while len(memo) > _KNOWN_LIMIT:
        memo.popitem(last=False)


class _EditCopy:
    """A request seen through one of its edits' copies: what lowering reads of a
    request, with the copy as its block."""

    def __init__(self, request: Any, copy: Any) -> None:
        self.id, self.mediator, self.copies = request.id, copy, {}
        self.index, self.engine_id, self.stem = request.index, request.engine_id, request.stem


def _harvested(request: Any, edit_id: str) -> dict:
    """An edit's shelf on its request (``Requests.harvest`` fills the same one)."""
    return request.harvested.setdefault(edit_id, {"saves": {}, "error": None})


def _keeps_a_cache(source: str | None) -> bool:
    """Whether a block's source names ``.cache`` (or cannot be read)."""
    try:
        tree = ast.parse(source or "")
    except SyntaxError:
        return True
    return any(isinstance(node, ast.Attribute) and node.attr == "cache" for node in ast.walk(tree))


def _as_saved(value: Any) -> Any:
    return value.unstack() if isinstance(value, Stacked) else value


def _failed(request: Any, lowered: Any, error: Any) -> None:
    if lowered.edit is None:
        request.error = error
    else:
        _harvested(request, lowered.edit)["error"] = error


def _overflow(lowered: Any, request_id: str) -> Exception:
    return KeptRowsError(
        f"request {request_id} computed more rows at its tap than its prompt and "
        f"max_tokens ({lowered.rows}), so the rows its block kept are incomplete (a "
        "preempted request recomputes its tokens). Run it again, or on an engine "
        "with room for every running request's KV cache."
    )


def _modules(model: Any) -> Any:
    """The model's module at a path relative to it, or None."""
    from . import _nnsight as nns

    return modules_of(nns.envoy_module(model))
