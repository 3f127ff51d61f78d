"""The tap operation's CUDA kernel (``taps/ops.py``) against the tensor operations it
stands for (``steer`` then ``keep``), bit for bit: every keep code, steered and
untouched rows, widths that are and are not a multiple of the kernel's block,
bf16 and fp32. No engine.

Run with ``pytest -m gpu`` on a machine with a GPU (``scripts/gpu/README.md``).
"""

from __future__ import annotations

import pytest
import torch

from vllm_nnsight_plugin.taps import ops

pytestmark = pytest.mark.gpu


def busy_tables(rows: int, width: int, sites: int, generator: torch.Generator, device: str = "cuda"):
    table = torch.zeros((rows + 8, 3, sites), dtype=torch.int32)
    table[:, 0].fill_(-1)
    for site in range(sites):
        steered = torch.randperm(rows, generator=generator)[: rows // 3]
        table[steered, 0, site] = torch.randint(
            0, 16, (len(steered),), generator=generator, dtype=torch.int32
        )
        kept = torch.randperm(rows, generator=generator)[: rows // 2]
        table[kept, 1, site] = torch.randint(1, 5, (len(kept),), generator=generator, dtype=torch.int32)
        table[kept, 2, site] = (2 + 2 * (site * rows + kept)).to(torch.int32)
    bank = torch.randn((16, width), generator=generator)
    return table.to(device), bank.to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [576, 4096])
def test_the_tap_kernel_computes_what_the_tensor_operations_do(dtype, width):
    assert ops._kernel() is not None, "Triton is missing: taps on CUDA would run as tensor operations"
    generator = torch.Generator().manual_seed(width)
    rows, sites = 37, 3
    table, bank = busy_tables(rows, width, sites, generator)
    slots, codes, dest = (table[:, part].t() for part in range(3))
    for site in range(sites):
        hidden = torch.randn((rows, width), generator=generator).to(dtype).cuda()
        residual = torch.randn((rows, width), generator=generator).to(dtype).cuda()
        store = torch.zeros((2 * sites * rows + 4, width), dtype=dtype, device="cuda")
        want_store = store.clone()
        want = ops.steer(hidden, slots, bank, site)
        ops.keep(want, residual, codes, dest, want_store, site)
        got = torch.ops.vllm_nnsight.tap(hidden, residual, table, bank, store, site, 1)
        assert torch.equal(got, want)
        assert torch.equal(store[1:], want_store[1:])  # row 0: where the tensor operations drop rows
        assert not torch.equal(got, hidden)  # some rows were steered
        alone = torch.ops.vllm_nnsight.tap(hidden, residual, table, bank, store, site, 0)
        assert torch.equal(alone, want)  # a tap that keeps nothing still steers
        tensor_store = torch.zeros_like(store)
        ops.keep(want, want, codes, dest, want_store, site)  # a tensor's tap: the steered value twice
        assert torch.equal(
            torch.ops.vllm_nnsight.tap(hidden, residual, table, bank, tensor_store, site, 2), want
        )
        assert torch.equal(tensor_store[1:], want_store[1:])
