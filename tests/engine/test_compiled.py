"""A compiled engine (``enforce_eager=False``: vLLM's torch.compile path on this CPU,
CUDA graphs too on a GPU). Module hooks never fire inside compiled code, so a step
that runs a block runs its forward as Python and every other step stays compiled;
with that fallback switched off, a module location is refused, never ignored."""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from tests.conftest import SESSION_SITES, SESSION_TAPS, start_llm, stop_llm
from tests.engine.test_taps import same_generation, steer_as_python, steer_seeds_loop
from tests.engine.test_taps_keep import keep_lowered, keep_python
from tests.engines import environment
from vllm_nnsight_plugin import VLLM

PROMPT = "The capital of France is"


def uncompiled_steps(llm) -> int:
    (stats,) = llm.collective_rpc("nnsight_stats")
    assert stats["compiled_engine"] is True
    return stats["uncompiled_steps"]


def metric(name: str, **labels: str) -> float:
    """A sample of the front end's Prometheus registry (this process: an offline engine's)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def steps_at_taps(llm) -> int:
    (stats,) = llm.collective_rpc("nnsight_stats")
    return stats["steps_at_taps"]


def steered_reads(model, vector, steps=4):
    """Layer 3 is no tap: the block's steps run their forward as Python."""
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps) as tracer:
        reads, logits = list().save(), list().save()
        for _ in tracer.iter[:steps]:
            reads.append(model.model.layers[3].output[0].clone())
            model.model.layers[3].output[0][:] += 8.0 * vector
            logits.append(model.logits.clone())
        out = tracer.result.save()
    return reads, logits, list(out.outputs[0].token_ids)


#: vLLM's compile cache, the form it loads back on a CPU. Its default there (an AOT
#: artifact, 0.32) is written and never loaded ("no attribute 'finalize_loading'" in
#: the log), so every compiled engine compiled again; this form lets the second
#: engine of this module load what the first compiled (same model, settings, taps).
COMPILE_CACHE = {"VLLM_USE_AOT_COMPILE": "0"}
#: Each tap as the one operation a CUDA engine runs, writing over its value (what a
#: graph that is not split at the taps calls there, ``ops.tap_in_place``), so this
#: CPU compiles that form too: torch.compile's functionalization must keep its
#: writes where the rest of the forward reads them. (The session's eager engine
#: runs the tensor operations.)
ONE_OPERATION = {"VLLM_NNSIGHT_TAP_KERNEL": "1"}


@pytest.fixture(scope="module")
def compiled(smollm2_path):
    # Tapped as the session engine is: the tests below that run as Python check that a
    # tap passes every row it is not asked to steer through unchanged.
    taps = {"nnsight_taps": SESSION_TAPS}
    with environment({**COMPILE_CACHE, **ONE_OPERATION}):
        llm = start_llm(smollm2_path, enforce_eager=False, additional_config=taps)
    yield llm
    stop_llm(llm)


