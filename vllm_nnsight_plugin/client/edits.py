"""``model.edit()``: a block installed on the engine, run on every request it serves.

nnsight's own tracer captures the block (``with model.edit() as (tracer, edit)``,
``tracer.all()`` and ``tracer.iter`` inside, ``async with``); what this module
changes is where the block goes and how it travels:

- sealed in the plugin's envelope with module references instead of tree copies,
  like a trace's block (``wire/envelope.py``, ``wire/references.py``);
- to an engine in this process through its front end's book
  (``vllm_nnsight_plugin.edits``), which signs it with the engine's local key,
  so the workers keep it, and from then on marks, salts and collects every
  request that runs it;
- or to a server (``serve=url``) through the operator's routes
  (``server/edits.py``), signed with the operator's key.

The handle (:class:`EngineEdit`, :class:`ServedEdit`) is nnsight's
``Registration``: ``edit.clear()``, ``await edit.aclear()``, ``edit.name``.
"""

from __future__ import annotations

import json
import uuid
from types import CodeType
from typing import Any
from urllib.parse import urlsplit

from nnsight.intervention.interleaver import Mediator
from nnsight.intervention.serialization import dumps
from nnsight.modeling.vllm.registration import RegisteringTracer, Registration

from ..versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
from ..wire.edits import COMMAND_HEADER, select, sign_command
from ..wire.envelope import seal
from ..wire.references import envoys_by_reference
from ..wire.trust import operator_key
from .remote import CONNECT_TIMEOUT_S, READ_TIMEOUT_S, _check
from .served import SERVER_KEY, key_spelling

#: The nnsight names this module builds on (checked by ``tests/unit/test_nnsight_seams.py``).
TOUCHES: tuple[tuple[str, str], ...] = (
    ("nnsight.modeling.vllm.registration", "RegisteringTracer._handle"),
    ("nnsight.modeling.vllm.registration", "RegisteringTracer.execute"),
    ("nnsight.modeling.vllm.registration", "RegisteringTracer.__exit__"),
    ("nnsight.modeling.vllm.registration", "RegisteringTracer.__aexit__"),
    ("nnsight.modeling.vllm.registration", "Registration._forget"),
    ("nnsight.intervention.serialization", "dumps"),
)
#: The route an edit is installed, listed and cleared through on a server.
ROUTE = "/v1/nnsight/edits"


def sealed(payload: bytes) -> str:
    """An edit's block in the envelope every block travels in (unsigned: the local
    key signs it for an engine here, the command signature for a server)."""
    return seal(payload, nnsight_version=SUPPORTED_NNSIGHT, plugin_version=PLUGIN_VERSION)


class EngineEdit(Registration):
    """An edit installed on an engine in this process (``LLM``, ``AsyncLLM``)."""

    def install(self, payload: bytes) -> None:
        from .. import edits

        edits.install(self.model.vllm_entrypoint, self.id, sealed(payload), self.name)

    async def ainstall(self, payload: bytes) -> None:
        from .. import edits

        await edits.ainstall(self.model.vllm_entrypoint, self.id, sealed(payload), self.name)

    def uninstall(self) -> None:
        from .. import edits

        edits.clear(self.model.vllm_entrypoint, [self.id])

    async def auninstall(self) -> None:
        from .. import edits

        await edits.aclear(self.model.vllm_entrypoint, [self.id])


class ServedEdit(Registration):
    """An edit installed on a ``vllm serve`` with the plugin, through its operator routes."""

    def __init__(self, model: Any, id: str, url: str, key: str, name: str | None = None) -> None:
        super().__init__(model, id, name=name)
        self.url = url.rstrip("/")
        self._key = key

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_key": None, "model": None}

    def install(self, payload: bytes) -> None:
        command(self.url, self._key, "POST", ROUTE, self._body(payload))

    async def ainstall(self, payload: bytes) -> None:
        await acommand(self.url, self._key, "POST", ROUTE, self._body(payload))

    def uninstall(self) -> None:
        command(self.url, self._key, "DELETE", f"{ROUTE}/{self.id}")

    async def auninstall(self) -> None:
        await acommand(self.url, self._key, "DELETE", f"{ROUTE}/{self.id}")

    def _body(self, payload: bytes) -> bytes:
        return json.dumps({"id": self.id, "name": self.name, "block": sealed(payload)}).encode("utf-8")

    def __repr__(self) -> str:
        state = "cleared" if self.cleared else "active"
        name = f" {self.name!r}" if self.name is not None else ""
        return f"<edit{name} {self.id} on {self.url} ({state})>"


def _request(url: str, key: str, method: str, route: str, body: bytes) -> dict:
    """The arguments of one signed control request."""
    path = urlsplit(url).path.rstrip("/") + route
    headers = {COMMAND_HEADER: sign_command(key, method, path, body), "content-type": "application/json"}
    return {"method": method, "url": url + route, "content": body, "headers": headers}


def command(url: str, key: str, method: str, route: str, body: bytes = b"") -> dict:
    """Send one signed control request to a server; its JSON answer."""
    import httpx

    timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S)
    with httpx.Client(timeout=timeout) as client:
        response = client.request(**_request(url, key, method, route, body))
    _check(response)
    return response.json()


async def acommand(url: str, key: str, method: str, route: str, body: bytes = b"") -> dict:
    """:func:`command`, awaited."""
    import httpx

    timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S)
    async with httpx.AsyncClient(timeout=timeout) as client:
        response = await client.request(**_request(url, key, method, route, body))
    _check(response)
    return response.json()


