"""Admission: a new request's envelope, checked and opened into its block.

Runs in the worker at the start of the step in which a request is first
scheduled. A refused envelope or a block that fails to load is that request's
error, reported on its output; it never reaches ``execute_model``'s caller.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from ..prefix import CLAIM_KEY, LAST_ROWS, SAME_EDIT, PrefixClaimError, last_rows_only, one_edit_every_step
from ..taps.meaning import folded
from ..taps.replay import modules_of
from ..versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
from ..wire.envelope import EXTRA_ARGS_KEY, EnvelopeError, Limits, open_envelope
from ..wire.trust import LOCAL_SIGNATURE_KEY, UntrustedBlockError, check_local
from . import _nnsight as nns
from .reach import needs_forward
from .writes import may_write


class RequestIndex:
    """Which tracked requests answer to an id the front end asks about.

    The front end names a request by the caller's id; the worker tracks vLLM's
    internal one (the caller's id plus a suffix, or an ``n > 1`` sequence's
    ``{index}_{parent}``). nnsight's ``Request`` knows all three spellings; this
    indexes them, so a collect finds its requests without a walk over all.
    """

    def __init__(self) -> None:
        self._ids: dict[str, dict[str, None]] = {}
        self._spellings: dict[str, tuple[str, ...]] = {}

    def add(self, request: Any) -> None:
        spellings = tuple(dict.fromkeys((request.engine_id, request.stem, request.id)))
        self._spellings[request.id] = spellings
        for spelling in spellings:
            self._ids.setdefault(spelling, {})[request.id] = None

    def answering(self, asked: str) -> list[str]:
        """Internal ids answering to ``asked``, in admission order."""
        return list(self._ids.get(asked, ()))

    def remove(self, internal: str) -> None:
        for spelling in self._spellings.pop(internal, ()):
            ids = self._ids.get(spelling)
            if ids is not None:
                ids.pop(internal, None)
                if not ids:
                    del self._ids[spelling]

    def __len__(self) -> int:
        return len(self._spellings)


#: Envelopes opened lately, by (envelope, signature, payload limit): the invokes
#: of a trace's loop share one envelope, checked and decoded once. Only those
#: with no expiry (the offline client's) and of at most ``_MEMO_CHARS``.
_opened: dict[tuple[str, str, int], tuple[bytes, bytes]] = {}
_MEMO_SIZE, _MEMO_CHARS = 64, 256 << 10


def opened(value: Any, signature: Any, limits: Limits) -> tuple[bytes, bytes]:
    """A request's block bytes and their digest, once its envelope is checked
    (the local signature, then ``open_envelope``); raises what they raise."""
    key = None
    if isinstance(value, str) and isinstance(signature, str) and len(value) <= _MEMO_CHARS:
        key = (value, signature, limits.max_payload_bytes)
        found = _opened.get(key)
        if found is not None:
            return found  # the same checks passed on these very strings
    check_local(value, signature)
    # Admitted by the front end while valid: time spent queued in the engine does
    # not expire it.
    envelope = open_envelope(
        value, nnsight_version=SUPPORTED_NNSIGHT, plugin_version=PLUGIN_VERSION, limits=limits, expiry=False
    )
    block = envelope.block_bytes()
    found = block, hashlib.blake2b(block, digest_size=32).digest()
    if key is not None and envelope.expires is None:
        _opened[key] = found
        while len(_opened) > _MEMO_SIZE:
            _opened.pop(next(iter(_opened)))
    return found


def read(mediator: Any, model: Any) -> None:
    """Note on a loaded block what its source shows: whether it may ask for a module
    location (``reach.py``) and whether it may write into the forward (``writes.py``)."""
    source, scope = nns.block_source(mediator), nns.block_scope(mediator)
    # An ``if`` on captured plain values takes one branch for the whole request:
    # what the block reaches and writes is what that branch does.
    source = (folded(source, scope) or source) if source else source
    mediator.needs_forward = needs_forward(source, scope, model, nns.InterleavingTracer)
    mediator.may_write = may_write(source, scope, model, nns.InterleavingTracer)


#: Blocks (by their claim and their bytes' digest) read at admission for a prefix
#: claim: whether they bear it out (``prefix.py``).
_CLAIMS: dict[tuple[str, bytes], bool] = {}
_CLAIMS_KEPT = 4096

#: What each claim says, and the test of it (the client's own).
_TESTS = {LAST_ROWS: last_rows_only, SAME_EDIT: one_edit_every_step}
_SAYS = {
    LAST_ROWS: "its block reads each module only at the last row of each step and writes nothing",
    SAME_EDIT: "its block's every write is one edit of every row at every step, and the rest of it "
    "reads only the last rows",
}


def _refusal(claim: str) -> str:
    return (
        f"this request read the prefix cache, saying {_SAYS[claim]}, and its block does not: it "
        "would have seen rows the cache supplied, or made KV that other requests read. A client of "
        f"this plugin sets that claim only where it holds; send the block without extra_args[{CLAIM_KEY!r}]."
    )


def _bears_out(claim: str, mediator: Any, model: Any, digest: bytes) -> bool:
    """Whether a loaded block bears out its claim (the client's own test), once
    per claim and block's bytes: a verdict of the bytes alone."""
    known = _CLAIMS.get((claim, digest))
    if known is not None:
        return known

    source, scope = nns.block_source(mediator), nns.block_scope(mediator)
    module_at = modules_of(nns.envoy_module(model))
    try:
        found = _TESTS[claim](source, scope, model, module_at, nns.InterleavingTracer)
    except Exception:  # noqa: BLE001 - any doubt: the claim does not hold
        found = False
    if len(_CLAIMS) >= _CLAIMS_KEPT:
        _CLAIMS.clear()
    _CLAIMS[(claim, digest)] = found
    return found


def edit_claim(mediator: Any, model: Any, block: bytes) -> str | None:
    """What an installed edit's block lets its requests do with the prefix cache:
    the first claim it bears out (reads only the last rows, then the same edit of
    every row at every step), or None (they are computed whole). Read here, at
    install, by the worker that will run it: no one else's word is taken."""
    digest = hashlib.blake2b(block, digest_size=32).digest()
    return next((claim for claim in _TESTS if _bears_out(claim, mediator, model, digest)), None)


def request_for(requests: Any, index: RequestIndex, request_id: str) -> Any:
    """The tracked request of this id, tracked from now on if it was not."""
    request = requests.requests.get(request_id)
    if request is None:
        request = requests.requests[request_id] = nns.Request(request_id)
        index.add(request)
    return request


def admit(
    requests: Any,
    index: RequestIndex,
    data: Any,
    persistent: dict,
    limits: Limits,
    model: Any,
    lower_known: Callable[[Any, bytes], bool] | None = None,
) -> bytes | None:
    """Take the block off one new request (``NewRequestData``) into ``requests``;
    return the digest of its bytes (None when it was refused).

    ``lower_known(request, digest)`` may put the request on the tap tables from
    a block of the same bytes lowered before; then its block is never loaded.
    Otherwise the block's mediator is marked with whether it may ask for a module
    location (``needs_forward``, see ``reach.py``): on a compiled engine only
    those blocks take a step off its compiled, graphed path; and with whether it
    may write into the forward (``may_write``, see ``writes.py``).
    """
    params = data.sampling_params
    request = request_for(requests, index, data.req_id)
    # the request read the prefix cache, saying what its block does (``prefix.py``)
    claim = params.extra_args.get(CLAIM_KEY)
    claimed = isinstance(claim, str) and claim in _TESTS  # (a caller's list is no claim)
    try:
        block, digest = opened(
            params.extra_args[EXTRA_ARGS_KEY], params.extra_args.get(LOCAL_SIGNATURE_KEY), limits
        )
        known = not claimed or _CLAIMS.get((claim, digest), False)
        if lower_known is not None and known and lower_known(request, digest):
            return digest
        mediator = nns.load_block(block, persistent)
        read(mediator, model)
        if claimed and not _bears_out(claim, mediator, model, digest):
            request.error = nns.capture_exception(PrefixClaimError(_refusal(claim)))
            return None
        request.mediator = mediator
        return digest
    except (EnvelopeError, UntrustedBlockError) as error:
        request.error = nns.capture_exception(error)
    except Exception as error:  # a payload nnsight cannot load
        request.error = nns.capture_exception(
            EnvelopeError(f"the block could not be loaded on the engine: {error!r}")
        )
    return None
