"""What a tap costs a graphed step, as tensor operations and as one kernel.

With every decoder layer tapped, the tap as two operations of tensor code
(``taps/ops.py``: ``steer`` and ``keep``, about 15 small kernels a tap) took
13-18% of an idle step (``RESULTS.md``, 2026-12-04). This measures, outside
vLLM, those two operations for 36 taps captured in one CUDA graph against the
tap operation's Triton kernel (one a tap: it steers and keeps in one pass, and
a row nobody touches costs one copy), idle and with busy tables, and checks
that the kernel computes what the two operations compute, bit for bit; and the
kernel writing over each tap's value (``tap_pair_in_place``, what a graph not
split at the taps runs), against the kernel writing a new tensor.

    python benchmarks/tap_kernels.py        # a CUDA device with Triton

Prints one ``RESULT {json}`` line per batch size.
"""

from __future__ import annotations

import importlib.util
import json
from functools import cache, partial
from pathlib import Path

import torch

HIDDEN, SITES, ROWS, ENTRIES, STORE = 4096, 36, 8192, 256, 1 << 17


def _ops():
    """``taps/ops.py`` alone (the package's import would pull in vLLM)."""
    path = Path(__file__).resolve().parents[1] / "vllm_nnsight_plugin" / "taps" / "ops.py"
    spec = importlib.util.spec_from_file_location("tap_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tables(rows: int, busy: bool):
    """The table (``[row, part, site]`` as ``install.TapTables`` holds it), a bank and a store."""
    table = torch.zeros((ROWS, 3, SITES), dtype=torch.int32, device="cuda")
    table[:, 0].fill_(-1)
    if busy:  # some rows steered, some kept in every way, at every site
        g = torch.Generator().manual_seed(0)
        for site in range(SITES):
            steered = torch.randperm(rows, generator=g)[: rows // 4]
            table[steered, 0, site] = torch.randint(
                0, ENTRIES, (len(steered),), generator=g, dtype=torch.int32
            ).cuda()
            kept = torch.randperm(rows, generator=g)[: rows // 4]
            table[kept, 1, site] = torch.randint(1, 5, (len(kept),), generator=g, dtype=torch.int32).cuda()
            table[kept, 2, site] = (2 + 2 * (site * rows + kept)).to(torch.int32).cuda()
    bank = torch.randn((ENTRIES, HIDDEN), device="cuda")
    store = torch.zeros((STORE, HIDDEN), dtype=torch.bfloat16, device="cuda")
    return table, bank, store


@cache
def how() -> torch.Tensor:
    """Every entry an addition (``ops.steer``'s ``how``)."""
    return torch.zeros((ENTRIES, 4), device="cuda")


def tensor_ops(ops, hidden, residual, table, bank, store):
    slots, codes, dest = (table[:, part].t() for part in range(3))
    for site in range(SITES):
        hidden = ops.steer_pair(hidden, residual, slots, bank, how(), site)
        ops.keep(hidden, residual, codes, dest, store, site)
    return hidden


def kernel(ops, hidden, residual, table, bank, store):
    for site in range(SITES):
        hidden = ops.tapped_pair(hidden, residual, table, bank, how(), store, site)
    return hidden


def kernel_in_place(ops, hidden, residual, table, bank, store):
    """The kernel writing over each tap's value (what a graph not split at the taps
    runs): a row nobody steers or keeps is not copied."""
    for site in range(SITES):
        ops.tap_pair_in_place.default(hidden, residual, table, bank, how(), store, site)
    return hidden


def timed(fn, replays: int = 200) -> float:
    """Microseconds per replay of ``fn`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / replays


def measure(ops, rows: int) -> dict:
    hidden = torch.randn((rows, HIDDEN), device="cuda").to(torch.bfloat16)
    residual = torch.randn((rows, HIDDEN), device="cuda").to(torch.bfloat16)
    # the same result, bit for bit, on a busy table
    table, bank, store = tables(rows, busy=True)
    want_store = store.clone()
    want = tensor_ops(ops, hidden.clone(), residual, table, bank, want_store)
    got = kernel(ops, hidden.clone(), residual, table, bank, store)
    in_place_store = torch.zeros_like(store)
    in_place = kernel_in_place(ops, hidden.clone(), residual, table, bank, in_place_store)
    # row 0 of the store: where the tensor operations drop the rows nobody keeps
    same = torch.equal(want, got) and torch.equal(want_store[1:], store[1:])
    same_in_place = torch.equal(in_place, got) and torch.equal(in_place_store, store)
    found = dict(rows=rows, taps=SITES, same=same, same_in_place=same_in_place)
    for load in ("idle", "busy"):
        table, bank, store = tables(rows, busy=load == "busy")
        found[f"{load}_tensor_ops_us"] = round(
            timed(partial(tensor_ops, ops, hidden, residual, table, bank, store)), 1
        )
        found[f"{load}_kernel_us"] = round(
            timed(partial(kernel, ops, hidden, residual, table, bank, store)), 1
        )
        found[f"{load}_kernel_in_place_us"] = round(
            timed(partial(kernel_in_place, ops, hidden.clone(), residual, table, bank, store)), 1
        )
    return found


def main() -> None:
    ops = _ops()
    for rows in (64, 256, 1000):
        print("RESULT " + json.dumps(measure(ops, rows)), flush=True)


if __name__ == "__main__":
    main()
