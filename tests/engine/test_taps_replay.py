"""Blocks that only read a tap, whatever they compute from it, are served the tap's
rows at the sampler while the forward stays compiled (``taps/replay.py``); each
is checked bit for bit against its Python twin on the session's tapped engine:
the same block with one more read of a location that is not a tap, which sends
it down the Python path and changes nothing it computes."""

from __future__ import annotations

import torch

from tests.engines import BATCHED, assert_batched_close
from vllm_nnsight_plugin.taps.lower import Unlowered
from vllm_nnsight_plugin.taps.replay import replayable

PROMPTS = ["The capital of France is", "Water boils at"]
REPLAY = {"lowered": True, "form": "replay", "reason": None}


def stats(llm) -> dict:
    (found,) = llm.collective_rpc("nnsight_stats")
    return found


def stream_and_token(model, twin: bool):
    """The docs' first read: the residual stream leaving layer 20 and the drawn token."""
    if twin:
        return stream_and_token_as_python(model)
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke(PROMPTS[0]):
            s0 = sum(model.model.layers[20].output).save()
            t0 = model.logits.argmax(-1).save()
            r0 = tracer.result.save()
        with tracer.invoke(PROMPTS[1]):
            s1 = sum(model.model.layers[20].output).save()
            t1 = model.logits.argmax(-1).save()
            r1 = tracer.result.save()
    return [s0, s1], [t0, t1], [r0, r1]


def stream_and_token_as_python(model):
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke(PROMPTS[0]):
            model.model.layers[5].output[0].clone()  # not a tap: Python
            s0 = sum(model.model.layers[20].output).save()
            t0 = model.logits.argmax(-1).save()
            r0 = tracer.result.save()
        with tracer.invoke(PROMPTS[1]):
            model.model.layers[5].output[0].clone()
            s1 = sum(model.model.layers[20].output).save()
            t1 = model.logits.argmax(-1).save()
            r1 = tracer.result.save()
    return [s0, s1], [t0, t1], [r0, r1]


def norms_each_step(model, twin: bool, steps: int = 4):
    if not twin:
        with model.trace(PROMPTS[0], temperature=0.0, max_tokens=steps) as tracer:
            norms = list().save()
            for _ in tracer.iter[:steps]:
                out = model.model.layers[10].output
                norms.append((out[0] + out[1]).float().norm(dim=-1))
            result = tracer.result.save()
        return norms, result
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=steps) as tracer:
        norms = list().save()
        for _ in tracer.iter[:steps]:
            model.model.layers[5].output[0].clone()
            out = model.model.layers[10].output
            norms.append((out[0] + out[1]).float().norm(dim=-1))
        result = tracer.result.save()
    return norms, result


def test_a_read_with_computation_is_served_at_the_sampler_and_equals_python(smollm2_llm, smol):
    before = stats(smollm2_llm)
    streams, tokens, results = stream_and_token(smol, twin=False)
    after = stats(smollm2_llm)
    assert after["lowered_by"]["replay"] - before["lowered_by"]["replay"] == 2
    # once per step at the sampler, both requests' rows in one value where they share it
    assert after["taps_served_at_sampler"] - before["taps_served_at_sampler"] in (1, 2)
    assert after["uncompiled_steps"] == before["uncompiled_steps"]
    assert after["python_blocks"] == before["python_blocks"]
    assert all(r.nnsight_path == REPLAY for r in results)
    want_streams, want_tokens, want_results = stream_and_token(smol, twin=True)
    assert stats(smollm2_llm)["python_blocks"] - after["python_blocks"] == 2
    for got, want in zip(streams, want_streams):
        assert got.shape == want.shape and got.shape[0] > 1  # every prompt row
        assert_batched_close(got, want)  # two requests: batched either way
    assert [t.tolist() for t in tokens] == [t.tolist() for t in want_tokens]
    for got, want in zip(results, want_results):
        assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
    assert stats(smollm2_llm)["tracked"] == 0 and stats(smollm2_llm)["lowered_now"] == 0


