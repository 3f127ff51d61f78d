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
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
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
        ([{"path": "", "class": "A", "module": "m", "params": {"w": [[-1], "float32"]}}], "malformed parameter"),
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