def test_compiled_engine_serves_module_locations_like_an_eager_one(compiled, smol):
    torch.manual_seed(0)
    vector = torch.randn(576)
    vector = vector / vector.norm()
    before = uncompiled_steps(compiled)
    reads, logits, tokens = steered_reads(VLLM(compiled), vector)
    assert uncompiled_steps(compiled) - before == 4  # the block ran in four steps
    want_reads, want_logits, want_tokens = steered_reads(smol, vector)
    assert tokens == want_tokens
    assert [tuple(r.shape) for r in reads] == [(5, 576), (1, 576), (1, 576), (1, 576)]
    for got, want in zip(reads, want_reads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_only_steps_with_a_running_block_leave_the_compiled_path(compiled):
    model = VLLM(compiled)
    before = uncompiled_steps(compiled)
    compiled.generate([PROMPT] * 3, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert uncompiled_steps(compiled) == before
    with model.trace(PROMPT, temperature=0.0, max_tokens=6):
        first = model.model.layers[3].output[0].clone().save()  # the first step only
    assert tuple(first.shape) == (5, 576)
    assert uncompiled_steps(compiled) - before == 1


def sampler_only(model, steps=4):
    """Reads and writes logits and samples only: served beside the compiled forward."""
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps) as tracer:
        logits, tokens = list().save(), list().save()
        for step in tracer.iter[:steps]:
            logits.append(model.logits.clone())
            if step == 1:
                model.samples[:] = 11  # force the second token
            tokens.append(model.samples.item())
        out = tracer.result.save()
    return logits, tokens, list(out.outputs[0].token_ids)


def test_a_block_on_logits_and_samples_only_keeps_every_step_compiled(compiled, smol):
    before = uncompiled_steps(compiled)
    logits, tokens, generated = sampler_only(VLLM(compiled))
    assert uncompiled_steps(compiled) == before  # no step left the compiled path
    want_logits, want_tokens, want_generated = sampler_only(smol)
    assert tokens == want_tokens == generated == want_generated and tokens[1] == 11
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_python_step_runs_the_kernels_an_eager_engine_runs(compiled):
    (stats,) = compiled.collective_rpc("nnsight_stats")
    assert stats["eager_kernels"] > 0  # CustomOps switched for Python steps, then back


# ---------------------------------------------------------------- taps
def lowered_count(llm) -> int:
    (stats,) = llm.collective_rpc("nnsight_stats")
    assert stats["taps"] == SESSION_SITES
    return stats["lowered"]


def test_a_lowered_block_keeps_every_step_compiled(compiled):
    model = VLLM(compiled)
    torch.manual_seed(1)
    vectors = [torch.randn(576) for _ in range(3)]
    before_lowered, before_python = lowered_count(compiled), uncompiled_steps(compiled)
    lowered = steer_seeds_loop(model, vectors)
    assert lowered_count(compiled) - before_lowered == 3
    assert uncompiled_steps(compiled) == before_python  # every step stayed compiled
    at_taps = steps_at_taps(compiled)
    python = steer_as_python(model, vectors)
    assert lowered_count(compiled) - before_lowered == 3  # not lowered
    assert [out.nnsight_path["form"] for out in python] == ["taps"] * 3
    assert uncompiled_steps(compiled) == before_python  # Python at the taps, compiled between them
    assert steps_at_taps(compiled) - at_taps >= 5
    # The same compiled kernels either way; the batches may be cut otherwise.
    same_generation(python, lowered, exact=False)
    plain = compiled.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert list(plain[0].outputs[0].token_ids) != list(lowered[0].outputs[0].token_ids)  # it steered
    (stats,) = compiled.collective_rpc("nnsight_stats")
    assert stats["tracked"] == 0 and stats["lowered_now"] == 0
    assert stats["tap_operation"] == "one" and stats["split_at_taps"] is False  # ``ops.tap_in_place``


def test_a_lowered_capture_keeps_every_step_compiled(compiled):
    model = VLLM(compiled)
    before_lowered, before_python = lowered_count(compiled), uncompiled_steps(compiled)
    kept = keep_lowered(model, 20, 4, 4)
    assert lowered_count(compiled) - before_lowered == 1
    assert uncompiled_steps(compiled) == before_python  # the rows came out of compiled steps
    read = keep_python(model, 20, 4, 4)
    assert uncompiled_steps(compiled) - before_python == 4
    assert [t.shape for t in kept] == [t.shape for t in read]
    for a, b in zip(kept, read, strict=True):  # compiled and Python steps fuse differently
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-4)


def test_a_read_served_at_the_sampler_keeps_every_step_compiled(compiled):
    """A block that computes from one tap gets the rows the compiled forward kept."""
    from tests.engine.test_taps_replay import norms_each_step

    model = VLLM(compiled)
    (before,) = compiled.collective_rpc("nnsight_stats")
    norms, result = norms_each_step(model, twin=False)
    (after,) = compiled.collective_rpc("nnsight_stats")
    assert result.nnsight_path["form"] == "replay"
    assert after["uncompiled_steps"] == before["uncompiled_steps"]
    assert after["taps_served_at_sampler"] - before["taps_served_at_sampler"] == 4
    want, _ = norms_each_step(model, twin=True)
    for a, b in zip(norms, want, strict=True):  # compiled and Python steps fuse differently
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-4)


def test_the_logit_lens_served_at_the_sampler_keeps_every_step_compiled(compiled):
    """The norm and unembedding a block calls run at the sampler with the kernels of
    a Python step, on the rows the compiled forward kept."""
    from tests.engine.test_taps_replay import lens

    model = VLLM(compiled)
    before = uncompiled_steps(compiled)
    guesses, result = lens(model, twin=False)
    assert result.nnsight_path["form"] == "replay" and uncompiled_steps(compiled) == before
    want, want_result = lens(model, twin=True)
    for got, expected in zip(guesses, want, strict=True):
        assert torch.equal(got.indices, expected.indices)
        assert torch.allclose(got.values, expected.values, atol=1e-3, rtol=1e-4)
    assert list(result.outputs[0].token_ids) == list(want_result.outputs[0].token_ids)


