"""Engine settings every test engine and test server shares (small, fp32, eager)."""

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from vllm.platforms import current_platform

ENGINE_DEFAULTS = dict(
    dtype="float32",
    max_model_len=512,
    gpu_memory_utilization=0.3,
    kv_cache_memory_bytes=512 * 1024 * 1024,
    max_num_seqs=16,
    enforce_eager=True,
)

#: Where the engines' tensors live (the same tests run on a GPU: ``pytest -m gpu``
#: selects the GPU ones, ``-o addopts=`` the rest); a block's vector goes there.
#: vLLM's own answer: asking CUDA here would spoil the engine processes vLLM forks.
DEVICE = current_platform.device_type

#: How close one request's activations stay when it shares its steps with other
#: requests (the kernels a batch gets depend on its size): to the last bits on a
#: CPU; on an H200 in fp32 (vLLM 0.25.1) the residual stream moved by up to 8.3e-4
#: (``tests/engine/test_edits.py``, V1 runner), as stock vLLM's log-probabilities move by
#: up to 2.5e-3 there (``benchmarks/batching_noise.py``).
BATCHED = dict(rtol=1e-5, atol=1e-5) if DEVICE == "cpu" else dict(rtol=1e-3, atol=4e-3)


def assert_batched_close(got: Any, want: Any) -> None:
    """Two reads of the same rows taken in different batches: :data:`BATCHED` on a
    CPU; on CUDA every row's cosine similarity at least 0.9999 (element by element,
    fp32 batching noise reached 7.6e-3 on a residual stream's small entries)."""
    import torch

    if DEVICE == "cpu":
        torch.testing.assert_close(got, want, **BATCHED)
        return
    assert got.shape == want.shape and got.dtype == want.dtype
    a, b = got.double().reshape(-1, got.shape[-1]), want.double().reshape(-1, want.shape[-1])
    assert float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) >= 0.9999


#: vLLM's CPU setting for the cores an engine's workers compute on. Left to vLLM
#: ("auto": the first core, the other kept for the front end) in a serial run; with
#: two test workers (``pytest -n 2``, ``scripts/test.sh``) the second one's engines
#: take the second core (``tests/conftest.py``), and an engine of several ranks
#: names a core per rank or lets vLLM choose (:data:`UNBOUND`).
CORE_BIND = "VLLM_CPU_OMP_THREADS_BIND"
#: In :func:`environment`: the engine's ranks spread as vLLM chooses ("auto").
UNBOUND = {CORE_BIND: None}


def core_of(place: int | None) -> str | None:
    """The core for the engines of the ``place``-th of several processes side by
    side (test workers, the docs runner's two): vLLM gives every engine the first
    core, which would leave the others to the front ends alone. None (the first
    process, a serial run, one core): vLLM's choice."""
    cores = os.cpu_count() or 1
    return str(place % cores) if place and cores > 1 else None


@contextlib.contextmanager
def environment(env: dict[str, str | None] | None) -> Iterator[None]:
    """``env`` set in this process while an engine starts (the processes it spawns
    inherit it; a None value unsets the name), and put back afterwards."""
    saved = {name: os.environ.get(name) for name in env or {}}
    for name, value in (env or {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
