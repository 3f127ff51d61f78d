"""Every location of the user docs' table, and the logits, equal HF transformers on
the same fp32 weights within 1e-4 relative error: one prompt, eight mixed-length
prompts batched in one trace, the same prompt traced twice with prefix
caching on, and an installed edit's reads on plain requests. Real SmolLM2
weights and a tiny random Qwen3."""

from __future__ import annotations

import pytest

from tests.conftest import start_llm, stop_llm
from tests.reference import LOCATIONS, hf_locations, load_hf, rel_error

TOLERANCE = 1e-4
PROMPTS = [
    "The capital of France is",
    "Paris is in",
    "Berlin is the capital of Germany, and Rome is the capital of",
    "One",
    "A small model reads a short sentence and writes another one about the river bank.",
    "Interpretability asks what each layer computes",
    "The quick brown fox",
    "Numbers like 1, 2, 3",
]


def read_locations(model, prompts: list[str], layer: int) -> list[dict]:
    """Run one trace with an invoke per prompt; return each prompt's locations."""
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                layer_module = model.model.layers[layer]
                embeddings = model.model.embed_tokens.output.clone().save()
                resid_before = layer_module.input_layernorm.output[1].clone().save()
                qkv_fused = layer_module.self_attn.qkv_proj.output[0].clone().save()
                kernel_args = layer_module.self_attn.attn.inputs[0]
                attn_q = kernel_args[0].clone().save()
                attn_k = kernel_args[1].clone().save()
                attn_v = kernel_args[2].clone().save()
                o_proj_in = layer_module.self_attn.o_proj.input.clone().save()
                attn_out = layer_module.self_attn.output.clone().save()
                mlp_act = layer_module.mlp.act_fn.output.clone().save()
                mlp_out = layer_module.mlp.output.clone().save()
                resid_after = (layer_module.output[0] + layer_module.output[1]).save()
                final_norm = model.model.norm.output[0].clone().save()
                logits = model.logits.clone().save()
    # The trace binds each saved name in this frame; LOCATIONS lists them.
    saved = locals()
    values = {name: saved[name] for name in LOCATIONS}
    if len(prompts) == 1:
        return [values]
    return [{name: values[name][i] for name in LOCATIONS} for i in range(len(prompts))]


def edited_locations(model, prompts: list[str], layer: int) -> list[dict]:
    """The same reads as an installed edit, on plain requests (one batch)."""
    with model.edit() as (tracer, edit):
        layer_module = model.model.layers[layer]
        embeddings = model.model.embed_tokens.output.clone().save()  # noqa: F841
        resid_before = layer_module.input_layernorm.output[1].clone().save()  # noqa: F841
        qkv_fused = layer_module.self_attn.qkv_proj.output[0].clone().save()  # noqa: F841
        kernel_args = layer_module.self_attn.attn.inputs[0]
        attn_q = kernel_args[0].clone().save()  # noqa: F841
        attn_k = kernel_args[1].clone().save()  # noqa: F841
        attn_v = kernel_args[2].clone().save()  # noqa: F841
        o_proj_in = layer_module.self_attn.o_proj.input.clone().save()  # noqa: F841
        attn_out = layer_module.self_attn.output.clone().save()  # noqa: F841
        mlp_act = layer_module.mlp.act_fn.output.clone().save()  # noqa: F841
        mlp_out = layer_module.mlp.output.clone().save()  # noqa: F841
        resid_after = (layer_module.output[0] + layer_module.output[1]).save()  # noqa: F841
        final_norm = model.model.norm.output[0].clone().save()  # noqa: F841
        logits = model.logits.clone().save()  # noqa: F841
    try:
        outputs = model.generate(prompts, temperature=0.0, max_tokens=1)
    finally:
        edit.clear()
    return [{name: output.saves[name] for name in LOCATIONS} for output in outputs]


def check(model, hf, prompts: list[str], layer: int, label: str, read=read_locations) -> None:
    tokenizer = model.tokenizer
    got = read(model, prompts, layer)
    worst: dict[str, float] = {}
    for prompt, values in zip(prompts, got):
        ids = tokenizer(prompt)["input_ids"]
        expected = hf_locations(hf, ids, layer)
        for name in LOCATIONS:
            assert tuple(values[name].shape) == tuple(expected[name].shape), (label, name, prompt)
            worst[name] = max(worst.get(name, 0.0), rel_error(values[name], expected[name]))
    print(f"\nfidelity {label}: " + ", ".join(f"{k}={v:.1e}" for k, v in worst.items()))
    bad = {k: v for k, v in worst.items() if v > TOLERANCE}
    assert not bad, f"{label}: relative error over {TOLERANCE}: {bad}"


@pytest.fixture(scope="module")
def smol_hf(smollm2_path):
    return load_hf(smollm2_path)


def test_smollm2_one_prompt(smol, smol_hf):
    check(smol, smol_hf, PROMPTS[:1], 10, "smollm2/one")


def test_smollm2_eight_mixed_prompts(smol, smol_hf):
    check(smol, smol_hf, PROMPTS, 10, "smollm2/eight")


def test_smollm2_prefix_cached_prompt_traced_twice(smol, smol_hf):
    # A plain run first fills the prefix cache with this prompt's blocks.
    long_prompt = " ".join(PROMPTS)
    smol.generate(long_prompt, temperature=0.0, max_tokens=2)
    check(smol, smol_hf, [long_prompt], 10, "smollm2/cached-1")
    check(smol, smol_hf, [long_prompt], 10, "smollm2/cached-2")


def test_smollm2_an_installed_edit_reads_what_hf_computes(smol, smol_hf):
    check(smol, smol_hf, PROMPTS, 10, "smollm2/edit", read=edited_locations)


@pytest.fixture(scope="module")
def qwen3(tiny_qwen3_path):
    from vllm_nnsight_plugin import VLLM

    llm = start_llm(tiny_qwen3_path)
    yield VLLM(llm), load_hf(tiny_qwen3_path)
    stop_llm(llm)


def test_tiny_qwen3_one_and_eight_prompts(qwen3):
    model, hf = qwen3
    check(model, hf, PROMPTS[:1], 1, "qwen3/one")
    check(model, hf, PROMPTS, 1, "qwen3/eight")
    check(model, hf, PROMPTS[4:5], 1, "qwen3/cached-1")
    check(model, hf, PROMPTS[4:5], 1, "qwen3/cached-2")
    check(model, hf, PROMPTS, 1, "qwen3/edit", read=edited_locations)
