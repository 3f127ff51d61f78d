"""Edits installed on an engine, as the engine's front end keeps them.

Each worker keeps every installed edit's block and gives a request its own copy
of each edit it runs (``worker/edits.py``). The front end that owns the engine
(an ``LLMEngine``, an ``AsyncLLM``) keeps a book of the same edits, because every
request passes through it (``seams.frontend``), which makes it the one place to:

- decide which edits a request runs (``wire/edits.select``) and refuse a name
  nothing is installed under, before the request reaches the engine;
- make that request compute its whole prompt and salt its KV blocks, so no
  edited, or unseen, KV is shared with another request, unless every edit it
  runs lets it share (below). Prefix caching stays on for every other request,
  and for all of them once the edits are cleared;
- mark it (signed with the engine's local key) so the workers run its copies,
  and collect its saves when it finishes, as for a request carrying a block.

An edit whose block reads only the last rows and writes nothing, or edits every
row alike at every step (``prefix.py``; the workers read it at install, and
their word is what the book keeps), does not stop its requests from sharing:
the first kind adds nothing to a request's salt, the second a salt drawn for
that install (:attr:`EditBook.kv`). Requests running the same installed edits
then share their KV, and never with a request running another install of it,
before or after. A request admitted before a clear and started after it runs
without the edit and may read KV made with it, as a request the clear finds in
flight keeps what the edit did to its earlier steps.

Installing reaches the workers first and then the book, so no request is marked
for an edit a worker lacks; clearing leaves the book first. Both are one
``collective_rpc``; on an ``AsyncLLM`` they are awaited (:func:`ainstall`,
:func:`aclear`).

Nothing here imports nnsight: it runs in the server's front end.
"""

from __future__ import annotations

import inspect
import json
import secrets
from typing import Any

from .errors import PluginError
from .prefix import EDIT_SALT, LAST_ROWS, SAME_EDIT
from .seams.frontend import engine_of, processor_of, rpc_every_engine
from .settings import blocks_off
from .wire import rpc
from .wire.edits import MAX_NAME_CHARS, EditChoiceError, select, wanted
from .wire.trust import EDITS_KEY, local_signature

#: The attribute of an engine's ``InputProcessor`` that holds its :class:`EditBook`.
BOOK_ATTR = "_vllm_nnsight_edits"
#: Requests marked but not yet collected, at most: a request refused after it was
#: marked is forgotten when this many newer ones were marked.
_MARKED_LIMIT = 1 << 16


class EditError(PluginError, RuntimeError):
    """An edit could not be installed or cleared; the message says why."""

    http_status = 422
    kind = "NNsightEditError"


class EditLayoutError(EditError):
    """This engine's layout cannot take installed edits (the message says which)."""

    http_status = 400


class NoEditError(EditError):
    """No edit is installed under the id a command names."""

    http_status = 404


class EditBook:
    """One front end's installed edits (id -> name, None when unnamed, in install
    order), the requests it marked for them that are not yet collected, and, for
    an edit its requests may share KV under, what it adds to their salt (``kv``:
    id -> "" for an edit that writes nothing, a salt of that install's own for
    one that edits every row alike; absent: its requests are computed whole)."""

    __slots__ = ("installed", "kv", "marked")

    def __init__(self) -> None:
        self.installed: dict[str, str | None] = {}
        self.kv: dict[str, str] = {}
        self.marked: dict[str, None] = {}

    def mark(self, request_id: str) -> None:
        self.marked[request_id] = None
        if len(self.marked) > _MARKED_LIMIT:
            self.marked.pop(next(iter(self.marked)))

    def take(self, request_id: str) -> bool:
        """Whether ``request_id`` was marked; it is not any more."""
        return self.marked.pop(request_id, False) is None


def book_of(processor: Any) -> EditBook | None:
    """The processor's book; None while nothing was ever installed through it."""
    return processor.__dict__.get(BOOK_ATTR)


def installed_on(processor: Any) -> dict[str, str | None]:
    """The edits installed through this processor (empty: the common, fast case)."""
    book = book_of(processor)
    return book.installed if book is not None else {}


def installed(engine: Any) -> dict[str, str | None]:
    """The edits installed on an engine through this front end: id -> name."""
    return dict(installed_on(processor_of(engine)))


def edits_to_run(processor: Any, extra: dict) -> list[str]:
    """The ids of the installed edits a request with these ``extra_args`` runs;
    raises :class:`EditChoiceError` for a malformed choice or an unknown name."""
    names = wanted(extra.get(EDITS_KEY))
    installed = installed_on(processor)
    if not installed and not names:
        return []
    return select(installed, names)


