"""Tensor parallelism on the CPU: the tiny Qwen3 at two ranks (one core each)
against the same weights at one rank. The locations of the user docs' table that
are gathered read the whole tensor one rank gives (fused projections in one
rank's layout; the MLP's activation and the attention kernel's arguments too),
a write at a split location lands the same, and the tokens are the same.
Parameters read in a block are whole."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import start_llm, stop_llm
from tests.engine.test_fidelity import PROMPTS, read_locations
from tests.engines import CORE_BIND, environment
from tests.reference import LOCATIONS

TOLERANCE = 1e-5
#: Read per rank at two ranks (their width halves), not gathered.
PER_RANK: tuple[str, ...] = ()


@pytest.fixture(scope="module")
def ranks(tiny_qwen3_path):
    """``{1: model, 2: model}``, built one after the other (never both alive)."""
    from vllm_nnsight_plugin import VLLM

    found = {}
    with environment({CORE_BIND: "0|1"}):  # vLLM's CPU build: a core per rank
        for size in (1, 2):
            llm = start_llm(tiny_qwen3_path, tensor_parallel_size=size, kv_cache_memory_bytes=64 << 20)
            model = VLLM(llm)
            found[size] = run(model)
            stop_llm(llm)
    return found


def run(model) -> dict:
    """What the checks compare, read from one engine."""
    locations = read_locations(model, PROMPTS[:3], 1)

    def steered() -> list[int]:
        with model.trace(PROMPTS[0], temperature=0.0, max_tokens=6) as tracer:
            drawn = list().save()
            for _ in tracer.iter[:6]:  # in the model's order
                model.model.layers[0].self_attn.qkv_proj.output[0][:, 256:320] = 0  # key head 0
                model.model.layers[0].mlp.gate_up_proj.output[0][:, 200:300] *= (
                    2.0  # across both ranks' gates
                )
                model.model.layers[1].self_attn.o_proj.input[:, :64] = 0  # head 0 (rank 0's half)
                drawn.append(model.samples.item())
        return drawn

    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
        layer = model.model.layers[1]
        lm_head = model.lm_head.weight.clone().save()  # vocabulary-parallel
        norm = model.model.norm.weight.clone().save()  # held whole by every rank
        qkv = layer.self_attn.qkv_proj.weight.clone().save()  # fused, column-parallel
        o_proj = layer.self_attn.o_proj.weight.clone().save()  # row-parallel
        gate_up = layer.mlp.gate_up_proj.weight.clone().save()
        down = layer.mlp.down_proj.weight.clone().save()
        lens = (layer.mlp.output[-1] @ model.lm_head.weight.T).save()  # a logit lens
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=8) as tracer:
        result = tracer.result.save()
    (stats,) = model.vllm_entrypoint.collective_rpc("nnsight_stats")[:1]
    return {
        "locations": locations,
        "weights": {
            "lm_head": lm_head,
            "norm": norm,
            "qkv": qkv,
            "o_proj": o_proj,
            "gate_up": gate_up,
            "down": down,
        },
        "lens": lens,
        "steered": steered(),
        "tokens": list(result.outputs[0].token_ids),
        "tracked": stats["tracked"],
    }


def test_every_gathered_location_reads_as_at_one_rank(ranks):
    one, two = ranks[1], ranks[2]
    worst = {}
    for a, b in zip(one["locations"], two["locations"]):
        for name in PER_RANK:
            assert b[name].shape[-1] * 2 == a[name].shape[-1], name
        for name in (n for n in LOCATIONS if n not in PER_RANK):
            assert tuple(a[name].shape) == tuple(b[name].shape), name
            error = ((b[name].float() - a[name].float()).norm() / a[name].float().norm()).item()
            worst[name] = max(worst.get(name, 0.0), error)
    print("\ntensor parallel, two ranks against one: " + ", ".join(f"{k}={v:.1e}" for k, v in worst.items()))
    assert all(v < TOLERANCE for v in worst.values()), worst


def test_writes_at_split_locations_land_as_at_one_rank(ranks):
    assert ranks[2]["tokens"] == ranks[1]["tokens"]
    assert ranks[2]["steered"] == ranks[1]["steered"]
    assert ranks[2]["steered"] != ranks[1]["tokens"][:6]
    assert ranks[2]["tracked"] == 0


def test_fused_pieces_are_laid_out_as_at_one_rank(ranks):
    """Queries, keys, values, each whole: the key block at two ranks is the key
    block at one (a plain gather would put rank 1's queries there)."""
    one = ranks[1]["locations"][0]["qkv_fused"]
    two = ranks[2]["locations"][0]["qkv_fused"]
    torch.testing.assert_close(two[:, 256:384], one[:, 256:384], rtol=1e-5, atol=1e-5)


def test_parameters_read_whole_as_at_one_rank(ranks):
    """A block reading a split parameter gets the whole one (``worker/parameters.py``),
    so a logit lens over ``lm_head.weight`` sees the whole vocabulary."""
    one, two = ranks[1], ranks[2]
    for name, weight in one["weights"].items():
        assert torch.equal(two["weights"][name], weight), name
    assert two["lens"].shape == one["lens"].shape
    torch.testing.assert_close(two["lens"], one["lens"], rtol=1e-5, atol=1e-5)