def test_a_loop_of_reads_is_served_every_step_and_equals_python_bit_for_bit(smollm2_llm, smol):
    before = stats(smollm2_llm)["taps_served_at_sampler"]
    norms, result = norms_each_step(smol, twin=False)
    assert result.nnsight_path == REPLAY
    assert stats(smollm2_llm)["taps_served_at_sampler"] - before == 4
    want, want_result = norms_each_step(smol, twin=True)
    assert len(norms) == len(want) == 4
    assert norms[0].shape[0] == want[0].shape[0] > 1 and all(n.shape == (1,) for n in norms[1:])
    for got, expected in zip(norms, want):
        assert torch.equal(got, expected)
    assert list(result.outputs[0].token_ids) == list(want_result.outputs[0].token_ids)
    # The same block again: what it reads is remembered by its bytes, and it is
    # served the same way with the same values.
    again, again_result = norms_each_step(smol, twin=False)
    assert again_result.nnsight_path == REPLAY
    for got, expected in zip(again, norms):
        assert torch.equal(got, expected)


def two_layers(model, twin: bool):
    if not twin:
        with model.trace(PROMPTS[1], temperature=0.0, max_tokens=3) as tracer:
            moved = list().save()
            for _ in tracer.iter[:3]:
                early = model.model.layers[10].output
                stream = early[0] + early[1]  # a copy, made before the next layer runs
                late = model.model.layers[20].output
                moved.append(((late[0] + late[1]) - stream).norm(dim=-1))
            result = tracer.result.save()
        return moved, result
    with model.trace(PROMPTS[1], temperature=0.0, max_tokens=3) as tracer:
        moved = list().save()
        for _ in tracer.iter[:3]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            early = model.model.layers[10].output
            stream = early[0] + early[1]
            late = model.model.layers[20].output
            moved.append(((late[0] + late[1]) - stream).norm(dim=-1))
        result = tracer.result.save()
    return moved, result


def test_a_block_reading_two_taps_is_served_both_in_model_order_bit_for_bit(smollm2_llm, smol):
    before = stats(smollm2_llm)["taps_served_at_sampler"]
    moved, result = two_layers(smol, twin=False)
    assert result.nnsight_path == REPLAY
    assert stats(smollm2_llm)["taps_served_at_sampler"] - before == 6  # two taps, three steps
    want, want_result = two_layers(smol, twin=True)
    assert len(moved) == len(want) == 3
    for got, expected in zip(moved, want):
        assert torch.equal(got, expected)
    assert list(result.outputs[0].token_ids) == list(want_result.outputs[0].token_ids)


def four_taps(model, twin: bool):
    """What a module is handed (``o_proj.input``, the tapped attention's output), a
    module's one tensor (layer 12's MLP) and two layers' pairs, each step: served
    in the order the forward reaches them."""
    with model.trace(PROMPTS[1], temperature=0.0, max_tokens=3) as tracer:
        seen = list().save()
        for _ in tracer.iter[:3]:
            if twin:
                model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            heads = model.model.layers[10].self_attn.o_proj.input[-1].clone()
            early = model.model.layers[10].output
            stream = (early[0] + early[1]).clone()
            mlp = model.model.layers[12].mlp.output.clone()
            late = model.model.layers[20].output[0].clone()
            seen.append((heads, stream, mlp.norm(dim=-1), late))
        result = tracer.result.save()
    return seen, result


def test_what_a_module_is_handed_and_a_tensor_tap_are_served_in_order_bit_for_bit(smollm2_llm, smol):
    before = stats(smollm2_llm)["taps_served_at_sampler"]
    seen, result = four_taps(smol, twin=False)
    assert result.nnsight_path == REPLAY
    assert stats(smollm2_llm)["taps_served_at_sampler"] - before == 12  # four taps, three steps
    want, want_result = four_taps(smol, twin=True)
    assert want_result.nnsight_path["lowered"] is False
    assert len(seen) == len(want) == 3 and seen[0][1].shape[0] > 1
    for got, expected in zip(seen, want):
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b)
    assert list(result.outputs[0].token_ids) == list(want_result.outputs[0].token_ids)


def test_served_in_the_order_the_forward_reaches_them():
    """A module's input before its children's locations, its output after them;
    otherwise the tree's order; an operation's site served as its child's input."""
    from vllm_nnsight_plugin.taps.replay import served

    class Tables:
        sites = ("model.embed_tokens", "model.layers.0", "model.layers.0.self_attn.source.attn_0",
                 "model.layers.0.mlp", "model.layers.1", "model.norm")  # fmt: skip
        pair_sites = frozenset({1, 4})
        first_sites = frozenset({5})
        handed = {"model.layers.0.self_attn.o_proj": 2}

    assert served([5, 4, 3, 2, 1, 0], Tables) == [
        (0, "model.embed_tokens.output", "one"),
        (2, "model.layers.0.self_attn.o_proj.input", "one"),
        (3, "model.layers.0.mlp.output", "one"),
        (1, "model.layers.0.output", "pair"),
        (4, "model.layers.1.output", "pair"),
        (5, "model.norm.output", "first"),
    ]


