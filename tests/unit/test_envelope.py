"""The envelope alone: framing, versions and limits, with no engine."""

from __future__ import annotations

import base64
import json

import pytest

from vllm_nnsight_plugin.wire.envelope import (
    ENVELOPE_VERSION,
    EXTRA_ARGS_KEY,
    EnvelopeError,
    Limits,
    open_envelope,
    seal,
    split_signature,
)

VERSIONS = dict(nnsight_version="0.8.1", plugin_version="0.1.0")


def test_round_trip():
    sealed = seal(b"\x00block\xff", **VERSIONS)
    assert isinstance(sealed, str) and sealed.isascii()
    assert open_envelope(sealed, **VERSIONS).block_bytes() == b"\x00block\xff"


@pytest.mark.parametrize("value", ["", "garbage", "nns2:!!!", "nns2:" + base64.b64encode(b"[1,2]").decode()])
def test_corrupt_is_refused(value):
    with pytest.raises(EnvelopeError):
        open_envelope(value, **VERSIONS)


def test_not_a_string_is_refused():
    with pytest.raises(EnvelopeError, match="must be the string"):
        open_envelope(12, **VERSIONS)


def test_format_version_mismatch_names_both_versions():
    document = {"v": ENVELOPE_VERSION + 1, "nnsight": "0.8.1", "plugin": "9.9", "payload": "eA=="}
    value = "nns2:" + base64.b64encode(json.dumps(document).encode()).decode()
    with pytest.raises(EnvelopeError, match=r"format version 4 .*plugin '9.9'.*versions 2 and 3"):
        open_envelope(value, **VERSIONS)
    document["v"] = 2  # an earlier client's: its payload is torch's pickles alone, read as before
    value = "nns2:" + base64.b64encode(json.dumps(document).encode()).decode()
    assert open_envelope(value, **VERSIONS).block_bytes() == b"x"
    document["v"] = ENVELOPE_VERSION + 1
    older = "nns1:" + base64.b64encode(json.dumps(document).encode()).decode()
    with pytest.raises(
        EnvelopeError, match=r"format 'nns1'; this engine reads 'nns2'.*same vllm-nnsight-plugin"
    ):
        open_envelope(older, **VERSIONS)
    document["v"] = "x" * 10_000  # what a refusal shows of the input is short
    value = "nns2:" + base64.b64encode(json.dumps(document).encode()).decode()
    with pytest.raises(EnvelopeError) as raised:
        open_envelope(value, **VERSIONS)
    assert len(str(raised.value)) < 400


def test_nnsight_version_mismatch_names_the_fix():
    sealed = seal(b"x", nnsight_version="0.7.0", plugin_version="0.1.0")
    with pytest.raises(EnvelopeError, match=r"nnsight==0.8.1"):
        open_envelope(sealed, **VERSIONS)


def test_unknown_fields_are_refused():
    document = {"v": ENVELOPE_VERSION, "nnsight": "0.8.1", "plugin": "0.1.0", "payload": "eA==", "exec": "rm"}
    value = "nns2:" + base64.b64encode(json.dumps(document).encode()).decode()
    with pytest.raises(EnvelopeError, match="malformed"):
        open_envelope(value, **VERSIONS)


def test_size_limit_is_enforced_before_decoding():
    sealed = seal(b"x" * 10_000, **VERSIONS)
    with pytest.raises(EnvelopeError, match="limit of 1000 bytes"):
        open_envelope(sealed, limits=Limits(max_payload_bytes=1000), **VERSIONS)


def test_a_block_at_the_limit_passes_and_one_over_it_is_refused():
    limits = Limits(max_payload_bytes=30_000)
    key = "k" * 32
    opened = open_envelope(seal(b"x" * 30_000, **VERSIONS, key=key), limits=limits, **VERSIONS)
    assert len(base64.b64decode(opened.payload)) == 30_000
    with pytest.raises(EnvelopeError, match="limit of 30000 bytes"):
        open_envelope(seal(b"x" * 30_010, **VERSIONS, key=key), limits=limits, **VERSIONS)


def test_limits_from_environment(monkeypatch):
    monkeypatch.setenv("VLLM_NNSIGHT_MAX_PAYLOAD_BYTES", "123")
    monkeypatch.setenv("VLLM_NNSIGHT_MAX_SAVE_BYTES", "456")
    assert Limits.from_env() == Limits(max_payload_bytes=123, max_save_bytes=456)


def test_local_signature_accepts_only_the_engines_key(monkeypatch):
    from vllm_nnsight_plugin.wire import trust

    trust.ensure_local_key()
    sealed = seal(b"x", **VERSIONS)
    signature = trust.local_signature(sealed)
    trust.check_local(sealed, signature)
    for bad in (None, "", "0" * 64, trust.local_signature(sealed + "x")):
        with pytest.raises(trust.UntrustedBlockError):
            trust.check_local(sealed, bad)
    monkeypatch.setattr(trust, "_LOCAL_KEY", None)  # a process with no key at all
    monkeypatch.delenv(trust.LOCAL_KEY_ENV, raising=False)
    with pytest.raises(trust.UntrustedBlockError):  # trusts nothing
        trust.check_local(sealed, signature)


