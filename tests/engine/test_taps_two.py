"""Taps whose value is two values by how their parent calls them, not by their own
forward: the final norm (``hidden, _ = self.norm(hidden, residual)``: a pair) and
layer 4's ``qkv_proj`` (``qkv, _ = self.qkv_proj(x)``: the output and no bias),
both on the session engine. What the tap has seen says which of the two each is;
reads are served at the sampler and an edit of the norm's pair runs in the
forward, each bit for bit against its Python twin (the same block with one more
read of a location that is not a tap)."""

from __future__ import annotations

import ast
import textwrap

import torch

from tests.engine.test_taps import PROMPT, same_generation
from vllm_nnsight_plugin.taps.source import unpacked_in_two

QKV = 576 + 192 + 192


def stats(llm) -> dict:
    (found,) = llm.collective_rpc("nnsight_stats")
    return found


def read_each_step(model, twin: bool):
    """The final norm's value (both) and layer 4's fused projections, each step."""
    with model.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        normed, streams, qkvs = list().save(), list().save(), list().save()
        for _ in tracer.iter[:3]:
            if twin:
                model.model.layers[3].output[0].clone()  # no tap: the block runs as Python
            qkvs.append(model.model.layers[4].self_attn.qkv_proj.output[0].clone())
            hidden, residual = model.model.norm.output
            normed.append(hidden.clone())
            streams.append((hidden + residual)[-1])
        result = tracer.result.save()
    return normed, streams, qkvs, result


def test_the_final_norm_and_a_fused_projection_are_served_bit_for_bit(smollm2_llm, smol):
    smol.generate(PROMPT, max_tokens=1)  # what a tap's value is is known once a forward ran through it
    before = stats(smollm2_llm)["taps_served_at_sampler"]
    normed, streams, qkvs, result = read_each_step(smol, twin=False)
    assert result.nnsight_path["form"] == "replay", result.nnsight_path
    assert stats(smollm2_llm)["taps_served_at_sampler"] - before == 6  # two taps, three steps
    want = read_each_step(smol, twin=True)
    assert want[3].nnsight_path["lowered"] is False
    assert tuple(qkvs[0].shape) == (len(smol.tokenizer(PROMPT)["input_ids"]), QKV)
    assert tuple(qkvs[1].shape) == (1, QKV) and tuple(streams[0].shape) == (576,)
    for got, expected in zip((normed, streams, qkvs), want[:3]):
        assert len(got) == len(expected) == 3
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
    assert list(result.outputs[0].token_ids) == list(want[3].outputs[0].token_ids)


def pushed(model, twin: bool):
    """The final norm's output pushed along one direction on every step."""
    push = torch.zeros(576)
    push[7] = 40.0
    with model.trace(PROMPT, temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        for _ in tracer.iter[:3]:
            if twin:
                model.model.layers[3].output[0].clone()
            model.model.norm.output[0][:] += push
        result = tracer.result.save()
    return result


def test_an_edit_of_the_final_norm_runs_in_the_forward_bit_for_bit(smollm2_llm, smol):
    (plain,) = smol.generate(PROMPT, temperature=0.0, max_tokens=3, logprobs=3)
    before = stats(smollm2_llm)
    got = pushed(smol, twin=False)
    after = stats(smollm2_llm)
    want = pushed(smol, twin=True)
    assert got.nnsight_path["lowered"] is True, got.nnsight_path
    assert after["lowered"] - before["lowered"] == 1 and after["python_blocks"] == before["python_blocks"]
    assert want.nnsight_path["lowered"] is False
    same_generation([got], [want])
    moved = {t: p.logprob for t, p in got.outputs[0].logprobs[0].items()}
    assert moved != {t: p.logprob for t, p in plain.outputs[0].logprobs[0].items()}


def _parent(body: str) -> type:
    """A class whose forward is ``body``, its source readable by ``inspect``."""
    namespace: dict = {}
    source = "class Parent:\n    def forward(self, x, residual=None):\n" + textwrap.indent(body, " " * 8)
    ast.parse(source)
    import linecache

    name = f"<parent {abs(hash(source))}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    exec(compile(source, name, "exec"), namespace)
    return namespace["Parent"]


def test_a_child_is_two_values_only_where_every_call_unpacks_it_in_two():
    assert unpacked_in_two(_parent("x, _ = self.norm(x, residual)\nreturn x\n"), "norm")
    assert unpacked_in_two(_parent("a, b = self.proj(x)\nc, d = self.proj(a)\nreturn c\n"), "proj")
    assert not unpacked_in_two(_parent("return self.norm(x)\n"), "norm")  # one value
    assert not unpacked_in_two(_parent("x, _ = self.norm(x, residual)\ny = self.norm(x)\nreturn y\n"), "norm")
    assert not unpacked_in_two(_parent("a, b, c = self.proj(x)\nreturn a\n"), "proj")  # three
    assert not unpacked_in_two(_parent("a, *b = self.proj(x)\nreturn a\n"), "proj")
    assert not unpacked_in_two(_parent("f = self.norm\na, b = f(x)\nreturn a\n"), "norm")  # named
    assert not unpacked_in_two(_parent("a, b = self.norm(x)\nreturn self.norm\n"), "norm")
    assert not unpacked_in_two(_parent("return x\n"), "norm")  # never called
    assert not unpacked_in_two(_parent("(a, b), c = self.proj(x)\nreturn a\n"), "proj")
