"""The user docs' behaviours, on a stock ``vllm.LLM`` serving SmolLM2 (real weights)."""

from __future__ import annotations

import time

import pytest
import torch
from vllm import SamplingParams

import vllm_nnsight_plugin
from tests.conftest import UNCOLLECTED_S
from vllm_nnsight_plugin import VLLM, BlockError

PROMPT = "The capital of France is"


def plain_tokens(llm, prompt, n=8):
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_read_one_activation(smol):
    with smol.trace(PROMPT, temperature=0.0):
        resid = smol.model.layers[10].output[0].clone().save()
        logits = smol.logits.save()
    assert tuple(resid.shape) == (5, 576)
    assert tuple(logits.shape) == (1, 49152)
    assert smol.tokenizer.decode(logits.argmax(-1)) == " Paris"


def test_shapes_per_step(smol):
    with smol.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        shapes = list().save()
        for _ in tracer.iter[:3]:
            shapes.append((tuple(smol.model.layers[10].output[0].shape), tuple(smol.logits.shape)))
    assert shapes == [((5, 576), (1, 49152)), ((1, 576), (1, 49152)), ((1, 576), (1, 49152))]


def test_residual_stream_is_the_pair_sum(smol):
    with smol.trace(PROMPT, temperature=0.0):
        hidden, residual = smol.model.layers[10].output
        stream = (hidden + residual).save()
        nxt = smol.model.layers[11].input_layernorm.output[1].clone().save()
    # The next layer's fused add-norm returns the same stream as its residual.
    torch.testing.assert_close(stream, nxt, rtol=1e-5, atol=1e-5)


def test_steering_changes_tokens_and_leaves_plain_requests_alone(smol, smollm2_llm):
    before = plain_tokens(smollm2_llm, PROMPT, 12)
    torch.manual_seed(0)
    vector = torch.randn(576)
    vector = vector / vector.norm()
    with smol.trace(PROMPT, temperature=0.0, max_tokens=12) as tracer:
        for _ in tracer.iter[:12]:
            hidden = smol.model.layers[10].output[0]
            hidden[:] += 40.0 * vector.to(hidden.device)  # the engine's device, CPU or GPU
        out = tracer.result.save()
    assert list(out.outputs[0].token_ids) != before
    # Prefix caching is on: the edited request must not leave its KV behind.
    assert plain_tokens(smollm2_llm, PROMPT, 12) == before


def test_write_in_body_runs_on_first_step_only(smol):
    berlin = smol.tokenizer.encode(" Berlin")[0]
    with smol.trace(PROMPT, temperature=0.0, max_tokens=4) as tracer:
        smol.samples[:] = berlin  # outside tracer.iter: the first step only
        out = tracer.result.save()
    tokens = list(out.outputs[0].token_ids)
    assert tokens[0] == berlin
    assert berlin not in tokens[1:]


def test_n_greater_than_one_gives_one_value_per_sequence(smol):
    with smol.trace(PROMPT, temperature=1.0, seed=0, n=2, max_tokens=3) as tracer:
        drawn = list().save()
        for _ in tracer.iter[:3]:
            drawn.append(smol.samples.item())
        out = tracer.result.save()
    assert isinstance(drawn, list) and len(drawn) == 2
    assert sorted(map(list, drawn)) == sorted(list(o.token_ids) for o in out.outputs)


def test_force_samples_every_step_and_collect(smol):
    berlin = smol.tokenizer.encode(" Berlin")[0]
    with smol.trace(PROMPT, temperature=0.0, max_tokens=6) as tracer:
        tokens = list().save()
        for step in tracer.iter[:6]:
            if step == 0:
                smol.samples[:] = berlin
            tokens.append(smol.samples.item())
        out = tracer.result.save()
    assert tokens[0] == berlin
    assert tokens == list(out.outputs[0].token_ids)
    assert out.outputs[0].text.startswith(" Berlin")


def test_logits_write_decides_the_token(smol):
    target = smol.tokenizer.encode(" Rome")[0]
    with smol.trace(PROMPT, temperature=0.0, max_tokens=1) as tracer:
        logits = smol.logits
        logits[:] = -1e9
        logits[0, target] = 0.0
        out = tracer.result.save()
    assert list(out.outputs[0].token_ids) == [target]


