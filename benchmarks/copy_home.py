"""How a large capture gets home: the two copies of a pool through shared memory.

    python benchmarks/copy_home.py [--requests 1000] [--rows 160] [--width 4096]

No engine: a flat bf16 tensor on the GPU the size of a capture (``--requests``
requests of ``--rows`` rows of ``--width``; the defaults are the GPU benchmark's
capture job, 1.3 GB) goes through ``Pool.share`` (the worker's copy into a new
``/dev/shm`` file) and then each request's part through ``Pool.own_views`` (the
front end's copy back onto the device), as a collect does. The same two copies
are also made the plain way (a pageable copy into the mapped file, and one
``.to(device)`` per request) for comparison, and the pool is lent on the device
instead (``returns/lent.py``: ``lend`` in a child process standing for the
engine's worker, ``own_lent`` here, as the front end). The worker's copies run with torch
on ``--worker-threads`` threads (default 1, as vLLM runs its engine processes),
the front end's with torch's default. Prints one JSON line, milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=160)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--worker-threads", type=int, default=1, help="torch threads for the worker's copy")
    args = parser.parse_args()

    import torch

    front_threads = torch.get_num_threads()

    from vllm_nnsight_plugin.returns import shared
    from vllm_nnsight_plugin.returns.pool import Pool

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    per = args.rows * args.width
    flat = torch.randn(args.requests * per, device=device).to(torch.bfloat16)
    places = {i: (0, i * per, (args.rows, args.width)) for i in range(args.requests)}
    os.environ.setdefault(shared.MIN_BYTES_ENV, str(1 << 20))
    found: dict[str, float] = {"gb": round(flat.numel() * 2 / 1e9, 2)}

    def timed(name: str, fn) -> object:
        torch.set_num_threads(args.worker_threads if "share" in name else front_threads)
        sync()
        start = time.perf_counter()
        value = fn()
        sync()
        found[name] = round(1000 * (time.perf_counter() - start), 1)
        return value

    for run in range(2):  # the second run finds the staging buffers made
        pool = Pool("bench", [flat], dict(places))
        timed(f"share_{run}", pool.share)
        views = timed(
            f"own_views_{run}", lambda pool=pool: [pool.own_views({i}) for i in range(args.requests)]
        )
        assert torch.equal(views[7][7], flat[7 * per : 8 * per].view(args.rows, args.width))
        del views

    # The plain copies, for comparison.
    path = os.path.join(shared.DIRECTORY, "vllm-nnsight-bench")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, flat.numel() * 2)
    os.close(fd)
    try:
        mapped = torch.from_file(path, shared=True, size=flat.numel(), dtype=flat.dtype)
        timed("plain_share", lambda: mapped.copy_(flat))
        back = torch.from_file(path, shared=False, size=flat.numel(), dtype=flat.dtype)
        timed("plain_own", lambda: [back[i * per : (i + 1) * per].to(device) for i in range(args.requests)])
    finally:
        os.unlink(path)
    if device == "cuda":
        found.update(_lent(args, places, per))
    found["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print("RESULT " + json.dumps(found), flush=True)


def _lender(conn, numel: int, places: dict, threads: int) -> None:
    """The worker, in a process of its own: lend the flat, time it, report its memory."""
    import pickle

    import torch

    from vllm_nnsight_plugin.returns.pool import Pool

    torch.set_num_threads(threads)
    for _ in range(2):
        flat = torch.randn(numel, device="cuda").to(torch.bfloat16)
        pool = Pool("bench", [flat], dict(places))
        del flat
        torch.cuda.synchronize()
        start = time.perf_counter()
        pool.share(lend=True)
        payload = pickle.dumps(pool)
        took = 1000 * (time.perf_counter() - start)
        del pool
        conn.send((took, payload))
        conn.recv()
    torch.cuda.ipc_collect()
    conn.send(torch.cuda.memory_allocated())


def _lent(args: argparse.Namespace, places: dict, per: int) -> dict[str, float]:
    """The same pool lent on the device (``returns/lent.py``): the worker in a
    child process, as vLLM's engine core is; the front end here."""
    import multiprocessing
    import pickle

    import torch

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=_lender, args=(theirs, args.requests * per, places, args.worker_threads))
    child.start()
    found: dict[str, float] = {}
    for run in range(2):
        took, payload = ours.recv()
        found[f"lend_{run}"] = round(took, 1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        pool = pickle.loads(payload)
        views = [pool.own_views({i}) for i in range(args.requests)]
        pool.close()
        torch.cuda.synchronize()
        found[f"own_lent_{run}"] = round(1000 * (time.perf_counter() - start), 1)
        del views, pool
        ours.send("done")
    found["lender_bytes_after"] = ours.recv()
    child.join(timeout=60)
    return found


if __name__ == "__main__":
    main()
