"""What a tap costs a graphed step when no row of it is lowered, per design.

Every decoder layer tapped costs 13-18% of an idle step with today's operations
(``taps/ops.py``: ``steer`` and ``keep``, about 15 small kernels a tap; see
``RESULTS.md``, 2026-12-04). This measures, outside vLLM, the two operations for
36 taps captured in one CUDA graph against one fused kernel a tap that steers in
place and keeps in the same pass, returning at once for a row nobody touches;
and checks that the fused kernel computes what today's operations compute, bit
for bit, on a table with steered and kept rows.

    python benchmarks/tap_kernels.py        # a CUDA device with Triton

Prints one ``RESULT {json}`` line per batch size.
"""

from __future__ import annotations

import importlib.util
import json
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

HIDDEN, SITES, ROWS, ENTRIES, STORE = 4096, 36, 8192, 256, 1 << 17


def _ops():
    """``taps/ops.py`` alone (the package's import would pull in vLLM)."""
    path = Path(__file__).resolve().parents[1] / "vllm_nnsight_plugin" / "taps" / "ops.py"
    spec = importlib.util.spec_from_file_location("tap_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@triton.jit
def _tap(hidden, residual, table, bank, store, site, sites, H: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    at = table + row * 3 * sites + site
    slot = tl.load(at)
    code = tl.load(at + sites)
    if (slot >= 0) | (code != 0):  # otherwise the row is left as it is
        dest = tl.load(at + 2 * sites).to(tl.int64)
        for start in range(0, H, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            h = tl.load(hidden + row * H + offs)
            if slot >= 0:
                h = (h.to(tl.float32) + tl.load(bank + slot.to(tl.int64) * H + offs)).to(h.dtype)
                tl.store(hidden + row * H + offs, h)
            if code != 0:
                r = tl.load(residual + row * H + offs)
                kept = tl.where(code == 2, r, h)
                kept = tl.where(code == 3, (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype), kept)
                tl.store(store + dest * H + offs, kept)
                if code == 4:
                    tl.store(store + (dest + 1) * H + offs, r)


def fused(hidden, residual, table, bank, store, site):
    rows = hidden.shape[0]
    _tap[(rows,)](hidden, residual, table, bank, store, site, SITES, H=HIDDEN, BLOCK=1024)
    return hidden


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


def today(ops, hidden, residual, table, bank, store):
    slots, codes, dest = (table[:, part].t() for part in range(3))
    for site in range(SITES):
        hidden = ops.steer(hidden, slots, bank, site)
        ops.keep(hidden, residual, codes, dest, store, site)
    return hidden


def fused_all(hidden, residual, table, bank, store):
    for site in range(SITES):
        fused(hidden, residual, table, bank, store, site)
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
    want = today(ops, hidden.clone(), residual, table, bank, want_store)
    got = fused_all(hidden.clone(), residual, table, bank, store)
    same = torch.equal(want, got) and torch.equal(want_store[1:], store[1:])  # row 0: today's sink
    found = dict(rows=rows, taps=SITES, same=same)
    for load in ("idle", "busy"):
        table, bank, store = tables(rows, busy=load == "busy")
        found[f"{load}_today_us"] = round(timed(partial(today, ops, hidden, residual, table, bank, store)), 1)
        found[f"{load}_fused_us"] = round(timed(partial(fused_all, hidden, residual, table, bank, store)), 1)
    return found


def main() -> None:
    ops = _ops()
    for rows in (64, 256, 1000):
        print("RESULT " + json.dumps(measure(ops, rows)), flush=True)


if __name__ == "__main__":
    main()
