"""The plugin on a CUDA vLLM (0.25.1 on an H200), SmolLM2 in bf16: CUDA graphs and
torch.compile stay on, a traced step runs as Python, buffer reuse is real, and the
reads agree with an eager engine and with HF transformers.

Run with ``pytest -m gpu`` on a machine with a GPU (``scripts/gpu/README.md``), on
the model runner vLLM picks (V2 for these models) and again with
``VLLM_USE_V2_MODEL_RUNNER=0`` (V1): the plugin runs on whichever the engine uses.
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams

from tests.engines import environment
from vllm_nnsight_plugin import VLLM

pytestmark = pytest.mark.gpu

PROMPT = "The capital of France is"
PROMPTS = [
    PROMPT,
    "The largest planet in the solar system is",
    "Water boils at a temperature of",
    "The author of Pride and Prejudice is",
    "A haiku is a poem with",
    "The chemical symbol for gold is",
    "In computer science, a linked list is",
    "The first person to walk on the moon was",
]
GPU = dict(dtype="bfloat16", max_model_len=512, max_num_seqs=16, gpu_memory_utilization=0.1)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The smallest per-row cosine similarity of two ``[tokens, width]`` tensors."""
    a, b = a.float().reshape(-1, a.shape[-1]), b.float().reshape(-1, b.shape[-1])
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())


def start(path: str, env: dict[str, str] | None = None, **overrides):
    """An engine without taps unless ``overrides`` gives some (``additional_config``):
    these tests are about the Python path, which every decoder layer's default tap
    would take blocks off."""
    from vllm import LLM

    with environment(env):  # read by the engine processes it spawns
        return LLM(path, **{**GPU, "additional_config": NO_TAPS, **overrides})


NO_TAPS = {"nnsight_taps": "none"}


def expected_runner() -> str:
    """The runner these engines use: vLLM's choice unless this run asks for V1."""
    import os

    return "V1" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0" else "V2"


def stats(llm) -> dict:
    (found,) = llm.collective_rpc("nnsight_stats")
    return found


@pytest.fixture(scope="module", autouse=True)
def cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu tests need a CUDA device (run them with -m gpu on a GPU machine)")


@pytest.fixture(scope="module")
def graphed(smollm2_path):
    return start(smollm2_path)  # vLLM's defaults: torch.compile and CUDA graphs


@pytest.fixture(scope="module")
def eager(smollm2_path):
    return start(smollm2_path, enforce_eager=True)


@pytest.fixture(scope="module")
def hf(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.bfloat16).cuda().eval()


def steered(model, vector, prompt=PROMPT, steps=6, scale=40.0):
    with model.trace(prompt, temperature=0.0, max_tokens=steps) as tracer:
        reads, logits = list().save(), list().save()
        for _ in tracer.iter[:steps]:
            hidden = model.model.layers[15].output[0]
            reads.append(hidden.clone())
            hidden[:] += scale * vector.to(hidden.device)
            logits.append(model.logits.clone())
        out = tracer.result.save()
    return reads, logits, list(out.outputs[0].token_ids)


