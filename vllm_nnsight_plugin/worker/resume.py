"""A request vLLM preempted and now resumes: which blocks go on, and what they see.

When the KV cache runs out, vLLM's scheduler preempts a running request (frees
its KV blocks) and later resumes it by recomputing its prompt and every token it
has generated, in one step or, under chunked prefill, several. The recompute
rebuilds the keys and values from the tokens alone, so a block may go on exactly
when nothing it did is missing from them:

- a Python block (or edit copy) that cannot write into the forward
  (``writes.py``: no swap, no skip, no in-place edit; writes to
  ``model.logits`` and ``model.samples`` only choose tokens, which the recompute
  has). It goes on as if the recompute were one ordinary generation step: it
  sits out the chunks whose sample vLLM throws away, and in the last chunk it
  sees the last row only, the one new row a step gives (:func:`narrow`). Its
  request makes the same tokens as the same prompt run alone;
- a lowered steering block over every step (``tracer.all()``): the tables add
  its vector to every row of the request in the recompute, which is what they
  added to each of those rows when it was first computed. (A lowered loop with an
  end counts forwards, and a recompute split by chunked prefill would add one, so
  it is not trusted to end where it should; a lowered keep has no row to skip.)
- a block served a tap's rows at the sampler (``taps/replay.py``): a Python
  block that writes nothing, so it goes on as one; the tables keep the
  recompute's rows as any step's;
- a request whose block already ended (refused, or failed): nothing of it runs.

Any other block (one that may have written on an earlier step, which the
recomputed KV would not hold) ends its request at once with
:class:`PreemptedError`, never a silent difference from the same request run
alone.
"""

from __future__ import annotations

from typing import Any

from .errors import PreemptedError
from .refusals import end

#: Stands in for a recomputing request's id in the spans of a chunk it sits out:
#: its rows still count toward where the next request's rows start.
SITTING_OUT = "\x00vllm-nnsight:sitting-out"


def refuse_resumed(
    requests: Any, tables: Any, resumed: set[str], capture: Any, writes: Any
) -> tuple[int, set[str]]:
    """Fail the blocks of resumed requests that cannot go on exactly; return how
    many failed, and the requests whose Python blocks go on through the recompute
    (``writes(mediator)``: whether a block may write into the forward)."""
    failed = 0
    going_on: set[str] = set()
    for request_id in resumed:
        request = requests.requests.get(request_id)
        if request is None or request.error is not None:
            continue
        lowered = None if tables is None else tables.requests.get(request_id)
        if lowered is not None and not lowered.replay:  # a replayed block goes on as Python
            if _replayed_exactly(lowered):
                continue
            taken = tables.forget(request_id)
            if taken is not None:
                tables.release(taken[0])
        else:
            workers = request.workers()
            if not workers:
                continue  # already ended: nothing of it runs
            if not any(writes(mediator) for mediator in workers):
                going_on.add(request_id)
                continue
        end(request, capture(PreemptedError(_message(request_id))))
        failed += 1
    return failed, going_on


def recompute_spans(
    spans: list[tuple[str, int]], recomputing: set[str], discarded: Any
) -> tuple[list[tuple[str, int]], set[str], int]:
    """This step's spans with each recomputing request's chunk either sat out
    (vLLM throws its sample away: ``discarded[row]``) or kept as the recompute's
    last chunk; return the spans, the requests in their last chunk (which leave
    ``recomputing``) and how many chunks were sat out."""
    last: set[str] = set()
    sat_out = 0
    out = list(spans)
    for row, (request_id, tokens) in enumerate(spans):
        if request_id not in recomputing:
            continue
        if discarded[row]:
            out[row] = (SITTING_OUT, tokens)
            sat_out += 1
        else:
            last.add(request_id)
            recomputing.discard(request_id)
    return out, last, sat_out


def narrow(requests: Any, spans: list[tuple[str, int]], last: set[str]) -> None:
    """Point the blocks of requests in their recompute's last chunk at its last
    row: the one row an ordinary step gives them (their logits and sample are
    already one row per request)."""
    start = 0
    for request_id, tokens in spans:
        if request_id in last:
            for mediator in requests.requests[request_id].workers():
                if mediator.batch_group is not None:
                    mediator.batch_group = [start + tokens - 1, 1]
        start += tokens


def _replayed_exactly(lowered: Any) -> bool:
    return not lowered.code and lowered.start == 0 and lowered.stop is None


def _message(request_id: str) -> str:
    return (
        f"request {request_id} was preempted by vLLM's scheduler (the KV cache was "
        "full) and is being recomputed; its block may have written into the forward "
        "on earlier steps, which a recompute cannot replay, so it ends here rather than "
        "give a different result. Give the engine more KV cache "
        "(gpu_memory_utilization, kv_cache_memory_bytes) or fewer concurrent "
        "requests (max_num_seqs)."
    )
