"""The front end's policy: what happens to a request in the process that owns
``LLM``, ``AsyncLLM`` or the OpenAI server.

The front-end seams (``seams/frontend.py``) hand each request here and apply the
answer to vLLM's objects; ``plugin.register`` joins the two (``seams.frontend.serve_with``).
Here a block is refused unless this process vouched for it, and signed for the
workers (``wire/trust.py``); a request's choice of installed edits is checked and
marked (``edits.py``); a block that reads only the last rows shares the prefix
cache, and one that edits every row alike shares it with the same edit
(``prefix.py``); finished requests get their saves (``returns/outputs.py``);
and the OpenAI server's door and routes are set up (``server/``).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

from .edits import book_of, edits_to_run, installed_on
from .prefix import CLAIM_KEY, EDIT_SALT, LAST_ROWS, SAME_EDIT, edit_salt
from .returns.outputs import (
    attach_collected,
    attach_failed,
    finished_for_workers,
    forget_unread,
    note_result_unread,
    traced_stream,
)
from .seams.frontend import (
    Admission,
    cuda_with_triton,
    engine_client_of,
    generates,
    parallel_config_of,
    processor_of,
    refused,
    unsupported_parallelism,
)
from .seams.wrap import carries_block
from .server import gate, responses
from .server.responses import current
from .settings import blocks_off
from .taps.spec import CONFIG_KEY, VERSION_KEY, taps_for, version_value
from .versions import PLUGIN_VERSION
from .wire import rpc
from .wire.edits import EditChoiceError, mark
from .wire.envelope import EXTRA_ARGS_KEY, payload_of
from .wire.trust import (
    LOCAL_SIGNATURE_KEY,
    MARK_KEY,
    VOUCHED_KEY,
    Vouched,
    ensure_local_key,
    ensure_nonce_dir,
    local_key,
    local_signature,
    mark_serving,
    touches_trust,
)

#: On an offline engine: the ids of requests whose finished output gets saves.
_PENDING = "_nnsight_pending"
#: On an async engine: the ids of such requests still streaming.
_IN_FLIGHT = "_nnsight_in_flight"


class FrontEnd:
    """The plugin's :class:`~vllm_nnsight_plugin.seams.frontend.FrontEndPolicy`."""

    def configure(self, engine_args: Any) -> None:
        ensure_local_key()  # before the engine's processes start: they inherit it
        ensure_nonce_dir()
        taps_into_config(engine_args)

    def admit(self, processor: Any, request_id: str, params: Any) -> Admission | None:
        extra = getattr(params, "extra_args", None)
        if not touches_trust(extra) and not installed_on(processor):
            return None
        given = params
        # The caller's extra_args (a dict the OpenAI server shares between a
        # request's prompts) stay as they were: the engine gets a dict of its
        # own on a shallow copy, which vLLM's own process_inputs then clones as
        # it does every request's params (deep unless skip_clone is set).
        params = copy.copy(params)
        params.extra_args = dict(extra or {})
        sign_vouched(processor, params.extra_args)
        run = mark_edits(processor, request_id, params)
        if EXTRA_ARGS_KEY not in params.extra_args and not run:
            # Runs no edit, carries no block: as the caller sent it (less any
            # trust key it should not have sent).
            return Admission(given if extra is None else params, None)
        return salted(params, request_id, own_kv(params.extra_args), edits_kv(processor, run))

    def added(self, engine: Any, request_id: str, params: Any) -> None:
        if carries_block(params) or took_mark(engine, request_id):
            # The finished RequestOutput carries the caller's (external) id;
            # the engine's internal one adds a random suffix.
            engine.__dict__.setdefault(_PENDING, set()).add(request_id)
            note_result_unread(engine, request_id, params, edits_installed(engine))

    def stepped(self, engine: Any, outputs: list) -> None:
        pending = engine.__dict__.get(_PENDING)
        if not pending:
            return
        finished = [o for o in outputs if getattr(o, "finished", False) and o.request_id in pending]
        if finished:
            ids = [o.request_id for o in finished]
            pending.difference_update(ids)
            try:
                replies = engine.collective_rpc(
                    rpc.COLLECT, args=(ids, finished_for_workers(engine, finished))
                )
            except Exception as error:  # each of these requests' error, not the whole call's
                attach_failed(finished, error)
                return
            attach_collected(finished, replies)

    def aborted(self, engine: Any, request_ids: list[str]) -> None:
        pending = engine.__dict__.get(_PENDING)
        dropped = [rid for rid in request_ids if rid in pending] if pending else []
        if dropped:
            pending.difference_update(dropped)
            forget_unread(engine, dropped)
            # Wind up the aborted requests' blocks so no state outlives them.
            engine.collective_rpc(rpc.COLLECT, args=(dropped, None))

    def generate(self, engine: Any, params: Any, request_id: str, start: Callable[[], Any]) -> Any:
        """Collect a traced request's saves on its finished output; a request
        without a block gets vLLM's own stream back untouched."""
        traced = carries_block(params)
        if not traced and not edits_installed(engine):
            return start()

        # Saves are collected by request id: two traced requests may not share one.
        in_flight = engine.__dict__.setdefault(_IN_FLIGHT, set())
        if request_id in in_flight:
            raise refused(
                f"a request with id {request_id!r} carrying an nnsight block or running "
                "installed edits is already running; give each request its own id."
            )
        stream = start()
        in_flight.add(request_id)  # until the stream ends (``traced_stream``)
        if traced:
            note_result_unread(engine, request_id, params, edits_installed(engine))
        collector = current()  # set while the OpenAI handler runs
        if collector is not None:
            collector.started(request_id)
        on_finished = collector.finished if collector else None
        # A request without a block is collected if its input processing marked
        # it for edits (known once the stream has started).
        collected = None if traced else functools.partial(took_mark, engine, request_id)
        return traced_stream(engine, stream, request_id, on_finished, in_flight, collected)

    async def serve(self, handler: Any, request: Any, answer: Callable[[], Awaitable[Any]]) -> Any:
        """Admit or refuse blocks from the network; return their saves, and those
        of installed edits, in the JSON."""
        xargs = getattr(request, "vllm_xargs", None)
        trusting = touches_trust(xargs)
        if not trusting and not edits_installed(engine_client_of(handler)):
            return await answer()
        beam_search = bool(getattr(request, "use_beam_search", False))
        refusal = None
        if trusting and gate.large(xargs):  # an HMAC over megabytes: off the event loop
            refusal = await asyncio.to_thread(gate.admit, xargs, beam_search=beam_search)
        elif trusting:
            refusal = gate.admit(xargs, beam_search=beam_search)
        if refusal is not None:
            return handler.create_error_response(
                refusal.message, err_type=refusal.kind, status_code=refusal.status
            )
        with responses.collecting() as collector:
            result = await answer()
        return await responses.finish(handler, result, collector)

    def app_built(self, app: Any) -> None:
        """The operator's routes (``server/edits.py``, ``server/tree.py``) and the
        door that keeps blocks off every other route."""
        from .server import edits, gate, tree

        edits.attach(app)
        tree.attach(app)
        if getattr(app, "middleware_stack", None) is None:
            app.add_middleware(gate.NoBlocksElsewhere)
        else:  # vLLM built the stack already: go outside it
            app.middleware_stack = gate.NoBlocksElsewhere(app.middleware_stack)
        mark_serving()  # the engine is up: nothing signed before a restart runs now