def test_invokes_batch_and_return_lists(smol):
    prompts = ["Paris is in", "The capital of Japan is", "Berlin is the capital of"]
    with smol.trace(temperature=0.0, max_tokens=1) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                stream = sum(smol.model.layers[20].output).save()
                token = smol.logits.argmax(-1).save()
    assert isinstance(stream, list) and len(stream) == 3
    lengths = [len(smol.tokenizer(p)["input_ids"]) for p in prompts]
    assert [tuple(s.shape) for s in stream] == [(n, 576) for n in lengths]
    assert smol.tokenizer.decode(token[1]) == " Tokyo"


def test_two_concurrent_requests_only_one_edited(smol, smollm2_llm):
    short, long = PROMPT, "Berlin is the capital of Germany, and the capital of Italy is"
    plain_long = plain_tokens(smollm2_llm, long, 8)
    plain_short = plain_tokens(smollm2_llm, short, 8)
    with smol.trace(temperature=0.0, max_tokens=8) as tracer:
        with tracer.invoke(short):
            for _ in tracer.iter[:8]:
                smol.model.layers[5].output[0][:] *= 0.0
            edited = tracer.result.save()
        with tracer.invoke(long):
            untouched = tracer.result.save()
    assert list(edited.outputs[0].token_ids) != plain_short
    assert list(untouched.outputs[0].token_ids) == plain_long


def test_prompt_forms_and_sampling_on_invoke(smol):
    ids = smol.tokenizer(PROMPT)["input_ids"]
    with smol.trace(temperature=0.0, max_tokens=2) as tracer:
        with tracer.invoke(ids):
            a = smol.logits.argmax(-1).save()
        with tracer.invoke(smol.tokenizer(PROMPT, return_tensors="pt")):
            b = smol.logits.argmax(-1).save()
        with tracer.invoke(PROMPT, max_tokens=5):
            c = tracer.result.save()
    assert int(a[0]) == int(b[0]) == smol.tokenizer.encode(" Paris")[0]
    assert len(c.outputs[0].token_ids) == 5


def test_loop_cut_short_when_request_ends(smol):
    with smol.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
        seen = list().save()
        for _ in tracer.iter[:10]:
            seen.append(smol.samples.item())
        after = "ran".save()  # noqa: F841 - never runs: the loop is cut short
    assert len(seen) == 3


def test_all_runs_on_every_step(smol):
    with smol.trace(PROMPT, temperature=0.0, max_tokens=4, ignore_eos=True) as tracer:
        widths = list().save()
        for _ in tracer.all():
            widths.append(smol.model.layers[2].output[0].shape[0])
    assert widths == [5, 1, 1, 1]


def test_generate_without_block_and_tokenizer(smol):
    outs = smol.generate([PROMPT], temperature=0.0, max_tokens=2)
    assert outs[0].outputs[0].text.startswith(" Paris")
    assert smol.tokenizer.decode(smol.tokenizer.encode(" Paris")) == " Paris"


def test_barrier_is_refused(smol):
    with pytest.raises(Exception, match="barrier.*cannot work on vLLM"):
        with smol.trace(temperature=0.0) as tracer:
            with tracer.invoke(PROMPT):
                tracer.barrier(2)


def test_exception_in_block_fails_that_request_only(smol, smollm2_llm):
    with pytest.raises(Exception, match="ZeroDivisionError") as caught:
        with smol.trace(PROMPT, temperature=0.0):
            hidden = smol.model.layers[1].output[0].save()  # noqa: F841
            oops = 1 / 0  # noqa: F841
    assert "oops = 1 / 0" in str(caught.value)  # the block's own line
    assert plain_tokens(smollm2_llm, PROMPT, 2)[0] == smol.tokenizer.encode(" Paris")[0]


def test_wrong_size_replacement_is_a_request_error(smol, smollm2_llm):
    with pytest.raises(Exception) as caught:
        with smol.trace(PROMPT, temperature=0.0):
            smol.model.layers[3].mlp.output = torch.zeros(2, 576)
    assert "shape" in str(caught.value).lower() or "size" in str(caught.value).lower()
    assert plain_tokens(smollm2_llm, PROMPT, 2)[0] == smol.tokenizer.encode(" Paris")[0]