def test_beside_a_python_block_the_forward_serves_it_and_nothing_is_served_twice(smollm2_llm, smol):
    """A step with a Python block runs the forward as Python: the replayed block is
    served there, and not again at the sampler (which would move it a step on)."""
    before = stats(smollm2_llm)["taps_served_at_sampler"]
    with smol.trace(temperature=0.0, max_tokens=3) as tracer:
        with tracer.invoke(PROMPTS[0]):
            norms = list().save()
            for _ in tracer.iter[:3]:
                out = smol.model.layers[10].output
                norms.append((out[0] + out[1]).float().norm(dim=-1))
            served = tracer.result.save()
        with tracer.invoke(PROMPTS[1]):
            for _ in tracer.iter[:3]:
                smol.model.layers[5].output[0].clone()
    assert served.nnsight_path == REPLAY
    # The two requests of one trace share their steps once both are in (the first
    # may run alone): on a shared step the forward served the tap.
    assert stats(smollm2_llm)["taps_served_at_sampler"] - before < 3
    want, _ = norms_each_step(smol, twin=True, steps=3)
    assert len(norms) == 3
    for got, expected in zip(norms, want):
        torch.testing.assert_close(got, expected, **BATCHED)  # batched otherwise


def encode(stream, features):
    """An SAE encoder as the docs' page writes one: a helper of the user's."""
    return torch.relu(stream.float() @ features["encoder"].to(stream.device))


def features_each_step(model, features, twin: bool):
    if not twin:
        with model.trace(PROMPTS[1], temperature=0.0, max_tokens=3) as tracer:
            top = list().save()
            for _ in tracer.iter[:3]:
                out = model.model.layers[10].output
                top.append(encode(out[0] + out[1], features).topk(3, dim=-1).values)
            result = tracer.result.save()
        return top, result
    with model.trace(PROMPTS[1], temperature=0.0, max_tokens=3) as tracer:
        top = list().save()
        for _ in tracer.iter[:3]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            out = model.model.layers[10].output
            top.append(encode(out[0] + out[1], features).topk(3, dim=-1).values)
        result = tracer.result.save()
    return top, result


def zero_first(h):
    h[0] = 0
    return h


def test_a_helper_that_only_computes_is_served_with_its_block_bit_for_bit(smollm2_llm, smol):
    """A captured function is read from its source: one that writes nothing and
    reaches nothing of the model keeps its block at the sampler."""
    torch.manual_seed(0)
    features = {"encoder": torch.randn(576, 64)}
    top, result = features_each_step(smol, features, twin=False)
    assert result.nnsight_path == REPLAY
    want, want_result = features_each_step(smol, features, twin=True)
    assert len(top) == len(want) == 3 and top[0].shape[0] > 1
    for got, expected in zip(top, want):
        assert torch.equal(got, expected)
    assert list(result.outputs[0].token_ids) == list(want_result.outputs[0].token_ids)
    with smol.trace(PROMPTS[1], temperature=0.0, max_tokens=1) as tracer:
        out = smol.model.layers[10].output
        zero_first(out[0] + out[1]).norm().save()  # a copy: but the helper writes
        written = tracer.result.save()
    assert not written.nnsight_path["lowered"] and written.nnsight_path["reason"]


def lens_by_hand(model, twin: bool):
    """The performance page's lens, written out: the final norm's weight and
    epsilon, and the unembedding's weight, read inside the block."""
    if not twin:
        with model.trace(PROMPTS[0], temperature=0.0, max_tokens=2) as tracer:
            tops = list().save()
            for _ in tracer.iter[:2]:
                hidden, residual = model.model.layers[20].output
                stream = hidden[-1:] + residual[-1:]
                norm = model.model.norm
                scale = torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                tops.append(((stream * scale * norm.weight) @ model.lm_head.weight.T).topk(5, dim=-1))
            result = tracer.result.save()
        return tops, result
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=2) as tracer:
        tops = list().save()
        for _ in tracer.iter[:2]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            hidden, residual = model.model.layers[20].output
            stream = hidden[-1:] + residual[-1:]
            norm = model.model.norm
            scale = torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            tops.append(((stream * scale * norm.weight) @ model.lm_head.weight.T).topk(5, dim=-1))
        result = tracer.result.save()
    return tops, result


