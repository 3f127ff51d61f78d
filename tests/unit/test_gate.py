"""The server's door and the operator signature, with no engine or server."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from http import HTTPStatus

import pytest

from vllm_nnsight_plugin.server.gate import admit
from vllm_nnsight_plugin.versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
from vllm_nnsight_plugin.wire.envelope import (
    ENVELOPE_VERSION,
    open_envelope,
    operator_signature,
    seal,
    sign,
    split_signature,
)
from vllm_nnsight_plugin.wire.trust import (
    LOCAL_KEY_ENV,
    LOCAL_SIGNATURE_KEY,
    VOUCHED_KEY,
    NonceBook,
    UntrustedBlockError,
    check_lifetime,
    check_local,
    check_operator_signature,
    local_signature,
)

KEY = "k" * 64
VERSIONS = dict(nnsight_version=SUPPORTED_NNSIGHT, plugin_version=PLUGIN_VERSION)


@pytest.fixture(autouse=True)
def keys(monkeypatch):
    monkeypatch.setenv(LOCAL_KEY_ENV, "local-" + "0" * 58)
    monkeypatch.delenv("VLLM_NNSIGHT_KEY", raising=False)
    monkeypatch.delenv("VLLM_NNSIGHT_KEY_FILE", raising=False)


def test_off_without_an_operator_key():
    refusal = admit({"nnsight": seal(b"block", key=KEY, **VERSIONS)})
    assert refusal.status == HTTPStatus.FORBIDDEN and refusal.kind == "NNsightBlocksDisabled"


def test_a_signed_envelope_is_admitted_once_and_vouched_for(monkeypatch):
    monkeypatch.setenv("VLLM_NNSIGHT_KEY", KEY)
    sealed = seal(b"block", key=KEY, **VERSIONS)
    xargs = {"nnsight": sealed, LOCAL_SIGNATURE_KEY: "forged", VOUCHED_KEY: "forged"}
    assert admit(xargs) is None
    assert LOCAL_SIGNATURE_KEY not in xargs and xargs[VOUCHED_KEY].covers(sealed)
    replay = admit({"nnsight": sealed})
    assert replay.status == HTTPStatus.FORBIDDEN and "replay" in replay.message


def test_key_from_a_file_read_per_request(monkeypatch, tmp_path):
    path = tmp_path / "key"
    path.write_text("")
    monkeypatch.setenv("VLLM_NNSIGHT_KEY_FILE", str(path))
    assert admit({"nnsight": seal(b"b", key=KEY, **VERSIONS)}).kind == "NNsightBlocksDisabled"
    path.write_text(KEY + "\n")
    assert admit({"nnsight": seal(b"b", key=KEY, **VERSIONS)}) is None


def test_a_refused_request_gets_no_local_signature(monkeypatch):
    monkeypatch.setenv("VLLM_NNSIGHT_KEY", KEY)
    xargs = {"nnsight": seal(b"b", **VERSIONS), LOCAL_SIGNATURE_KEY: "forged"}
    assert admit(xargs).kind == "NNsightUntrustedBlock"
    assert LOCAL_SIGNATURE_KEY not in xargs and VOUCHED_KEY not in xargs


def tampered(sealed: str, **changes) -> str:
    """The sealed envelope with fields changed and its signature kept."""
    body, signature = split_signature(sealed)
    document = json.loads(base64.b64decode(body[5:]))
    document.update(changes)
    return "nns2:" + base64.b64encode(json.dumps(document).encode()).decode() + f".{signature}"


def check_operator(value: str, key: str, nonces) -> None:
    """The door's checks in its order: the signature on the text, then the lifetime."""
    check_operator_signature(value, key)
    check_lifetime(open_envelope(value, **VERSIONS), nonces)


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: seal(b"b", **VERSIONS), "not signed"),
        (lambda: seal(b"b", key="w" * 64, **VERSIONS), "does not match"),
        (
            lambda: tampered(seal(b"b", key=KEY, **VERSIONS), payload=base64.b64encode(b"evil").decode()),
            "does not match",
        ),
        (lambda: tampered(seal(b"b", key=KEY, **VERSIONS), expires=time.time() + 60), "does not match"),
        (lambda: seal(b"b", key=KEY, ttl_s=10**6, **VERSIONS), "limit"),
    ],
)
def test_signature_checks(make, reason):
    with pytest.raises(UntrustedBlockError, match=reason):
        check_operator(make(), KEY, NonceBook())


def test_the_local_key_is_read_once(monkeypatch):
    """A worker's key cannot be swapped through its environment after it started."""
    signature = local_signature("envelope")
    monkeypatch.setenv(LOCAL_KEY_ENV, "chosen-by-an-attacker")
    assert local_signature("envelope") == signature
    check_local("envelope", signature)
    with pytest.raises(UntrustedBlockError):
        check_local("envelope", "0" * 64)


def resigned(sealed: str, **changes) -> str:
    """The envelope with fields changed, signed again with the operator's key."""
    body, _ = split_signature(tampered(sealed, **changes))
    return sign(body, KEY)


def test_a_nan_expiry_is_refused():
    with pytest.raises(UntrustedBlockError, match="finite"):
        check_operator(resigned(seal(b"b", key=KEY, **VERSIONS), expires=float("nan")), KEY, NonceBook())


