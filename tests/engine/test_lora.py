"""LoRA: a traced request that names an adapter reads and edits the adapted model
(checked against HF transformers with the adapter merged into its weights), and
a request beside it without the adapter reads the base model."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import start_llm, stop_llm

PROMPTS = [[5, 17, 40, 9, 33, 81, 12], [7, 7, 90, 14, 3]]


@pytest.fixture(scope="module")
def adapted(tiny_qwen3_path, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from vllm.lora.request import LoRARequest

    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.models.tiny import build_lora_adapter, merged_lora

    adapter = build_lora_adapter(tmp_path_factory.mktemp("lora"), tiny_qwen3_path)
    # Two slots, one adapter: vLLM's CPU LoRA kernels (0.32) read a row without
    # an adapter from the last slot (index -1), so with one slot a plain request
    # beside an adapted one in the same step gets the adapter too (vllm-project/
    # vllm#48421). An empty last slot adds nothing.
    llm = start_llm(tiny_qwen3_path, enable_lora=True, max_lora_rank=8, max_loras=2)
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path, dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(tiny_qwen3_path, dtype=torch.float32).eval()
    merged_lora(merged, adapter)
    yield VLLM(llm), LoRARequest("random", 1, adapter), base, merged
    stop_llm(llm)


@torch.no_grad()
def hf_reads(hf, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1's attention output and the last position's logits."""
    got = {}
    handle = hf.model.layers[1].self_attn.register_forward_hook(
        lambda m, i, o: got.__setitem__("attn", o[0][0])
    )
    try:
        logits = hf(torch.tensor([ids])).logits[0, -1:]
    finally:
        handle.remove()
    return got["attn"], logits


def test_a_request_with_an_adapter_reads_the_adapted_model_beside_one_without(adapted):
    model, lora, base, merged = adapted
    with model.trace(temperature=0.0, max_tokens=1) as tracer:
        with tracer.invoke(PROMPTS[0], lora_request=lora):
            attn = model.model.layers[1].self_attn.output.save()
            logits = model.logits.save()
        with tracer.invoke(PROMPTS[1]):
            plain_attn = model.model.layers[1].self_attn.output.save()
            plain_logits = model.logits.save()
    want_attn, want_logits = hf_reads(merged, PROMPTS[0])
    torch.testing.assert_close(attn, want_attn, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    base_attn, base_logits = hf_reads(base, PROMPTS[0])
    assert (attn - base_attn).abs().max() > 1e-2  # the adapter changed something
    want_attn, want_logits = hf_reads(base, PROMPTS[1])
    torch.testing.assert_close(plain_attn, want_attn, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(plain_logits, want_logits, rtol=1e-4, atol=1e-4)


def test_an_edit_on_an_adapted_request_lands(adapted):
    model, lora, base, merged = adapted
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=1, lora_request=lora):
        model.model.layers[1].self_attn.output[:] = 0
        zeroed = model.logits.save()
    with torch.no_grad():
        handle = merged.model.layers[1].self_attn.register_forward_hook(
            lambda m, i, o: (torch.zeros_like(o[0]), *o[1:])
        )
        try:
            want = merged(torch.tensor([PROMPTS[0]])).logits[0, -1:]
        finally:
            handle.remove()
    torch.testing.assert_close(zeroed, want, rtol=1e-4, atol=1e-4)