def test_what_modules_hold_is_read_at_the_sampler_bit_for_bit(smollm2_llm, smol):
    tops, result = lens_by_hand(smol, twin=False)
    assert result.nnsight_path == REPLAY
    want, want_result = lens_by_hand(smol, twin=True)
    assert len(tops) == len(want) == 2
    for got, expected in zip(tops, want):
        assert torch.equal(got.values, expected.values) and torch.equal(got.indices, expected.indices)
    assert list(result.outputs[0].token_ids) == list(want_result.outputs[0].token_ids)


def test_what_is_not_served_at_the_sampler_runs_as_python(smollm2_llm, smol):
    """A write, a module used other than by a call, the model's config, a loop over
    the layers (not every one a tap here): each stays on the Python path."""
    paths = []
    with smol.trace(PROMPTS[0], temperature=0.0, max_tokens=1) as tracer:
        out = smol.model.layers[10].output
        out[0][:] = out[0] * 1.0
        paths.append(tracer.result.save())
    with smol.trace(PROMPTS[0], temperature=0.0, max_tokens=1) as tracer:
        str(smol.model.layers[3].self_attn)  # a module, other than called
        smol.model.layers[10].output[0].norm().save()
        paths.append(tracer.result.save())
    with smol.trace(PROMPTS[0], temperature=0.0, max_tokens=1) as tracer:
        (smol.model.layers[10].output[0] * smol.config.hidden_size).save()
        paths.append(tracer.result.save())
    with smol.trace(PROMPTS[0], temperature=0.0, max_tokens=1) as tracer:
        for layer in smol.model.layers:
            layer.output[0].norm().save()
        paths.append(tracer.result.save())
    for i, result in enumerate(paths):
        assert not result.nnsight_path["lowered"] and result.nnsight_path["reason"], i


def lens(model, twin: bool):
    """The docs' logit lens at a tap, every step: the norm and the unembedding called
    inside the block."""
    if not twin:
        with model.trace(PROMPTS[0], temperature=0.0, max_tokens=3) as tracer:
            guesses = list().save()
            for _ in tracer.iter[:3]:
                out = model.model.layers[20].output
                logits = model.logits_processor(model.lm_head, model.model.norm(out[0] + out[1]))
                guesses.append(logits.float().log_softmax(-1).max(-1))
            result = tracer.result.save()
        return guesses, result
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=3) as tracer:
        guesses = list().save()
        for _ in tracer.iter[:3]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            out = model.model.layers[20].output
            logits = model.logits_processor(model.lm_head, model.model.norm(out[0] + out[1]))
            guesses.append(logits.float().log_softmax(-1).max(-1))
        result = tracer.result.save()
    return guesses, result


def test_the_logit_lens_at_a_tap_is_served_at_the_sampler_bit_for_bit(smollm2_llm, smol):
    """Modules called inside the block run at the sampler as they run in a Python
    step: the same values."""
    guesses, result = lens(smol, twin=False)
    assert result.nnsight_path == REPLAY
    want, want_result = lens(smol, twin=True)
    assert len(guesses) == len(want) == 3 and guesses[0].values.shape[0] > 1
    for got, expected in zip(guesses, want):
        assert torch.equal(got.values, expected.values) and torch.equal(got.indices, expected.indices)
    assert list(result.outputs[0].token_ids) == list(want_result.outputs[0].token_ids)