def taps_into_config(engine_args: Any) -> None:
    """Put the engine's taps in its ``additional_config`` with this plugin's
    version: vLLM hashes that dict into the compile cache's key, so graphs built
    with other taps, or none, or by another release of the tap operation, are
    never reused."""
    extra = engine_args.additional_config
    extra = dict(extra) if isinstance(extra, dict) else None
    if extra is None:
        return  # a config object of the user's own: leave it alone
    taps, kernel = taps_for(extra, cuda_with_triton)
    if taps:
        extra[CONFIG_KEY] = list(taps)
        extra[VERSION_KEY] = version_value(PLUGIN_VERSION, kernel)
        engine_args.additional_config = extra


def mark_edits(processor: Any, request_id: str, params: Any) -> list[str]:
    """Choose the installed edits this request runs and mark it for them (signed,
    for the workers; booked, for the collect); the ids of those it runs. A choice
    that is malformed or names nothing installed is refused here, as a bad request."""
    try:
        run = edits_to_run(processor, params.extra_args)
    except EditChoiceError as error:
        raise refused(str(error)) from None
    if not run or not generates(params):  # edits run on generation only
        return []
    signed = mark(run)
    if signed is None:
        return []
    params.extra_args[MARK_KEY] = signed
    book_of(processor).mark(request_id)
    return run