def unit(seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    vector = torch.randn(576)
    return vector / vector.norm()


# ---------------------------------------------------------------- graphs stay on
def test_an_idle_engine_keeps_compile_and_cuda_graphs(graphed):
    config = graphed.llm_engine.vllm_config
    assert config.model_config.enforce_eager is False
    assert int(config.compilation_config.mode) == 3  # VLLM_COMPILE
    assert config.compilation_config.cudagraph_mode.name != "NONE"
    before = stats(graphed)
    assert before["runner_family"] == expected_runner()  # vLLM's choice, not the plugin's
    graphed.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    after = stats(graphed)
    graphed_steps = sum(n for mode, n in after["graph_modes"].items() if mode != "NONE") - sum(
        n for mode, n in before["graph_modes"].items() if mode != "NONE"
    )
    assert graphed_steps >= 15  # the decode steps replayed a graph
    assert after["uncompiled_steps"] == before["uncompiled_steps"]


def test_a_traced_step_runs_as_python_and_matches_an_eager_engine(graphed, eager):
    before = stats(graphed)
    reads, logits, tokens = steered(VLLM(graphed), unit(), scale=0.0)
    after = stats(graphed)
    assert after["uncompiled_steps"] - before["uncompiled_steps"] == 6
    assert after["graph_modes"].get("NONE", 0) - before["graph_modes"].get("NONE", 0) >= 6
    want_reads, want_logits, want_tokens = steered(VLLM(eager), unit(), scale=0.0)
    assert tokens == want_tokens
    assert [tuple(r.shape) for r in reads] == [(5, 576)] + [(1, 576)] * 5
    for got, want in zip(reads + logits, want_reads + want_logits):
        assert cosine(got, want) >= 0.999


def test_steering_a_graphed_engine_matches_an_eager_one(graphed, eager):
    reads, _, tokens = steered(VLLM(graphed), unit())
    want_reads, _, want_tokens = steered(VLLM(eager), unit())
    assert tokens == want_tokens
    # A traced step on the graphed engine runs the eager engine's kernels
    # (seams/kernels.py), so even a large edit agrees closely.
    assert stats(graphed)["eager_kernels"] > 0
    for got, want in zip(reads, want_reads):
        assert cosine(got, want) >= 0.999
    plain = graphed.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert list(plain[0].outputs[0].token_ids) != tokens  # the edit landed


def test_a_block_on_logits_and_samples_only_keeps_the_graphs(graphed, eager):
    def run(model):
        with model.trace(PROMPT, temperature=0.0, max_tokens=6) as tracer:
            logits, tokens = list().save(), list().save()
            for _ in tracer.iter[:6]:
                logits.append(model.logits.clone())
                tokens.append(model.samples.item())
        return logits, tokens

    before = stats(graphed)
    logits, tokens = run(VLLM(graphed))
    after = stats(graphed)
    assert after["uncompiled_steps"] == before["uncompiled_steps"]
    graphed_steps = sum(n for mode, n in after["graph_modes"].items() if mode != "NONE") - sum(
        n for mode, n in before["graph_modes"].items() if mode != "NONE"
    )
    assert graphed_steps >= 5  # the decode steps replayed a graph
    want_logits, want_tokens = run(VLLM(eager))
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        assert cosine(got, want) >= 0.999


def test_traced_and_plain_requests_share_a_graphed_engine(graphed, eager):
    def run(llm):
        model = VLLM(llm)
        with model.trace(temperature=0.0, max_tokens=4) as tracer:
            for prompt in PROMPTS:
                with tracer.invoke(prompt):
                    seen = model.model.layers[20].output[0].clone().save()
        return seen  # one entry per invoke

    plain_before = graphed.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    got, want = run(graphed), run(eager)
    assert len(got) == len(PROMPTS)
    for a, b in zip(got, want):
        assert a.shape == b.shape and cosine(a, b) >= 0.999
    plain_after = graphed.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain_after] == [o.outputs[0].token_ids for o in plain_before]
    assert stats(graphed)["tracked"] == 0


# ---------------------------------------------------------------- fidelity
LAYERS = (0, 10, 28)  # HF's last hidden state is after the final norm: stop before it