def test_an_operation_tap_is_lowered_and_every_step_stays_compiled(compiled):
    from tests.engine.test_taps_source import keep_lowered as keep_operations
    from tests.engine.test_taps_source import keep_python as keep_operations_python
    from tests.engine.test_taps_source import steer_lowered as steer_operation
    from tests.engine.test_taps_source import steer_python as steer_operation_python

    model = VLLM(compiled)
    torch.manual_seed(5)
    vector = torch.randn(576)
    before_lowered, before_python = lowered_count(compiled), uncompiled_steps(compiled)
    lowered = steer_operation(model, vector)
    attention, mlp = keep_operations(model)
    assert lowered_count(compiled) - before_lowered == 3
    assert uncompiled_steps(compiled) == before_python
    python = steer_operation_python(model, vector)
    want_attention, want_mlp = keep_operations_python(model)
    assert list(lowered.outputs[0].token_ids) == list(python.outputs[0].token_ids)
    for got, want in ((attention, want_attention), (mlp, want_mlp)):
        for a, b in zip(got, want, strict=True):
            assert torch.allclose(a, b, atol=1e-3, rtol=1e-4)


# ---------------------------------------------------------------- Python at the taps
def steer_if(model, vector, whole_forward=False, steps=4):
    """A block the tables cannot run (a Python ``if`` on an activation) whose every
    location is a tap; ``whole_forward``: the same, plus a read of a module that is
    no tap, which takes its steps' forwards off the compiled path."""
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps, logprobs=3) as tracer:
        reads = list().save()
        for _ in tracer.iter[:steps]:
            if whole_forward:
                model.model.embed_tokens.output.clone()
            hidden = model.model.layers[10].output[0]
            if hidden.norm() > 0:
                hidden[:] += 8.0 * vector
            reads.append(model.model.layers[20].output[0].clone())
        out = tracer.result.save()
    return reads, out


def steer_lowered(model, vector, steps=4):
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps, logprobs=3) as tracer:
        for _ in tracer.iter[:steps]:
            model.model.layers[10].output[0][:] += 8.0 * vector
        out = tracer.result.save()
    return out


def test_a_block_on_taps_runs_at_the_taps_and_every_step_stays_compiled(compiled):
    model = VLLM(compiled)
    torch.manual_seed(7)
    vector = torch.randn(576)  # large enough to move greedy tokens
    before, at_taps = uncompiled_steps(compiled), steps_at_taps(compiled)
    counted = metric("vllm_nnsight_steps_total", forward="taps")
    reads, out = steer_if(model, vector)
    assert out.nnsight_path["form"] == "taps" and out.nnsight_path["lowered"] is False
    assert "`if`" in out.nnsight_path["reason"]
    assert uncompiled_steps(compiled) == before
    assert steps_at_taps(compiled) - at_taps == 4
    # the front end's Prometheus counters, from the collect's reply
    assert metric("vllm_nnsight_steps_total", forward="taps") - counted == 4
    assert metric("vllm_nnsight_requests_total", path="taps", form="") >= 1
    assert [tuple(r.shape) for r in reads] == [(5, 576), (1, 576), (1, 576), (1, 576)]
    # The edit is the lowered steering loop's: the same compiled kernels, bit for bit.
    same_generation([out], [steer_lowered(model, vector)])
    plain = compiled.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert list(plain[0].outputs[0].token_ids) != list(out.outputs[0].token_ids)  # it steered
    # The whole forward as Python (eager kernels): close, not bit for bit.
    want_reads, want = steer_if(model, vector, whole_forward=True)
    assert want.nnsight_path["form"] is None and uncompiled_steps(compiled) - before == 4
    assert list(out.outputs[0].token_ids) == list(want.outputs[0].token_ids)
    for got, expected in zip(reads, want_reads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3)
    (stats,) = compiled.collective_rpc("nnsight_stats")
    assert stats["tracked"] == 0
    # The same block's bytes again: sent to the taps on the first one's verdict,
    # without the analysis, and computing the same, bit for bit.
    again_reads, again = steer_if(model, vector)
    (after,) = compiled.collective_rpc("nnsight_stats")
    assert after["at_taps_known"] - stats["at_taps_known"] == 1
    assert again.nnsight_path == out.nnsight_path
    same_generation([again], [out])
    for got, first in zip(again_reads, reads, strict=True):
        assert torch.equal(got, first)


