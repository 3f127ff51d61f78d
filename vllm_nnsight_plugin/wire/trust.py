"""Who may send a block, and how an engine tells.

A block is code. A worker runs one only when the request carries a signature
made with the engine's *local key*: a random secret created in the process that
builds the engine (before its engine-core and worker processes start, which
inherit it through the environment; each process reads it once, so a later
change to the environment cannot forge it).

The signature is issued in one place, the front end's input processing
(``seams.patch_input_processor``), which first drops any signature a request
arrived with. It signs only a request whose ``extra_args`` hold a
:class:`Vouched` marker for its envelope: a Python object, which no JSON body,
log line or other process can produce. Two things create one:

- the client, when it seals a block in the user's own process (offline
  ``LLM``, ``AsyncLLM``, ``model.requests``);
- the server's door (``server/gate.py``), after checking the operator's
  signature: a block sent over HTTP must be signed with the *operator key*,
  unexpired and not seen before.

Anything else that carries a block (another endpoint, a replayed log line) is
refused before any of it is decoded.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import math
import os
import secrets
import shutil
import tempfile
import threading
import time

from ..errors import PluginError
from ..folders import UnsafeFolderError, private_folder
from ..settings import CLOCK_SKEW_S, KEY, KEY_FILE, LOCAL_KEY, MAX_TTL_S, NONCE_DIR, value
from ..settings import value as setting
from .envelope import EXTRA_ARGS_KEY, Envelope, operator_signature, split_signature

#: The environment variable holding the engine's local key.
LOCAL_KEY_ENV = LOCAL_KEY
#: The ``extra_args`` key carrying the local signature.
LOCAL_SIGNATURE_KEY = "nnsight_local_sig"
#: The ``extra_args`` key carrying a :class:`Vouched` marker (front end only).
VOUCHED_KEY = "nnsight_vouched"
#: The ``extra_args`` key of a request's choice of installed edits (``wire/edits.py``).
EDITS_KEY = "nnsight_edits"
#: The ``extra_args`` key of the front end's signed mark of the edits a request
#: runs (``wire/edits.py``); like the local signature, never taken from a client.
MARK_KEY = "nnsight_edit_mark"
#: The operator's key: set on a server to accept signed blocks over HTTP; a
#: client reads the same variable to sign.
OPERATOR_KEY_ENV = KEY
#: Or a file holding it, read on every request: a mounted secret, rotated (or
#: emptied, which turns blocks off) without restarting the server.
OPERATOR_KEY_FILE_ENV = KEY_FILE
#: The longest lifetime a server accepts on a signed envelope, in seconds.
MAX_TTL_ENV = MAX_TTL_S
DEFAULT_MAX_TTL_S = 900.0
#: Shortest operator key accepted: a short secret is a guessable one.
MIN_KEY_CHARS = 32


_INSPECTED = (EXTRA_ARGS_KEY, LOCAL_SIGNATURE_KEY, VOUCHED_KEY, EDITS_KEY, MARK_KEY)


def touches_trust(extra: object) -> bool:
    """Whether a request's ``extra_args`` (or ``vllm_xargs``) hold a block, a choice
    of edits or any of the trust keys, all of which the front end must inspect or drop."""
    return isinstance(extra, dict) and any(key in extra for key in _INSPECTED)


class UntrustedBlockError(PluginError, PermissionError):
    """A block arrived without a signature this engine accepts."""

    http_status = 403
    kind = "NNsightUntrustedBlock"


class RefusedBlockError(PluginError, ValueError):
    """A request carries a block nobody in this process vouched for (a bad request)."""


class Vouched:
    """Marks an envelope as built or admitted in this process (see the module docstring)."""

    __slots__ = ("digest", "_envelope")

    def __init__(self, envelope: str) -> None:
        self.digest = hashlib.sha256(envelope.encode("utf-8", "replace")).digest()
        self._envelope = envelope  # the very object it was made for (requests may share one)

    def covers(self, envelope: object) -> bool:
        if envelope is self._envelope:
            return True
        return isinstance(envelope, str) and hmac.compare_digest(self.digest, Vouched(envelope).digest)

    def __repr__(self) -> str:
        return "<vouched nnsight block>"


_LOCAL_KEY: str | None = None


def local_key() -> str | None:
    """This process's local key, read from the environment once and then kept."""
    global _LOCAL_KEY
    if _LOCAL_KEY is None:
        _LOCAL_KEY = value(LOCAL_KEY_ENV) or None
    return _LOCAL_KEY


