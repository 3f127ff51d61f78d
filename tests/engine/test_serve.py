"""The stock OpenAI server (``python -m vllm.entrypoints.openai.api_server``) with
the plugin installed, started on 127.0.0.1 by the test, driven by the project's
client, raw HTTP and the ``openai`` client.

``served`` runs with an operator key read from a file that is not there when it
starts (blocks off, as with no key) and is written by ``armed``; it also starts
with stale settings only the demo reads, which must not matter. ``stock`` runs
with the plugin switched off (``VLLM_NNSIGHT_DISABLE``, read before a setting the
engine could not use): the reference for plain outputs.
"""

from __future__ import annotations

import json
import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import nnsight
import pytest
import torch

from tests.servers import KEY, start_server
from vllm_nnsight_plugin.versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
from vllm_nnsight_plugin.wire.envelope import seal, sign
from vllm_nnsight_plugin.wire.saves import decode_request

PROMPT = "The capital of France is"
MAX_SAVE_BYTES = 8 * 1024 * 1024
MAX_PAYLOAD_BYTES = 1024 * 1024


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    return tmp_path_factory.mktemp("operator") / "key"  # not there yet: a secret mounted later


@pytest.fixture(scope="module")
def served(smollm2_path, key_file, tmp_path_factory):
    env = {
        "VLLM_NNSIGHT_KEY_FILE": str(key_file),
        "VLLM_SERVER_DEV_MODE": "1",  # for the nnsight_tracked RPC below
        "VLLM_NNSIGHT_MAX_SAVE_BYTES": str(MAX_SAVE_BYTES),
        "VLLM_NNSIGHT_MAX_PAYLOAD_BYTES": str(MAX_PAYLOAD_BYTES),
        "VLLM_NNSIGHT_STEP_BUDGET_S": "2",
        # Room for pickling a 113 MB parameter up to its unsendable part on a loaded
        # CPU (over 2 s under the full suite), which must fail as unsendable.
        "VLLM_NNSIGHT_PACK_BUDGET_S": "10",
        "VLLM_NNSIGHT_STEP_MEMORY_BYTES": str(512 << 20),
        "VLLM_NNSIGHT_SMOLLM2_GGUF": "/no/such/model.gguf",  # stale, demo only: warned about, nothing more
        "VLLM_NNSIGHT_MEMORY": "0.5x",
    }
    server = start_server(smollm2_path, str(tmp_path_factory.mktemp("logs") / "served.log"), env=env)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def armed(served, key_file):
    key_file.write_text(KEY)
    return served


@pytest.fixture(scope="module")
def client(smollm2_path):
    from vllm_nnsight_plugin import VLLM

    return VLLM(smollm2_path)  # the module tree only: no engine here


def model_name(server) -> str:
    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]


def complete(server, prompt=PROMPT, max_tokens=4, **fields) -> httpx.Response:
    body = {
        "model": model_name(server),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        **fields,
    }
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def assert_still_serving(server) -> None:
    response = complete(server)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"].startswith(" Paris")


def cached_rows(server) -> int:
    """Prompt rows traced requests read from the prefix cache, over the server's workers."""
    response = httpx.post(f"{server.url}/collective_rpc", json={"method": "nnsight_stats"}, timeout=30)
    return sum(int(stats["prompt_rows_cached"]) for stats in response.json()["results"])


def tracked(server) -> int:
    response = httpx.post(f"{server.url}/collective_rpc", json={"method": "nnsight_tracked"}, timeout=30)
    return sum(int(x) for x in response.json()["results"])


