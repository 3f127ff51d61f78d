"""The client's pieces for a machine with no vLLM, without an engine: the stand-in
sampling settings against vLLM's own, the served tree rebuilt from its
description, the tokenizer's files. The client driving a real server from an
environment without vLLM is in ``test_serve.py``."""

from __future__ import annotations

import pytest
import torch

from vllm_nnsight_plugin.client.remote import SAMPLING_FIELDS
from vllm_nnsight_plugin.client.standalone import DEFAULTS, SamplingParams, vllm_installed
from vllm_nnsight_plugin.wire.tree import TreeError, describe, load_tokenizer, rebuild, tokenizer_files


def test_the_stand_in_has_vllms_fields_and_defaults():
    from vllm import SamplingParams as Real

    real = Real()
    assert set(DEFAULTS) == set(SAMPLING_FIELDS)
    for name, default in DEFAULTS.items():
        assert getattr(real, name) == default, name
    ours = SamplingParams(temperature=0.0, max_tokens=3, stop=("x",))
    assert (ours.temperature, ours.max_tokens, ours.stop, ours.top_k) == (0.0, 3, ["x"], 0)
    with pytest.raises(TypeError, match="'temprature' is not a sampling setting"):
        SamplingParams(temprature=0.0)
    assert vllm_installed()  # here; the environment in test_serve.py has none


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def test_a_described_tree_rebuilds_with_the_same_names_classes_shapes_and_print():
    model = _tiny_llama()
    rebuilt = rebuild(describe(model))
    assert [name for name, _ in rebuilt.named_modules()] == [name for name, _ in model.named_modules()]
    for (_, ours), (_, theirs) in zip(rebuilt.named_modules(), model.named_modules()):
        assert type(ours).__name__ == type(theirs).__name__
    assert {n: (p.shape, p.dtype) for n, p in rebuilt.named_parameters()} == {
        n: (p.shape, p.dtype) for n, p in model.named_parameters()
    }
    assert all(p.is_meta for p in rebuilt.parameters())
    assert repr(rebuilt) == repr(model)
    with pytest.raises(RuntimeError, match="its forward runs on the server"):
        rebuilt.model.layers[0](torch.zeros(1))


@pytest.mark.parametrize(
    "entries, message",
    [
        ([], "no module tree"),
        ([{"path": "", "class": "os.system", "module": "m"}], "names a class"),
        ([{"path": "a.b", "class": "A", "module": "m"}], "before its parent"),
        ([{"path": "", "class": "A", "module": "m", "params": {"w": [[2], "os"]}}], "dtype"),
        ([{"path": "", "class": "A", "module": "m"}, {"path": "", "class": "A", "module": "m"}], "twice"),
        ([{"class": "A"}], "malformed"),
        (
            [{"path": "", "class": "A", "module": "m", "params": {"w": [[-1], "float32"]}}],
            "malformed parameter",
        ),
        ([{"path": "", "class": "A", "module": "m", "params": {"w": 3}}], "malformed parameter"),
    ],
)
def test_a_malformed_tree_is_refused(entries, message):
    with pytest.raises(TreeError, match=message):
        rebuild(entries)


def test_the_tokenizer_travels_as_its_files(smollm2_path):
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained(smollm2_path)
    # vLLM hands its tokenizer out as a subclass made at run time.
    original.__class__ = type("CachedTokenizer", (type(original),), {})
    copy = load_tokenizer(tokenizer_files(original))
    text = "The capital of France is Paris.<|im_end|>"
    assert copy.encode(text) == original.encode(text)
    assert copy.decode(original.encode(text)) == text
    assert copy.eos_token == original.eos_token
    assert load_tokenizer({}) is None
    with pytest.raises(TreeError, match="tokenizer file named"):
        load_tokenizer({"../x": ""})


def test_a_module_held_at_several_paths_is_one_module_in_the_rebuilt_tree_too():
    """vLLM shares one rotary embedding between every layer's attention. The
    workers' nnsight tree lists it at its first path only, so the client's must
    too: a block (or a copy of the tree) naming another path would not resolve
    there (``UnknownPersistentIdError`` on ``layers.1.self_attn.rotary_emb``)."""
    import nnsight

    model = _tiny_llama()
    shared = model.model.layers[0].self_attn.q_proj
    for layer in model.model.layers:
        layer.self_attn.shared = shared
    entries = describe(model)
    assert {"path": "model.layers.1.self_attn.shared", "same": "model.layers.0.self_attn.q_proj"} in entries
    rebuilt = rebuild(entries)
    assert rebuilt.model.layers[1].self_attn.shared is rebuilt.model.layers[0].self_attn.q_proj
    assert repr(rebuilt) == repr(model)
    paths = {envoy.path for envoy in nnsight.NNsight(rebuilt).modules()}
    assert paths == {envoy.path for envoy in nnsight.NNsight(model).modules()}
    with pytest.raises(TreeError, match="inside itself"):
        rebuild([*entries, {"path": "model.layers.0.self_attn.q_proj.loop", "same": "model.layers.0"}])
    with pytest.raises(TreeError, match="has not listed"):
        rebuild([*entries, {"path": "model.extra", "same": "model.nowhere"}])


