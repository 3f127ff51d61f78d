"""Taps on what a module is handed: ``<module>.inputs`` taps each value its parent
hands it, where every call in the parent's forward hands the same plain values
(``self.attn(q, k, v)``). A block reading them (``attn.inputs``, ``attn.input``)
is served them at the sampler, together, in the order the forward reaches them
(before ``o_proj``'s input, though the parent makes ``o_proj`` first). On the
session engine, layer 10's attention inputs are taps; each read is checked bit
for bit against its Python twin (the same block with one more read of a location
that is not a tap)."""

from __future__ import annotations

import ast
import linecache
import textwrap

import pytest
import torch

from tests.engine.test_taps import PROMPT
from vllm_nnsight_plugin.taps.replay import served
from vllm_nnsight_plugin.taps.source import first_call, handed_positionally
from vllm_nnsight_plugin.taps.spec import TapError, input_site, module_of, resolve

NAMES = ["", "model", "model.layers", "model.layers.0", "model.layers.0.self_attn",
         "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.attn"]  # fmt: skip


def test_an_inputs_pattern_names_one_site_per_value_handed():
    sites = resolve(
        ["model.layers.*.self_attn.attn.inputs", "model.layers.0.output"], NAMES, None, lambda p: 3
    )
    assert sites == (
        "model.layers.0",
        "model.layers.0.self_attn.attn.inputs.0",
        "model.layers.0.self_attn.attn.inputs.1",
        "model.layers.0.self_attn.attn.inputs.2",
    )
    assert input_site(sites[2]) == ("model.layers.0.self_attn.attn", 1) and input_site(sites[0]) is None
    assert module_of(sites[3]) == "model.layers.0.self_attn.attn"

    def unknown(path):
        raise ValueError("handed other values on some call")

    with pytest.raises(TapError, match="handed other values on some call"):
        resolve(["model.layers.0.self_attn.attn.inputs"], NAMES, None, unknown)
    with pytest.raises(TapError, match="names no module"):
        resolve(["model.layers.0.nothing.inputs"], NAMES, None, lambda p: 1)


def _parent(body: str) -> type:
    source = "class Parent:\n    def forward(self, x, y=None):\n" + textwrap.indent(body, " " * 8)
    ast.parse(source)
    name = f"<parent {abs(hash(source))}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    namespace: dict = {}
    exec(compile(source, name, "exec"), namespace)
    return namespace["Parent"]


def test_what_a_child_is_handed_is_known_only_where_every_call_hands_the_same():
    assert handed_positionally(_parent("return self.attn(x, x, y)\n"), "attn") == 3
    assert handed_positionally(_parent("a = self.attn(x, y)\nreturn self.attn(a, y)\n"), "attn") == 2
    assert handed_positionally(_parent("a = self.attn(x)\nreturn self.attn(a, y)\n"), "attn") is None
    assert handed_positionally(_parent("return self.attn(x, scale=2)\n"), "attn") is None  # a keyword
    assert handed_positionally(_parent("return self.attn(*x)\n"), "attn") is None
    assert handed_positionally(_parent("f = self.attn\nreturn f(x)\n"), "attn") is None
    assert handed_positionally(_parent("return self.attn()\n"), "attn") is None  # nothing handed
    parent = _parent("h = self.o(x)\nz = self.attn(h, h, h)\nreturn self.o(z)\n")
    assert first_call(parent, "o") < first_call(parent, "attn") and first_call(parent, "v") is None


def test_inputs_are_served_once_together_in_the_order_of_the_parents_calls():
    class Tables:
        sites = ("model.layers.0", "model.layers.0.self_attn.source.attn_0",
                 "model.layers.0.self_attn.attn.inputs.0", "model.layers.0.self_attn.attn.inputs.1")  # fmt: skip
        pair_sites = frozenset({0})
        first_sites = frozenset()
        handed = {"model.layers.0.self_attn.o_proj": 1}
        inputs = {"model.layers.0.self_attn.attn": (2, 3)}
        # o_proj is made first and called last
        reached = {"model.layers.0.self_attn.attn": (9, 8), "model.layers.0.self_attn.o_proj": (10, 8)}

    assert served([3, 2, 1, 0], Tables) == [
        (2, "model.layers.0.self_attn.attn.input", "handed"),
        (1, "model.layers.0.self_attn.o_proj.input", "one"),
        (0, "model.layers.0.output", "pair"),
    ]


def stats(llm) -> dict:
    (found,) = llm.collective_rpc("nnsight_stats")
    return found


def attention_each_step(model, twin: bool):
    """Layer 10's query, key and value, its query again as ``.input``, and the
    heads' output, at each of three steps."""
    with model.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        qs, ks, vs, firsts, heads = (list().save() for _ in range(5))
        for _ in tracer.iter[:3]:
            if twin:
                model.model.layers[3].output[0].clone()  # no tap: the block runs as Python
            attention = model.model.layers[10].self_attn
            (q, k, v), _ = attention.attn.inputs
            qs.append(q.clone())
            ks.append(k.clone())
            vs.append(v.clone())
            firsts.append(attention.attn.input.clone())
            heads.append(attention.o_proj.input.clone())
        result = tracer.result.save()
    return (qs, ks, vs, firsts, heads), result


def test_attentions_inputs_are_served_at_the_sampler_bit_for_bit(smollm2_llm, smol):
    smol.generate(PROMPT, max_tokens=1)  # what a tap's value is is known once a forward ran through it
    before = stats(smollm2_llm)["taps_served_at_sampler"]
    got, result = attention_each_step(smol, twin=False)
    assert result.nnsight_path["form"] == "replay", result.nnsight_path
    assert stats(smollm2_llm)["taps_served_at_sampler"] - before == 6  # inputs and o_proj's, three steps
    want, want_result = attention_each_step(smol, twin=True)
    assert want_result.nnsight_path["lowered"] is False
    rows = len(smol.tokenizer(PROMPT)["input_ids"])
    assert [tuple(t.shape) for t in got[0]] == [(rows, 576), (1, 576), (1, 576)]
    assert tuple(got[1][0].shape) == tuple(got[2][0].shape) == (rows, 192)
    for kept, expected in zip(got, want):
        assert len(kept) == len(expected) == 3
        for a, b in zip(kept, expected):
            assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(got[0], got[3]))  # ``.input`` is the first value
    assert list(result.outputs[0].token_ids) == list(want_result.outputs[0].token_ids)