def ensure_local_key() -> str:
    """Create this engine family's key if needed and export it to the processes
    the engine is about to start."""
    global _LOCAL_KEY
    key = local_key() or secrets.token_hex(32)
    _LOCAL_KEY = key
    os.environ[LOCAL_KEY_ENV] = key
    return key


def local_signature(envelope: str) -> str | None:
    key = local_key()
    if not key:
        return None
    if len(envelope) > _MEMO_CHARS:
        return _hmac(key, envelope)
    with _memo_lock:  # the invokes of a trace's loop share one envelope (the client's)
        found = _signatures.get((key, envelope))
        if found is None:
            found = _signatures[(key, envelope)] = _hmac(key, envelope)
            while len(_signatures) > _MEMO_SIZE:
                _signatures.pop(next(iter(_signatures)))
    return found


#: Signatures of recent envelopes up to ``_MEMO_CHARS`` long: each request of a
#: shared envelope is signed (front end) and checked (worker), once each.
_MEMO_SIZE, _MEMO_CHARS = 64, 256 << 10
_signatures: dict[tuple[str, str], str] = {}
_memo_lock = threading.Lock()


def _hmac(key: str, envelope: str) -> str:
    return hmac.new(key.encode(), envelope.encode("utf-8", "replace"), hashlib.sha256).hexdigest()


def check_local(envelope: object, signature: object) -> None:
    """Raise :class:`UntrustedBlockError` unless ``signature`` is the local one."""
    expected = local_signature(envelope) if isinstance(envelope, str) else None
    if expected is None or not _same(expected, signature):
        raise UntrustedBlockError(
            "this engine runs a block only when it was built in the engine's own "
            "process (the vllm_nnsight_plugin client) or admitted by the server's "
            "nnsight door with the operator's key; this one was neither, so none of "
            "it was run."
        )


def _same(expected: str, given: object) -> bool:
    """A constant-time comparison that any string can take part in (``compare_digest``
    refuses non-ASCII ``str``; a signature from the network may be anything)."""
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "surrogatepass"))


def operator_key(value: str | None = None) -> str | None:
    """The operator key: ``value`` if given, else ``VLLM_NNSIGHT_KEY``, else the
    contents of ``VLLM_NNSIGHT_KEY_FILE``; None when none is set (blocks off)."""
    if value:
        return value

    key = setting(OPERATOR_KEY_ENV)
    if key:
        return key
    path = setting(OPERATOR_KEY_FILE_ENV)
    if path:
        try:
            with open(path, encoding="utf-8") as handle:
                return handle.read().strip() or None
        except OSError:  # not there (yet): no key, blocks off
            return None
    return None


def max_ttl_s() -> float:
    return float(value(MAX_TTL_ENV))


