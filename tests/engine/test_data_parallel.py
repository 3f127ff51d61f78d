"""Data parallelism behind one server: ``--data-parallel-size 2`` on the tiny Qwen3
(two engines, one core each). Traced requests go to whichever engine the server
picks; each one's saves come back from that engine and equal HF's on the same
weights, a steering block steers on both, and afterwards the engine the
server's RPC route reaches (the first) holds no block. (One envelope across
several API server processes: ``test_gate.py``.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.engines import UNBOUND
from tests.reference import hf_locations, load_hf, rel_error
from tests.servers import start_server

KEY = "d" * 64
PROMPT = "The capital of France is"
REQUESTS = 8


@pytest.fixture(scope="module")
def two_engines(tiny_qwen3_path, tmp_path_factory):
    env = {"VLLM_NNSIGHT_KEY": KEY, "VLLM_SERVER_DEV_MODE": "1", **UNBOUND}
    log = str(tmp_path_factory.mktemp("logs") / "data-parallel.log")
    server = start_server(tiny_qwen3_path, log, env=env, data_parallel_size=2, kv_cache_memory_bytes=64 << 20)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(tiny_qwen3_path):
    from vllm_nnsight_plugin import VLLM

    return VLLM(tiny_qwen3_path)


def read(client, url: str) -> tuple[torch.Tensor, list[int]]:
    with client.trace(PROMPT, temperature=0.0, max_tokens=4, serve=url, key=KEY) as tracer:
        mlp = client.model.layers[1].mlp.output.clone().save()
        drawn = list().save()
        for _ in tracer.iter[:4]:
            drawn.append(client.samples.item())
        result = tracer.result.save()  # decoded by threads at once (the pool below)
    assert list(result.outputs[0].token_ids) == drawn
    return mlp, drawn


def steer(client, url: str) -> list[int]:
    with client.trace(PROMPT, temperature=0.0, max_tokens=4, serve=url, key=KEY) as tracer:
        drawn = list().save()
        for _ in tracer.iter[:4]:
            client.model.layers[0].mlp.output[:] = 0
            drawn.append(client.samples.item())
    return drawn


def test_saves_come_back_from_whichever_engine_ran_the_request(two_engines, client, tiny_qwen3_path):
    with ThreadPoolExecutor(REQUESTS) as pool:  # at once: the server spreads them over both engines
        reads = list(pool.map(lambda _: read(client, two_engines.url), range(REQUESTS)))
        steered = list(pool.map(lambda _: steer(client, two_engines.url), range(REQUESTS)))
    hf = load_hf(tiny_qwen3_path)
    expected = hf_locations(hf, client.tokenizer.encode(PROMPT), 1)["mlp_out"]
    for mlp, _ in reads:
        assert rel_error(mlp, expected) < 1e-4
    plain = reads[0][1]
    assert all(tokens == plain for _, tokens in reads)
    assert all(tokens == steered[0] for tokens in steered) and steered[0] != plain


def test_no_engine_holds_a_block_after(two_engines):
    answer = httpx.post(f"{two_engines.url}/collective_rpc", json={"method": "nnsight_tracked"}, timeout=30)
    assert answer.status_code == 200 and sum(int(x) for x in answer.json()["results"]) == 0
