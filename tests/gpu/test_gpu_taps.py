"""Taps on a CUDA vLLM (SmolLM2, bf16, graphed, layers 10 and 20 tapped): the lowered
steering and capture loops against the same blocks run as Python on the same
engine, every lowered step staying in the graphs.

Run with ``pytest -m gpu`` on a machine with a GPU (``scripts/gpu/README.md``).
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from tests.conftest import SESSION_SITES, SESSION_TAPS
from tests.engine.test_taps_keep import (
    cache_lowered,
    cache_python,
    first_lowered,
    first_python,
    keep_lowered,
    keep_python,
    keep_residual_lowered,
    stream_lowered,
    stream_python,
)
from tests.gpu.test_gpu import PROMPTS, cosine, start, stats
from vllm_nnsight_plugin import VLLM

pytestmark = pytest.mark.gpu
TAPS = {"nnsight_taps": SESSION_TAPS}  # decoder layers, an attention operation, an MLP


@pytest.fixture(scope="module")
def tapped(smollm2_path):
    # graphs and torch.compile as configured by default: each graph of the whole
    # forward also captured broken at the taps, which a decode step whose blocks
    # run at the taps replays (docs/taps.md, "Python at the taps"); collects read
    # beside the step in flight by default (``worker/ready.py``), so every test
    # here checks saves collected that way
    return start(smollm2_path, additional_config=TAPS)


def steer_lowered(model, vectors):
    with model.trace(temperature=0.0, max_tokens=12, logprobs=5) as tracer:
        for prompt, vector in zip(PROMPTS, vectors):
            with tracer.invoke(prompt):
                for _ in tracer.iter[:12]:
                    model.model.layers[10].output[0][:] += vector
                out = tracer.result.save()
    return out


def steer_python(model, vectors):
    with model.trace(temperature=0.0, max_tokens=12, logprobs=5) as tracer:
        for prompt, vector in zip(PROMPTS, vectors):
            with tracer.invoke(prompt):
                for _ in tracer.iter[:12]:
                    hidden = model.model.layers[10].output[0]
                    hidden[:] = hidden + vector  # an assignment: not lowered, Python at the taps
                out = tracer.result.save()
    return out


def test_an_idle_tapped_engine_generates_what_an_untapped_one_does(tapped, smollm2_path):
    params = SamplingParams(temperature=0.0, max_tokens=16)
    got = [list(o.outputs[0].token_ids) for o in tapped.generate(PROMPTS, params, use_tqdm=False)]
    assert stats(tapped)["taps"] == SESSION_SITES
    plain = start(smollm2_path)
    try:
        want = [list(o.outputs[0].token_ids) for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        del plain
    assert got == want


def test_lowered_steering_matches_python_and_stays_in_the_graphs(tapped):
    model = VLLM(tapped)
    torch.manual_seed(0)
    units = [torch.randn(576, device="cuda") for _ in PROMPTS[:4]]
    vectors = [(16.0 * u / u.norm()).to(torch.bfloat16) for u in units]
    before = stats(tapped)
    lowered = steer_lowered(model, vectors)
    middle = stats(tapped)
    assert middle["lowered"] - before["lowered"] == 4
    assert middle["uncompiled_steps"] == before["uncompiled_steps"]  # every step graphed
    python = steer_python(model, vectors)
    after = stats(tapped)
    assert after["uncompiled_steps"] == middle["uncompiled_steps"]  # compiled, between the taps
    assert after["steps_at_taps"] > middle["steps_at_taps"]
    # Graphed steps and steps without a graph (other batch shapes, other GEMM
    # choices) round differently in bf16: the
    # first step's log-probabilities agree to a couple of the logits' bf16 steps
    # (0.125 at magnitudes 16-32), the first greedy token with them (a near-tie
    # later in a steered generation may still go either way).
    for a, b in zip(lowered, python, strict=True):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        for token in set(first_a) & set(first_b):
            assert abs(first_a[token].logprob - first_b[token].logprob) <= 0.26
    same = sum(list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids) for a, b in zip(lowered, python))
    assert same >= 3
    plain = tapped.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    assert any(list(o.outputs[0].token_ids) != list(t.outputs[0].token_ids) for o, t in zip(plain, lowered))


def test_lowered_capture_matches_python(tapped):
    model = VLLM(tapped)
    before = stats(tapped)
    kept = keep_lowered(model, 20, 6, 6)
    (stream, _), first = stream_lowered(model, 10, 5), first_lowered(model, 4)
    middle = stats(tapped)
    assert middle["lowered"] - before["lowered"] == 3
    assert middle["uncompiled_steps"] == before["uncompiled_steps"]
    want_kept = keep_python(model, 20, 6, 6)
    (want_stream, _), want_first = stream_python(model, 10, 5), first_python(model, 4)
    for got, want in ((kept, want_kept), (stream, want_stream)):
        assert [t.shape for t in got] == [t.shape for t in want]
        assert all(a.device.type == "cuda" and a.dtype == torch.bfloat16 for a in got)
        assert min(cosine(a, b) for a, b in zip(got, want)) >= 0.999
    assert cosine(first[0], want_first[0]) >= 0.999
    assert list(first[1].outputs[0].token_ids) == list(want_first[1].outputs[0].token_ids)
    assert stats(tapped)["tracked"] == 0


def test_a_lowered_cache_matches_python(tapped):
    model = VLLM(tapped)
    before = stats(tapped)
    got, got_out = cache_lowered(model, 6)
    middle = stats(tapped)
    assert middle["lowered_by"]["cache"] - before["lowered_by"]["cache"] == 1
    kept = [keep_lowered(model, 10, 6, 6), keep_residual_lowered(model, 10, 6, 6)]  # the same graphs
    assert stats(tapped)["uncompiled_steps"] == before["uncompiled_steps"]
    want, want_out = cache_python(model, 6)
    steps, expected = got["model.model.layers.10"].output, want["model.model.layers.10"].output
    assert len(steps) == len(expected) == 6
    for step, (a, b) in enumerate(zip(steps, expected)):
        for part, (x, y) in enumerate(zip(a, b)):
            assert x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.shape == y.shape
            assert torch.equal(x, kept[part][step].cpu())  # exactly what the lowered keeps see
            # against eager kernels: one layer's parts, one row a step, round apart
            assert cosine(x, y) >= 0.995
        assert cosine(a[0] + a[1], b[0] + b[1]) >= 0.999  # the residual stream they make
    assert got_out.outputs[0].token_ids[0] == want_out.outputs[0].token_ids[0]


def test_lowered_operation_taps_match_python_and_stay_in_the_graphs(tapped):
    from tests.engine.test_taps_source import keep_lowered as keep_operations
    from tests.engine.test_taps_source import keep_python as keep_operations_python
    from tests.engine.test_taps_source import steer_lowered as steer_operation
    from tests.engine.test_taps_source import steer_python as steer_operation_python

    model = VLLM(tapped)
    torch.manual_seed(1)
    unit = torch.randn(576, device="cuda")
    vector = (8.0 * unit / unit.norm()).to(torch.bfloat16)
    before = stats(tapped)
    lowered = steer_operation(model, vector)
    attention, mlp = keep_operations(model)
    middle = stats(tapped)
    assert middle["lowered"] - before["lowered"] == 3
    assert middle["uncompiled_steps"] == before["uncompiled_steps"]
    python = steer_operation_python(model, vector)
    want_attention, want_mlp = keep_operations_python(model)
    assert lowered.outputs[0].token_ids[0] == python.outputs[0].token_ids[0]
    for got, want in ((attention, want_attention), (mlp, want_mlp)):
        assert [t.shape for t in got] == [t.shape for t in want]
        assert all(a.device.type == "cuda" and a.dtype == torch.bfloat16 for a in got)
        assert min(cosine(a, b) for a, b in zip(got, want)) >= 0.995
        assert cosine(torch.cat(got), torch.cat(want)) >= 0.999


def stream_until(model, stop):
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=24, stop_token_ids=[stop]) as tracer:
        stream = list().save()
        for _ in tracer.all():
            stream.append(model.model.layers[10].output[0].clone())
    return stream


def drawn_until(model, stop):
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=24, stop_token_ids=[stop]) as tracer:
        drawn = list().save()
        for _ in tracer.all():
            drawn.append(model.samples.item())
    return drawn


def test_a_block_sees_no_step_past_the_token_that_ends_its_request(tapped):
    """Async scheduling (vLLM's default here) lays out a step before it has read the
    last one's samples, so a request runs once more after drawing its stop token
    and vLLM throws that sample away. Lowered or Python, the block sees only the
    steps whose tokens are in the output."""
    assert tapped.llm_engine.vllm_config.scheduler_config.async_scheduling
    (plain,) = tapped.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    tokens = list(plain.outputs[0].token_ids)
    i = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])  # first drawn at step i
    model = VLLM(tapped)
    before = stats(tapped)
    stream = stream_until(model, tokens[i])
    after = stats(tapped)
    assert after["lowered"] - before["lowered"] == 1 and after["tracked"] == 0
    assert len(stream) == i + 1 and [tuple(t.shape) for t in stream[1:]] == [(1, 576)] * i
    assert drawn_until(model, tokens[i]) == tokens[: i + 1]


def steer_if(model, vector, whole_forward=False, reads=True):
    """A Python ``if`` on the activation: at the taps, or (``whole_forward``, a read
    of a module that is no tap beside it) a Python forward."""
    with model.trace(PROMPTS[1], temperature=0.0, max_tokens=8, logprobs=5) as tracer:
        kept = list().save()
        for _ in tracer.iter[:8]:
            if whole_forward:
                model.model.embed_tokens.output.clone()
            hidden = model.model.layers[10].output[0]
            if hidden.norm() > 0:
                hidden[:] += vector
            if reads:
                kept.append(model.model.layers[20].output[0].clone())
        out = tracer.result.save()
    return kept, out


def steer_lowered_one(model, vector):
    with model.trace(PROMPTS[1], temperature=0.0, max_tokens=8, logprobs=5) as tracer:
        for _ in tracer.iter[:8]:
            model.model.layers[10].output[0][:] += vector
        out = tracer.result.save()
    return out


def test_a_block_at_the_taps_matches_the_lowered_edit_and_the_python_forward(tapped):
    at_the_taps_against_lowered_and_python(tapped, "BROKEN", 7)


def test_a_block_at_the_taps_between_piece_graphs_on_an_engine_split_at_the_taps(smollm2_path):
    split = start(smollm2_path, env={"VLLM_NNSIGHT_SPLIT_AT_TAPS": "1"}, additional_config=TAPS)
    try:
        at_the_taps_against_lowered_and_python(split, "PIECEWISE", 8)
    finally:
        del split


def at_the_taps_against_lowered_and_python(tapped, mode: str, steps: int) -> None:
    """``steer_if`` at the taps: its steps replay graphs in ``mode`` (a split engine's
    pieces, or the whole forward's graph broken at the taps: a batch of one decode
    row fits the smallest capture size; the prompt's step runs without a graph there),
    against the same edit lowered and against the whole forward as Python."""
    model = VLLM(tapped)
    torch.manual_seed(4)
    vector = (8.0 * torch.randn(576, device="cuda") / 24).to(torch.bfloat16)
    before = stats(tapped)
    reads, out = steer_if(model, vector)
    middle = stats(tapped)
    assert out.nnsight_path["form"] == "taps"
    assert middle["steps_at_taps"] - before["steps_at_taps"] >= 8
    assert middle["split_at_taps"] is (mode == "PIECEWISE")
    assert middle["broken_at_taps"] is (mode == "BROKEN")
    replayed = middle["graph_modes"].get(mode, 0) - before["graph_modes"].get(mode, 0)
    assert replayed >= steps, (before["graph_modes"], middle["graph_modes"])
    assert middle["uncompiled_steps"] - before["uncompiled_steps"] <= 8 - steps
    # The same edit lowered: the same compiled kernels (this step without a graph).
    _, alone = steer_if(model, vector, reads=False)
    lowered = steer_lowered_one(model, vector)
    assert list(alone.outputs[0].token_ids) == list(lowered.outputs[0].token_ids)
    for step_a, step_b in zip(alone.outputs[0].logprobs, lowered.outputs[0].logprobs, strict=True):
        for token in set(step_a) & set(step_b):
            assert abs(step_a[token].logprob - step_b[token].logprob) <= 0.13  # a bf16 step of the logits
    # The whole forward as Python runs the eager kernels: in bf16 ten layers after the
    # edit its rows are within about 1% (0.9925 measured on an H100), the first token the same.
    want_reads, want = steer_if(model, vector, whole_forward=True)
    assert want.nnsight_path["form"] is None
    assert stats(tapped)["uncompiled_steps"] > middle["uncompiled_steps"]
    assert cosine(reads[0], want_reads[0]) >= 0.99
    assert out.outputs[0].token_ids[0] == want.outputs[0].token_ids[0]


def staggered(model, how: str):
    """Each prompt keeps layer 20's every row for as many tokens as its place:
    the requests finish at different steps while the others go on, so each
    collect comes with a step on the device (async scheduling). ``how``:
    ``lowered``; ``python``, the same keep behind a Python ``if``, so it runs as
    Python on the values of the same compiled kernels."""
    with model.trace(temperature=0.0) as tracer:
        for i, prompt in enumerate(PROMPTS[:6]):
            with tracer.invoke(prompt, max_tokens=2 + 3 * i):
                rows = list().save()
                if how == "lowered":
                    for _ in tracer.iter[: 2 + 3 * i]:
                        rows.append(model.model.layers[20].output[0].clone())
                else:
                    for _ in tracer.iter[: 2 + 3 * i]:
                        hidden = model.model.layers[20].output[0]
                        if hidden.norm() > 0:
                            rows.append(hidden.clone())
    return rows  # each invoke's list, in order


def test_a_collect_beside_the_step_in_flight_reads_what_the_requests_kept(tapped):
    """A request's saves, collected while the engine has its next step on the
    device, are the rows its own steps kept: read beside that step (no wait for
    the device, ``worker/ready.py``), as the same block run as Python has them
    (bit for bit on a CPU engine). (Against the whole forward as Python, eager bf16 kernels, a
    near-tie drew another token a few steps in for one of the six prompts, after
    which the rows are another sequence's.)"""
    model = VLLM(tapped)
    before = stats(tapped)
    got = staggered(model, "lowered")
    after = stats(tapped)
    assert after["lowered"] - before["lowered"] == 6 and after["tracked"] == 0
    assert after["collects_beside_step"] > before["collects_beside_step"]
    want = staggered(model, "python")
    # (a block whose reads are taps runs as Python on what the taps kept, at the sampler)
    assert stats(tapped)["taps_served_at_sampler"] - after["taps_served_at_sampler"] >= 6
    for i, (rows, wanted) in enumerate(zip(got, want)):
        assert len(rows) == len(wanted) == 2 + 3 * i
        assert [t.shape for t in rows] == [t.shape for t in wanted]
        assert min(cosine(a, b) for a, b in zip(rows, wanted)) >= 0.999


def test_a_block_at_the_taps_that_changes_nothing_leaves_every_request_as_in_a_plain_batch(tapped):
    """A decode step whose blocks run at the taps replays the whole forward's graph
    broken at the taps: the same kernels on the same batch, so a block that edits
    nothing (its ``if`` never true) leaves its own request and its plain neighbour
    bit for bit as in a batch of plain requests of the same size."""
    model = VLLM(tapped)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
    plain = tapped.generate(PROMPTS[:2], params, use_tqdm=False)
    before = stats(tapped)
    with model.trace(temperature=0.0, max_tokens=12, logprobs=5) as tracer:
        with tracer.invoke(PROMPTS[0]):
            for _ in tracer.iter[:12]:
                hidden = model.model.layers[10].output[0]
                if hidden.norm() > 1e9:
                    hidden[:] *= 0.5
            traced = tracer.result.save()
        with tracer.invoke(PROMPTS[1]):
            neighbour = tracer.result.save()
    after = stats(tapped)
    assert traced.nnsight_path["form"] == "taps"
    assert after["graph_modes"].get("BROKEN", 0) - before["graph_modes"].get("BROKEN", 0) >= 10
    for got, want in ((traced, plain[0]), (neighbour, plain[1])):
        assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)
        for step_a, step_b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert {t: p.logprob for t, p in step_a.items()} == {t: p.logprob for t, p in step_b.items()}
