"""The client's side of a server: send each invoke as one ``/v1/completions`` request.

A trace with ``serve=url`` is built exactly like a local one; only the engine
call changes. Each invoke's block is sealed and signed with the operator's key
(``wire/envelope.py``), its ``SamplingParams`` become the request's sampling
fields, and the invokes go out concurrently. What comes back is read into
:class:`ServedOutput` objects shaped like the finished ``RequestOutput`` the
local path collects from, so the same code pushes saves into the caller's
names and re-raises a block's error.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..errors import PluginError
from ..wire.saves import RESPONSE_FIELD, decode_request

#: ``SamplingParams`` fields that ``/v1/completions`` accepts under the same name.
SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "bad_words",
    "allowed_token_ids",
)
#: The operator's route describing the served model (``server/tree.py``).
TREE_ROUTE = "/v1/nnsight/model"
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0
#: How much of each field of a block's error from a server is shown.
_MAX_ERROR_CHARS = 20_000


class ServeError(PluginError, RuntimeError):
    """The server refused or failed a request (not an error inside the block)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(f"the server answered {status} {kind}: {message}")
        self.status = status
        self.kind = kind
        self.message = message

    def __reduce__(self) -> tuple:
        return type(self), (self.status, self.kind, self.message)


@dataclass
class ServedOutput:
    """What the server returned for one invoke, in the shape the collect reads."""

    request_id: str
    text: list[str] = field(default_factory=list)
    nnsight_saves: dict = field(default_factory=dict)
    nnsight_sequences: list = field(default_factory=list)
    nnsight_edit_saves: dict = field(default_factory=dict)
    nnsight_edit_sequences: list = field(default_factory=list)
    nnsight_error: dict | None = None
    nnsight_path: dict | None = None
    finished: bool = True

    @property
    def saves(self) -> dict:
        """The installed edits' saves and the block's (the block's win a shared name)."""
        return {**self.nnsight_edit_saves, **self.nnsight_saves}


def served_path(sent: Any) -> dict | None:
    """The path a server says a request took, kept only in its documented shape."""
    if not isinstance(sent, dict) or type(sent.get("lowered")) is not bool:
        return None
    texts = {key: sent.get(key) for key in ("form", "reason")}
    if any(value is not None and not isinstance(value, str) for value in texts.values()):
        return None
    return {"lowered": sent["lowered"], **{k: v[:_MAX_ERROR_CHARS] if v else v for k, v in texts.items()}}


def prompt_field(prompt: Any) -> str | list[int]:
    """A vLLM prompt as the completions API spells it."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"]
    raise TypeError(
        f"a served trace takes text or token-id prompts, not {type(prompt).__name__} "
        f"({sorted(prompt) if isinstance(prompt, dict) else prompt!r:.80})."
    )


def sampling_fields(params: Any) -> dict:
    """The request's sampling settings, every one sent so the server's defaults
    (which may come from the model's generation config) cannot differ from vLLM's."""
    fields = {}
    for name in SAMPLING_FIELDS:
        value = getattr(params, name, None)
        if value is None or (isinstance(value, (list, tuple, set)) and not value):
            continue
        fields[name] = list(value) if isinstance(value, (tuple, set)) else value
    return fields


class Server:
    """An OpenAI-compatible vLLM server with the plugin installed, and the
    operator's key to sign for it. Never pickled with a block: see ``__getstate__``."""

    def __init__(self, url: str, key: str, *, timeout_s: float = READ_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.key = key
        self.timeout_s = timeout_s
        self._client: Any = None
        self._model: str | None = None

    def __getstate__(self) -> dict:
        # A trace's frame (and so this object) can be reachable from a block; the
        # key and the connection pool must not travel with it.
        return {"url": self.url, "key": None, "timeout_s": self.timeout_s, "_client": None, "_model": None}

    @property
    def _http(self) -> Any:
        if self._client is None:
            import httpx

            self._client = httpx.Client(timeout=httpx.Timeout(CONNECT_TIMEOUT_S, read=self.timeout_s))
        return self._client

    def model_name(self) -> str:
        if self._model is None:
            response = self._http.get(f"{self.url}/v1/models")
            _check(response)
            self._model = response.json()["data"][0]["id"]
        return self._model

    def run(self, prompts: list, params: list) -> list[ServedOutput]:
        """Send one request per prompt, concurrently; answers in prompt order."""
        bodies = [self.body(prompt, param) for prompt, param in zip(prompts, params)]
        if len(bodies) == 1:
            return [self._send(bodies[0])]
        with ThreadPoolExecutor(max_workers=min(len(bodies), 32)) as pool:
            return list(pool.map(self._send, bodies))

    def body(self, prompt: Any, params: Any) -> dict:
        from .served import served_xargs

        return {
            "model": self.model_name(),
            "prompt": prompt_field(prompt),
            **sampling_fields(params),
            "vllm_xargs": served_xargs(params.extra_args or {}),
        }

    def _send(self, body: dict) -> ServedOutput:
        response = self._http.post(f"{self.url}/v1/completions", json=body)
        document = _json(response)
        served = (document or {}).get(RESPONSE_FIELD) or {}
        if response.status_code == 422 and served.get("error"):
            return ServedOutput(request_id=document.get("id", ""), nnsight_error=self._sent(served["error"]))
        _check(response, document)
        entries = served.get("requests") or []
        if len(entries) != 1:
            raise ServeError(
                response.status_code,
                "NoSaves",
                "the response carries no nnsight saves: is vllm-nnsight-plugin installed "
                "on the server, and the same version as here?",
            )
        decoded = decode_request(entries[0])
        return ServedOutput(
            request_id=entries[0].get("request_id", ""),
            text=[choice.get("text", "") for choice in document.get("choices", [])],
            nnsight_saves=decoded.saves,
            nnsight_sequences=decoded.sequences,
            nnsight_edit_saves=decoded.edits,
            nnsight_edit_sequences=decoded.edit_sequences,
            nnsight_error=self._sent(entries[0].get("error")),
            nnsight_path=served_path(entries[0].get("path")),
        )

    def _sent(self, error: Any) -> dict | None:
        """A block's error as the server sent it, marked as the server's words: a
        server (or whoever sits between it and here on plain HTTP) can send any
        text as a traceback, so nothing in it is this machine's to trust."""
        if error is None:
            return None
        if not isinstance(error, dict):
            error = {"type_name": "ServerError", "message": str(error)}
        marked = {
            key: str(value)[:_MAX_ERROR_CHARS] for key, value in error.items() if key != "is_control_flow"
        }
        marked["is_control_flow"] = error.get("is_control_flow") is True
        sent = marked.get("traceback") or "(none)"
        marked["traceback"] = f"[as sent by the server at {self.url}; not checked here]\n{sent}"
        return marked

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def _json(response: Any) -> dict | None:
    try:
        document = response.json()
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


def _check(response: Any, document: dict | None = None) -> None:
    if response.status_code == 200:
        return
    document = document if document is not None else _json(response)
    error = (document or {}).get("error")
    if isinstance(error, dict):
        raise ServeError(response.status_code, str(error.get("type", "")), str(error.get("message", "")))
    raise ServeError(response.status_code, response.reason_phrase, response.text[:500])
