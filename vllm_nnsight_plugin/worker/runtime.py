"""The worker side: run each request's block against the live model, step by step.

A *step* is one call of the runner's ``execute_model`` then its sampler. In a step
vLLM packs every scheduled request's new tokens into one ``[tokens, ...]`` slab.
A block belongs to one request, so each step it must be pointed at its own rows.

nnsight already knows how to run a block next to a forward (its ``Mediator`` and
``Interleaver``) and how to narrow a slab to one request's rows (``VLLMBatcher``,
``Requests.scope``); this module reuses that machinery and drives it with three
plain torch hooks instead of a replacement model runner:

- a forward pre-hook on the root model starts the step: it admits new requests
  (opening their envelopes), reads the step layout, and opens the interleaver;
- a forward pre-hook on ``runner.sampler`` serves ``model.logits``;
- a forward hook on ``runner.sampler`` serves ``model.samples``, ends any
  request whose block raised, and snapshots what each block saved.

Module hooks fire only where the forward runs as Python. On an engine that
compiles its forward (torch.compile, CUDA graphs), a step in which some block
may run is dispatched without a CUDA graph and with the compiled module bypassed;
every other step keeps vLLM's compiled, graphed path.

The nnsight tree over the live model is built only when the first request with
a block arrives, so an engine that never sees one is never instrumented.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from .. import seams
from ..versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
from ..wire.envelope import EXTRA_ARGS_KEY, EnvelopeError, Limits, open_envelope
from ..wire.references import envoy_references
from ..wire.trust import LOCAL_SIGNATURE_KEY, UntrustedBlockError, check_local

logger = logging.getLogger("vllm_nnsight_plugin")


#: An uncollected block is dropped once its request has been finished this many
#: steps *and* ``VLLM_NNSIGHT_UNCOLLECTED_S`` seconds (default 30): long enough
#: for a busy front end's collect to arrive, short enough not to hold memory.
_UNCOLLECTED_STEPS = 8
_UNCOLLECTED_ENV = "VLLM_NNSIGHT_UNCOLLECTED_S"
_FALSY = {"", "0", "false", "no", "off"}


class ChunkedPromptError(RuntimeError):
    """A block's prompt was split across steps by chunked prefill."""


class SaveLimitError(RuntimeError):
    """A request's saves were over the engine's limit."""


class UnsendableSaveError(RuntimeError):
    """A saved value could not be pickled to go back to the front end."""


class CompiledForwardError(RuntimeError):
    """A block asked for a module location in a forward that ran compiled."""


#: ``0`` keeps every step compiled: a module location is then refused, not served.
_EAGER_STEPS_ENV = "VLLM_NNSIGHT_EAGER_STEPS"