class NonceBook:
    """Nonces of accepted envelopes, kept until they expire: each is good once.

    A server with several API server processes (``--api-server-count``, which
    ``--data-parallel-size`` raises by default) could otherwise be sent one
    envelope once per process. So where the engine family shares a nonce
    directory (:func:`ensure_nonce_dir`, inherited like the local key), a claim
    is also an exclusive create of a file named for the nonce there: one system
    call, atomic across the processes of one host."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}
        self._prune_at = 1024
        self._lock = threading.Lock()
        self._shared_pruned = time.monotonic()

    def claim(self, nonce: str, expires: float, now: float) -> bool:
        with self._lock:
            if len(self._seen) >= self._prune_at:
                self._seen = {n: t for n, t in self._seen.items() if t >= now}
                self._prune_at = max(1024, 2 * len(self._seen))
            if nonce in self._seen:
                return False
            self._seen[nonce] = expires
            directory = nonce_dir()
            if directory is None:
                return True
            try:
                claimed = _claim_shared(directory, nonce, expires)
            except UntrustedBlockError:
                del self._seen[nonce]  # not recorded, so not used: the same envelope may come again
                raise
            # Off the caller's thread, and only once this nonce's file has its expiry:
            # a file just created still has the time of its creation.
            if time.monotonic() - self._shared_pruned > _SHARED_PRUNE_S:
                self._shared_pruned = time.monotonic()
                threading.Thread(target=_prune_shared, args=(directory, now), daemon=True).start()
            return claimed


#: The environment variable naming the engine family's shared nonce directory.
NONCE_DIR_ENV = NONCE_DIR
#: How often a process clears expired nonces out of the shared directory.
_SHARED_PRUNE_S = 60.0


def nonce_dir() -> str | None:
    return value(NONCE_DIR_ENV) or None


def ensure_nonce_dir() -> str:
    """Name this engine family's nonce directory and export it to the processes it
    is about to start (made on first use; removed when this process exits)."""
    directory = nonce_dir()
    if directory is None:
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        directory = os.path.join(base, f"vllm-nnsight-nonces-{secrets.token_hex(12)}")
        os.environ[NONCE_DIR_ENV] = directory
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _claim_shared(directory: str, nonce: str, expires: float) -> bool:
    """Record ``nonce`` in the shared directory, checked on this very use: a folder
    another user could change (swap, empty) would let a replay through."""
    name = hashlib.sha256(nonce.encode("utf-8", "replace")).hexdigest()[:40]
    try:
        with private_folder(directory) as folder:
            try:
                handle = os.open(
                    name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600, dir_fd=folder
                )
            except FileExistsError:
                return False
            try:
                os.utime(handle, (expires, expires))  # its expiry, for pruning
            finally:
                os.close(handle)
    except UnsafeFolderError as unsafe:
        raise UntrustedBlockError(
            f"the server's nonce store is not its own ({unsafe}); it takes no blocks."
        ) from None
    except OSError as error:
        raise UntrustedBlockError(
            f"the server could not record this block's nonce ({type(error).__name__}); try again."
        ) from None
    return True


def _prune_shared(directory: str, now: float) -> None:
    try:
        with private_folder(directory) as folder, os.scandir(folder) as entries:
            for entry in entries:
                try:
                    if entry.stat(follow_symlinks=False).st_mtime < now:
                        os.unlink(entry.name, dir_fd=folder)
                except OSError:
                    pass  # pruned by another process meanwhile
    except OSError:
        pass  # not this server's folder (a claim says so) or gone


def check_operator_signature(value: object, key: str) -> None:
    """Raise :class:`UntrustedBlockError` unless the envelope's text is signed with
    ``key``. Reads nothing inside it: a sender without the key gets no further."""
    if len(key) < MIN_KEY_CHARS:
        raise UntrustedBlockError(
            f"the server's operator key is shorter than {MIN_KEY_CHARS} characters, so "
            "it accepts no blocks (operator: set a longer VLLM_NNSIGHT_KEY or "
            "VLLM_NNSIGHT_KEY_FILE, e.g. "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`)."
        )
    body, signature = split_signature(value) if isinstance(value, str) else ("", None)
    if signature is None:
        raise UntrustedBlockError(
            "the block is not signed. This server runs blocks signed with its operator "
            "key only: pass key=... to the client or set VLLM_NNSIGHT_KEY where it runs."
        )
    if not _same(operator_signature(body, key), signature):
        raise UntrustedBlockError(
            "the block's signature does not match this server's operator key (a wrong "
            "key, or the envelope was changed on the way)."
        )


def check_lifetime(envelope: Envelope, nonces: NonceBook, now: float | None = None) -> None:
    """Raise :class:`UntrustedBlockError` unless a signed envelope is unexpired,
    within the server's lifetime limit, made since the server started serving, and
    not seen before (its signature checked already)."""
    now = time.time() if now is None else now
    if envelope.expires is None or envelope.nonce is None or not math.isfinite(envelope.expires):
        raise UntrustedBlockError("a signed block needs a finite expiry and a nonce; build it again.")
    if envelope.expires < now:
        raise UntrustedBlockError("the signed block has expired; build the request again.")
    if envelope.expires - now > max_ttl_s():
        raise UntrustedBlockError(
            f"the signed block is valid for {envelope.expires - now:.0f} s, over this "
            f"server's limit of {max_ttl_s():.0f} s ({MAX_TTL_ENV}); sign with a shorter ttl."
        )
    if not made_since_serving(envelope.created):
        raise UntrustedBlockError(
            "the signed block was made before this server started serving (a replay across "
            "a restart, or a clock far behind the server's); build the request again."
        )
    if not nonces.claim(envelope.nonce, envelope.expires, now):
        raise UntrustedBlockError(
            "this signed block was already used (a replay); every request needs a fresh one."
        )


#: When this process began serving (``mark_serving``, as the server's app is built,
#: after its engine is up); until then, when this module was imported.
_SERVING_SINCE = time.time()


def mark_serving(now: float | None = None) -> None:
    """From now on, refuse signed envelopes and commands made before now (less the
    clock skew allowed): nothing used before a restart runs again after it."""
    global _SERVING_SINCE
    _SERVING_SINCE = time.time() if now is None else now


def made_since_serving(created: float) -> bool:
    """Whether something signed at ``created`` (the sender's clock) can be new here."""
    return math.isfinite(created) and created >= _SERVING_SINCE - float(value(CLOCK_SKEW_S))
