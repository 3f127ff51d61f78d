"""Blocks that must end before a step, with the reason, on their own request only.

A prompt split by chunked prefill (:func:`refuse_chunked`): the block, or a copy
of an installed edit, would never see the prompt whole. (A request vLLM
preempted and recomputes is ``resume.py``'s.)
"""

from __future__ import annotations

from typing import Any

from .errors import ChunkedPromptError


def refuse_chunked(requests: Any, spans: list[tuple[str, int]], view: Any, capture: Any) -> None:
    """Fail each started block whose prompt this step does not finish (``spans``:
    request id and rows scheduled, row by row of ``view``, the step's
    ``seams.StepView``: how far each row's request had computed, and where its
    prompt ends)."""
    for row, (request_id, scheduled) in enumerate(spans):
        request = requests.requests.get(request_id)
        if request is None or (request.mediator is None and not request.copies):
            continue
        prompt = int(view.prefill[row])
        if int(view.computed[row]) + scheduled >= prompt:
            continue
        end(
            request,
            capture(
                ChunkedPromptError(
                    f"this request's {prompt}-token prompt was split across "
                    f"engine steps by chunked prefill ({scheduled} tokens in this step), so "
                    "its block could not see the prompt whole. Raise max_num_batched_tokens "
                    "above the prompt length, or build the engine with "
                    "enable_chunked_prefill=False."
                )
            ),
        )


def end(request: Any, error: Any) -> None:
    """The request's block and edit copies end with ``error`` (captured) and run no
    further; the sampler then ends the request itself (``runtime._finish_refused``)."""
    request.error = error
    request.mediator = None
    request.copies = {}
