"""Truth for the fidelity tests: the same locations read from HF transformers (fp32)
on the same weights, and the matching nnsight block for the plugin.

Location names follow the "by name" table of the user docs. Each value is
``[tokens, width]`` for one prompt (HF's batch axis dropped)."""

from __future__ import annotations

import torch

LOCATIONS = (
    "embeddings",
    "resid_before",
    "qkv_fused",
    "attn_q",
    "attn_k",
    "attn_v",
    "o_proj_in",
    "attn_out",
    "mlp_act",
    "mlp_out",
    "resid_after",
    "final_norm",
    "logits",
)

_CAPTURED: dict[int, tuple] = {}


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """An HF attention function that records q/k/v as the kernel gets them."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _CAPTURED[module.layer_idx] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def load_hf(path: str):
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register("vllm_nnsight_capture", _capture_attention)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="vllm_nnsight_capture"
    )
    return model.eval()


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[1, heads, T, d]`` -> ``[T, heads * d]``."""
    return x[0].transpose(0, 1).reshape(x.shape[2], -1)


@torch.no_grad()
def hf_locations(model, token_ids: list[int], layer: int) -> dict[str, torch.Tensor]:
    block = model.model.layers[layer]
    attn, mlp = block.self_attn, block.mlp
    got: dict[str, torch.Tensor] = {}
    hooks = []

    def out(name, pick=lambda o: o):
        def hook(module, args, output):
            got[name] = pick(output)[0].detach().clone()

        return hook

    def inp(name):
        def hook(module, args):
            got[name] = args[0][0].detach().clone()

        return hook

    hooks.append(model.model.embed_tokens.register_forward_hook(out("embeddings")))
    for proj in ("q_proj", "k_proj", "v_proj"):
        hooks.append(getattr(attn, proj).register_forward_hook(out(proj)))
    hooks.append(attn.o_proj.register_forward_pre_hook(inp("o_proj_in")))
    hooks.append(attn.register_forward_hook(out("attn_out", lambda o: o[0])))
    hooks.append(mlp.down_proj.register_forward_pre_hook(inp("mlp_act")))
    hooks.append(mlp.register_forward_hook(out("mlp_out")))
    hooks.append(model.model.norm.register_forward_hook(out("final_norm")))
    try:
        result = model(torch.tensor([token_ids]), output_hidden_states=True)
    finally:
        for hook in hooks:
            hook.remove()
    got["qkv_fused"] = torch.cat([got.pop("q_proj"), got.pop("k_proj"), got.pop("v_proj")], dim=-1)
    q, k, v = _CAPTURED[layer]
    got["attn_q"], got["attn_k"], got["attn_v"] = _flat(q), _flat(k), _flat(v)
    got["resid_before"] = result.hidden_states[layer][0]
    got["resid_after"] = result.hidden_states[layer + 1][0]
    got["logits"] = result.logits[0, -1:]
    return got


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e|: the error relative to the location's scale."""
    actual = actual.to(torch.float32).reshape(expected.shape)
    scale = expected.abs().max().clamp_min(1e-12)
    return float((actual - expected).abs().max() / scale)