def test_replayable_reads_the_block_not_its_spelling(smollm2_llm, smol):
    """The check alone, on stand-in tables and modules: the tap is found through a
    captured envoy or index, modules are called or handed to a module, and
    anything else on the model is named."""
    import nnsight

    class Tables:
        sites = ("model.layers.10", "model.layers.10.self_attn.source.attn_0", "model.layers.12.mlp",
                 "model.layers.20")  # fmt: skip
        site_of = {name: i for i, name in enumerate(sites)}
        tuple_sites = frozenset({0, 3})
        handed = {"model.layers.10.self_attn.o_proj": 1}

    attention = torch.nn.Linear(2, 2)
    attention.kv_cache = [torch.zeros(1)]  # as vLLM's attention layers hold theirs
    modules = {
        "model.norm": torch.nn.LayerNorm(2),
        "lm_head": torch.nn.Linear(2, 2),
        "logits_processor": torch.nn.Identity(),
        "model.layers.3.self_attn": attention,
    }
    layer = 20
    scope = {"model": smol, "layer": layer, "block": smol.model.layers[10], "nnsight": nnsight}

    def check(source):
        return replayable(source, scope, smol, Tables, modules.get)

    assert check("x = sum(model.model.layers[layer].output).save()") == (3,)
    assert check("x = block.output[0].norm().save()") == (0,)
    assert check("t = model.logits.argmax(-1).save()\nx = block.output") == (0,)
    two = "a = model.model.layers[20].output[0] * 1.0\nb = block.output[1]\nx = (a - b).save()"
    assert check(two) == (0, 3)  # in model order
    lens = "x = model.logits_processor(model.lm_head, model.model.norm(block.output[0])).save()"
    assert check(lens) == (0,)
    not_a_tap = check("x = model.model.layers[3].output[0].save()")
    assert isinstance(not_a_tap, Unlowered) and not_a_tap.kind == "not_a_tap"
    attends = check("x = model.model.layers[3].self_attn(block.output[0])")
    assert isinstance(attends, Unlowered) and "needs the forward" in attends.reason
    # What a module holds is read as the Python path reads it; a module named once
    # by the block's own name stands for it.
    assert check("x = block.output[0] @ model.lm_head.weight.T") == (0,)
    assert check("x = block.output[0] * model.model.norm.eps") == (0,)
    held = "norm = model.model.norm\nx = norm(block.output[0] * 1.0) * norm.weight"
    assert check(held) == (0,)
    method = check("x = block.output[0] * model.model.norm.forward")
    assert isinstance(method, Unlowered) and "other than through a tap" in method.reason
    twice = check("norm = model.model.norm\nnorm = None\nx = block.output[0]")
    assert isinstance(twice, Unlowered) and "other than by calling it" in twice.reason
    named = check("a = model.model.layers[3].self_attn\nx = a(block.output[0] * 1.0)")
    assert isinstance(named, Unlowered) and "needs the forward" in named.reason
    handed = check("x = block.output[0]\nprint(model.lm_head)")
    assert isinstance(handed, Unlowered) and "other than by calling it" in handed.reason
    entered = check("x = block.output[0]\ny = model.model.layers[3].input")
    assert isinstance(entered, Unlowered) and entered.kind == "not_a_tap"
    # What a module is handed, where that is a tap's value; a module's one tensor;
    # never an operation's value read as itself, nor a module's whole inputs.
    assert check("x = model.model.layers[10].self_attn.o_proj.input[-1].clone().save()") == (1,)
    assert check("x = model.model.layers[12].mlp.output.norm().save()") == (2,)
    found = check("x = model.model.layers[10].self_attn.source.attn_0.output.save()")
    assert isinstance(found, Unlowered) and found.kind == "form"
    found = check("x = model.model.layers[10].self_attn.o_proj.inputs")  # its inputs are no taps
    assert isinstance(found, Unlowered) and found.kind == "not_a_tap" and "o_proj.inputs" in found.reason
    no_modules = replayable(lens, scope, smol, Tables)
    assert isinstance(no_modules, Unlowered)
    # A module reached other than by name from the model: never served, since its
    # reads would not be known.
    captured = {**scope, "chosen": [smol.model.layers[20]], "pick": lambda: None}
    for source in (
        "for layer in chosen:\n    x = layer.output[0].save()",
        "x = chosen[0].output[0].save()",
        "x = block.output[0]\ny = pick().output",
    ):
        found = replayable(source, captured, smol, Tables, modules.get)
        assert isinstance(found, Unlowered) and found.kind == "form", source


