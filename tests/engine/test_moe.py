"""A tiny random mixture of experts (Qwen3-MoE, built in code): the router's
logits read as HF transformers computes them, and masking an expert through
them changes exactly what the same mask does in HF, beside an unedited
neighbour in the same batch."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import start_llm, stop_llm

LAYER, EXPERT = 1, 2  # the last layer's router is read; the first layer's is masked
PROMPTS = [[5, 17, 40, 9, 33, 81, 12], [7, 7, 90, 14, 3]]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.models.tiny import build_tiny_qwen3_moe

    path = build_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny-qwen3-moe"))
    llm = start_llm(path)
    yield VLLM(llm), hf_model(path)
    stop_llm(llm)


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_reads(hf, ids: list[int], mask: int | None = None, layer: int = LAYER) -> dict[str, torch.Tensor]:
    """A layer's router logits and MoE output, and the last position's logits;
    with ``mask``, that expert's router logit is -inf before routing."""
    import torch.nn.functional as F

    block = hf.model.layers[layer].mlp
    router, got = block.gate, {}
    original = router.forward

    def route(hidden):  # the router's own steps, with the logits edited first
        logits = F.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
        got["router"] = logits.clone()
        if mask is not None:
            logits[:, mask] = float("-inf")
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, index = torch.topk(probs, router.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index

    router.forward = route
    handle = block.register_forward_hook(lambda m, i, o: got.__setitem__("moe", o[0]))
    try:
        got["logits"] = hf(torch.tensor([ids])).logits[0, -1:]
    finally:
        router.forward = original
        handle.remove()
    return got


def test_the_router_logits_and_the_experts_output_read_as_in_hf(moe):
    model, hf = moe
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
        router = model.model.layers[LAYER].mlp.gate.output[0].save()
        out = model.model.layers[LAYER].mlp.output.save()
    want = hf_reads(hf, PROMPTS[0])
    assert router.shape == (len(PROMPTS[0]), 4)
    torch.testing.assert_close(router, want["router"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, want["moe"], rtol=1e-5, atol=1e-5)


def test_masking_an_expert_is_the_same_edit_as_in_hf_and_spares_the_neighbour(moe):
    model, hf = moe
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke(PROMPTS[0]):
            router = model.model.layers[0].mlp.gate.output[0]
            chose = (router.topk(2, dim=-1).indices == EXPERT).any().save()
            router[:, EXPERT] = float("-inf")
            masked = model.logits.save()
        with tracer.invoke(PROMPTS[1]):
            neighbour = model.logits.save()
    assert bool(chose)  # the expert was in some token's top two: the mask had work to do
    # (in the first layer, so through attention it reaches the last position's logits)
    want, unmasked = hf_reads(hf, PROMPTS[0], mask=EXPERT, layer=0), hf_reads(hf, PROMPTS[0], layer=0)
    torch.testing.assert_close(masked, want["logits"], rtol=1e-4, atol=1e-4)
    assert (masked - unmasked["logits"]).abs().max() > 1e-3
    torch.testing.assert_close(neighbour, hf_reads(hf, PROMPTS[1])["logits"], rtol=1e-4, atol=1e-4)