def own_kv(extra: dict) -> str | None:
    """What a request's own block adds to the salt of its KV: "" for no block or
    one that reads only the last rows and writes nothing, the block's salt for one
    that edits every row alike at every step (``prefix.py``; the worker checks
    either claim), None for any other (the request is computed whole)."""
    if EXTRA_ARGS_KEY not in extra:
        return ""
    claim = extra.get(CLAIM_KEY)
    if claim == LAST_ROWS:
        return ""
    return edit_salt_of(extra[EXTRA_ARGS_KEY]) if claim == SAME_EDIT else None


def edits_kv(processor: Any, run: list[str]) -> list[str] | None:
    """What the installed edits a request runs add to its salt, in the order they
    run (``EditBook.kv``); None where one of them keeps its requests whole."""
    if not run:
        return []
    kv = book_of(processor).kv
    parts = [kv.get(edit_id) for edit_id in run]
    return None if any(part is None for part in parts) else parts


def salted(params: Any, request_id: str, own: str | None, edits: list[str] | None) -> Admission:
    """How a request with a block or installed edits uses the prefix cache.

    Where its block and every edit it runs write nothing and read only last rows, as
    a plain request; where the writers among them each edit every row alike, under
    a salt naming those writers in order, read as well as written; otherwise
    computed whole, under a salt of its own: hooks see every prompt row, and its
    KV (traced, perhaps edited) is never another request's.
    """
    if own is None or edits is None:
        return Admission(params, f"vllm-nnsight:{request_id}")
    writers = [part for part in (own, *edits) if part]
    if not writers:
        return Admission(params, None)
    if len(writers) == 1:
        return Admission(params, writers[0], reads_cache=True)
    digest = hashlib.blake2b("\n".join(writers).encode("ascii"), digest_size=16, person=b"nnsight-salts")
    return Admission(params, EDIT_SALT + digest.hexdigest(), reads_cache=True)


def sign_vouched(processor: Any, extra: dict) -> None:
    """Issue the worker's signature for a vouched block; refuse any other block.

    Every request with a block passes here in the front end, whatever the entry
    (``LLM``, ``AsyncLLM``, any HTTP endpoint), so this is the one place the
    signature is made. A signature the request arrived with is dropped: it may
    have been read from a log. See ``wire/trust.py``.
    """
    vouched = extra.pop(VOUCHED_KEY, None)
    extra.pop(LOCAL_SIGNATURE_KEY, None)
    extra.pop(MARK_KEY, None)
    if EXTRA_ARGS_KEY not in extra:
        return
    off = blocks_off()
    if off is not None:
        raise refused(off)
    envelope = extra[EXTRA_ARGS_KEY]
    if not (isinstance(vouched, Vouched) and vouched.covers(envelope)):
        raise refused(
            "this request carries an nnsight block that was neither built in this "
            "process by the vllm_nnsight_plugin client nor admitted by the server's "
            "nnsight door (/v1/completions or /v1/chat/completions with a block signed "
            "with the operator's key); it is refused and none of it runs."
        )
    refusal = unsupported_parallelism(parallel_config_of(processor))
    if refusal is not None:
        raise refused(refusal)
    extra[LOCAL_SIGNATURE_KEY] = local_signature(envelope)


def edit_salt_of(envelope: Any) -> str | None:
    """The salt of a same-edit block's KV (``prefix.edit_salt``), or None. The
    invokes of a trace's loop share one envelope: one up to ``_SALTS_CHARS`` long
    is decoded once (:func:`_recent_salt`)."""
    key = local_key()
    if not isinstance(envelope, str) or not key:
        return None
    return (_recent_salt if len(envelope) <= _SALTS_CHARS else _salt)(envelope, key)


def _salt(envelope: str, key: str) -> str | None:
    payload = payload_of(envelope)
    return None if payload is None else edit_salt(payload, key)


_SALTS_CHARS = 256 << 10
_recent_salt = functools.lru_cache(maxsize=64)(_salt)


def edits_installed(engine: Any) -> bool:
    return bool(installed_on(processor_of(engine)))


def took_mark(engine: Any, request_id: str) -> bool:
    """Whether the engine's input processing marked this request for edits (once)."""
    book = book_of(processor_of(engine))
    return book is not None and book.take(request_id)