class WorkerRuntime:
    """Per-runner state: the nnsight tree, the requests with blocks, this step's layout.

    The attribute names ``nnsight_model`` and ``nnsight_requests`` are the ones
    nnsight's own runner uses, so its step and collection methods run on this
    object unchanged.
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.nnsight_model: Any = None
        self.nnsight_requests: Any = None
        self.persistent: dict = {}
        self.limits = Limits.from_env()
        self.eager = seams.engine_is_eager(runner.vllm_config)
        # On a compiled engine, a step that runs a block runs its forward as Python
        # (module hooks fire there and nowhere else); every other step keeps the
        # engine's CUDA graphs and compiled code.
        self.eager_steps = os.environ.get(_EAGER_STEPS_ENV, "1").strip().lower() not in _FALSY
        self.uncompiled = False  # this step's forward runs as Python
        self.uncompiled_steps = 0
        self.scheduler_output: Any = None
        self.in_step = False
        self.open = False  # the interleaver is entered for this step's forward
        self.rows: dict[str, int] = {}
        self.steps = 0
        self.finished_at: dict[str, tuple[int, float]] = {}
        self.uncollected_s = float(os.environ.get(_UNCOLLECTED_ENV) or 30.0)

    # ------------------------------------------------------------------ setup
    def _build(self) -> None:
        """Wrap the live module in nnsight's tree and hook the runner (once)."""
        from nnsight.modeling.vllm.fragments import VLLMFragments
        from nnsight.modeling.vllm.interleaver import VLLMInterleaver
        from nnsight.modeling.vllm.model_runners.GPUModelRunner import Requests
        from nnsight.modeling.vllm.vllm import VLLM as NNsightVLLM
        from vllm.tokenizers import cached_tokenizer_from_config

        from .batching import CheckedBatcher

        runner = self.runner
        module = runner.get_model()
        model = NNsightVLLM(module, interleaver=VLLMInterleaver((), fragments=VLLMFragments()))
        model.tokenizer = cached_tokenizer_from_config(runner.model_config)
        model.interleaver.batcher = CheckedBatcher(None)
        # A block's error ends its own request, never the engine.
        model.interleaver.defer_exceptions = True
        self.nnsight_model = model
        self.nnsight_requests = Requests()
        self.persistent = {**model._remoteable_persistent_objects(), **envoy_references(model)}
        module.register_forward_pre_hook(self._on_forward)
        runner.sampler.register_forward_pre_hook(self._on_logits, with_kwargs=True)
        runner.sampler.register_forward_hook(self._on_samples)
        logger.info(
            "vllm-nnsight: instrumented %s (%s forward)",
            type(module).__name__,
            "eager" if self.eager else "compiled",
        )

    # ------------------------------------------------------------------ step
    def begin_step(self, scheduler_output: Any) -> None:
        """Called by the runner before each real step (see ``seams``)."""
        if self.open:  # a step whose sampler never ran: close what it opened
            self.abandon_step()
        self.scheduler_output = scheduler_output
        if self.nnsight_requests is not None and self.nnsight_requests.requests:
            self._expire(getattr(scheduler_output, "finished_req_ids", ()))
        new = getattr(scheduler_output, "scheduled_new_reqs", ())
        new_block = any(seams.carries_block(getattr(data, "sampling_params", None)) for data in new)
        if self.nnsight_model is None and new_block:
            self._build()
        self.in_step = self.nnsight_model is not None
        self.uncompiled = (
            self.in_step
            and not self.eager
            and self.eager_steps
            and (new_block or self._block_still_running(scheduler_output))
        )
        seams.mark_uncompiled_step(self.runner, self.uncompiled)

    def _block_still_running(self, scheduler_output: Any) -> bool:
        """Whether a block that already started may run in this step."""
        requests = self.nnsight_requests.requests
        for request_id in getattr(scheduler_output, "num_scheduled_tokens", None) or ():
            request = requests.get(request_id)
            if request is not None and any(
                m.worker is None or m.alive or m.caches for m in request.workers()
            ):
                return True
        return False

    def _expire(self, finished: Any) -> None:
        """Wind up blocks of requests that finished and were never collected.

        The front end collects a request as soon as it finishes. One nobody
        collects (a caller that bypassed the plugin's front-end seams, a front
        end that died) is dropped a while after vLLM says it finished, so no state
        outlives it.
        """
        self.steps += 1
        now = time.monotonic()
        requests = self.nnsight_requests.requests
        for request_id in finished or ():
            if request_id in requests:
                self.finished_at.setdefault(request_id, (self.steps, now))
        stale = [
            rid
            for rid, (step, at) in self.finished_at.items()
            if self.steps - step >= _UNCOLLECTED_STEPS and now - at >= self.uncollected_s
        ]
        for request_id in stale:
            del self.finished_at[request_id]
            if request_id in requests:
                self.collect([request_id], None)

    def abandon_step(self) -> None:
        """The step raised: close the interleaver so nothing leaks into the next."""
        self._end_uncompiled()
        if self.open:
            self.nnsight_model.interleaver.__exit__(None, None, None)
            self.open = False
        self.in_step = False

    def _admit(self, new_requests: Any) -> None:
        """Take the block off each new request that carries one.

        A refused envelope or a block that fails to load is that request's error,
        reported on its output; it never reaches ``execute_model``'s caller.
        """
        from nnsight.intervention.errors import capture_exception
        from nnsight.intervention.interleaver import Mediator
        from nnsight.intervention.serialization import loads
        from nnsight.modeling.vllm.model_runners.GPUModelRunner import Request

        requests = self.nnsight_requests.requests
        for data in new_requests:
            params = getattr(data, "sampling_params", None)
            if not seams.carries_block(params) or data.req_id in requests:
                continue
            request = requests[data.req_id] = Request(data.req_id)
            try:
                check_local(params.extra_args[EXTRA_ARGS_KEY], params.extra_args.get(LOCAL_SIGNATURE_KEY))
                envelope = open_envelope(
                    params.extra_args[EXTRA_ARGS_KEY],
                    nnsight_version=SUPPORTED_NNSIGHT,
                    plugin_version=PLUGIN_VERSION,
                    limits=self.limits,
                )
                block = loads(envelope.block_bytes(), persistent_objects=self.persistent)
                if not isinstance(block, Mediator):
                    raise TypeError(f"the payload is a {type(block).__name__}, not an nnsight block")
                request.mediator = block
            except (EnvelopeError, UntrustedBlockError) as error:
                request.error = capture_exception(error)
            except Exception as error:  # a payload nnsight cannot load
                request.error = capture_exception(
                    EnvelopeError(f"the block could not be loaded on the engine: {error!r}")
                )

    def _refuse_chunked(self, spans: list[tuple[str, int]]) -> None:
        from nnsight.intervention.errors import capture_exception

        for request_id, scheduled in spans:
            request = self.nnsight_requests.requests.get(request_id)
            if request is None or request.mediator is None:
                continue
            state = seams.request_state(self.runner, request_id)
            if state is None or state.num_computed_tokens + scheduled >= state.num_prompt_tokens:
                continue
            request.error = capture_exception(
                ChunkedPromptError(
                    f"this request's {state.num_prompt_tokens}-token prompt was split across "
                    f"engine steps by chunked prefill ({scheduled} tokens in this step), so "
                    "its block could not see the prompt whole. Raise max_num_batched_tokens "
                    "above the prompt length, or build the engine with "
                    "enable_chunked_prefill=False."
                )
            )
            request.mediator = None
            request.copies = {}

    def _end_uncompiled(self) -> None:
        if self.uncompiled:
            self.uncompiled = False
            seams.mark_uncompiled_step(self.runner, False)

    def _on_forward(self, module: Any, args: Any) -> None:
        if self.uncompiled:
            seams.skip_compiled_forward()
            self.uncompiled_steps += 1
        if self.in_step and not self.open:
            self._start_step()

    def _start_step(self) -> None:
        """Admit new requests, read the layout, open the interleaver for this step.

        Called by the root forward pre-hook, or by the sampler pre-hook when the
        forward ran as a replayed CUDA graph (no Python, so no root hook).
        """
        from nnsight.tracing.tracer import _local, _saves, inc

        requests = self.nnsight_requests
        self._admit(getattr(self.scheduler_output, "scheduled_new_reqs", ()))
        if not requests.requests:
            # Nothing in flight: no pending save can matter, so bound the
            # thread-local save set nnsight keys by object id.
            _saves().clear()
            return
        if not getattr(_local, "depth", 0):
            inc()  # a block's .save() needs an open trace scope on this thread
        layout = seams.StepLayout(self.runner)
        spans = layout.spans()
        self.rows = {rid: row for row, rid in enumerate(layout.req_ids)}
        self._refuse_chunked(spans)
        interleaver = self.nnsight_model.interleaver
        interleaver.mediators = []
        interleaver.__enter__()
        self.open = True
        requests.scope(self.nnsight_model, spans)

    def _on_logits(self, module: Any, args: Any, kwargs: Any) -> Any:
        if self.in_step and not self.open:
            self._start_step()
        if not self.open:
            return None
        from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner as R

        model = self.nnsight_model
        self.nnsight_requests.unflatten(model)
        model.interleaver.__exit__(None, None, None)  # the forward is over
        logits = kwargs["logits"] if "logits" in kwargs else args[0]
        R._still_running(self)
        new = type(model).logits.provide(model, logits)
        # The sampler scales logits in place; a block's read must not see that.
        new = new.clone()
        if "logits" in kwargs:
            return args, {**kwargs, "logits": new}
        return (new, *args[1:]), kwargs

    def _on_samples(self, module: Any, args: Any, output: Any) -> Any:
        if not self.open:
            return None
        from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner as R

        self.open = False
        self.in_step = False
        self._end_uncompiled()
        model = self.nnsight_model
        R._still_running(self)
        output.sampled_token_ids = type(model).samples.provide(model, output.sampled_token_ids)
        R._finish_erred(self, output)
        self._finish_refused(output)
        self.nnsight_requests.record_saves()
        return output

    def _finish_refused(self, output: Any) -> None:
        """End requests whose block never started (refused envelope, chunked prompt)."""
        eos = getattr(self.nnsight_model.tokenizer, "eos_token_id", None)
        if eos is None:
            return
        for request_id, request in self.nnsight_requests.requests.items():
            if request.error is not None and request.mediator is None and request_id in self.rows:
                output.sampled_token_ids[self.rows[request_id]] = eos

    # ------------------------------------------------------------------ collect
    def collect(self, request_ids: list[str], outputs: bytes | None) -> list[bytes] | None:
        """Wind up finished requests' blocks and return their saves and errors.

        ``outputs`` are the finished ``RequestOutput`` objects (pickled), which
        serve ``tracer.result``; None only winds up (an aborted request). Each
        request is packed on its own, so a save that cannot be sent (or is over
        the limit) fails that request and no other collected with it.
        """
        if self.nnsight_requests is None:
            return None
        import pickle

        from nnsight.intervention.errors import capture_exception
        from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner as R

        from ..returns.outputs import empty_entry

        finished = pickle.loads(outputs) if outputs else None
        parts = []
        for request_id in request_ids:
            try:
                part = R.collect_nnsight(self, [request_id], [request_id], finished)
            except Exception as error:  # the block's state is already wound up
                unsent = UnsendableSaveError(
                    f"a value request {request_id} saved could not be sent back from the "
                    f"engine ({error}). Save tensors (.detach().clone()) and plain Python "
                    "values, not modules, parameters or objects holding them."
                )
                part = pickle.dumps({request_id: {**empty_entry(), "error": capture_exception(unsent)}})
            if not self.eager or len(part) > self.limits.max_save_bytes:
                part = self._review(pickle.loads(part))
            parts.append(part)
        for request_id in list(self.finished_at):
            if request_id not in self.nnsight_requests.requests:
                del self.finished_at[request_id]
        return parts

    def _review(self, collected: dict) -> bytes:
        """Refuse oversize saves, and on a compiled engine say why a module location
        was never reached. Runs only when one of the two can apply."""
        import pickle

        from nnsight.intervention.errors import capture_exception
        from nnsight.modeling.vllm.collect import dumps_compact

        for request_id, entry in collected.items():
            size = len(dumps_compact(entry))
            if size > self.limits.max_save_bytes:
                entry["saves"], entry["registered"], entry["sequences"] = {}, {}, {}
                entry["error"] = capture_exception(
                    SaveLimitError(
                        f"request {request_id} saved {size} bytes, over this engine's limit "
                        f"of {self.limits.max_save_bytes} (VLLM_NNSIGHT_MAX_SAVE_BYTES). Save "
                        "less (a slice, a reduction), or split the work over several traces."
                    )
                )
            error = entry.get("error")
            if not self.eager and error is not None and "OutOfOrder" in repr(error):
                entry["error"] = capture_exception(CompiledForwardError(self._compiled_miss()))
        return pickle.dumps(collected)

    def _compiled_miss(self) -> str:
        """Why a module location was never reached on this compiled engine."""
        if not self.eager_steps:
            why = (
                f"it was started with {_EAGER_STEPS_ENV}=0, so a step with a block stays "
                f"compiled. For module locations unset {_EAGER_STEPS_ENV} or build the "
                "engine with enforce_eager=True."
            )
        else:
            why = (
                "the step ran as Python but this model's compiled forward was not "
                "bypassed. Build the engine with enforce_eager=True for module locations."
            )
        return (
            "this engine compiles the model's forward (torch.compile or CUDA graphs), "
            "where module hooks do not fire, so a module location was never reached: "
            f"{why} model.logits and model.samples work on any engine."
        )

    def tracked(self) -> int:
        """How many requests' blocks this worker still holds (a leak gauge)."""
        return 0 if self.nnsight_requests is None else len(self.nnsight_requests.requests)

    def stats(self) -> dict[str, Any]:
        """What this worker did: blocks held, steps run as Python on a compiled engine."""
        return {
            "tracked": self.tracked(),
            "compiled_engine": not self.eager,
            "uncompiled_steps": self.uncompiled_steps,
            "graph_modes": seams.graph_mode_counts(self.runner),
            "runner": seams.runner_name(self.runner),
        }
