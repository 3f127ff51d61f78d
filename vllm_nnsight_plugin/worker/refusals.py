"""Blocks that must end before a step, with the reason, on their own request only.

A prompt split by chunked prefill (:func:`refuse_chunked`): the block would
never see the prompt whole.

A request vLLM preempted and now resumes (:func:`refuse_resumed`). When the KV
cache runs out, vLLM's scheduler preempts a running request (frees its
KV blocks) and later resumes it by recomputing its prompt and every token it has
generated, in one step. A block that has run on earlier steps cannot see that
step as the step it expects (one new row), and whatever it wrote into earlier
steps is not in the recomputed KV. So a resumed request keeps its block only
where the recompute is exactly what the block did:

- a lowered steering block over every step (``tracer.all()``): the tables add
  its vector to every row of the request in the recompute, which is what they
  added to each of those rows when it was first computed. (A loop with an end
  counts forwards, and a recompute split by chunked prefill would add one, so
  it is not trusted to end where it should.)
- a request whose block already ended (refused, or failed): nothing of it runs.

Any other block ends its request at once with :class:`PreemptedError`, never a
silent difference from the same request run alone.
"""

from __future__ import annotations

from typing import Any

from .errors import ChunkedPromptError, PreemptedError


def refuse_chunked(requests: Any, spans: list[tuple[str, int]], state_of: Any, capture: Any) -> None:
    """Fail each started block whose prompt this step does not finish (``spans``:
    request id and rows scheduled; ``state_of``: the runner's state of a request)."""
    for request_id, scheduled in spans:
        request = requests.requests.get(request_id)
        if request is None or request.mediator is None:
            continue
        state = state_of(request_id)
        if state is None or state.num_computed_tokens + scheduled >= state.num_prompt_tokens:
            continue
        _end(
            request,
            capture(
                ChunkedPromptError(
                    f"this request's {state.num_prompt_tokens}-token prompt was split across "
                    f"engine steps by chunked prefill ({scheduled} tokens in this step), so "
                    "its block could not see the prompt whole. Raise max_num_batched_tokens "
                    "above the prompt length, or build the engine with "
                    "enable_chunked_prefill=False."
                )
            ),
        )


def refuse_resumed(requests: Any, tables: Any, resumed: set[str], capture: Any) -> int:
    """Fail the blocks of resumed requests that cannot continue exactly; how many."""
    failed = 0
    for request_id in resumed:
        request = requests.requests.get(request_id)
        if request is None or request.error is not None:
            continue
        lowered = None if tables is None else tables.requests.get(request_id)
        if lowered is not None:
            if _replayed_exactly(lowered):
                continue
            taken = tables.forget(request_id)
            if taken is not None:
                tables.release(taken[0])
        elif request.mediator is None:
            continue  # already ended: nothing of it runs
        _end(request, capture(PreemptedError(_message(request_id))))
        failed += 1
    return failed


def _end(request: Any, error: Any) -> None:
    """The request's block ends with ``error`` (captured) and runs no further; the
    sampler then ends the request itself (``runtime._finish_refused``)."""
    request.error = error
    request.mediator = None
    request.copies = {}


def _replayed_exactly(lowered: Any) -> bool:
    return not lowered.code and lowered.start == 0 and lowered.stop is None


def _message(request_id: str) -> str:
    return (
        f"request {request_id} was preempted by vLLM's scheduler (the KV cache was "
        "full) and is being recomputed in one step; its block had already run on "
        "earlier steps, which a recompute cannot replay, so it ends here rather than "
        "give a different result. Give the engine more KV cache "
        "(gpu_memory_utilization, kv_cache_memory_bytes) or fewer concurrent "
        "requests (max_num_seqs)."
    )
