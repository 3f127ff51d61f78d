"""The worker side: run each request's block against the live model, step by step.

nnsight already knows how to run a block next to a forward (its ``Mediator`` and
``Interleaver``) and how to narrow a slab to one request's rows (``VLLMBatcher``,
``Requests.scope``); this module reuses that machinery (through ``_nnsight.py``)
and drives it with three plain torch hooks instead of a replacement model runner:

- a forward pre-hook on the root model starts the step (``step.py``): it admits
  new requests (``admit.py``), reads the step layout, and opens the interleaver;
- as the runner's sampler is called, ``model.logits`` is served;
- once it drew, ``model.samples`` is served, any request whose block raised is
  ended, and what each block saved is snapshotted; a request that drew the
  token that ends it sits out the step async scheduling still gives it
  (``stops.py``).

Which runner vLLM built (V1 or V2) is the adapter's business
(``seams.runner_of``): the layout, the sampler's two calls, asking for an eager
step and the requests resumed after a preemption come through it.

Finished requests are wound up and their saves packed by ``collect.py``. On an
engine with taps, a request whose block is one of the forms the tap tables run
is lowered at admission and never runs as Python (``lowering.py``).

Module hooks fire only where the forward runs as Python. On an engine that
compiles its forward (torch.compile, CUDA graphs), a step in which some block
may ask for a module location is dispatched without a CUDA graph, with the
compiled module bypassed and vLLM's eager kernels switched in
(``seams/kernels.py``); every other step, including one whose blocks only read
or write logits and samples (``reach.py``), keeps vLLM's compiled, graphed path.

The nnsight tree over the live model is built only when the first request with
a block arrives, so an engine that never sees one is never instrumented (and
never imports nnsight).
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from typing import Any

from .. import seams, settings
from ..returns.lent import stats as lent
from ..returns.metrics import StepCounts
from ..returns.pool import Pooler
from ..taps import ops
from ..taps.kept import step_rows
from ..taps.replay import FIRST, HANDED, PAIR, served
from ..taps.spec import RUNNER_ATTR
from ..wire.envelope import Limits
from ..wire.references import envoy_references
from ..wire.reply import request_reply
from . import _nnsight as nns
from .admit import RequestIndex, admit
from .batching import CheckedBatcher
from .budget import watchdogs
from .collect import Uncollected, pack_all, pool_part, synchronize_device, wind_up
from .edits import give_copies, marked
from .errors import CompiledForwardError
from .live import AtTaps
from .lowering import OUTPUT, Lowering
from .paths import AT_SAMPLER, CHUNKED, EDITED, FAILED, NO_TAPS
from .ready import Ready
from .refusals import end, refuse_chunked
from .resume import SITTING_OUT, narrow, recompute_spans, refuse_resumed
from .step import Phase, Step
from .stops import Stops
from .writes import writes

#: What a step's blocks ask of its forward (``WorkerRuntime._forward_wanted``).
PYTHON, TAPS = "python", "taps"

logger = logging.getLogger("vllm_nnsight_plugin")


class WorkerRuntime:
    """Per-runner state: the nnsight tree, the requests with blocks, the current step."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.adapter = seams.runner_of(runner)
        self.model: Any = None  # nnsight's tree over the live module
        self.requests: Any = None  # nnsight's book of in-flight blocks
        self.index: Any = None
        self.persistent: dict = {}
        self.limits = Limits.from_env()
        self.eager = seams.engine_is_eager(seams.config_of(runner))
        # On a compiled engine, a step that runs a block runs its forward as Python
        # (module hooks fire there and nowhere else); every other step keeps the
        # engine's CUDA graphs and compiled code.
        # Unset or empty: on (an empty value is how a shell unsets it for a child).
        self.eager_steps = bool(settings.value(settings.EAGER_STEPS))
        self.python_steps = 0
        self.served_at_sampler = 0  # taps served to blocks at the sampler (``taps/replay.py``)
        self.steps_at_taps = self.taps_handed = 0  # blocks run at the taps of a compiled forward
        self.step_seconds = {PYTHON: 0.0, TAPS: 0.0}  # the time of those steps, and of Python ones
        self.resumed = self.preempted = 0  # requests resumed after a preemption; blocks it ended
        self.recomputing: set[str] = set()  # resumed requests whose blocks go on, until the recompute ends
        self.continued = 0  # blocks that went on through a recompute
        # prompt tokens the prefix cache supplied to requests with a block or edits
        self.prompt_rows_cached = 0
        self.sat_out = 0  # recompute chunks those blocks sat out (vLLM threw their samples away)
        self.kernels: Any = None  # the eager kernels for a compiled engine's Python steps
        self.lowering = Lowering(runner)  # requests whose blocks run on the tap tables
        self.step: Step | None = None
        ahead = seams.schedules_ahead(seams.config_of(runner))  # a step may be in flight
        self.stops = Stops(ahead)
        self.noted_at_mark = 0
        self.ready = Ready(ahead and bool(settings.value(settings.COLLECT_BESIDE)))
        self.uncollected = Uncollected(float(settings.value(settings.UNCOLLECTED_S)))
        self.step_watch, self.pack_watch = watchdogs()

    # ------------------------------------------------------------------ setup
    def _build(self) -> None:
        """Wrap the live module in nnsight's tree and hook the runner (once)."""
        runner = self.runner
        module = seams.model_of(runner)
        self.model = nns.build_model(module, seams.tokenizer_of(runner), CheckedBatcher(None))
        nns.time_switches(self.step_watch)
        self.requests = nns.new_requests()
        self.index = RequestIndex()
        self.persistent = {**nns.persistent_objects(self.model), **envoy_references(self.model)}
        self.lowering.reads_are_copies = nns.reads_are_copies(self.model)
        if not self.eager:
            self.kernels = seams.eager_kernels(module, seams.config_of(runner))
        module.register_forward_pre_hook(self._on_forward)
        self.adapter.hook_sampler(runner, self._on_logits, self._on_samples)
        logger.info(
            "vllm-nnsight: instrumented %s (%s forward, %s runner)",
            type(module).__name__,
            "eager" if self.eager else "compiled",
            self.adapter.family,
        )

    # ------------------------------------------------------------------ step
    def begin_step(self, scheduler_output: Any) -> None:
        """Called by the runner before each real step (see ``seams``)."""
        if self.step is not None and self.step.open:  # its sampler never ran
            self.abandon_step()
        if self.kernels is not None:
            self.kernels.restore()
        self.step_watch.new_step()
        self.ready.began(scheduler_output, self.requests is not None and bool(self.requests.requests))
        self.noted_at_mark = self.stops.noted  # the samples of the steps before this one
        finished = seams.finished_ids(scheduler_output)
        if self.tables is not None and finished:
            for request_id in finished:  # their entries for the requests after them
                self.tables.retire(request_id)
        if self.requests is not None and self.requests.requests:
            stale = self.uncollected.step(finished, self.requests.requests)
            if stale:
                self.collect(stale, None)
        tracked = {} if self.requests is None else self.requests.requests
        resumed = self.adapter.resumed(scheduler_output, tracked)  # preempted, recomputed now
        if resumed:
            self.resumed += len(resumed)
            if self.requests is not None:
                failed, going_on = refuse_resumed(
                    self.requests, self.tables, resumed, nns.capture_exception, writes
                )
                self.preempted += failed
                self.continued += len(going_on - self.recomputing)
                self.recomputing |= going_on
        new_block = any(
            seams.carries_block(params) or marked(params) for params in seams.new_params(scheduler_output)
        )
        if self.model is None and new_block:
            self._build()
        if self.model is None:
            self.step = None
            return
        if new_block:
            self._admit(scheduler_output)
        forward = self._forward_wanted(scheduler_output)
        # On a compiled engine, blocks whose every location is a tap run at the taps
        # of the compiled forward (``live.py``); an eager forward serves them anyway.
        at_taps = forward == TAPS and not self.eager
        python = not self.eager and self.eager_steps and forward == PYTHON
        self.step = Step(scheduler_output, python=python, forward=forward is not None, at_taps=at_taps)
        if python or at_taps:
            self.step.started = time.perf_counter()
        # Where the compiled graph is split at the taps, a step at the taps replays
        # the graphs of the pieces between them; where the graphs of the whole
        # forward were also captured broken at the taps, a decode step replays
        # those (a batch with none runs without graphs); elsewhere it runs without graphs.
        pieces = at_taps and self.tables is not None and self.tables.split
        broken = at_taps and self.tables is not None and self.tables.broken
        self.adapter.ask_eager(self.runner, python or (at_taps and not pieces and not broken))
        self.adapter.ask_pieces(self.runner, pieces)
        self.adapter.ask_broken(self.runner, broken)

    def _admit(self, scheduler_output: Any) -> None:
        """Open the envelopes of this step's new requests and give them their copies of
        installed edits (before the forward is dispatched)."""
        requests = self.requests
        tables = self.tables
        for data in seams.new_requests(scheduler_output):
            if data.req_id in requests.requests:
                continue
            edited = (
                requests.templates
                and marked(data.sampling_params)
                and give_copies(requests, self.index, data)
            )
            carries = seams.carries_block(data.sampling_params)
            if carries or edited:
                self.prompt_rows_cached += seams.cached_rows(data)
            if not carries:
                # a request with no block of its own (a plain one the edits run on)
                if edited and tables is not None and seams.whole_prompt_scheduled(data, scheduler_output):
                    self._lower_edited(requests.requests[data.req_id], tables, *_room(data, scheduler_output))
                continue
            # A lowered block counts one step per forward; a prompt split by
            # chunked prefill (the Python path refuses it, with its reason) is
            # never lowered.
            if tables is None or not seams.whole_prompt_scheduled(data, scheduler_output):
                admit(requests, self.index, data, self.persistent, self.limits, self.model)
                if data.req_id in requests.requests:
                    why = NO_TAPS if tables is None else CHUNKED
                    mediator = requests.requests[data.req_id].mediator
                    if why is NO_TAPS and not getattr(mediator, "needs_forward", True):
                        why = AT_SAMPLER  # taps or none, it runs at the sampler
                    self.lowering.paths.python(data.req_id, *why)
                continue
            rows, most = _room(data, scheduler_output)
            if edited:
                admit(requests, self.index, data, self.persistent, self.limits, self.model)
                request = requests.requests.get(data.req_id)
                if request is not None and request.mediator is not None:
                    self._lower_edited(request, tables, rows, most)
                continue

            def known(request: Any, digest: bytes, rows: int = rows, most: int = most) -> bool:
                return self._lower(self.lowering.lower_known, request, tables, digest, rows, most)

            digest = admit(requests, self.index, data, self.persistent, self.limits, self.model, known)
            request = requests.requests.get(data.req_id)
            if request is not None and request.mediator is not None:
                self._lower(self.lowering.lower, request, tables, self.model, rows, most, digest)
        for data in seams.new_requests(scheduler_output):
            if data.req_id in requests.requests and data.req_id not in self.stops.tokens:
                self.stops.admit(data.req_id, data.sampling_params)
                if not self.eager and not self.eager_steps:
                    self._refuse_python_forward(requests.requests[data.req_id])

    def _refuse_python_forward(self, request: Any) -> None:
        """On a compiled engine whose operator turned Python forwards off, a block
        that would need one ends now, before it runs, saying what it reads that is
        no tap (the tables and the taps serve the rest)."""
        if _forward_of(request.mediator) != PYTHON:  # its own block: an edit's copy is the operator's
            return
        path = self.lowering.paths.taken.get(request.id)
        why = path.reason if path is not None and path.reason else "it reads a location that is not a tap"
        end(
            request,
            nns.capture_exception(
                CompiledForwardError(
                    f"this engine runs no step's forward as Python ({settings.EAGER_STEPS}=0), and this "
                    f"block would need one: {why}. Ask the operator to tap what it reads (the "
                    'engine\'s `nnsight_taps` setting, e.g. "model.layers.*.output"), or run it on '
                    f"an engine without {settings.EAGER_STEPS}=0."
                )
            ),
        )

    def _lower_edited(self, request: Any, tables: Any, rows: int, most: int) -> None:
        """A request with installed edits: where one of its blocks (its own, if it
        carries one, or its copy of an edit) needs the forward and the others only
        the sampler, that one is lowered; with two or more needing it, all run as
        Python."""
        wanting = [c for c in request.copies if getattr(request.copies[c], "needs_forward", True)]
        if request.mediator is not None and getattr(request.mediator, "needs_forward", True):
            wanting.append(None)
        if len(wanting) > 1:
            self.lowering.paths.python(request.id, *EDITED)
        elif request.mediator is None and not wanting:
            return  # its copies run at the sampler: nothing of it is in the forward
        elif wanting == [None] or not wanting:  # its own block (or only the sampler): as any
            self._lower(self.lowering.lower, request, tables, self.model, rows, most)
        else:
            self._lower(self.lowering.lower_edit, request, wanting[0], tables, self.model, rows, most)

    def _lower(self, how: Any, request: Any, *args: Any) -> bool:
        """Lowering is an optimisation: where it fails, the block runs as Python."""
        try:
            return how(request, *args)
        except Exception:
            logger.exception("vllm-nnsight: could not lower request %s", request.id)
            self.lowering.paths.python(request.id, *FAILED)
            return False

    @property
    def tables(self) -> Any:
        """This runner's tap tables, or None for an engine without taps."""
        return self.runner.__dict__.get(RUNNER_ATTR)

    def fill_taps(self) -> None:
        """Called once a forward's layout is known: this step's rows into the tap tables."""
        step, tables = self.step, self.tables
        if step is None or step.phase is not Phase.SCHEDULED or step.taps_filled or tables is None:
            return
        step.taps_filled = True
        if tables.idle():
            return
        step.filled = self.adapter.rows(self.runner)
        tables.fill(*step.filled)

    def _forward_wanted(self, scheduler_output: Any) -> str | None:
        """Whether a block in this step, not yet finished, may ask for a module
        location: ``PYTHON`` where one may ask for any, ``TAPS`` where every such
        block asks only for taps (``live.py``), else None."""
        requests = self.requests.requests
        if not requests or self._all_lowered():
            return None
        ended = self.stops.ended
        found = None
        for request_id in seams.scheduled_ids(scheduler_output):
            request = requests.get(request_id)
            if request is None or request_id in ended:
                continue
            for m in request.workers():
                wanted = _forward_of(m) if m.worker is None or m.alive or m.caches else None
                if wanted == PYTHON:
                    return PYTHON
                found = wanted or found
        return found

    def _all_lowered(self) -> bool:
        """Every tracked request runs on the tap tables (a check that costs nothing
        per request; a lowered request's error is only ever set at collect)."""
        tables = self.tables
        return (
            tables is not None
            and not self.lowering.mixed
            and len(tables.requests) == len(self.requests.requests)
        )

    def abandon_step(self) -> None:
        """The step raised: close the interleaver so nothing leaks into the next."""
        step, self.step = self.step, None
        if step is None:
            return
        self._end_python(step)
        self._close_taps(step)
        if step.phase is Phase.FORWARD:
            self.model.interleaver.__exit__(None, None, None)

    def _end_python(self, step: Step) -> None:
        if self.kernels is not None:
            self.kernels.restore()
        if step.started is not None:
            self.step_seconds[PYTHON if step.python else TAPS] += time.perf_counter() - step.started
            step.started = None
        if step.python or step.at_taps:
            step.python = step.at_taps = False
            self.adapter.ask_eager(self.runner, False)
            self.adapter.ask_pieces(self.runner, False)
            self.adapter.ask_broken(self.runner, False)

    def _on_forward(self, module: Any, args: Any) -> None:
        step = self.step
        if step is None:
            return
        if step.python:
            seams.skip_compiled_forward()
            if self.kernels is not None:
                self.kernels.use()
            self.python_steps += 1
        if step.phase is Phase.SCHEDULED and step.forward:
            self._start(step)

    def forward_replayed(self) -> None:
        """The forward replays graphs broken at the taps (``taps/broken.py``): no root
        module hook runs, so the step's blocks are readied here, as that hook does."""
        self._on_forward(None, ())

    def _start(self, step: Step, in_forward: bool = True) -> None:
        """Read the layout and open the interleaver for this step.

        Called by the root forward pre-hook (or, before graphs broken at the taps
        replay, :meth:`forward_replayed`), or by the sampler pre-hook when the
        forward ran as a replayed CUDA graph (no Python, so no root hook).
        """
        requests = self.requests
        if not requests.requests:
            # Nothing in flight: no pending save can matter, so bound the
            # thread-local save set nnsight keys by object id.
            nns.clear_saves()
            step.phase = Phase.DONE
            return
        if self._all_lowered() or not any(
            r.mediator is not None or r.copies or r.error is not None for r in requests.requests.values()
        ):
            step.phase = Phase.DONE  # only lowered requests: nothing for the interleaver to serve
            return
        nns.open_save_scope()
        view = self.adapter.view(self.runner)
        spans = view.spans()
        step.rows = view.rows()
        step.discarded = [r for r, thrown in zip(view.req_ids, view.discarded) if thrown]
        ended = self.stops.ended
        if ended:  # vLLM runs them once more and throws the sample away
            spans = [(SITTING_OUT, n) if r in ended else (r, n) for r, n in spans]
        last = None
        if self.recomputing:  # sit out a recompute's thrown-away chunks; see its last row only
            spans, last, sat_out = recompute_spans(spans, self.recomputing, view.discarded)
            self.sat_out += sat_out
        refuse_chunked(self.requests, spans, view, nns.capture_exception)
        interleaver = self.model.interleaver
        interleaver.mediators = []
        interleaver.__enter__()
        step.phase = Phase.FORWARD
        step.spans = spans
        if self.lowering.replays or step.at_taps:
            step.visits = dict(interleaver.counts)
        requests.scope(self.model, spans)
        if last:
            narrow(requests, spans, last)
        if step.at_taps and in_forward:  # (a forward that ran as a graph handed nothing)
            self._open_taps(step)

    def _open_taps(self, step: Step) -> None:
        """Have each tap that this step's blocks read hand its value to the
        interleaver as the compiled forward passes it (``live.py``)."""
        tracked, replays = self.requests.requests, self.lowering.replays
        sites: set[int] = set()
        for request_id, count in step.spans:
            request = tracked.get(request_id)
            if request is None or not count:
                continue
            at = getattr(request.mediator, "at_taps", None)
            if at is not None:
                sites.update(at)
            lowered = replays.get(request_id)
            if lowered is not None and _waiting(request, lowered.edit):
                sites.update(site for site, _ in lowered.regions)
        rows = sum(count for _, count in step.spans)
        step.live = AtTaps(self.tables, sites, self.model.interleaver, self.model.path, self.kernels, rows)
        ops.at_taps(step.live)
        self.steps_at_taps += 1

    def _close_taps(self, step: Step) -> None:
        """The forward is over: no tap hands anything on until the next such step."""
        live, step.live = step.live, None
        if live is None:
            return

        ops.at_taps(None)
        self.taps_handed += live.handed
        if live.failure is not None:  # the step's blocks at the taps end with it, no other
            error = nns.capture_exception(live.failure)
            for request_id, _ in step.spans:
                request = self.requests.requests.get(request_id)
                if request is not None and getattr(request.mediator, "at_taps", None) is not None:
                    request.error = request.error or error

    def _on_logits(self, logits: Any) -> Any:
        """The logits the sampler is about to draw from; a tensor back replaces them."""
        step = self.step
        if step is None:
            return None
        if self.kernels is not None:
            self.kernels.restore()  # the forward is over
        self._close_taps(step)
        if step.phase is Phase.SCHEDULED:
            self._start_at_the_sampler(step)
        if step.phase is not Phase.FORWARD:
            return None
        model = self.model
        if self.lowering.replays:
            self._replay(step)
        self.requests.unflatten(model)
        model.interleaver.__exit__(None, None, None)
        step.phase = Phase.SAMPLING
        nns.still_running(model.interleaver)
        # The sampler scales logits in place; a block's read must not see that, so
        # blocks get a copy. Their edits are copied back into vLLM's own tensor,
        # which the sampler then reads as it would without a block (same layout,
        # so the same log-probabilities as a plain step's).
        new = nns.provide_logits(model, logits.clone())
        if new.shape == logits.shape:
            logits.copy_(new)
            return None
        return new

    def _start_at_the_sampler(self, step: Step) -> None:
        """Open the interleaver after a forward no block needed. A block served a tap
        here (``taps/replay.py``) starts here too: what it runs before its first
        read runs with the kernels it would get in a Python step's forward."""
        kernels = self.kernels if self.lowering.replays else None
        if kernels is not None:
            kernels.use()
        try:
            self._start(step, in_forward=False)
        finally:
            if kernels is not None:
                kernels.restore()

    def _replay(self, step: Step) -> None:
        """Serve each tap that blocks read at the sampler, where the forward did not
        reach it (compiled, or graphed): its value for this step, the kept rows of
        those blocks' requests at their rows of the slab, the taps in model order
        (``taps/replay.py``)."""
        replays, tracked = self.lowering.replays, self.requests.requests
        at: dict[int, list[tuple[int, int, int]]] = {}
        offset = 0
        for request_id, count in step.spans:
            lowered = replays.get(request_id)
            if lowered is not None and count and _waiting(tracked.get(request_id), lowered.edit):
                if count * lowered.widest > lowered.rows:
                    # cannot happen: its region holds its prompt and tokens
                    logger.error("vllm-nnsight: request %s has more rows than its region", request_id)
                    offset += count
                    continue  # never served: its block ends with an error, not another's rows
                for site, base in lowered.regions:
                    at.setdefault(site, []).append((offset, count, base))
            offset += count
        if not at:
            return
        kernels = self.kernels
        if kernels is not None:  # a module a block calls runs as in a Python step
            kernels.use()
        try:
            self._serve(at, offset, step)
        finally:
            if kernels is not None:
                kernels.restore()

    def _serve(self, at: dict[int, list[tuple[int, int, int]]], rows: int, step: Step) -> None:
        """Hand the interleaver each tap's value: ``rows`` rows, the kept ones in place."""
        tables, interleaver = self.tables, self.model.interleaver
        for site, where, kind in served(at, tables):
            location = f"{self.model.path}.{where}"
            if interleaver.counts.get(location, 0) != step.visits.get(location, 0):
                continue  # the forward ran as Python and served it there
            if kind == HANDED:  # each value the module is handed, from its own tap
                handed = tables.inputs[where.rpartition(".")[0]]
                value: Any = (tuple(_rebuilt(tables, each, at[each], rows)[0] for each in handed), {})
            else:
                first, second = _rebuilt(tables, site, at[site], rows, pair=kind == PAIR)
                if kind == PAIR:
                    value = (first, second)
                elif kind == FIRST:
                    value = (first, None)
                else:
                    value = ((first,), {}) if where.endswith(".input") else first
            interleaver.handle(location, value)
            self.served_at_sampler += 1

    def _on_samples(self, sampled: Any) -> Any:
        """The ``[requests, 1]`` tokens the sampler drew; a tensor back replaces them."""
        step = self.step
        if step is None:
            return None
        if step.phase is not Phase.SAMPLING:
            self._lowered_drew(step, sampled)
            return None
        step.phase = Phase.DONE
        self._end_python(step)
        model = self.model
        nns.still_running(model.interleaver)
        sampled = nns.provide_samples(model, sampled)
        eos = seams.eos_token_id(model.tokenizer)
        if eos is not None:
            nns.finish_erred(self.requests, sampled, eos)
            self._finish_refused(step, sampled, eos)
        if self.stops.tokens:
            self.stops.drew(sampled, self._running(step.rows), step.discarded)
            self._lowered_drew(step, sampled)
        self.requests.record_saves()
        return sampled

    def _running(self, rows: dict[str, int]) -> dict[str, int]:
        """The rows of requests whose blocks may still run a step (a block that
        finished its loop cannot see one more, so its samples need not be read)."""
        tokens, requests = self.stops.tokens, self.requests.requests
        running = {}
        for request_id, row in rows.items():
            request = requests.get(request_id) if request_id in tokens else None
            if request is not None and any(m.alive or m.caches for m in request.workers()):
                running[request_id] = row
        return running

    def _lowered_drew(self, step: Step, sampled: Any) -> None:
        """Note what this step's lowered requests drew (read later: ``stops.py``).
        A forward of several rows after the first is a recompute, whose sample
        vLLM may throw away: not noted."""
        tokens, tables = self.stops.tokens, self.tables
        if not tokens or step.filled is None or tables is None:
            return
        req_ids, bounds = step.filled
        rows = []
        for row, request_id in enumerate(req_ids):
            if request_id in tokens and request_id in tables.requests:
                steps = tables.steps(request_id)
                if steps == 1 or bounds[row + 1] - bounds[row] == 1:
                    rows.append((request_id, row, steps - 1))
        self.stops.lowered_drew(sampled, rows)

    def _finish_refused(self, step: Step, sampled: Any, eos: int) -> None:
        """End requests whose block never started (refused envelope, chunked prompt)."""
        for request_id, request in self.requests.requests.items():
            if request.error is not None and request.mediator is None and request_id in step.rows:
                sampled[step.rows[request_id]] = eos

    def ensure_built(self) -> None:
        """Build the tree now: an edit may arrive before any request with a block."""
        if self.model is None:
            self._build()

    # ------------------------------------------------------------------ collect
    def collect(self, request_ids: list[str], outputs: bytes | None) -> list[bytes] | None:
        """Wind up finished requests' blocks and return their saves and errors.

        ``outputs`` are the finished ``RequestOutput`` objects (pickled), which
        serve ``tracer.result``, of the requests whose blocks may read it
        (``returns/outputs.RESULT_KEY``); None only winds up (an aborted request). One
        reply part per request id, packed on its own, then the pool of saved
        tensors they refer to (``collect.py``).
        """
        if self.requests is None:
            return None

        finished = pickle.loads(outputs) if outputs else None
        internal = [i for rid in request_ids for i in self.index.answering(rid)]
        with self.ready.reading(internal) as apart:
            return self._collect(request_ids, finished, apart)

    def _collect(self, request_ids: list[str], finished: dict | None, apart: bool) -> list[bytes]:
        """:meth:`collect`'s work; ``apart``: its device work runs beside the step in
        flight, behind the mark of where that step began (``ready.py``)."""
        paths = {rid: self.lowering.paths.take(self.index.answering(rid)) for rid in request_ids}
        for rid, path in paths.items():  # on the output that ``tracer.result`` serves, too
            if path is not None and finished and rid in finished:
                finished[rid].nnsight_path = path
        # Beside the step in flight, the samples of the steps before it (which say
        # where the collected requests ended) are all that is waited for.
        self.stops.settle(upto=self.noted_at_mark if apart else None)
        lowered = self.lowering.forget(
            self.tables, self.index, self.requests, request_ids, self.stops.counted
        )
        reporting = seams.reports_saves()
        entries = wind_up(self.requests, self.model, self.index, request_ids, finished, reporting)
        if reporting:
            for engine_id, saves in lowered.items():
                if engine_id not in entries:
                    continue
                for name, value in saves.items():
                    if value is OUTPUT:
                        if not finished or engine_id not in finished:
                            continue
                        value = finished[engine_id]
                    entries[engine_id]["saves"][name] = value
        for rid, path in paths.items():
            if path is not None and rid in entries:
                entries[rid]["path"] = path
            elif path is not None and reporting:  # its edits' copies left nothing else to say
                entries[rid] = {**request_reply(), "path": path}
        self.uncollected.forget(self.requests.requests)
        self.lowering.paths.keep_only(self.requests.requests)
        self.lowering.mixed.intersection_update(self.requests.requests)
        self.recomputing.intersection_update(self.requests.requests)
        self.stops.keep_only(self.requests.requests)
        if not apart and any(entry.get("saves") or entry.get("sequences") for entry in entries.values()):
            synchronize_device()
        # Only a step that stayed compiled misses module locations; with Python steps a
        # location "already run past" is the block's own order (layer 20, then 10).
        miss = None if self.eager or self.eager_steps else self._compiled_miss()
        pooler = Pooler()
        parts = pack_all(request_ids, entries, self.limits, miss, pooler, self.pack_watch)
        return parts + pool_part(pooler) + self._counts_part()

    def _counts_part(self) -> list[bytes]:
        """This engine's step counts, from its first rank (``returns/metrics.py``)."""
        if not seams.answers_for_engine():
            return []
        seconds = self.step_seconds
        counts = StepCounts(
            os.getpid(), self.python_steps, seconds[PYTHON], self.steps_at_taps, seconds[TAPS]
        )
        return [pickle.dumps(counts)]

    def _compiled_miss(self) -> str:
        """Why a module location was never reached on this compiled engine (started
        with Python steps off)."""
        why = (
            f"it was started with {settings.EAGER_STEPS}=0, so a step with a block stays "
            f"compiled. For module locations unset {settings.EAGER_STEPS} or build the "
            "engine with enforce_eager=True."
        )
        return (
            "this engine compiles the model's forward (torch.compile or CUDA graphs), "
            "where module hooks do not fire, so a module location was never reached: "
            f"{why} model.logits and model.samples work on any engine."
        )

    def tracked(self) -> int:
        """How many requests' blocks this worker still holds (a leak gauge)."""
        return 0 if self.requests is None else len(self.requests.requests)

    def stats(self) -> dict[str, Any]:
        """What this worker did: blocks held, steps run as Python on a compiled engine."""
        return {
            "tracked": self.tracked(),
            "compiled_engine": not self.eager,
            "uncompiled_steps": self.python_steps,
            "taps_served_at_sampler": self.served_at_sampler,
            "steps_at_taps": self.steps_at_taps,
            "taps_handed_at_taps": self.taps_handed,
            "step_seconds": {
                "python": round(self.step_seconds[PYTHON], 6),
                "taps": round(self.step_seconds[TAPS], 6),
            },
            "collects_beside_step": self.ready.beside,
            "collects_waited": self.ready.waited,
            "resumed": self.resumed,
            "prompt_rows_cached": self.prompt_rows_cached,
            "preempted_blocks": self.preempted,
            "continued_blocks": self.continued,
            "recompute_chunks_sat_out": self.sat_out,
            "edits": 0 if self.requests is None else len(self.requests.templates),
            "saves_tracked": 0 if self.model is None else nns.saves_tracked(),
            "budget_stops": self.step_watch.stopped + self.pack_watch.stopped,
            "eager_kernels": 0 if self.kernels is None else len(self.kernels),
            **self.lowering.stats(),
            **lent(),
            **({} if self.tables is None else self.tables.stats()),
            "graph_modes": seams.graph_mode_counts(self.runner),
            "runner": seams.runner_name(self.runner),
            "runner_family": self.adapter.family,
        }


