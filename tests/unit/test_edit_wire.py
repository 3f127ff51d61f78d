"""The pieces of edits that need no engine: a request's choice of edits, the front
end's signed mark, the operator's signed commands, and which blocks may write."""

from __future__ import annotations

import time

import pytest

from vllm_nnsight_plugin.wire import edits as wire
from vllm_nnsight_plugin.wire import trust
from vllm_nnsight_plugin.wire.trust import NonceBook, UntrustedBlockError

KEY = "k" * 64
INSTALLED = {"a": "probe", "b": "steer", "c": None}


def test_a_choice_is_a_list_of_names_or_that_list_as_json():
    assert wire.wanted(None) is None
    assert wire.wanted(["probe"]) == wire.wanted('["probe"]') == ["probe"]
    assert wire.wanted([]) == wire.wanted("[]") == []
    for bad, match in (
        ("probe", r"edits=\['probe'\]"),
        ("[1]", "non-empty strings"),
        ({"probe": 1}, "not dict"),
        (["x" * 200], "at most 128"),
        (["n"] * 65, "more than 64"),
        ("[not json", "not a JSON list"),
    ):
        with pytest.raises(wire.EditChoiceError, match=match):
            wire.wanted(bad)


def test_the_rule_for_which_edits_run():
    assert wire.select(INSTALLED, None) == ["a", "b", "c"]
    assert wire.select(INSTALLED, ["probe"]) == ["a", "c"]
    assert wire.select(INSTALLED, ["steer", "probe"]) == ["a", "b", "c"]
    assert wire.select(INSTALLED, []) == ["c"]
    assert wire.select({}, None) == [] and wire.select({}, []) == []
    with pytest.raises(wire.EditChoiceError, match=r"\['nope'\].*installed: \['probe', 'steer'\]"):
        wire.select(INSTALLED, ["probe", "nope"])
    two = {"a": "probe", "b": "probe"}  # a name is a tag: both run
    assert wire.select(two, ["probe"]) == ["a", "b"]


def test_a_mark_is_good_only_with_the_engines_key(monkeypatch):
    monkeypatch.setattr(trust, "_LOCAL_KEY", KEY)
    marked = wire.mark(["a", "c"])
    assert wire.read_mark(marked) == ["a", "c"]
    assert wire.mark(["a"]) != wire.mark(["a"])  # a nonce of its own
    nonce, ids, mac = marked.split(":")
    assert wire.read_mark(f"{nonce}:a,b,c:{mac}") == []  # more edits than it was marked for
    assert wire.read_mark(f"{nonce}:{ids}:{'0' * 64}") == []
    assert wire.read_mark(None) == wire.read_mark(3) == wire.read_mark("garbage") == []
    monkeypatch.setattr(trust, "_LOCAL_KEY", "another" * 8)
    assert wire.read_mark(marked) == []


def test_a_command_is_good_once_for_its_method_path_and_body():
    nonces = NonceBook()
    header = wire.sign_command(KEY, "POST", "/v1/nnsight/edits", b"body")
    wire.check_command(header, "POST", "/v1/nnsight/edits", b"body", KEY, nonces)
    with pytest.raises(UntrustedBlockError, match="already used"):
        wire.check_command(header, "POST", "/v1/nnsight/edits", b"body", KEY, nonces)
    for method, path, body, key in (
        ("DELETE", "/v1/nnsight/edits", b"body", KEY),
        ("POST", "/v1/nnsight/edits/x", b"body", KEY),
        ("POST", "/v1/nnsight/edits", b"other", KEY),
        ("POST", "/v1/nnsight/edits", b"body", "x" * 64),
    ):
        fresh = wire.sign_command(KEY, "POST", "/v1/nnsight/edits", b"body")
        with pytest.raises(UntrustedBlockError, match="does not match"):
            wire.check_command(fresh, method, path, body, key, NonceBook())
    expired = wire.sign_command(KEY, "GET", "/p", ttl_s=-1)
    with pytest.raises(UntrustedBlockError, match="expired"):
        wire.check_command(expired, "GET", "/p", b"", KEY, NonceBook())
    too_long = wire.sign_command(KEY, "GET", "/p", ttl_s=10**6)
    with pytest.raises(UntrustedBlockError, match="lifetime"):
        wire.check_command(too_long, "GET", "/p", b"", KEY, NonceBook())
    for bad in (None, "", "v2:x", "v1:1:2:3", "v2:1:nan:n:m", "v2:nan:1e30:n:m", "v2:1:1e30:n:" + "é" * 10):
        with pytest.raises(UntrustedBlockError):
            wire.check_command(bad, "GET", "/p", b"", KEY, NonceBook())
    with pytest.raises(UntrustedBlockError, match="shorter than"):
        wire.check_command(header, "GET", "/p", b"", "short", NonceBook())


def test_a_command_made_before_the_server_started_serving_is_refused(monkeypatch):
    """A command captured before a restart is not good after it, however long its
    lifetime; one made since (within the clock skew allowed) is."""
    from vllm_nnsight_plugin.wire import trust

    before = wire.sign_command(KEY, "GET", "/p", ttl_s=600)
    monkeypatch.setattr(trust, "_SERVING_SINCE", time.time() + 10)  # the server restarted since
    with pytest.raises(UntrustedBlockError, match="before this server started serving"):
        wire.check_command(before, "GET", "/p", b"", KEY, NonceBook())
    monkeypatch.setattr(trust, "_SERVING_SINCE", time.time() + 3)  # within the 5 s of skew
    wire.check_command(wire.sign_command(KEY, "GET", "/p"), "GET", "/p", b"", KEY, NonceBook())