def test_an_envelope_made_before_the_server_started_serving_is_refused(monkeypatch):
    """A replay across a restart: signed, unexpired, its nonce unseen by the new
    process, and still refused."""
    from vllm_nnsight_plugin.wire import trust

    sealed = seal(b"b", key=KEY, ttl_s=600, **VERSIONS)
    monkeypatch.setattr(trust, "_SERVING_SINCE", time.time() + 30)
    with pytest.raises(UntrustedBlockError, match="before this server started serving"):
        check_operator(sealed, KEY, NonceBook())
    with pytest.raises(UntrustedBlockError, match="before this server started serving"):
        check_operator(resigned(sealed, created=float("nan")), KEY, NonceBook())


def test_a_short_operator_key_accepts_nothing():
    with pytest.raises(UntrustedBlockError, match="shorter than"):
        check_operator(seal(b"b", key="short", **VERSIONS), "short", NonceBook())


def test_the_signature_covers_the_whole_text_and_nothing_is_decoded_before_it():
    sealed = seal(b"b", key=KEY, **VERSIONS)
    body, signature = split_signature(sealed)
    assert signature == operator_signature(body, KEY) and len(signature) == 64
    envelope = open_envelope(sealed, **VERSIONS)
    assert envelope.v == ENVELOPE_VERSION and envelope.nonce and envelope.expires
    for garbage in ("nns2:!!!." + signature, "x" * 1000 + "." + "0" * 64, body + ".", "é" * 10 + ".é"):
        with pytest.raises(UntrustedBlockError):  # refused as unsigned or forged, not as corrupt
            check_operator_signature(garbage, KEY)


def test_the_front_end_parts_do_not_import_nnsight():
    """nnsight puts ``.save`` on every object, which breaks pydantic models the
    OpenAI server builds per request: the server's front end must never import it."""
    code = (
        "import sys\n"
        "import vllm_nnsight_plugin.server.gate, vllm_nnsight_plugin.server.responses\n"
        "import vllm_nnsight_plugin.returns.outputs, vllm_nnsight_plugin.seams\n"
        "assert 'nnsight' not in sys.modules, 'nnsight imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_operator_key_never_travels_inside_a_block(smollm2_path, monkeypatch):
    """A block that names its tracer carries it (and what it references) along;
    neither form of building a signed request may put the key in there."""
    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.client.remote import ServedOutput, Server

    model = VLLM(smollm2_path)  # the tree only
    with model.requests("The capital of France is", key=KEY) as tracer:
        steps = list().save()
        for _ in tracer.iter[:2]:
            steps.append(model.logits)
    built = tracer.prepared.vllm_xargs[0]["nnsight"]

    sent = []

    def run(self, prompts, params):
        sent.extend(param.extra_args["nnsight"] for param in params)
        return [ServedOutput(request_id="r")]

    monkeypatch.setattr(Server, "run", run)
    with model.trace("The capital of France is", serve="http://127.0.0.1:9", key=KEY) as tracer:
        steps = list().save()
        for _ in tracer.iter[:2]:
            steps.append(model.logits)
    served = sent[0]

    for envelope in (built, served):
        assert split_signature(envelope)[1]  # signed for the server...
        assert KEY.encode() not in open_envelope(envelope, **VERSIONS).block_bytes()  # ...without the key


def test_processes_sharing_a_nonce_directory_accept_an_envelope_once(monkeypatch, tmp_path):
    """Several API server processes (one book each) share the engine family's
    nonce directory: an envelope accepted by one is a replay to the others, in
    this process and in another one; expired nonces are pruned from it."""
    import vllm_nnsight_plugin.wire.trust as trust

    directory = tmp_path / "nonces"
    monkeypatch.setenv(trust.NONCE_DIR_ENV, str(directory))
    sealed = seal(b"b", key=KEY, **VERSIONS)
    check_operator(sealed, KEY, NonceBook())
    with pytest.raises(UntrustedBlockError, match="already used"):
        check_operator(sealed, KEY, NonceBook())  # another process's book
    another = seal(b"b", key=KEY, **VERSIONS)
    script = (
        "import sys; from tests.unit.test_gate import check_operator; from vllm_nnsight_plugin.wire.trust "
        "import NonceBook; check_operator(sys.argv[1], sys.argv[2], NonceBook())"
    )
    first = subprocess.run([sys.executable, "-c", script, another, KEY], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    with pytest.raises(UntrustedBlockError, match="already used"):
        check_operator(another, KEY, NonceBook())
    assert oct(directory.stat().st_mode & 0o777) == "0o700" and len(list(directory.iterdir())) == 2
    book = NonceBook()
    book._shared_pruned -= 3600
    later = time.time() + 10**6  # as if much later: the two above have expired
    assert book.claim("fresh", later + 60, now=later)
    fresh = trust.hashlib.sha256(b"fresh").hexdigest()[:40]
    deadline = time.monotonic() + 10
    while [p.name for p in directory.iterdir()] != [fresh] and time.monotonic() < deadline:
        time.sleep(0.05)  # pruned on a thread of its own
    assert [p.name for p in directory.iterdir()] == [fresh]
