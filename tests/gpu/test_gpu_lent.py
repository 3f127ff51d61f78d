"""Pools lent on the device (``returns/lent.py``): a worker process lends a flat
tensor on its GPU, this process (the front end) reads each request's part from
it, and the lender's memory is free again once the front end lets go.

No engine: a child process stands for the worker. Run with ``pytest -m gpu``.
"""

from __future__ import annotations

import multiprocessing
import pickle

import pytest
import torch

pytestmark = pytest.mark.gpu

REQUESTS, ROWS, WIDTH = 8, 64, 4096  # 8 MiB of float32 per flat


def _places() -> dict:
    per = ROWS * WIDTH
    return {i: (0, i * per, (ROWS, WIDTH)) for i in range(REQUESTS)}


def _lender(conn) -> None:
    """The worker: lend one pool, then report its device memory once told."""
    import os

    os.environ["VLLM_NNSIGHT_SHARED_SAVES_BYTES"] = str(1 << 20)
    from vllm_nnsight_plugin.returns.lent import LentFlat
    from vllm_nnsight_plugin.returns.pool import Pool

    flat = torch.arange(REQUESTS * ROWS * WIDTH, device="cuda", dtype=torch.float32)
    pool = Pool("lent", [flat], _places())
    del flat
    pool.share(lend=True)
    conn.send((isinstance(pool.flats[0], LentFlat), pickle.dumps(pool)))
    del pool
    held = torch.cuda.memory_allocated()
    conn.recv()  # the front end is done with it
    torch.cuda.ipc_collect()
    conn.send((held, torch.cuda.memory_allocated()))


@pytest.mark.parametrize("read", [True, False], ids=["read", "never-read"])
def test_a_lent_pool_reads_whole_and_is_freed_once_let_go(read):
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=_lender, args=(theirs,))
    child.start()
    try:
        was_lent, payload = ours.recv()
        assert was_lent
        pool = pickle.loads(payload)
        if read:
            per = ROWS * WIDTH
            for i in range(REQUESTS):
                (got,) = pool.own_views({i}).values()
                want = torch.arange(i * per, (i + 1) * per, device="cuda", dtype=torch.float32)
                assert got.device.type == "cuda" and torch.equal(got.reshape(-1), want)
                assert got.untyped_storage().nbytes() == per * 4  # a copy of its own part only
        pool.close()
        del pool
        ours.send("done")
        held, after = ours.recv()
        assert held >= REQUESTS * ROWS * WIDTH * 4  # kept for the front end after the send
        assert after == 0
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0