class _HostileServer:
    """A loopback server that answers the tree route with a tokenizer that names
    Python of its own to run (``auto_map`` and a ``tokenization_evil.py``)."""

    def __init__(self, tokenizer: dict) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        document = json.dumps(
            {"version": 1, "model": "evil", "modules": describe(_tiny_llama()), "tokenizer": tokenizer}
        ).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(document)))
                self.end_headers()
                self.wfile.write(document)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def _evil_tokenizer(smollm2_path, canary, *, auto_map: bool, code: bool) -> dict:
    import base64
    import json
    from pathlib import Path

    files = {
        name: base64.b64encode((Path(smollm2_path) / name).read_bytes()).decode()
        for name in ("tokenizer.json", "chat_template.jinja")
    }
    config = json.loads((Path(smollm2_path) / "tokenizer_config.json").read_text())
    if auto_map:
        config["extra"] = {
            "nested": [{"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}]
        }
    files["tokenizer_config.json"] = base64.b64encode(json.dumps(config).encode()).decode()
    if code:
        evil = f"open({str(canary)!r}, 'w').write('ran')\nfrom transformers import PreTrainedTokenizerFast as EvilTokenizer\n"
        files["tokenization_evil.py"] = base64.b64encode(evil.encode()).decode()
    return files


@pytest.mark.parametrize(
    "auto_map, code, refused",
    [
        (True, True, "names code to run|not one a tokenizer"),
        (True, False, "names code to run"),
        (False, True, "not one a tokenizer"),
    ],
)
def test_a_server_cannot_make_the_client_run_its_code(smollm2_path, tmp_path, auto_map, code, refused):
    """``connect()`` takes a served model's tree and tokenizer from the server.
    Files a tokenizer is not saved as, or an ``auto_map`` anywhere in one, refuse
    the tokenizer with a clear error: transformers never gets to ask whether to
    run the server's Python, and nothing of the sent folder is imported."""
    import sys

    from vllm_nnsight_plugin.client.model import _ServedModel

    canary = tmp_path / "canary"
    hostile = _HostileServer(_evil_tokenizer(smollm2_path, canary, auto_map=auto_map, code=code))
    try:
        with pytest.raises(TreeError, match=refused):
            _ServedModel(hostile.url, "k" * 64).tree()
    finally:
        hostile.close()
    assert not canary.exists()
    assert not [name for name in sys.modules if "tokenization_evil" in name]


def test_a_clean_tokenizer_from_a_server_loads(smollm2_path, tmp_path):
    from vllm_nnsight_plugin.client.model import _ServedModel

    hostile = _HostileServer(_evil_tokenizer(smollm2_path, tmp_path / "c", auto_map=False, code=False))
    try:
        tree, tokenizer = _ServedModel(hostile.url, "k" * 64).tree()
    finally:
        hostile.close()
    assert tokenizer.decode(tokenizer.encode("Paris")) == "Paris" and len(tree.model.layers) == 2


def test_a_block_error_from_a_server_is_marked_as_the_servers_words():
    """A server (or whoever sits on plain HTTP between it and here) can send any
    text as a block's traceback: the client says where it came from."""
    from vllm_nnsight_plugin.client.remote import Server

    server = Server("http://127.0.0.1:9", "k" * 64)
    sent = {
        "type_name": "IndexError",
        "message": "out of range",
        "traceback": '  File "<block>", line 3\n',
        "is_control_flow": "yes",
    }
    marked = server._sent(sent)
    assert marked["type_name"] == "IndexError" and marked["is_control_flow"] is False
    assert marked["traceback"].startswith("[as sent by the server at http://127.0.0.1:9; not checked here]\n")
    from nnsight.intervention.errors import raise_deferred

    with pytest.raises(RuntimeError, match=r"(?s)IndexError: out of range.*as sent by the server at"):
        raise_deferred(marked)
    assert server._sent(None) is None
    assert server._sent("text")["type_name"] == "ServerError"