def test_a_loop_over_the_layers_is_served_every_layer(smollm2_llm, smol):
    """``for layer in model.model.layers`` (or a comprehension over them) names each
    layer: all must be taps, and the loop's name is used through ``output`` only."""

    class Tables:
        site_of = {"model.layers.0": 0, "model.layers.1": 1, "model.layers.0.mlp": 2, "model.layers.1.mlp": 3}
        tuple_sites = frozenset({0, 1})
        handed = {"model.layers.0.self_attn.o_proj": 4, "model.layers.1.self_attn.o_proj": 5}

    modules = {"model.layers": torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Identity()])}
    modules["model.norm"] = torch.nn.LayerNorm(2)
    scope = {"model": smol}

    def check(source):
        return replayable(source, scope, smol, Tables, modules.get)

    assert check("for layer in model.model.layers:\n    x = layer.output[0].norm().save()") == (0, 1)
    assert check("x = [(l.output[0] + l.output[1])[-1] for l in model.model.layers]") == (0, 1)
    lens = "for layer in model.model.layers:\n    x = model.model.norm(layer.output[0]).save()"
    assert check(lens) == (0, 1)
    # a module of each layer: its output, or what it is handed
    assert check("for layer in model.model.layers:\n    x = layer.mlp.output.norm().save()") == (2, 3)
    handed = "x = [l.self_attn.o_proj.input[-1].clone() for l in model.model.layers]"
    assert check(handed) == (4, 5)
    for source in (
        "for layer in model.model.layers:\n    x = layer.self_attn.output.save()",  # not a tap
        "for layer in model.model.layers:\n    x = layer.output[0]\nlayer = 3",  # rebound
        "for layer in model.model.layers:\n    x = layer.mlp.source.act_0.output",
        "for layer in model.model.layers:\n    x = layer.mlp[0].output",
    ):
        found = check(source)
        assert isinstance(found, Unlowered), source
    fewer = Tables()
    fewer.site_of = {"model.layers.0": 0}
    fewer.handed = {}
    missing = replayable(
        "for layer in model.model.layers:\n    x = layer.output", scope, smol, fewer, modules.get
    )
    assert isinstance(missing, Unlowered) and missing.kind == "not_a_tap"


def test_a_served_block_keeps_each_step_at_the_start_of_a_region_per_tap():
    """The tables alone: a request served at the sampler takes an entry and a region
    at each tap it reads; each step's rows land at the start of each region (over
    the step before's), as the two outputs in turn; both regions come back."""
    from tests.engine.test_taps import bounds
    from vllm_nnsight_plugin.taps.install import Lowered, TapTables
    from vllm_nnsight_plugin.taps.kept import step_rows
    from vllm_nnsight_plugin.taps.ops import KEEP_BOTH

    tables = TapTables(
        ("model.layers.0", "model.layers.1"), max_tokens=8, hidden=3, entries=4, device="cpu", store_size=64
    )
    served = Lowered(0, 0, None, None, code=KEEP_BOTH, replay=True)
    assert tables.add("s", served, room=2 * 6, also=(1,))
    assert [site for site, _ in served.regions] == [0, 1] and len(tables.free) == 2
    assert not tables.add("big", Lowered(0, 0, None, None, code=KEEP_BOTH, replay=True), room=40, also=(1,))
    assert tables.regions.free_rows() == 63 - 2 * 12  # the failed add gave its region back
    for req_ids, starts, counts in [(["p", "s"], [0, 2], [2, 4]), (["s", "p"], [0, 1], [1, 1])]:
        tables.fill(req_ids, bounds(starts, counts))
        values = {}
        for site in (0, 1):
            hidden, residual = torch.randn(8, 3), torch.randn(8, 3)
            torch.ops.vllm_nnsight.keep(hidden, residual, tables.codes, tables.dest, tables.store, site)
            values[site] = (hidden, residual)
        mine = starts[req_ids.index("s")]
        count = counts[req_ids.index("s")]
        for site, base in served.regions:
            first, second = step_rows(base, tables.store, count, 3)
            assert torch.equal(first, values[site][0][mine : mine + count])
            assert torch.equal(second, values[site][1][mine : mine + count])
    lowered, forwards = tables.forget("s")
    assert forwards == 2 and tables.saves(lowered) == {} and not tables.overflowed(lowered)
    tables.release(lowered)
    assert tables.regions.free_rows() == 63 and len(tables.free) == 4