class EditingTracer(RegisteringTracer):
    """nnsight's tracer for ``model.edit()``, sending the block the plugin's way."""

    def __init__(
        self,
        model: Any,
        *,
        serve: str | None = None,
        key: str | None = None,
        name: str | None = None,
        backend: Any = None,
    ) -> None:
        super().__init__(model, backend=backend, serve=serve, name=name)
        self._key = key

    def _handle(self) -> Registration:
        edit_id = f"edit-{uuid.uuid4().hex}"
        if self._serve is not None:
            return ServedEdit(self._model, edit_id, self._serve, self._key, name=self._name)
        return EngineEdit(self._model, edit_id, name=self._name)

    def execute(self, code: CodeType) -> None:
        """Capture the block as a template (no copy: the worker makes one per request)."""
        model = self._model
        if self._serve is None and not model.dispatched:
            model.dispatch()
        frame = self.info.frame
        template = Mediator(code, frame.f_globals, dict(frame.f_locals), node=self.node)
        with envoys_by_reference(model):
            self._payload = dumps(template)


class Edits:
    """The edit methods of :class:`~vllm_nnsight_plugin.VLLM` (mixed in ahead of
    nnsight's own, which send the block the way nnsight's engine takes it)."""

    _installed_edits: list
    vllm_entrypoint: Any

    def edit(
        self,
        *,
        name: str | None = None,
        inplace: bool = True,
        serve: str | None = None,
        key: str | None = None,
        backend: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Install a block on the engine, to run on every request it serves from now on.

        ``with model.edit() as (tracer, edit):`` captures the block like a trace body
        (no invoke: it belongs to no request; ``tracer.all()`` follows generation).
        Each request, traced or plain, from this client or any other, runs its own
        copy, and what the copy saves comes back on that request's output
        (``output.saves``; ``tracer.result.saves`` inside a trace). ``name`` lets a
        request choose with ``edits=[...]``; ``serve=url`` (with the operator's
        ``key``) installs it on a server. On ``mode="async"`` use ``async with``.
        ``edit.clear()`` (or ``model.clear_edits()``) takes it off again.
        """
        from ..edits import check_name

        key = key_spelling(key, kwargs)
        serve, key = self._where(serve, key)
        if kwargs:
            raise TypeError(f"model.edit() got unexpected arguments {sorted(kwargs)}")
        if not inplace:
            raise ValueError(
                "an edit is installed on the engine itself, which every caller shares: "
                "there is no copy to edit instead. Drop inplace=False, or trace the "
                "requests you want to change."
            )
        check_name(name)
        signing_key = None
        if serve is not None:
            signing_key = operator_key(key)
            if signing_key is None:
                raise ValueError(
                    "an edit for a server must be signed: pass key=... (the server "
                    "operator's key) or set VLLM_NNSIGHT_KEY."
                )
        return EditingTracer(self, serve=serve, key=signing_key, name=name, backend=backend)

    def clear_edits(self, *, serve: str | None = None, key: str | None = None) -> None:
        """Clear every edit installed on this model's engine (or, with ``serve=url``
        and the operator's ``key``, on that server)."""
        from .. import edits

        serve, key = self._where(serve, key)
        for edit in list(self._installed_edits):
            if serve is None or getattr(edit, "url", None) == serve.rstrip("/"):
                edit.clear()
        if serve is not None:
            command(serve.rstrip("/"), self._signing_key(key), "DELETE", ROUTE)
        elif self._engine() is not None:
            edits.clear(self._engine())

    async def aclear_edits(self, *, serve: str | None = None, key: str | None = None) -> None:
        """:meth:`clear_edits`, awaited: the form for ``mode="async"``."""
        from .. import edits

        serve, key = self._where(serve, key)
        for edit in list(self._installed_edits):
            if serve is None or getattr(edit, "url", None) == serve.rstrip("/"):
                await edit.aclear()
        if serve is not None:
            await acommand(serve.rstrip("/"), self._signing_key(key), "DELETE", ROUTE)
        elif self._engine() is not None:
            await edits.aclear(self._engine())

    def installed_edits(self, *, serve: str | None = None, key: str | None = None) -> dict[str, str | None]:
        """The edits installed on this model's engine (or on a server): id -> name."""
        from .. import edits

        serve, key = self._where(serve, key)
        if serve is not None:
            listed = command(serve.rstrip("/"), self._signing_key(key), "GET", ROUTE)["edits"]
            return {entry["id"]: entry["name"] for entry in listed}
        engine = self._engine()
        return {} if engine is None else edits.installed(engine)

    def _engine(self) -> Any:
        return self.__dict__.get("vllm_entrypoint")

    def _where(self, serve: str | None, key: str | None) -> tuple[str | None, str | None]:
        """``serve``/``key`` as given, or a served model's own (``VLLM(name, serve=url)``)."""
        served = self.__dict__.get("_served")
        if serve is None and served is not None:
            return served.url, key if key is not None else served.key
        return serve, key

    @staticmethod
    def _signing_key(key: str | None) -> str:
        found = operator_key(key)
        if found is None:
            raise ValueError("pass key=... (the server operator's key) or set VLLM_NNSIGHT_KEY.")
        return found

    def _check_edit_names(self, edits: list[str] | None) -> None:
        """Refuse a name nothing is installed under at the call, when this process
        holds the engine (a server's front end checks its own requests)."""
        from .. import edits as engine_edits

        engine = self._engine()
        if edits is None or SERVER_KEY.get() is not None or engine is None:
            return
        select(engine_edits.installed(engine), edits)