def test_a_plain_neighbour_of_a_block_at_the_taps_computes_what_it_computes_alone(compiled):
    """The traced request beside a plain one, then the same prompt plain beside it:
    the neighbour's tokens and log-probabilities (a Python step would run the whole
    batch's forward with the eager kernels)."""
    import vllm_nnsight_plugin

    model = VLLM(compiled)
    neighbour = "Paris is a city in"
    # Both rows run every step (no early end): the batches keep one shape.
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    with model.requests(PROMPT, temperature=0.0, max_tokens=6, ignore_eos=True) as tracer:
        for _ in tracer.iter[:6]:
            hidden = model.model.layers[10].output[0]
            if hidden.norm() > 0:
                hidden[:] *= 0.5
    prepared = tracer.prepared
    before = uncompiled_steps(compiled)
    traced, beside = compiled.generate(
        prepared.prompts + [neighbour], prepared.params + [params], use_tqdm=False
    )
    assert uncompiled_steps(compiled) == before
    vllm_nnsight_plugin.saves(traced)  # no error
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    _, alone = compiled.generate([PROMPT, neighbour], [plain, params], use_tqdm=False)
    # The same compiled kernels (no step left the compiled path); bit for bit where the
    # two runs cut their batches alike, which the front end's timing decides.
    same_generation([beside], [alone], exact=False)
    assert list(traced.outputs[0].token_ids) != list(_.outputs[0].token_ids)  # the block edited


def replaced(model, whole_forward=False, steps=3):
    """A replacement of a layer's output and an edit of what attention is handed."""
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps, logprobs=3) as tracer:
        for _ in tracer.iter[:steps]:
            if whole_forward:
                model.model.embed_tokens.output.clone()
            query = model.model.layers[10].self_attn.attn.inputs[0][0]
            if query.abs().max() > 0:
                query[:] *= 0.25
            layer = model.model.layers[20]
            layer.output = (layer.output[0] * -4.0, layer.output[1])
        out = tracer.result.save()
    return out


def test_replacements_and_edits_of_what_a_module_is_handed_land_at_the_taps(compiled):
    model = VLLM(compiled)
    before = uncompiled_steps(compiled)
    out = replaced(model)
    assert out.nnsight_path["form"] == "taps", out.nnsight_path
    assert "not a tap" not in out.nnsight_path["reason"]  # what it reads is served; its form is not run
    assert uncompiled_steps(compiled) == before
    want = replaced(model, whole_forward=True)
    assert want.nnsight_path["form"] is None
    same_generation([out], [want], exact=False)  # compiled and eager kernels: close
    plain = compiled.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert list(plain[0].outputs[0].token_ids) != list(out.outputs[0].token_ids)


def test_a_block_that_fails_at_a_tap_ends_its_own_request_only(compiled):
    import vllm_nnsight_plugin

    model = VLLM(compiled)
    with model.requests(PROMPT, temperature=0.0, max_tokens=4) as tracer:
        hidden = model.model.layers[10].output[0]
        if hidden.norm() > 0:
            hidden[:] += torch.ones(3)  # the wrong width
    prepared = tracer.prepared
    plain = SamplingParams(temperature=0.0, max_tokens=4)
    want = compiled.generate([PROMPT], [plain], use_tqdm=False)[0]
    traced, beside = compiled.generate(prepared.prompts + [PROMPT], prepared.params + [plain], use_tqdm=False)
    with pytest.raises(Exception, match="size"):
        vllm_nnsight_plugin.saves(traced)
    assert list(beside.outputs[0].token_ids) == list(want.outputs[0].token_ids)
    (stats,) = compiled.collective_rpc("nnsight_stats")
    assert stats["tracked"] == 0


def out_of_order(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=1):
        late = model.model.layers[20].output[0].clone().save()  # noqa: F841
        early = model.model.layers[10].output[0].clone().save()  # noqa: F841  (already run past)


def test_an_out_of_order_read_is_reported_as_one_on_a_compiled_engine(compiled):
    model = VLLM(compiled)
    with pytest.raises(Exception, match="OutOfOrderError") as raised:
        out_of_order(model)
    assert "layers.10" in str(raised.value) and "CompiledForwardError" not in str(raised.value)
    (stats,) = compiled.collective_rpc("nnsight_stats")
    assert stats["tracked"] == 0


