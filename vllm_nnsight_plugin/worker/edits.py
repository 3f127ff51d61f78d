"""Edits installed on this worker: their blocks, and each new request's copies.

An edit's block arrives once (``nnsight_edit_install``, from the front end that
owns the engine, signed with the engine's local key like a request's block) and
is kept as a template in nnsight's book of in-flight blocks
(``Requests.templates``, ``Requests.names``). A new request the front end
marked for edits (``wire/edits.py``) gets its own copy of each marked edit that
is still installed: the same code and captured values, a scope of its own, so
what it saves is that request's. Its saves are harvested when the request is
collected, beside (not into) the request's own block's.
"""

from __future__ import annotations

from typing import Any

from ..versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
from ..wire.edits import MARK_KEY, read_mark
from ..wire.envelope import Limits, open_envelope
from ..wire.trust import check_local
from . import _nnsight as nns
from .admit import RequestIndex, edit_claim, read, request_for

#: The most edits one engine holds at once: each runs on every request it marks.
MAX_EDITS = 64


def install_on(
    runtime: Any, edit_id: str, envelope: str, signature: str, name: str | None
) -> str | dict[str, str | None]:
    """Install an edit on a worker's runtime. The answer, for the front end: why
    not (a string, which it raises for the caller), or what the edit's requests
    may do with the prefix cache (``{"prefix": claim or None}``, see
    ``admit.edit_claim``)."""
    try:
        runtime.ensure_built()
        claim = install(
            runtime.requests,
            edit_id,
            envelope,
            signature,
            name,
            runtime.persistent,
            runtime.limits,
            runtime.model,
        )
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return {"prefix": claim}


def install(
    requests: Any,
    edit_id: str,
    envelope: str,
    signature: str,
    name: str | None,
    persistent: dict,
    limits: Limits,
    model: Any,
) -> str | None:
    """Check an edit's envelope and keep its block as a template; raises what the
    checks raise. Returns the prefix claim the block bears out (``edit_claim``)."""
    if edit_id not in requests.templates and len(requests.templates) >= MAX_EDITS:
        raise ValueError(f"this engine already holds {MAX_EDITS} edits; clear some first.")
    check_local(envelope, signature)
    opened = open_envelope(
        envelope,
        nnsight_version=SUPPORTED_NNSIGHT,
        plugin_version=PLUGIN_VERSION,
        limits=limits,
        expiry=False,
    )
    block = opened.block_bytes()
    template = nns.load_block(block, persistent)
    read(template, model)
    requests.templates[edit_id] = template
    requests.names[edit_id] = name
    return edit_claim(template, model, block)


def clear(requests: Any, edit_ids: list[str] | None) -> list[str]:
    """Take edits off (every one for None): no new request gets a copy, and the
    copies in flight are unwound and dropped with what they saved. Returns the
    ids cleared."""
    if requests is None:
        return []  # nothing was ever installed here
    cleared = [i for i in requests.templates if edit_ids is None or i in edit_ids]
    for edit_id in cleared:
        requests.templates.pop(edit_id, None)
        requests.names.pop(edit_id, None)
    for request in requests.requests.values():
        for edit_id in cleared:
            copy = request.copies.pop(edit_id, None)
            if copy is not None:
                requests.finish_dangling(copy, quiet=True)
            request.harvested.pop(edit_id, None)
    return cleared


def listed(requests: Any) -> list[dict]:
    """The installed edits, in the order they were installed."""
    if requests is None:
        return []
    return [{"id": edit_id, "name": requests.names.get(edit_id)} for edit_id in requests.templates]


def marked(params: Any) -> bool:
    """Whether a request's front end marked it for edits (cheap; the mark is checked
    when copies are given)."""
    extra = getattr(params, "extra_args", None)
    return bool(extra) and MARK_KEY in extra


def give_copies(requests: Any, index: RequestIndex, data: Any) -> bool:
    """Give a new request (``NewRequestData``) its copy of each edit its front end
    marked it for that is still installed; whether it got any."""
    templates = requests.templates
    chosen = [i for i in read_mark(data.sampling_params.extra_args.get(MARK_KEY)) if i in templates]
    if not chosen:
        return False
    request = request_for(requests, index, data.req_id)
    for edit_id in chosen:
        request.copies[edit_id] = nns.copy_block(templates[edit_id])
    return True