def _rebuilt(
    tables: Any, site: int, kept: list[tuple[int, int, int]], rows: int, pair: bool = False
) -> tuple[Any, Any]:
    """A tap's value for a step of ``rows`` rows: the kept rows of the requests
    served it, in place (each ``(start, count, base)``), zeros elsewhere; and, for
    a ``pair``, the second value beside it (else None)."""
    width = tables.width(site)
    first = tables.store.new_zeros((rows, width))
    second = first.new_zeros(first.shape) if pair else None
    for start, count, base in kept:
        one, two = step_rows(base, tables.store, count, width)
        first[start : start + count] = one
        if second is not None:
            second[start : start + count] = two
    return first, second


def _room(data: Any, scheduler_output: Any) -> tuple[int, int]:
    """A new request's rows in this step and the most it can have (prompt and
    ``max_tokens``; 0: unknown, never kept lowered)."""
    rows = seams.scheduled_rows(data, scheduler_output)
    limit = getattr(data.sampling_params, "max_tokens", None)
    return rows, rows + int(limit) if limit else 0


def _forward_of(mediator: Any) -> str | None:
    """What a block asks of its steps' forwards: ``PYTHON`` (any module location),
    ``TAPS`` (only taps: ``live.py``), or None (nothing: lowered, or the sampler's)."""
    if mediator is None or not getattr(mediator, "needs_forward", True):
        return None
    return PYTHON if getattr(mediator, "at_taps", None) is None else TAPS


def _waiting(request: Any, edit: str | None = None) -> bool:
    """Whether a request's block (or its copy of ``edit``) may still read a location
    (not finished, not failed)."""
    if request is None or request.error is not None:
        return False
    mediator = request.mediator if edit is None else request.copies.get(edit)
    return mediator is not None and (mediator.worker is None or bool(mediator.alive))