def test_the_client_says_which_locations_are_not_taps_before_it_sends(compiled):
    import warnings

    from vllm_nnsight_plugin import UntappedLocationWarning

    model = VLLM(compiled)
    layer = model.model.layers[3]  # a module captured by the block
    with pytest.warns(UntappedLocationWarning) as said:
        with model.trace(PROMPT, temperature=0.0, max_tokens=2):
            layer.output[0].clone().save()
            model.model.layers[5].mlp.output.clone().save()
            model.model.layers[10].output[0].clone().save()  # a tap
    messages = sorted(str(w.message) for w in said if w.category is UntappedLocationWarning)
    assert len(messages) == 2, messages
    assert "`model.model.layers.3.output` is not a tap" in messages[0]
    assert "taps=['model.layers.3.output']" in messages[0]
    assert "`model.model.layers.5.mlp.output`" in messages[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UntappedLocationWarning)
        with model.trace(PROMPT, temperature=0.0, max_tokens=2):
            model.model.layers[10].self_attn.attn.inputs[0][0].clone().save()
            model.model.layers[10].output[0].clone().save()
            model.model.layers[12].mlp.act_fn.output.clone().save()
            model.logits.clone().save()


def test_each_invoke_of_a_loop_is_checked_by_the_values_its_block_reads(compiled):
    """The invokes of one loop share a block; each is checked by the values of the
    names it reads (a module from the loop's variable), not by its loop's other
    variables, which need not make a block's reach differ."""
    from vllm_nnsight_plugin import UntappedLocationWarning

    model = VLLM(compiled)
    layers = [model.model.layers[10], model.model.layers[3], model.model.layers[10]]
    with pytest.warns(UntappedLocationWarning) as said:
        with model.trace(temperature=0.0, max_tokens=1) as tracer:
            for _i, each in enumerate(layers):
                with tracer.invoke(PROMPT):
                    each.output[0][-1].clone().save()
    messages = [str(w.message) for w in said if w.category is UntappedLocationWarning]
    assert len(messages) == 1 and "`model.model.layers.3.output` is not a tap" in messages[0], messages


@pytest.fixture(scope="module")
def compiled_no_fallback(smollm2_path, compiled):
    stop_llm(compiled)  # one engine at a time on two cores
    # The setting is read by the workers the engine spawns; the graphs are the first engine's.
    with environment({**COMPILE_CACHE, **ONE_OPERATION, "VLLM_NNSIGHT_EAGER_STEPS": "0"}):
        llm = start_llm(smollm2_path, enforce_eager=False, additional_config={"nnsight_taps": SESSION_TAPS})
    yield llm
    stop_llm(llm)


def test_without_the_fallback_a_module_location_is_refused_not_ignored(compiled_no_fallback, smol):
    model = VLLM(compiled_no_fallback)
    with pytest.raises(Exception, match="CompiledForwardError") as raised:
        with model.trace(PROMPT, temperature=0.0, max_tokens=8) as tracer:
            for _ in tracer.iter[:8]:
                model.model.layers[3].output[0].clone().save()  # no tap
    # refused before it ran, naming what is no tap and how to have it tapped
    assert "model.model.layers.3" in str(raised.value) and "nnsight_taps" in str(raised.value)
    (stats,) = compiled_no_fallback.collective_rpc("nnsight_stats")
    assert stats["tracked"] == 0
    # logits and samples are served outside the forward, compiled or not.
    with model.trace(PROMPT, temperature=0.0):
        logits = model.logits.save()
    with smol.trace(PROMPT, temperature=0.0):
        want = smol.logits.save()
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    assert uncompiled_steps(compiled_no_fallback) == 0
    # A block on taps needs no Python forward: it runs there too.
    vector = torch.ones(576)
    with model.trace(PROMPT, temperature=0.0, max_tokens=2):
        hidden = model.model.layers[10].output[0]
        if hidden.norm() > 0:
            hidden[:] += vector
        kept = model.model.layers[10].output[0].clone().save()
    assert kept.shape == (5, 576) and uncompiled_steps(compiled_no_fallback) == 0
    (stats,) = compiled_no_fallback.collective_rpc("nnsight_stats")
    assert stats["tracked"] == 0