def test_a_served_tap_wider_than_the_store_keeps_each_row_over_several_of_its_rows():
    """A tap 7 wide beside a store 3 wide (an MLP's neurons beside the hidden state):
    once its width is seen, a served request's entry there takes 2 x 3 rows of the
    store per token row, and each step's rows read back whole."""
    from tests.engine.test_taps import bounds
    from vllm_nnsight_plugin.taps.install import Lowered, TapTables
    from vllm_nnsight_plugin.taps.kept import step_rows
    from vllm_nnsight_plugin.taps.ops import KEEP_BOTH

    tables = TapTables(
        ("model.layers.0.mlp.act_fn",), max_tokens=8, hidden=3, entries=4, device="cpu", store_size=64
    )
    assert tables.replay_stride(0) == 2  # its width is not known yet: the hidden state's
    torch.ops.vllm_nnsight.steer(
        torch.zeros(8, 7), torch.zeros(8, 7), tables.slots, tables.bank, tables.how, 0
    )
    assert tables.width(0) == 7 and tables.replay_stride(0) == 6
    served = Lowered(0, 0, None, None, code=KEEP_BOTH, replay=True)
    assert tables.add("s", served, room=6 * 4)
    for starts, counts in [([0, 2], [2, 4]), ([0, 1], [1, 1])]:
        tables.fill(["p", "s"], bounds(starts, counts))
        neurons = torch.randn(8, 7)
        torch.ops.vllm_nnsight.keep(neurons, neurons, tables.codes, tables.dest, tables.store, 0)
        first, second = step_rows(served.base, tables.store, counts[1], 7)
        assert torch.equal(first, neurons[starts[1] : starts[1] + counts[1]]) and torch.equal(first, second)
    lowered, _ = tables.forget("s")
    tables.release(lowered)
    assert tables.regions.free_rows() == 63


def test_what_could_see_a_buffer_the_next_layer_overwrites_is_not_served(smollm2_llm, smol):
    """On the Python path a tap's value is the step's own buffer, which the next
    layer of a Python step may overwrite in place (vLLM's fused residual add and
    norm on a GPU); served at the sampler it is a copy. So a block is served only
    where the two cannot differ: no view of a tap's value used after a later
    location is read, kept past its statement, or handed to a call that may keep
    or write it; and no cache, and no layer named by a name the block binds."""
    import nnsight

    class Tables:
        site_of = {"model.layers.10": 0, "model.layers.20": 3}
        tuple_sites = frozenset({0, 3})

    modules = {"model.norm": torch.nn.LayerNorm(2), "lm_head": torch.nn.Linear(2, 2)}
    modules["logits_processor"] = torch.nn.Identity()
    scope = {"model": smol, "i": 10, "torch": torch, "nnsight": nnsight, "keep": print}

    def check(source):
        return replayable(source, scope, smol, Tables, modules.get)

    served = [
        "out = model.model.layers[20].output\nx = model.logits_processor(model.lm_head, model.model.norm(out[0] + out[1])).save()",
        "h = model.model.layers[10].output[0]\nn = h.norm()\nlate = model.model.layers[20].output[0].clone().save()",
        "x = sum(model.model.layers[20].output).save()\nt = model.logits.argmax(-1).save()",
        "x = model.model.norm(model.model.layers[10].output[0]).save()",
        # a location's new value built of its own parts (a block that writes runs at the taps)
        "model.model.layers[20].output = (model.model.layers[20].output[0] * 0.5, model.model.layers[20].output[1])",
    ]
    for source in served:
        assert isinstance(check(source), tuple), source
    not_served = [
        "a = model.model.layers[10].output\nb = model.model.layers[20].output\nx = (b[0] - a[0]).save()",
        "h = model.model.layers[10].output[0]\nt = model.logits.argmax(-1)\nx = h.norm().save()",
        "x = model.model.layers[10].output[0].save()",
        "x = model.model.layers[10].output[0].float().save()",
        "rows = list().save()\nrows.append(model.model.layers[10].output[0][-1])",
        "x = nnsight.save([model.model.layers[10].output[0]])",
        "h, r = model.model.layers[10].output\ny = model.model.norm(h, r)",
        "h = model.model.layers[10].output[0]\ny = torch.nn.functional.relu(h, inplace=True)",
        "h = model.model.layers[10].output[0]\nkeep(h)",
        "c = tracer.cache()\nx = model.model.layers[10].output[0].norm().save()",
        "i = 20\nx = model.model.layers[i].output[0].norm().save()",
        "for i in (10, 20):\n    x = model.model.layers[i].output[0].norm().save()",
        # an earlier location's view in a later one's new value: stale on the Python path
        "a = model.model.layers[10].output\nmodel.model.layers[20].output = (a[0], a[1])",
    ]
    for source in not_served:
        found = check(source)
        assert isinstance(found, Unlowered), source
    # where everything it reads is served, how it uses a value is the reason
    assert check(not_served[2]).kind == "view" and "saves a view" in check(not_served[2]).reason