def test_stock_llm_with_prepared_params(smol, smollm2_llm):
    with smol.requests(PROMPT, temperature=0.0, max_tokens=2) as tracer:
        hidden = smol.model.layers[4].output[0].clone().save()  # noqa: F841
    prepared = tracer.prepared
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    outs = smollm2_llm.generate(prepared.prompts + [PROMPT], prepared.params + [plain], use_tqdm=False)
    saved = vllm_nnsight_plugin.saves(outs[0])
    assert tuple(saved["hidden"].shape) == (5, 576)
    assert not hasattr(outs[1], "saves")
    assert list(outs[0].outputs[0].token_ids) == list(outs[1].outputs[0].token_ids)


def test_corrupt_envelope_and_version_mismatch_are_request_errors(smollm2_llm):
    from vllm_nnsight_plugin.wire.envelope import EXTRA_ARGS_KEY, seal
    from vllm_nnsight_plugin.wire.trust import VOUCHED_KEY, Vouched

    def carrying(envelope: str) -> dict:  # vouched for, so the worker opens it
        return {EXTRA_ARGS_KEY: envelope, VOUCHED_KEY: Vouched(envelope)}

    stale = seal(b"x", nnsight_version="0.0.1", plugin_version="0.0.1")
    params = [
        SamplingParams(temperature=0.0, max_tokens=4, extra_args=carrying("garbage")),
        SamplingParams(temperature=0.0, max_tokens=4, extra_args=carrying(stale)),
        SamplingParams(temperature=0.0, max_tokens=4),
    ]
    outs = smollm2_llm.generate([PROMPT] * 3, params, use_tqdm=False)
    with pytest.raises(Exception, match="not a vllm-nnsight envelope"):
        vllm_nnsight_plugin.saves(outs[0])
    with pytest.raises(Exception, match="nnsight 0.0.1"):
        vllm_nnsight_plugin.saves(outs[1])
    with pytest.raises(BlockError):
        vllm_nnsight_plugin.saves(outs[2])
    assert outs[2].outputs[0].text.startswith(" Paris")


def test_wrapping_keeps_the_users_engine(smol, smollm2_llm):
    assert smol.vllm_entrypoint is smollm2_llm
    config = smollm2_llm.llm_engine.vllm_config
    assert config.cache_config.enable_prefix_caching
    assert config.parallel_config.worker_extension_cls.startswith("vllm_nnsight_plugin.")


def test_no_state_left_in_workers(smol):
    with smol.trace(PROMPT, temperature=0.0, max_tokens=2):
        smol.logits.save()
    assert smol.vllm_entrypoint.collective_rpc("nnsight_tracked") == [0]


def test_client_builds_tree_without_engine(smollm2_path):
    model = VLLM(smollm2_path, dtype="float32", max_model_len=512)
    text = repr(model.model.layers[10].mlp)
    assert "gate_up_proj" in text and "down_proj" in text
    assert model.vllm_entrypoint is None