class Canary:
    """Unpickling this writes a file: proof that a payload was decoded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def canary_envelope(path, **seal_kwargs) -> str:
    return seal(
        pickle.dumps(Canary(str(path))),
        nnsight_version=seal_kwargs.pop("nnsight_version", SUPPORTED_NNSIGHT),
        plugin_version=PLUGIN_VERSION,
        **seal_kwargs,
    )


def test_blocks_are_off_until_the_operator_sets_a_key(served, client, tmp_path):
    """The key file is not there yet: the server started, said so once, and runs
    no block; stale demo-only settings were warned about, and blocks run once the
    file is there (``armed``)."""
    log = open(served.log).read()
    assert (
        log.count("VLLM_NNSIGHT_KEY_FILE names") == 1 and "blocks from the network are off until it is" in log
    )
    assert "VLLM_NNSIGHT_SMOLLM2_GGUF ('/no/such/model.gguf') must be the path of a readable file" in log
    assert "VLLM_NNSIGHT_MEMORY ('0.5x') must be a fraction" in log and "blocks are off" not in log
    response = complete(served, vllm_xargs={"nnsight": canary_envelope(tmp_path / "c", key=KEY)})
    assert response.status_code == 403
    assert response.json()["error"]["type"] == "NNsightBlocksDisabled"
    assert "VLLM_NNSIGHT_KEY" in response.json()["error"]["message"]
    assert not (tmp_path / "c").exists()
    with pytest.raises(Exception, match="403 NNsightBlocksDisabled"):
        with client.trace(PROMPT, temperature=0.0, serve=served.url, key=KEY):
            client.logits.save()
    assert_still_serving(served)


def edit_install(server, body: bytes, header: str | None) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if header is not None:
        headers["x-nnsight-signature"] = header
    return httpx.post(f"{server.url}/v1/nnsight/edits", content=body, headers=headers, timeout=60)


def test_edit_routes_are_off_until_the_operator_sets_a_key(served, client, tmp_path):
    from vllm_nnsight_plugin import ServeError
    from vllm_nnsight_plugin.wire.edits import sign_command

    body = json.dumps({"block": canary_envelope(tmp_path / "c")}).encode()
    response = edit_install(served, body, sign_command(KEY, "POST", "/v1/nnsight/edits", body))
    assert response.status_code == 403 and response.json()["error"]["type"] == "NNsightBlocksDisabled"
    with pytest.raises(ServeError, match="403 NNsightBlocksDisabled"):
        with client.edit(serve=served.url, key=KEY) as (tracer, edit):
            client.logits.save()
    with pytest.raises(ServeError, match="403"):
        client.installed_edits(serve=served.url, key=KEY)
    assert not (tmp_path / "c").exists()
    assert_still_serving(served)


def test_served_trace_reads_like_the_offline_one(armed, client, smol):
    def run(model, **serve):
        with model.trace(PROMPT, temperature=0.0, max_tokens=3, **serve) as tracer:
            hidden = model.model.layers[10].output[0].clone().save()
            logits = model.logits.save()
            out = tracer.result.save()
        return hidden, logits, out

    hidden, logits, out = run(client, serve=armed.url, api_key=KEY)  # nnsight's spelling of key=
    hidden_offline, logits_offline, out_offline = run(smol)
    assert tuple(hidden.shape) == (5, 576) and hidden.dtype == torch.float32
    torch.testing.assert_close(hidden, hidden_offline, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, logits_offline, rtol=1e-4, atol=1e-4)
    assert list(out.outputs[0].token_ids) == list(out_offline.outputs[0].token_ids)
    assert out.outputs[0].text.startswith(" Paris")
    # vLLM's own Prometheus metrics count it by its path
    metrics = httpx.get(f"{armed.url}/metrics", timeout=30).text
    counted = [line for line in metrics.splitlines() if line.startswith("vllm_nnsight_requests_total{")]
    assert counted and sum(float(line.rsplit(" ", 1)[1]) for line in counted) >= 1, counted


def test_a_client_without_vllm_traces_edits_and_errs_like_one_with_it(armed, client, smol, tmp_path):
    """``pip install vllm-nnsight-plugin`` on a laptop: no vLLM, a CPU torch. The
    tree and tokenizer come from the server; traces, invokes, steps, edits and
    errors behave as with vLLM installed, and the reads equal the offline engine's."""
    import os
    import subprocess

    from tests.without_vllm import ROOT, python_without_vllm

    python = python_without_vllm(tmp_path / "laptop")
    out = tmp_path / "seen.pt"
    script = str(ROOT / "tests" / "clients" / "served_without_vllm.py")
    env = {**os.environ, "VLLM_NNSIGHT_KEY": KEY, "PYTHONPATH": ""}
    done = subprocess.run(
        [python, script, armed.url, str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seen = torch.load(out, weights_only=False)

    assert seen["vllm_loaded"] == []  # nothing named vllm is left in that process
    assert seen["concurrent"] == [(576,)] * 4  # first traces at once, each its own
    assert seen["layers"] == 30 and "LlamaForCausalLM" in seen["tree"] and "QKVParallelLinear" in seen["tree"]
    with smol.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        hidden = smol.model.layers[10].output[0].clone().save()
        logits = smol.logits.save()
        result = tracer.result.save()
    torch.testing.assert_close(seen["hidden"], hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(seen["logits"], logits, rtol=1e-4, atol=1e-4)
    assert seen["tokens"] == list(result.outputs[0].token_ids)
    assert seen["text"] == result.outputs[0].text and seen["text"].startswith(" Paris")
    assert seen["first"] == (3, 576) and seen["japan"].startswith(" Tokyo")
    assert seen["installed"] == ["probe"] and seen["edit_saves"] == ["norm"] and seen["after_clear"] == []
    assert "IndexError" in seen["block_error"] and "Intervention traceback" in seen["block_error"]
    assert f"[as sent by the server at {armed.url}; not checked here]" in seen["block_error"]
    assert "'temprature' is not a sampling parameter; did you mean 'temperature'" in seen["typo"]
    assert_still_serving(armed)
    assert tracked(armed) == 0


def test_key_and_api_key_are_one_setting():
    from vllm_nnsight_plugin.client.served import key_spelling

    assert key_spelling(None, {"api_key": "k"}) == key_spelling("k", {}) == "k"
    assert key_spelling("k", {"api_key": "k"}) == "k"
    with pytest.raises(ValueError, match="key=... or api_key"):
        key_spelling("k", {"api_key": "other"})


def test_served_invokes_steps_and_generate(armed, client):
    with client.generate(temperature=0.0, max_tokens=3, serve=armed.url, key=KEY) as tracer:
        with tracer.invoke("Paris is in"):
            first = client.model.layers[3].output[0].clone().save()
        with tracer.invoke("The capital of Japan is"):
            tokens = list().save()
            for _ in tracer.iter[:3]:
                tokens.append(client.samples.item())
    assert tuple(first.shape) == (3, 576)
    assert len(tokens) == 3
    assert client.tokenizer.decode(tokens).startswith(" Tokyo")


def test_block_errors_come_back_with_their_traceback(armed, client):
    with pytest.raises(RuntimeError, match="IndexError") as raised:
        with client.trace(PROMPT, temperature=0.0, max_tokens=2, serve=armed.url, key=KEY):
            row = client.model.layers[3].output[0][99].save()  # noqa: F841
    assert "Intervention traceback" in str(raised.value)  # the block's, from the engine
    assert_still_serving(armed)

    with pytest.raises(RuntimeError, match="ReplacementShapeError"):
        with client.trace(PROMPT, temperature=0.0, max_tokens=2, serve=armed.url, key=KEY):
            client.model.layers[3].mlp.output = torch.zeros(1, 7)
    assert_still_serving(armed)

    with pytest.raises(RuntimeError, match="VLLM_NNSIGHT_MAX_SAVE_BYTES"):
        with client.trace(PROMPT, temperature=0.0, max_tokens=2, serve=armed.url, key=KEY):
            weight = client.model.embed_tokens.weight.detach().clone().save()  # noqa: F841 (113 MB > 8 MiB)
    assert_still_serving(armed)

    with pytest.raises(RuntimeError, match="UnsendableSaveError"):
        with client.trace(PROMPT, temperature=0.0, max_tokens=2, serve=armed.url, key=KEY):
            weight = client.model.embed_tokens.weight.save()  # noqa: F841 (a Parameter vLLM-CPU tags with a lambda)
    assert_still_serving(armed)
    assert tracked(armed) == 0


def test_refusals_are_http_errors_and_run_nothing(armed, tmp_path):
    cases = {
        "unsigned": (canary_envelope(tmp_path / "a"), 403, "NNsightUntrustedBlock"),
        "wrong key": (canary_envelope(tmp_path / "b", key="x" * 64), 403, "NNsightUntrustedBlock"),
        "expired": (canary_envelope(tmp_path / "c", key=KEY, ttl_s=-1), 403, "NNsightUntrustedBlock"),
        "too long-lived": (
            canary_envelope(tmp_path / "d", key=KEY, ttl_s=10**6),
            403,
            "NNsightUntrustedBlock",
        ),
        "corrupt, unsigned": ("nns2:!!!" + "A" * 40, 403, "NNsightUntrustedBlock"),
        "corrupt, signed": (sign("nns2:!!!" + "A" * 40, KEY), 400, "NNsightBadEnvelope"),
        "forged signature": ("nns2:" + "A" * 40 + "." + "é" * 64, 403, "NNsightUntrustedBlock"),
        "other nnsight": (
            canary_envelope(tmp_path / "e", key=KEY, nnsight_version="0.0.1"),
            400,
            "NNsightBadEnvelope",
        ),
        "too large": (
            seal(
                b"x" * (2 * MAX_PAYLOAD_BYTES), nnsight_version=SUPPORTED_NNSIGHT, plugin_version="0", key=KEY
            ),
            413,
            "NNsightPayloadTooLarge",
        ),
    }
    for name, (envelope, status, kind) in cases.items():
        # A client-made local signature is dropped, never trusted.
        xargs = {"nnsight": envelope, "nnsight_local_sig": "0" * 64}
        response = complete(armed, vllm_xargs=xargs)
        assert response.status_code == status, (name, response.text)
        assert response.json()["error"]["type"] == kind, name
        for opened in tmp_path.iterdir():
            pytest.fail(f"{name}: a refused payload was decoded ({opened.name})")
        assert_still_serving(armed)


def test_a_block_through_any_other_endpoint_is_refused_unread(armed, tmp_path):
    """/v1/responses also fills extra_args from vllm_xargs; it is not a door for
    blocks, and a signature copied from a log does not make it one."""
    envelope = canary_envelope(tmp_path / "r", key=KEY)
    forged = {"nnsight": envelope, "nnsight_local_sig": "0" * 64}
    name = model_name(armed)
    for path, body in (
        ("/v1/responses", {"model": name, "input": PROMPT, "max_output_tokens": 4, "vllm_xargs": forged}),
        (
            "/v1/responses",
            {"model": name, "input": PROMPT, "stream": True, "vllm_xargs": {"nnsight": envelope}},
        ),
        (
            "/v1/messages",
            {
                "model": name,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": PROMPT}],
                "vllm_xargs": {"nnsight": envelope},
            },
        ),
    ):
        response = httpx.post(f"{armed.url}{path}", json=body, timeout=120)
        assert response.status_code == 400, (path, response.text)  # before any stream starts
        assert response.json()["error"]["type"] == "NNsightBadEnvelope"
        assert "does not take nnsight blocks" in response.text
    assert not (tmp_path / "r").exists()
    plain = {"model": name, "input": PROMPT, "max_output_tokens": 4, "vllm_xargs": {"other": "x"}}
    assert httpx.post(f"{armed.url}/v1/responses", json=plain, timeout=120).status_code == 200
    assert tracked(armed) == 0
    assert_still_serving(armed)


def test_a_signed_envelope_is_good_once(armed, client):
    with client.requests(PROMPT, key=KEY) as tracer:
        client.logits.save()
    xargs = tracer.prepared.vllm_xargs[0]
    assert complete(armed, vllm_xargs=dict(xargs)).status_code == 200
    again = complete(armed, vllm_xargs=dict(xargs))
    assert again.status_code == 403 and "replay" in again.json()["error"]["message"]


def test_openai_client_completions_chat_streams_n_and_stop(armed, client):
    import openai

    api = openai.OpenAI(base_url=f"{armed.url}/v1", api_key="unused")
    name = model_name(armed)

    def xargs():
        with client.requests("unused", key=KEY) as tracer:
            hidden = client.model.layers[3].output[0].clone().save()  # noqa: F841
        return {"vllm_xargs": tracer.prepared.vllm_xargs[0]}

    # Two prompts, two sequences each: one entry per prompt, one saves dict per sequence.
    both = api.completions.create(
        model=name,
        prompt=[PROMPT, "Berlin is"],
        max_tokens=3,
        temperature=1.0,
        seed=0,
        n=2,
        extra_body=xargs(),
    )
    entries = both.model_extra["nnsight"]["requests"]
    assert len(entries) == 2 and len(both.choices) == 4
    for entry, rows in zip(entries, (5, 3)):
        saves, sequences, _, _ = decode_request(entry)
        assert len(sequences) == 2
        assert [tuple(s["hidden"].shape) for s in sequences] == [(rows, 576)] * 2

    stream = api.completions.create(
        model=name, prompt=PROMPT, max_tokens=8, temperature=0.0, stream=True, stop=["."], extra_body=xargs()
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " Paris"
    assert chunks[-1].choices == [] and chunks[-1].id == chunks[0].id
    assert tuple(decode_request(chunks[-1].model_extra["nnsight"]["requests"][0])[0]["hidden"].shape) == (
        5,
        576,
    )

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = api.chat.completions.create(
        model=name, messages=messages, max_tokens=4, temperature=0.0, extra_body=xargs()
    )
    (entry,) = chat.model_extra["nnsight"]["requests"]
    assert decode_request(entry)[0]["hidden"].shape[1] == 576
    chat_chunks = list(
        api.chat.completions.create(
            model=name, messages=messages, max_tokens=4, temperature=0.0, stream=True, extra_body=xargs()
        )
    )
    assert chat_chunks[-1].model_extra["nnsight"]["requests"]


def test_a_block_error_in_a_stream_is_an_error_event(armed, client):
    import openai

    with client.requests(PROMPT, key=KEY) as tracer:
        client.model.layers[3].output[0][99].save()
    api = openai.OpenAI(base_url=f"{armed.url}/v1", api_key="unused")
    stream = api.completions.create(
        model=model_name(armed),
        prompt=PROMPT,
        max_tokens=3,
        stream=True,
        extra_body={"vllm_xargs": tracer.prepared.vllm_xargs[0]},
    )
    with pytest.raises(openai.APIError, match="IndexError"):
        list(stream)
    assert_still_serving(armed)


def test_a_client_that_disconnects_leaves_nothing_behind(armed, client):
    with client.requests(PROMPT, key=KEY) as tracer:
        hidden = client.model.layers[3].output[0].clone().save()  # noqa: F841
    body = {
        "model": model_name(armed),
        "prompt": PROMPT,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "vllm_xargs": tracer.prepared.vllm_xargs[0],
    }
    with httpx.stream("POST", f"{armed.url}/v1/completions", json=body, timeout=60) as response:
        assert next(response.iter_lines())  # generating
    deadline = time.monotonic() + 30
    while tracked(armed) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert tracked(armed) == 0
    assert_still_serving(armed)


def test_edits_over_http_run_on_every_request(armed, client, smol):
    """Installed by the client with the operator's key; chosen with edits=[...];
    their saves on every response, for the project's client, the openai client
    (streaming too) and raw HTTP, requests that carried no block included."""
    import openai

    from vllm_nnsight_plugin import ServeError

    with client.edit(serve=armed.url, key=KEY, name="probe") as (tracer, probe):
        hidden = client.model.layers[5].output[0][-1].clone().save()  # noqa: F841
    with client.edit(serve=armed.url, key=KEY) as (tracer, always):
        seen = nnsight.save(True)  # noqa: F841
    assert client.installed_edits(serve=armed.url, key=KEY) == {probe.id: "probe", always.id: None}
    try:
        for edits, names in ((None, ["hidden", "seen"]), (["probe"], ["hidden", "seen"]), ([], ["seen"])):
            kw = {} if edits is None else {"edits": edits}
            with client.trace(
                PROMPT, temperature=0.0, max_tokens=2, serve=armed.url, key=KEY, **kw
            ) as tracer:
                mine = client.logits.argmax(-1).save()
                result = tracer.result.save()
            assert sorted(result.saves) == names and client.tokenizer.decode(mine) == " Paris"
        with smol.trace(PROMPT, temperature=0.0, max_tokens=2):
            want = smol.model.layers[5].output[0][-1].clone().save()
        torch.testing.assert_close(result.saves.get("hidden", want), want, rtol=1e-4, atol=1e-4)

        api = openai.OpenAI(base_url=f"{armed.url}/v1", api_key="unused")
        name = model_name(armed)
        plain = api.completions.create(model=name, prompt=PROMPT, max_tokens=3, temperature=0.0)
        assert plain.choices[0].text.startswith(" Paris")
        decoded = decode_request(plain.model_extra["nnsight"]["requests"][0])
        assert decoded.saves == {} and sorted(decoded.edits) == ["hidden", "seen"]
        torch.testing.assert_close(decoded.edits["hidden"], want, rtol=1e-4, atol=1e-4)
        chosen = complete(armed, vllm_xargs={"nnsight_edits": "[]"})
        (entry,) = chosen.json()["nnsight"]["requests"]
        assert sorted(decode_request(entry).edits) == ["seen"]
        as_list = complete(armed, vllm_xargs={"nnsight_edits": ["probe"]})
        assert sorted(decode_request(as_list.json()["nnsight"]["requests"][0]).edits) == ["hidden", "seen"]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chunks = list(
            api.chat.completions.create(
                model=name, messages=messages, max_tokens=3, temperature=0.0, stream=True
            )
        )
        (entry,) = chunks[-1].model_extra["nnsight"]["requests"]
        assert sorted(decode_request(entry).edits) == ["hidden", "seen"]

        unknown = complete(armed, vllm_xargs={"nnsight_edits": '["nope"]'})
        assert unknown.status_code == 400 and "no edit is installed under that name" in unknown.text
        with pytest.raises(ServeError, match="400"):
            with client.trace(PROMPT, max_tokens=1, serve=armed.url, key=KEY, edits=["nope"]):
                client.logits.save()

        with client.edit(serve=armed.url, key=KEY, name="broken") as (tracer, broken):
            client.model.layers[3].output[0][99].save()
        failed = complete(armed, vllm_xargs={"nnsight_edits": '["broken"]'})
        assert failed.status_code == 422 and failed.json()["error"]["type"] == "NNsightBlockError"
        assert "IndexError" in failed.json()["error"]["message"]
        broken.clear()
        probe.clear()
        assert client.installed_edits(serve=armed.url, key=KEY) == {always.id: None}
    finally:
        client.clear_edits(serve=armed.url, key=KEY)
    assert client.installed_edits(serve=armed.url, key=KEY) == {}
    cleared = complete(armed)
    assert cleared.status_code == 200 and "nnsight" not in cleared.json()
    assert tracked(armed) == 0


def test_edit_routes_refuse_what_is_not_signed_right_and_run_nothing(armed, tmp_path):
    from vllm_nnsight_plugin.wire.edits import sign_command

    route = "/v1/nnsight/edits"

    def body(name: str, envelope: str | None = None) -> bytes:
        return json.dumps({"block": envelope or canary_envelope(tmp_path / name)}).encode()

    signed_request = body("g", canary_envelope(tmp_path / "g", key=KEY))  # a block's own signature
    replayed = body("h", "nns2:!!!")  # refused after the signature is checked, the first time
    replay_header = sign_command(KEY, "POST", route, replayed)
    assert edit_install(armed, replayed, replay_header).status_code == 400
    cases = {
        "unsigned": (body("a"), None, 403),
        "wrong key": (body("b"), sign_command("x" * 64, "POST", route, body("b")), 403),
        "expired": (body("c"), sign_command(KEY, "POST", route, body("c"), ttl_s=-1), 403),
        "another body": (body("d"), sign_command(KEY, "POST", route, b"{}"), 403),
        "another route": (body("e"), sign_command(KEY, "POST", route + "/x", body("e")), 403),
        "another method": (body("f"), sign_command(KEY, "DELETE", route, body("f")), 403),
        "a block's signature only": (signed_request, None, 403),
        "malformed header": (body("j"), "v1:garbage", 403),
    }
    cases["replayed"] = (replayed, replay_header, 403)
    for name, (content, header, status) in cases.items():
        response = edit_install(armed, content, header)
        assert response.status_code == status, (name, response.text)
        assert response.json()["error"]["type"] == "NNsightUntrustedBlock", name
    corrupt = body("k", "nns2:!!!")
    response = edit_install(armed, corrupt, sign_command(KEY, "POST", route, corrupt))
    assert response.status_code == 400 and response.json()["error"]["type"] == "NNsightBadEnvelope"
    huge = json.dumps({"block": "nns2:" + "A" * (4 * MAX_PAYLOAD_BYTES)}).encode()
    response = edit_install(armed, huge, sign_command(KEY, "POST", route, huge))
    assert response.status_code == 413
    gone = httpx.delete(
        f"{armed.url}{route}/edit-none",
        headers={"x-nnsight-signature": sign_command(KEY, "DELETE", f"{route}/edit-none")},
    )
    assert gone.status_code == 404
    listed = httpx.get(
        f"{armed.url}{route}", headers={"x-nnsight-signature": sign_command(KEY, "GET", route)}
    )
    assert listed.status_code == 200
    for opened in tmp_path.iterdir():
        pytest.fail(f"a refused edit's payload was decoded ({opened.name})")
    assert tracked(armed) == 0
    assert_still_serving(armed)


def test_concurrent_traced_and_plain_requests(armed, stock, client, smol):
    """16 traces and 16 plain requests at once: each trace gets its own saves (as
    the offline path reads them), and plain outputs equal a server without the plugin."""
    traced_prompts = [f"Fact number {i}: the capital of France is" for i in range(16)]
    plain_prompts = [f"Question {i}: what is the largest ocean?" for i in range(16)]
    barrier = threading.Barrier(32)

    def trace(prompt):
        barrier.wait()
        with client.trace(prompt, temperature=0.0, max_tokens=4, serve=armed.url, key=KEY):
            hidden = client.model.layers[5].output[0].clone().save()
        return hidden

    def plain(prompt, server=armed, wait=True):
        if wait:
            barrier.wait()
        response = complete(server, prompt, max_tokens=8)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    with ThreadPoolExecutor(32) as pool:
        traced = [pool.submit(trace, p) for p in traced_prompts]
        plains = [pool.submit(plain, p) for p in plain_prompts]
        traced = [f.result() for f in traced]
        plains = [f.result() for f in plains]

    for prompt, hidden in zip(traced_prompts, traced):
        with smol.trace(prompt, temperature=0.0, max_tokens=4):
            expected = smol.model.layers[5].output[0].clone().save()
        torch.testing.assert_close(hidden, expected, rtol=1e-4, atol=1e-4)
    reference = [plain(p, stock, wait=False) for p in plain_prompts]
    assert plains == reference
    assert tracked(armed) == 0


@pytest.fixture(scope="module")
def stock(smollm2_path, tmp_path_factory):
    server = start_server(
        smollm2_path,
        str(tmp_path_factory.mktemp("logs") / "stock.log"),
        env={"VLLM_NNSIGHT_DISABLE": "yes", "VLLM_NNSIGHT_MAX_SAVE_BYTES": "lots"},
    )
    yield server
    server.stop()


def test_fuzz_smoke(armed, client):
    """A few hundred of ``benchmarks/fuzz.py``'s hostile and careless requests (the
    10,000-case run is on demand): each answered with its documented 4xx (or 200
    where the request is fine), none with a 5xx or a reflected input, plain
    requests in between unchanged, no payload decoded without the key, and the
    server serving and holding no block after."""
    from benchmarks.fuzz import fuzz

    report = fuzz(armed.url, KEY, 300, client, seed=1, clients=4, payload_limit=MAX_PAYLOAD_BYTES)
    summary = report.summary()
    assert summary["unexpected"] == 0, summary["unexpected_examples"]
    assert summary["server_errors_5xx"] == 0 and summary["transport_errors"] == 0
    assert summary["plain_checked"] >= 10 and summary["plain_mismatches"] == 0
    assert summary["canaries_written"] == 0
    assert summary["still_serving"] and summary["blocks_held_after"] == 0
    kinds = summary["by_kind"]
    assert len(kinds) >= 20 and any(kind.startswith("signed:") for kind in kinds)


def test_a_served_block_reading_last_rows_shares_the_prefix_cache(armed, client):
    """The client's claim travels in ``vllm_xargs``; the server's front end lets the
    request read the cache, and its worker checks the block (``prefix.py``)."""
    prompt = " ".join(f"Entry {i} of the served ledger lists a cached prefix." for i in range(24))

    def last_row():
        with client.trace(prompt, temperature=0.0, max_tokens=1, serve=armed.url, key=KEY):
            row = client.model.layers[10].output[0][-1].clone().save()
        return row

    before = cached_rows(armed)
    first, second = last_row(), last_row()
    assert cached_rows(armed) - before >= 128
    assert tuple(first.shape) == (576,) and torch.equal(first, second)


def test_served_requests_making_the_same_edit_share_its_kv(armed, client):
    """The same-edit claim travels the same way; the server's front end salts the KV
    with the block's bytes, which two traces sealed apart (each envelope with its
    own nonce) share."""
    prompt = " ".join(f"Line {i} of the served log repeats a steered prefix." for i in range(24))
    vector = torch.ones(576)

    def steered() -> list[int]:
        with client.trace(prompt, temperature=0.0, max_tokens=3, serve=armed.url, key=KEY) as tracer:
            drawn = list().save()
            for _ in tracer.all():
                hidden = client.model.layers[10].output[0]
                hidden[:] += 4.0 * vector.to(hidden)
                drawn.append(client.samples.item())
        return list(drawn)

    before = cached_rows(armed)
    first = steered()
    middle = cached_rows(armed)
    assert middle == before  # the first computed its whole prompt: nothing under its salt yet
    assert steered() == first and cached_rows(armed) - middle >= 128


def test_served_requests_running_one_installed_steering_edit_share_its_kv(armed, client):
    """An edit installed over HTTP that edits every row alike: the server's workers
    read it at install, and the requests running it share the KV made under it
    (each trace here reads only the logits, so its block adds nothing to the salt)."""
    prompt = " ".join(f"Row {i} of the served ledger sits under an installed edit." for i in range(24))
    vector = torch.ones(576)

    def first_token() -> int:
        with client.trace(prompt, temperature=0.0, max_tokens=2, serve=armed.url, key=KEY):
            token = client.logits.argmax(-1).save()
        return int(token)

    unsteered = first_token()
    with client.edit(serve=armed.url, key=KEY, name="steer") as (tracer, steer):
        for _ in tracer.all():
            hidden = client.model.layers[10].output[0]
            hidden[:] += 8.0 * vector.to(hidden)
    try:
        before = cached_rows(armed)
        first = first_token()
        middle = cached_rows(armed)
        second = first_token()
        after = cached_rows(armed)
    finally:
        steer.clear()
    assert middle == before and after - middle >= 128  # the second read the first's steered KV
    assert first == second != unsteered
    assert first_token() == unsteered and cached_rows(armed) - after >= 128  # plain KV again