@torch.no_grad()
def test_bf16_reads_match_hf_transformers(eager, graphed, hf, smollm2_path):
    model = VLLM(eager)
    with model.trace(PROMPT, temperature=0.0):
        streams = list().save()
        for i in LAYERS:
            hidden, residual = model.model.layers[i].output
            streams.append((hidden + residual).clone())
        logits = model.logits.save()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids.cuda()
    ref = hf(ids, output_hidden_states=True)
    for got, i in zip(streams, LAYERS):
        assert cosine(got, ref.hidden_states[i + 1][0]) >= 0.999, i
    assert cosine(logits, ref.logits[0, -1:]) >= 0.999
    # Greedy tokens agree with HF and between the graphed and eager engines.
    hf_tokens = hf.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for llm in (eager, graphed):
        out = llm.generate([PROMPT], params, use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == hf_tokens


# ---------------------------------------------------------------- buffer reuse
def test_a_saved_view_changes_without_clone_on_gpu(eager):
    model = VLLM(eager)
    with model.trace(PROMPT, temperature=0.0):
        view = model.model.layers[10].output[0].save()
        copy = model.model.layers[10].output[0].clone().save()
    # Layer 11's fused add-norm writes over layer 10's output in place.
    assert not torch.equal(view, copy)


def test_clone_reads_makes_every_read_a_copy(smollm2_path, eager):
    llm = start(smollm2_path, env={"NNSIGHT_VLLM_CLONE_READS": "1"}, enforce_eager=True)
    try:
        model = VLLM(llm)
        with model.trace(PROMPT, temperature=0.0):
            view = model.model.layers[10].output[0].save()
            copy = model.model.layers[10].output[0].clone().save()
        assert torch.equal(view, copy)
        vector = unit(1)
        plain = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
        with model.trace(PROMPT, temperature=0.0, max_tokens=6) as tracer:
            for _ in tracer.iter[:6]:
                hidden = model.model.layers[15].output[0]
                hidden[:] += 40.0 * vector.to(hidden.device)  # edits the copy: lost
            lost = tracer.result.save()
        with model.trace(PROMPT, temperature=0.0, max_tokens=6) as tracer:
            for _ in tracer.iter[:6]:
                hidden, residual = model.model.layers[15].output
                edited = hidden + 40.0 * vector.to(hidden.device)
                model.model.layers[15].output = (edited, residual)  # assigned: lands
            landed = tracer.result.save()
        assert lost.outputs[0].token_ids == plain[0].outputs[0].token_ids
        _, _, steered_tokens = steered(VLLM(eager), unit(1))
        assert list(landed.outputs[0].token_ids) == steered_tokens
    finally:
        llm.llm_engine.engine_core.shutdown()


# ---------------------------------------------------------------- refusals
def test_without_eager_steps_a_module_location_is_refused(smollm2_path):
    llm = start(smollm2_path, env={"VLLM_NNSIGHT_EAGER_STEPS": "0"})
    try:
        model = VLLM(llm)
        with pytest.raises(Exception, match="CompiledForwardError"):
            with model.trace(PROMPT, temperature=0.0):
                model.model.layers[10].output[0].clone().save()
        with model.trace(PROMPT, temperature=0.0):
            top = model.logits.argmax(-1).save()
        assert model.tokenizer.decode(top) == " Paris"
        assert stats(llm)["uncompiled_steps"] == 0 and stats(llm)["tracked"] == 0
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_the_plugin_never_chooses_the_runner(smollm2_path):
    """With the plugin installed, an engine runs the runner stock vLLM would (the
    plugin sets no ``VLLM_USE_V2_MODEL_RUNNER``), and blocks run on it."""
    import os

    asked = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    llm = start(smollm2_path, enforce_eager=True, additional_config={})  # the default taps
    try:
        assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == asked
        assert llm.llm_engine.vllm_config.use_v2_model_runner == (expected_runner() == "V2")
        model = VLLM(llm)
        with model.trace(PROMPT, temperature=0.0):
            top = model.logits.argmax(-1).save()
        assert model.tokenizer.decode(top) == " Paris"
        found = stats(llm)
        assert found["runner_family"] == expected_runner()
        # On CUDA with Triton an engine nobody gave taps taps every decoder layer,
        # each as one kernel.
        assert found["taps"] == [f"model.layers.{i}" for i in range(30)]
        assert found["tap_operation"] == "one"
        vector = (4.0 * unit()).to("cuda", torch.bfloat16)
        with model.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
            for _ in tracer.iter[:3]:
                model.model.layers[12].output[0][:] += vector
        assert stats(llm)["lowered_by"]["steer"] - found["lowered_by"].get("steer", 0) == 1
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_the_client_builds_a_graphed_engine_tapped_at_every_layer_by_default(smollm2_path):
    model = VLLM(smollm2_path, dispatch=True, **GPU)
    llm = model.vllm_entrypoint
    try:
        config = llm.llm_engine.vllm_config
        assert config.model_config.enforce_eager is False
        assert config.compilation_config.cudagraph_mode.name != "NONE"
        assert stats(llm)["taps"] == [f"model.layers.{i}" for i in range(30)]
        vector = (4.0 * unit()).to("cuda", torch.bfloat16)
        before = stats(llm)
        with model.trace(PROMPT, temperature=0.0, max_tokens=4) as tracer:
            for _ in tracer.iter[:4]:
                hidden = model.model.layers[7].output[0]
                hidden[:] += vector.to(hidden)
        after = stats(llm)
        assert after["lowered"] - before["lowered"] == 1
        assert after["uncompiled_steps"] == before["uncompiled_steps"]  # every step graphed
    finally:
        llm.llm_engine.engine_core.shutdown()