def test_a_remembered_envelope_is_still_checked_against_its_signature_and_key(monkeypatch):
    """The worker remembers an envelope it opened, by the envelope and its signature:
    the same envelope with another signature, or under another key, is checked
    afresh (and refused), and an envelope that can expire is never remembered."""
    import hashlib

    from vllm_nnsight_plugin.wire import trust
    from vllm_nnsight_plugin.worker import admit

    trust.ensure_local_key()
    limits = Limits()
    sealed = seal(b"block" * 20, **VERSIONS)
    signature = trust.local_signature(sealed)
    assert signature == trust._hmac(trust.local_key(), sealed)  # the memo's is the HMAC
    want = (b"block" * 20, hashlib.blake2b(b"block" * 20, digest_size=32).digest())
    assert admit.opened(sealed, signature, limits) == want
    assert admit.opened(sealed, signature, limits) == want  # remembered
    for bad in ("0" * 64, trust.local_signature(sealed + "x")):
        with pytest.raises(trust.UntrustedBlockError):
            admit.opened(sealed, bad, limits)
    with pytest.raises(EnvelopeError, match="limit of 10 bytes"):  # the limit is part of the key
        admit.opened(sealed, signature, Limits(max_payload_bytes=10))
    monkeypatch.setattr(trust, "_LOCAL_KEY", "another key")  # a signature from another engine
    with pytest.raises(trust.UntrustedBlockError):
        admit.opened(sealed, trust._hmac("yet another", sealed), limits)
    expiring = seal(b"block", key="k" * 40, ttl_s=60, **VERSIONS)
    admit.opened(expiring, trust.local_signature(expiring), limits)
    assert not any(key[0] == expiring for key in admit._opened)


def test_a_signed_block_admitted_in_time_does_not_expire_while_it_waits_in_the_engine(monkeypatch):
    """The door refuses an expired envelope; the worker runs one the front end
    admitted (its local signature says so), however long it waited in the queue."""
    import time

    from vllm_nnsight_plugin.wire import envelope as wire
    from vllm_nnsight_plugin.wire import trust
    from vllm_nnsight_plugin.worker import admit

    trust.ensure_local_key()
    sealed = seal(b"queued", key="k" * 40, ttl_s=60, **VERSIONS)
    signature = trust.local_signature(sealed)
    later = time.time() + 3600
    monkeypatch.setattr(wire.time, "time", lambda: later)
    with pytest.raises(EnvelopeError, match="expired"):
        open_envelope(sealed, **VERSIONS)
    assert admit.opened(sealed, signature, Limits())[0] == b"queued"


def test_a_refusal_is_small_and_echoes_nothing_of_the_input():
    """Thousands of unknown fields, deep nesting, a non-ASCII signature: each is a
    short EnvelopeError or UntrustedBlockError, never the input echoed back or an
    unhandled exception."""
    from vllm_nnsight_plugin.wire import trust

    fields = {f"field{i}": "secret-value-" * 20 for i in range(5_000)}
    document = {
        "v": ENVELOPE_VERSION,
        "nnsight": "0.8.1",
        "plugin": VERSIONS["plugin_version"],
        "payload": "eA==",
        **fields,
    }
    value = "nns2:" + base64.b64encode(json.dumps(document).encode()).decode()
    with pytest.raises(EnvelopeError, match="malformed") as raised:
        open_envelope(value, **VERSIONS)
    assert len(str(raised.value)) < 400 and "secret-value" not in str(raised.value)

    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(EnvelopeError, match="nests too deeply|corrupt"):
        open_envelope("nns2:" + base64.b64encode(deep.encode()).decode(), **VERSIONS)

    key = "k" * 40
    body, _ = split_signature(seal(b"x", key=key, **VERSIONS))
    with pytest.raises(trust.UntrustedBlockError, match="signature"):
        trust.check_operator_signature(f"{body}.{'é' * 64}", key)
    with pytest.raises(trust.UntrustedBlockError):
        trust.check_local("nns2:abc", "é" * 64)


def test_a_claim_of_any_type_is_that_request_s_error_not_the_worker_s():
    """``extra_args`` come from the caller: a prefix claim that is not a string
    (a list cannot be looked up) is no claim, and the request's bad envelope is
    its own error."""
    from types import SimpleNamespace

    from vllm_nnsight_plugin.prefix import CLAIM_KEY, SAME_EDIT
    from vllm_nnsight_plugin.worker import admit

    requests = SimpleNamespace(requests={})
    extra = {EXTRA_ARGS_KEY: "nns2:unsigned", CLAIM_KEY: [SAME_EDIT]}
    data = SimpleNamespace(req_id="r", sampling_params=SimpleNamespace(extra_args=extra))
    assert admit.admit(requests, admit.RequestIndex(), data, {}, Limits(), None) is None
    assert requests.requests["r"].error is not None
