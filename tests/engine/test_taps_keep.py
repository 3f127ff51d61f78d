"""Kept rows on the taps: the capture loop and the first-step read, lowered, against
the same reads run as Python on the session engine (eager, fp32, tapped at layers
10 and 20), where the two must agree bit for bit for a request traced alone."""

from __future__ import annotations

import torch

from tests.engines import DEVICE

PROMPT = "The capital of France is"


def stats(llm) -> dict:
    (found,) = llm.collective_rpc("nnsight_stats")
    return found


# Each block twice: in a form the taps run, and written so that it runs as Python
# (a second statement). Separate functions: an invoke's saves must be made in the
# trace's own frame.
def keep_lowered(model, layer, steps, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        hidden = list().save()
        for _ in tracer.iter[:steps]:
            hidden.append(model.model.layers[layer].output[0].clone())
    return hidden


def keep_residual_lowered(model, layer, steps, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        residual = list().save()
        for _ in tracer.iter[:steps]:
            residual.append(model.model.layers[layer].output[1].clone())
    return residual


def keep_python(model, layer, steps, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        hidden = list().save()
        for _ in tracer.iter[:steps]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            out = model.model.layers[layer].output
            hidden.append(out[0].clone())
    return hidden


def stream_lowered(model, layer, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        stream = list().save()
        for _ in tracer.all():
            stream.append(model.model.layers[layer].output[0] + model.model.layers[layer].output[1])
        out = tracer.result.save()
    try:
        return stream, out
    except UnboundLocalError:  # after tracer.all() the line after the loop never runs
        return stream, None


def stream_python(model, layer, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        stream = list().save()
        for _ in tracer.all():
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            hidden, residual = model.model.layers[layer].output
            stream.append(hidden + residual)
        out = tracer.result.save()
    try:
        return stream, out
    except UnboundLocalError:  # after tracer.all() the line after the loop never runs
        return stream, None


def residual_lowered(model, layer, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        residual = list().save()
        for _ in tracer.iter[1:]:
            residual.append(model.model.layers[layer].output[1].clone())
    return residual


def residual_python(model, layer, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        residual = list().save()
        for _ in tracer.iter[1:]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            out = model.model.layers[layer].output
            residual.append(out[1].clone())
    return residual


def first_lowered(model, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        last = model.model.layers[10].output[0][-1].clone().save()
        out = tracer.result.save()
    return last, out


def first_python(model, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
        hidden = model.model.layers[10].output[0]
        last = hidden[-1].clone().save()
        out = tracer.result.save()
    return last, out


def last_rows_lowered(model, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        last = list().save()
        for _ in tracer.iter[:tokens]:
            last.append(model.model.layers[10].output[0][-1].clone())
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        first = list().save()
        for _ in tracer.all():
            first.append((model.model.layers[20].output[0] + model.model.layers[20].output[1])[0])
    return last, first


def last_rows_python(model, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        last = list().save()
        for _ in tracer.iter[:tokens]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            hidden = model.model.layers[10].output[0]
            last.append(hidden[-1].clone())
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        first = list().save()
        for _ in tracer.all():
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            hidden, residual = model.model.layers[20].output
            first.append((hidden + residual)[0])
    return last, first


def layers_lowered(model, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        probe = list().save()
        for _ in tracer.iter[:tokens]:
            for i in (10, 20):
                probe.append(model.model.layers[i].output[0][-1].clone())
        out = tracer.result.save()
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        streams = list().save()
        for _ in tracer.iter[1:]:
            for layer in LAYERS:
                streams.append(model.model.layers[layer].output[0] + model.model.layers[layer].output[1])
    return probe, out, streams


def layers_python(model, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        probe = list().save()
        for _ in tracer.iter[:tokens]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            for i in (10, 20):
                probe.append(model.model.layers[i].output[0][-1].clone())
        out = tracer.result.save()
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        streams = list().save()
        for _ in tracer.iter[1:]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            for layer in LAYERS:
                hidden, residual = model.model.layers[layer].output
                streams.append(hidden + residual)
    return probe, out, streams


LAYERS = [10, 20]


def same_list(got, want) -> None:
    assert type(got) is list and len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
        assert torch.equal(a, b)


def test_the_capture_loop_is_lowered_and_keeps_what_python_keeps_bit_for_bit(smollm2_llm, smol):
    before = stats(smollm2_llm)
    lowered = keep_lowered(smol, 10, 4, 4)
    middle = stats(smollm2_llm)
    python = keep_python(smol, 10, 4, 4)
    after = stats(smollm2_llm)
    assert middle["lowered"] - before["lowered"] == 1 and after["lowered"] == middle["lowered"]
    assert middle["lowered_by"]["keep"] - before["lowered_by"]["keep"] == 1
    assert middle["kept_rows"] - before["kept_rows"] == lowered[0].shape[0] + 3
    assert [t.shape[0] for t in lowered] == [python[0].shape[0], 1, 1, 1]
    same_list(lowered, python)
    # a loop longer than the request: cut short on both paths, with what ran
    same_list(keep_lowered(smol, 20, 10, 3), keep_python(smol, 20, 10, 3))
    # the residual, from the second step on
    same_list(residual_lowered(smol, 20, 4), residual_python(smol, 20, 4))


def test_one_row_of_each_step_is_kept_lowered_as_python_keeps_it_bit_for_bit(smollm2_llm, smol):
    """``rows.append(<tap>.output[0][-1].clone())``: the prompt's last row, then each
    new token's (and ``[0]`` of the residual stream: the prompt's first row)."""
    before = stats(smollm2_llm)
    lowered = last_rows_lowered(smol, 4)
    middle = stats(smollm2_llm)
    python = last_rows_python(smol, 4)
    assert middle["lowered_by"]["keep"] - before["lowered_by"]["keep"] == 2
    assert stats(smollm2_llm)["lowered"] == middle["lowered"]
    assert middle["kept_rows"] - before["kept_rows"] == 8
    for got, want in zip(lowered, python, strict=True):
        assert [tuple(t.shape) for t in got] == [(576,)] * 4
        same_list(got, want)


def test_rows_kept_at_several_layers_are_the_list_python_builds_bit_for_bit(smollm2_llm, smol):
    """A probe's rows: each step's last row at every layer of a loop, one request,
    one region per tap, the saves interleaved as the loop appends."""
    before = stats(smollm2_llm)
    probe, out, streams = layers_lowered(smol, 4)
    middle = stats(smollm2_llm)
    want_probe, want_out, want_streams = layers_python(smol, 4)
    assert middle["lowered_by"]["keep"] - before["lowered_by"]["keep"] == 2
    assert stats(smollm2_llm)["lowered"] == middle["lowered"]
    assert middle["kept_rows"] - before["kept_rows"] == 2 * 4 + 2 * 3
    assert [tuple(t.shape) for t in probe] == [(576,)] * 8
    same_list(probe, want_probe)
    same_list(streams, want_streams)
    assert [tuple(t.shape) for t in streams] == [(1, 576)] * 6
    assert list(out.outputs[0].token_ids) == list(want_out.outputs[0].token_ids)
    assert stats(smollm2_llm)["kept_free_rows"] == before["kept_free_rows"]


def test_the_residual_stream_sum_is_kept_every_step_and_tracer_result_follows(smollm2_llm, smol):
    (got, got_out), (want, want_out) = stream_lowered(smol, 20, 3), stream_python(smol, 20, 3)
    same_list(got, want)
    assert len(got) == 3
    assert got_out is None and want_out is None  # the line after tracer.all(): never run


def test_a_read_on_the_first_step_only_is_lowered(smollm2_llm, smol):
    before = stats(smollm2_llm)["lowered"]
    (last, out), (want, want_out) = first_lowered(smol, 3), first_python(smol, 3)
    assert stats(smollm2_llm)["lowered"] - before == 1 and stats(smollm2_llm)["lowered_by"]["read"] >= 1
    assert last.shape == (576,) and torch.equal(last, want)
    assert list(out.outputs[0].token_ids) == list(want_out.outputs[0].token_ids)


def test_kept_and_other_requests_in_one_trace(smollm2_llm, smol):
    """Batched with a Python block, a steered request and a plain one: the kept rows
    match a Python block's in the same trace (same batch, same arithmetic)."""
    torch.manual_seed(3)
    vector = torch.randn(576).to(DEVICE)
    before = stats(smollm2_llm)["lowered"]
    with smol.trace(temperature=0.0, max_tokens=4) as tracer:
        with tracer.invoke(PROMPT):
            kept = list().save()
            for _ in tracer.iter[:4]:
                kept.append(smol.model.layers[10].output[0].clone())
        with tracer.invoke(PROMPT):
            read = list().save()
            for _ in tracer.iter[:4]:
                smol.model.embed_tokens.output.clone()  # no tap: the block runs as Python
                out = smol.model.layers[10].output
                read.append(out[0].clone())
        with tracer.invoke("Water boils at"):
            for _ in tracer.iter[:4]:
                smol.model.layers[10].output[0][:] += 4.0 * vector
        with tracer.invoke("Water boils at"):
            first = smol.model.layers[20].output[0][-1].clone().save()
        with tracer.invoke("Water boils at"):
            plain = tracer.result.save()
    assert stats(smollm2_llm)["lowered"] - before == 3
    assert [t.shape for t in kept] == [t.shape for t in read]
    for a, b in zip(kept, read):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert first.shape == (576,) and len(plain.outputs[0].token_ids) == 4
    assert stats(smollm2_llm)["tracked"] == 0


def reads_together(model, prompt):
    """Five single reads lowered and the same five as Python, in one trace."""
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke(prompt):
            last = model.model.layers[10].output[0][-1].clone().save()
        with tracer.invoke(prompt):
            first = model.model.layers[10].output[0][0].clone().save()
        with tracer.invoke(prompt):
            middle = model.model.layers[10].output[0][1:3].clone().save()
        with tracer.invoke(prompt):
            tail = model.model.layers[10].output[0][-2:].clone().save()
        with tracer.invoke(prompt):
            whole = model.model.layers[10].output[0].clone().save()
        with tracer.invoke(prompt):
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            out = model.model.layers[10].output[0]
            python = [out[-1].clone(), out[0].clone(), out[1:3].clone(), out[-2:].clone(), out.clone()]
            python = python.save()
    return [last, first, middle, tail, whole], python


def test_a_traces_reads_collected_together_are_each_the_read_python_makes(smollm2_llm, smol):
    """A trace's single reads are collected together (one copy of the store for
    all of them): each is what the same read run as Python keeps beside it, of its
    own prompt, whatever it indexes."""
    for prompt in ("The capital of France is", "Water boils at"):
        before = stats(smollm2_llm)["lowered_by"].get("read", 0)
        lowered, python = reads_together(smol, prompt)
        assert stats(smollm2_llm)["lowered_by"]["read"] - before == 5
        for at, (value, want) in enumerate(zip(lowered, python, strict=True)):
            assert value.shape == want.shape and torch.equal(value, want), (prompt, at)
    assert stats(smollm2_llm)["tracked"] == 0


LONG = "The history of the city goes back many centuries, " * 4 + "and today it is"


def test_a_cached_prompt_is_computed_whole_for_a_lowered_read(smollm2_llm, smol):
    """A traced request never reads the prefix cache, lowered or not: its first step
    keeps every prompt row even when a plain request just cached that prompt."""
    from vllm import SamplingParams

    smollm2_llm.generate([LONG], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    before = stats(smollm2_llm)["lowered"]
    with smol.trace(LONG, temperature=0.0, max_tokens=2) as tracer:
        rows = list().save()
        for _ in tracer.iter[:2]:
            rows.append(smol.model.layers[10].output[0].clone())
    prompt = len(smollm2_llm.get_tokenizer()(LONG).input_ids)
    assert prompt > 32 and stats(smollm2_llm)["lowered"] - before == 1
    assert [t.shape[0] for t in rows] == [prompt, 1]


def test_one_loops_invokes_share_a_block_and_each_is_checked_on_its_own_prompt(smollm2_llm, smol):
    """The invokes of one loop carry the same bytes: the first is loaded and lowered,
    the rest are lowered from it without loading; each read is still checked
    against its own prompt (row 3 of a two-token prompt raises, as Python does),
    and each gets the rows of its own request."""
    import pytest

    import vllm_nnsight_plugin

    prompts = [PROMPT, "Water boils at a temperature of", "Hi there"]
    before = stats(smollm2_llm)
    with smol.requests(temperature=0.0, max_tokens=2) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                row = smol.model.layers[10].output[0][3].clone().save()  # noqa: F841
    prepared = tracer.prepared
    outs = smollm2_llm.generate(prepared.prompts, prepared.params, use_tqdm=False)
    after = stats(smollm2_llm)
    assert after["lowered"] - before["lowered"] == 2  # the short prompt runs as Python
    assert after["lowered_unloaded"] - before["lowered_unloaded"] == 1
    with pytest.raises(Exception, match="index 3 is out of bounds|out of range|IndexError"):
        vllm_nnsight_plugin.saves(outs[2])
    for out, prompt in zip(outs[:2], prompts[:2]):
        got = vllm_nnsight_plugin.saves(out)["row"]
        want = first_row(smol, prompt)
        assert got.shape == (576,) and torch.allclose(got, want, atol=1e-5, rtol=0)  # batched vs alone
    assert stats(smollm2_llm)["tracked"] == 0


def first_row(model, prompt):
    with model.trace(prompt, temperature=0.0, max_tokens=1):
        hidden = model.model.layers[10].output[0]
        row = hidden[3].clone().save()
    return row


def keep_until_stop_lowered(model, stop):
    with model.trace(PROMPT, temperature=0.0, max_tokens=6, stop_token_ids=[stop]) as tracer:
        rows = list().save()
        for _ in tracer.iter[:6]:
            rows.append(model.model.layers[10].output[0].clone())
    return rows


def keep_until_stop_python(model, stop):
    with model.trace(PROMPT, temperature=0.0, max_tokens=6, stop_token_ids=[stop]) as tracer:
        rows = list().save()
        for _ in tracer.iter[:6]:
            model.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            out = model.model.layers[10].output
            rows.append(out[0].clone())
    return rows


def test_a_request_that_ends_early_keeps_the_steps_it_ran_on_both_paths(smollm2_llm, smol):
    """Stopped by a stop token before its loop's last step, a lowered request keeps
    one entry per forward it was in, as the Python loop does."""
    from vllm import SamplingParams

    (plain,) = smollm2_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    tokens = list(plain.outputs[0].token_ids)
    stop = tokens[2]
    ran = tokens.index(stop) + 1  # forwards until the stop token is drawn
    assert ran < 6
    before = stats(smollm2_llm)["lowered"]
    lowered = keep_until_stop_lowered(smol, stop)
    assert stats(smollm2_llm)["lowered"] - before == 1
    python = keep_until_stop_python(smol, stop)
    assert len(lowered) == ran
    same_list(lowered, python)
    assert stats(smollm2_llm)["tracked"] == 0


def cache_lowered(model, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        cache = tracer.cache(modules=[model.model.layers[10]])
        out = tracer.result.save()
    return cache, out


def cache_python(model, tokens):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        cache = tracer.cache(modules=[model.model.layers[10]])
        out = tracer.result.save()
        out.outputs  # noqa: B018  (a second statement: runs as Python)
    return cache, out


def test_a_cache_of_a_tap_is_lowered_and_is_the_cache_python_builds(smollm2_llm, smol):
    before = stats(smollm2_llm)
    got, got_out = cache_lowered(smol, 4)
    middle = stats(smollm2_llm)
    want, want_out = cache_python(smol, 4)
    after = stats(smollm2_llm)
    assert middle["lowered_by"]["cache"] - before["lowered_by"]["cache"] == 1
    assert after["lowered"] == middle["lowered"]
    assert type(got) is type(want) and got.keys() == want.keys() == ["model.model.layers.10"]
    steps, expected = got["model.model.layers.10"].output, want["model.model.layers.10"].output
    assert len(steps) == len(expected) == 4
    for a, b in zip(steps, expected):
        assert type(a) is tuple and len(a) == 2
        for x, y in zip(a, b):
            assert x.device.type == "cpu" and x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y)
    assert steps[0][0].shape[0] > 1 and steps[1][0].shape[0] == 1  # the prompt, then a row a step
    assert list(got_out.outputs[0].token_ids) == list(want_out.outputs[0].token_ids)
    # the client's tree comes back with the view: it navigates as on a local model
    navigated = got.model.model.layers[10].output
    assert len(navigated) == 4 and all(a[0] is b[0] for a, b in zip(navigated, steps))


def mlp_cache(model, tokens, python: bool):
    with model.trace(PROMPT, temperature=0.0, max_tokens=tokens) as tracer:
        cache = tracer.cache(modules=[model.model.layers[12].mlp])
        out = tracer.result.save()
        if python:
            out.outputs  # noqa: B018  (a second statement: runs as Python)
    return cache, out


def test_a_cache_of_a_tensor_tap_is_lowered_and_is_the_cache_python_builds(smollm2_llm, smol):
    """Layer 12's MLP, whose output is one tensor: each step's entry is that tensor."""
    before = stats(smollm2_llm)
    got, got_out = mlp_cache(smol, 3, python=False)
    middle = stats(smollm2_llm)
    want, want_out = mlp_cache(smol, 3, python=True)
    assert middle["lowered_by"]["cache"] - before["lowered_by"]["cache"] == 1
    assert got_out.nnsight_path["form"] == "cache" and not want_out.nnsight_path["lowered"]
    key = "model.model.layers.12.mlp"
    assert got.keys() == want.keys() == [key]
    steps, expected = got[key].output, want[key].output
    assert len(steps) == len(expected) == 3
    for a, b in zip(steps, expected):
        assert type(a) is torch.Tensor and a.device.type == "cpu" and a.dtype == b.dtype
        assert torch.equal(a, b)
    assert steps[0].shape[0] > 1 and steps[1].shape[0] == 1
    assert list(got_out.outputs[0].token_ids) == list(want_out.outputs[0].token_ids)
    assert got.model.model.layers[12].mlp.output[2] is steps[2]


def test_a_keep_of_one_row_a_step_takes_room_for_its_window_only():
    """A probe's keep (``rows.append(<tap>.output[0][-1].clone())`` for ``iter[:n]``)
    keeps one row at each of at most ``n`` steps, however long its prompt: a region
    of the prompt and every token would send such requests to Python for room
    while the store had plenty."""
    from types import SimpleNamespace

    from vllm_nnsight_plugin.taps.install import TapTables
    from vllm_nnsight_plugin.taps.kept import Lowered
    from vllm_nnsight_plugin.taps.lower import LoweredBlock
    from vllm_nnsight_plugin.taps.ops import KEEP_FIRST
    from vllm_nnsight_plugin.worker.lowering import Lowering

    tables = TapTables(("a", "b"), max_tokens=64, hidden=8, entries=8, device="cpu", store_size=300)
    lowering = Lowering(None)

    def probe(request_id, stop, select):
        lowered = Lowered(0, 0, stop, None, code=KEEP_FIRST, name="rows", select=select)
        request = SimpleNamespace(id=request_id, mediator=None, copies={})
        added = lowering._add(request, tables, LoweredBlock("a", lowered, None, (1,)), rows=100, most=228)
        return added, lowered

    # every row of every step (the prompt's 100 too), at two taps: 2 x 228 rows, more than the store
    added, _ = probe("every row", 128, None)
    assert not added and lowering.paths.taken["every row"].kind == "room"
    added, lowered = probe("last rows", 128, -1)  # one row a step, 128 steps: 2 x 128 rows
    assert added and lowered.rows == 128 and [site for site, _ in lowered.regions] == [0, 1]
    assert tables.regions.free_rows() == 299 - 2 * 128
    added, lowered = probe("every step", None, -1)  # no last step: room for every row it can have
    assert not added
