"""How saves travel back over HTTP (``wire/saves.py``), without an engine: vLLM's
output records come back as themselves, other types are refused unless the
server is trusted, and decoding is safe from many threads at once."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from vllm_nnsight_plugin.wire.saves import decode_request, encode_request


def finished(saves: dict) -> SimpleNamespace:
    return SimpleNamespace(request_id="r", nnsight_saves=saves, nnsight_sequences=[], nnsight_error=None)


def a_result():
    from vllm.outputs import CompletionOutput, RequestOutput

    done = CompletionOutput(index=0, text="x", token_ids=[1, 2], cumulative_logprob=None, logprobs=None)
    return RequestOutput("r", "p", [5, 6], None, [done], finished=True)


def test_a_saved_result_comes_back_as_vllms_own_record():
    saves = decode_request(encode_request(finished({"result": a_result(), "hidden": torch.ones(2, 3)}))).saves
    assert type(saves["result"]).__name__ == "RequestOutput" and saves["result"].outputs[0].token_ids == [
        1,
        2,
    ]
    assert torch.equal(saves["hidden"], torch.ones(2, 3))


class Unknown:
    pass


def test_a_save_of_another_type_is_refused_unless_the_server_is_trusted(monkeypatch):
    document = encode_request(finished({"odd": Unknown()}))
    with pytest.raises(ValueError, match="does not load from the network"):
        decode_request(document)
    monkeypatch.setenv("VLLM_NNSIGHT_TRUST_SERVER", "1")
    assert isinstance(decode_request(document).saves["odd"], Unknown)


def test_results_decode_from_many_threads_at_once():
    """Each decode admits vLLM's records for its own load only; one thread's
    admission ending must not refuse another thread's load halfway."""
    document = encode_request(finished({"result": a_result()}))
    with ThreadPoolExecutor(16) as pool:
        decoded = list(pool.map(lambda _: decode_request(document).saves["result"], range(400)))
    assert all(result.outputs[0].token_ids == [1, 2] for result in decoded)