class Canary:
    """Unpickling this creates a file: proof that a payload was (or was not) run."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_block_without_the_engines_key_is_refused_and_never_run(smollm2_llm, tmp_path):
    import hashlib
    import hmac
    import pickle

    from vllm_nnsight_plugin.versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
    from vllm_nnsight_plugin.wire.envelope import EXTRA_ARGS_KEY, seal
    from vllm_nnsight_plugin.wire.trust import LOCAL_SIGNATURE_KEY, VOUCHED_KEY, RefusedBlockError, Vouched

    def envelope(canary) -> str:
        return seal(
            pickle.dumps(Canary(str(canary))),
            nnsight_version=SUPPORTED_NNSIGHT,
            plugin_version=PLUGIN_VERSION,
        )

    def send(extra) -> object:
        params = SamplingParams(temperature=0.0, max_tokens=2, extra_args=extra)
        return smollm2_llm.generate([PROMPT], params, use_tqdm=False)[0]

    # A block nobody in this process vouched for, with a signature made elsewhere
    # (as anything from the network or a log would be): refused before decoding.
    refused = envelope(tmp_path / "refused")
    forged = hmac.new(b"another-key", refused.encode(), hashlib.sha256).hexdigest()
    with pytest.raises(RefusedBlockError, match="neither built in this process"):
        send({EXTRA_ARGS_KEY: refused, LOCAL_SIGNATURE_KEY: forged})
    assert not (tmp_path / "refused").exists()
    assert plain_tokens(smollm2_llm, PROMPT, 2)[0] == smollm2_llm.get_tokenizer().encode(" Paris")[0]
    # The same payload vouched for in the engine's own process is decoded: the canary is live.
    accepted = envelope(tmp_path / "accepted")
    output = send({EXTRA_ARGS_KEY: accepted, VOUCHED_KEY: Vouched(accepted)})
    assert (tmp_path / "accepted").exists()
    with pytest.raises(Exception, match="could not be loaded"):
        vllm_nnsight_plugin.saves(output)  # not a block, so the request still fails


def test_uncollected_blocks_are_dropped_after_their_request_ends(smol, smollm2_llm):
    from vllm.v1.engine.llm_engine import LLMEngine

    engine = smollm2_llm.llm_engine
    with smol.requests(PROMPT, temperature=0.0, max_tokens=2) as tracer:
        smol.logits.save()
    engine.add_request("nobody-collects", tracer.prepared.prompts[0], tracer.prepared.params[0])
    engine._nnsight_pending.discard("nobody-collects")
    unwrapped_step = LLMEngine.step.__wrapped__  # the stock step: no collect
    while engine.has_unfinished_requests():
        unwrapped_step(engine)
    assert smollm2_llm.collective_rpc("nnsight_tracked") == [1]
    time.sleep(UNCOLLECTED_S + 0.2)  # conftest shortens the engine's wait
    for _ in range(3):  # a few more steps of plain traffic
        plain_tokens(smollm2_llm, PROMPT, 4)
    assert smollm2_llm.collective_rpc("nnsight_tracked") == [0]


def test_a_finished_sequence_waits_for_its_siblings_before_it_is_stale():
    from types import SimpleNamespace

    from vllm_nnsight_plugin.worker.collect import UNCOLLECTED_STEPS, Uncollected

    tracked = {
        "0_r": SimpleNamespace(engine_id="r"),
        "1_r": SimpleNamespace(engine_id="r"),
        "alone": SimpleNamespace(engine_id="alone"),
    }
    books = Uncollected(0.0)
    books.step(["0_r", "alone"], tracked)
    for _ in range(UNCOLLECTED_STEPS - 1):
        assert books.step([], tracked) == []
    assert books.step([], tracked) == ["alone"]  # the sibling of 0_r still runs
    del tracked["alone"]
    for _ in range(3 * UNCOLLECTED_STEPS):
        assert books.step([], tracked) == []
    # Once the last sequence finishes, the request as a whole gets the usual wait.
    assert books.step(["1_r"], tracked) == []
    for _ in range(UNCOLLECTED_STEPS - 1):
        assert books.step([], tracked) == []
    assert sorted(books.step([], tracked)) == ["0_r", "1_r"]


def early_and_late(model, stop):
    with model.trace(PROMPT, temperature=1.0, seed=1, n=2, max_tokens=96, stop_token_ids=[stop]) as tracer:
        drawn = list().save()
        for _ in tracer.all():
            drawn.append(model.samples.item())
    return drawn


def test_a_sequence_that_finishes_early_keeps_its_saves_while_its_sibling_runs(smol, smollm2_llm):
    """``n > 1``: one sequence stops on its first token, the other runs on for
    longer than an uncollected block is kept (conftest shortens that wait)."""
    params = SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=96)
    plain = smollm2_llm.generate([PROMPT], params, use_tqdm=False)[0]
    a, b = (list(o.token_ids) for o in plain.outputs)
    # A token one sequence draws early and the other never draws: stopping on it
    # ends the first sequence there and leaves the other to run its course.
    early = [
        (i + 1, seq[i]) for seq, sib in ((a, b), (b, a)) for i in range(8) if seq[i] not in sib + seq[:i]
    ]
    assert early, (a, b)
    length, stop = min(early)
    want = sorted(seq[: seq.index(stop) + 1] if stop in seq else seq for seq in (a, b))
    started = time.monotonic()
    drawn = early_and_late(smol, stop)
    assert time.monotonic() - started > UNCOLLECTED_S  # long enough to have been dropped
    assert isinstance(drawn, list) and len(drawn) == 2  # both sequences' saves came home
    lengths = sorted(map(len, want))
    assert sorted(map(list, drawn)) == want and lengths[0] == length and lengths[1] > length + 8
    assert smollm2_llm.collective_rpc("nnsight_tracked") == [0]


def test_a_misspelled_sampling_keyword_is_refused_with_the_right_spelling(smol):
    with pytest.raises(
        TypeError, match="'temprature' is not a sampling parameter; did you mean 'temperature'"
    ):
        with smol.trace(PROMPT, temprature=0.0, max_tokens=1):
            smol.logits.save()
    with pytest.raises(ValueError, match="separate tracer.invoke"):  # nnsight's own refusal
        with smol.trace(temperature=0.0, max_tokens=1) as tracer:
            with tracer.invoke([PROMPT, "Paris is in"]):
                smol.logits.save()
    assert plain_tokens(smol.vllm_entrypoint, PROMPT, 1)[0] == smol.tokenizer.encode(" Paris")[0]


def test_an_out_of_order_read_says_so(smol):
    from tests.engine.test_compiled import out_of_order

    with pytest.raises(Exception, match="OutOfOrderError.*layers.10"):
        out_of_order(smol)
    assert plain_tokens(smol.vllm_entrypoint, PROMPT, 1)[0] == smol.tokenizer.encode(" Paris")[0]
    with smol.trace(PROMPT, temperature=0.0, max_new_tokens=2) as tracer:  # nnsight's spelling
        out = tracer.result.save()
    assert len(out.outputs[0].token_ids) == 2


def test_stop_string_still_returns_saves(smol):
    with smol.trace(PROMPT, temperature=0.0, max_tokens=16, stop=["answer"]) as tracer:
        first = smol.model.layers[3].output[0].clone().save()
        out = tracer.result.save()
    assert tuple(first.shape) == (5, 576)
    assert out.outputs[0].finish_reason == "stop" and "answer" not in out.outputs[0].text
    assert smol.vllm_entrypoint.collective_rpc("nnsight_tracked") == [0]


def test_an_unsendable_save_fails_only_its_own_request(smol):
    ok = None
    with pytest.raises(Exception, match="could not be sent back"):
        with smol.trace(temperature=0.0, max_tokens=1) as tracer:
            with tracer.invoke(PROMPT):
                rows = (row for row in smol.model.layers[3].output[0]).save()  # noqa: F841 (a generator)
            with tracer.invoke("Paris is in"):
                ok = smol.model.layers[3].output[0].clone().save()
    assert ok is not None and tuple(ok.shape) == (3, 576)  # collected in the same call
    assert smol.vllm_entrypoint.collective_rpc("nnsight_tracked") == [0]


def test_progress_bars_and_plain_generate_keywords(smol, capfd):
    """A trace of several requests shows vLLM's progress bar, one request shows
    none, ``use_tqdm`` decides either way; a plain generate takes ``use_tqdm`` and
    refuses a misspelled sampling keyword like a trace does."""

    def trace(*prompts, **kwargs):
        with smol.trace(temperature=0.0, max_tokens=1, **kwargs) as tracer:
            for prompt in prompts:
                with tracer.invoke(prompt):
                    smol.logits.save()
        return capfd.readouterr().err

    capfd.readouterr()
    assert "Processed prompts" in trace(PROMPT, "Paris is in")
    assert "Processed prompts" not in trace(PROMPT, "Paris is in", use_tqdm=False)
    assert "Processed prompts" not in trace(PROMPT)
    assert "Processed prompts" in trace(PROMPT, use_tqdm=True)
    out = smol.generate(PROMPT, temperature=0.0, max_tokens=2, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2 and "Processed prompts" not in capfd.readouterr().err
    with pytest.raises(TypeError, match="did you mean 'temperature'"):
        smol.generate(PROMPT, temprature=0.0, max_tokens=1)