def check_name(name: Any) -> str | None:
    if name is not None and (not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS):
        raise TypeError(f"an edit's name is a non-empty string of at most {MAX_NAME_CHARS} characters")
    return name


# ---------------------------------------------------------------------- install
def _install_args(edit_id: str, envelope: str, name: str | None) -> tuple:
    off = blocks_off()
    if off is not None:
        raise EditError(f"the edit could not be installed: {off}")
    signature = local_signature(envelope)
    if signature is None:
        raise EditError(
            "this engine was not built with vllm-nnsight-plugin loaded (it has no local key), "
            "so it runs no edits; build it after installing the plugin."
        )
    return (edit_id, envelope.encode("ascii"), signature.encode("ascii"), check_name(name))


def _refused(replies: list) -> str | None:
    return next((reply for reply in replies or () if isinstance(reply, str)), None)


def _kv_part(replies: list) -> str | None:
    """What the installed edit adds to its requests' salts (see :attr:`EditBook.kv`),
    where every worker read its block alike; None: they are computed whole."""
    claims = {reply.get("prefix") if isinstance(reply, dict) else None for reply in replies or ()}
    claim = claims.pop() if len(claims) == 1 else None
    if claim == LAST_ROWS:
        return ""
    if claim == SAME_EDIT:
        return EDIT_SALT + secrets.token_hex(16)  # this install's, named nowhere else
    return None


def _booked(book: EditBook, edit_id: str, name: str | None, replies: list) -> None:
    book.installed[edit_id] = name
    part = _kv_part(replies)
    if part is None:
        book.kv.pop(edit_id, None)
    else:
        book.kv[edit_id] = part


def _sync(result: Any) -> Any:
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise EditError(
            "this engine is an AsyncLLM, whose workers are reached from inside its event "
            "loop only: use `async with model.edit()`, `await edit.aclear()` and "
            "`await model.aclear_edits()` there."
        )
    return result


def _clear_args(edit_ids: list[str] | None) -> tuple:
    return (json.dumps(edit_ids).encode("ascii"),)


def install(engine: Any, edit_id: str, envelope: str, name: str | None = None) -> None:
    """Install an edit (its block sealed in ``envelope``) on an ``LLM`` or ``LLMEngine``."""
    core = engine_of(engine)
    args = _install_args(edit_id, envelope, name)
    replies = _sync(core.collective_rpc(rpc.EDIT_INSTALL, args=args))
    refusal = _refused(replies)
    if refusal is not None:
        _sync(core.collective_rpc(rpc.EDIT_CLEAR, args=_clear_args([edit_id])))
        raise EditError(f"the edit could not be installed: {refusal}")
    _booked(_book(core), edit_id, name, replies)


async def ainstall(engine: Any, edit_id: str, envelope: str, name: str | None = None) -> None:
    """:func:`install`, on an ``AsyncLLM`` (awaited in its event loop)."""
    args = _install_args(edit_id, envelope, name)
    replies = await rpc_every_engine(engine, rpc.EDIT_INSTALL, args)
    refusal = _refused(replies)
    if refusal is not None:
        await rpc_every_engine(engine, rpc.EDIT_CLEAR, _clear_args([edit_id]))
        raise EditError(f"the edit could not be installed: {refusal}")
    _booked(_book(engine), edit_id, name, replies)


def _unbook(engine: Any, edit_ids: list[str] | None) -> None:
    book = book_of(processor_of(engine))
    if book is None:
        return
    for edit_id in list(book.installed) if edit_ids is None else edit_ids:
        book.installed.pop(edit_id, None)
        book.kv.pop(edit_id, None)


def clear(engine: Any, edit_ids: list[str] | None = None) -> None:
    """Clear edits (every one for None) on an ``LLM`` or ``LLMEngine``."""
    core = engine_of(engine)
    _unbook(core, edit_ids)
    _sync(core.collective_rpc(rpc.EDIT_CLEAR, args=_clear_args(edit_ids)))


async def aclear(engine: Any, edit_ids: list[str] | None = None) -> None:
    """:func:`clear`, on an ``AsyncLLM``."""
    _unbook(engine, edit_ids)
    await rpc_every_engine(engine, rpc.EDIT_CLEAR, _clear_args(edit_ids))


def _book(engine: Any) -> EditBook:
    processor = processor_of(engine)
    book = processor.__dict__.get(BOOK_ATTR)
    if book is None:
        book = processor.__dict__[BOOK_ATTR] = EditBook()
    return book


__all__ = [
    "BOOK_ATTR",
    "EditBook",
    "EditChoiceError",
    "EditError",
    "EditLayoutError",
    "NoEditError",
    "aclear",
    "ainstall",
    "book_of",
    "clear",
    "edits_to_run",
    "install",
    "installed",
    "installed_on",
]
