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
    how = torch.zeros((16, 4))
    how[12:, 0] = torch.tensor([1.0, 2.0, 2.0, 1.0])  # the last four: directions removed or clamped
    how[12:, 1:3] = torch.tensor([[0.0, 0.0], [0.0, 0.0], [-0.5, 0.25], [float("-inf"), 1.0]])
    bank[12:] /= bank[12:].norm(dim=-1, keepdim=True)
    # four before them: the value scaled or filled, on every column or some
    how[8:12] = torch.tensor(
        [[3.0, 1.5, 0.0, width], [3.0, -0.3, 10.0, 50.0], [4.0, 0.0, 0.0, width], [4.0, 2.5, 64.0, 128.0]]
    )
    # and before those, rows patched: both values, the hidden state's only, the residual's only
    how[5:8] = torch.tensor([[5.0, 5.0, 2.0, 0.0], [5.0, 3.0, -1.0, 0.0], [5.0, -1.0, 4.0, 0.0]])
    # and one patched on some columns (a head's): from another row of the bank
    how[4] = torch.tensor([6.0, 9.0, 64.0, 128.0])
    return table.to(device), bank.to(device), how.to(device)


#: How close a row whose direction was removed or clamped must come: the kernel
#: sums ``s @ u`` in float32 in its own order, which may move the rounded
#: coefficient by a unit in its last place (bf16: 2**-8 of it).
CLOSE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def projected_rows(table, how, site: int, rows: int) -> torch.Tensor:
    """The rows at ``site`` whose entry removes or clamps a direction."""
    slots = table[:rows, 0, site].long()
    mode = how[slots.clamp(min=0), 0]
    return (slots >= 0) & ((mode == ops.PROJECT) | (mode == ops.PROJECT_STREAM))


def patched_rows(table, how, site: int, rows: int) -> torch.Tensor:
    """The rows at ``site`` whose entry patches them."""
    slots = table[:rows, 0, site].long()
    return (slots >= 0) & (
        (how[slots.clamp(min=0), 0] == ops.PATCH) | (how[slots.clamp(min=0), 0] == ops.PATCH_COLUMNS)
    )


def check_against_the_tensor_operations(hidden, residual, table, bank, how, site, dtype, launch) -> None:
    """The kernel (``launch(keeps, store, residual)``) against ``steer`` then ``keep``:
    bit for bit on every row but those that remove or clamp a direction, close
    there; on a pair (``keeps`` 1) the residual's patched rows too."""
    slots, codes, dest = (table[:, part].t() for part in range(3))
    rows = hidden.shape[0]
    projected = projected_rows(table, how, site, rows)
    for keeps in (1, 0, 2):
        pair = keeps == 1
        want_residual, got_residual = residual.clone(), residual.clone()
        steer = ops.steer_pair if pair else ops.steer
        want = steer(hidden, want_residual, slots, bank, how, site)
        store = torch.zeros(
            (2 * table.shape[2] * rows + 4, hidden.shape[1]), dtype=dtype, device=hidden.device
        )
        want_store = store.clone()
        if keeps:
            ops.keep(want, want if keeps == 2 else want_residual, codes, dest, want_store, site)
        got = launch(keeps, store, got_residual)
        assert torch.equal(got_residual, want_residual), keeps  # a pair's patched rows, or untouched
        if not pair:
            assert torch.equal(got_residual, residual), keeps
        assert torch.equal(got[~projected], want[~projected]), keeps
        scale = float(hidden.abs().max())
        assert float((got - want).abs().max()) <= CLOSE[dtype] * scale, keeps
        assert float((store[1:] - want_store[1:]).abs().max()) <= 2 * CLOSE[dtype] * scale, keeps
        if not bool(projected.any()):  # only additions: the same bits everywhere
            assert torch.equal(got, want) and torch.equal(store[1:], want_store[1:]), keeps
    assert not torch.equal(got, hidden)  # some rows were edited


def check_in_place(hidden, residual, table, bank, how, site) -> None:
    """The kernel writing over its value (``in_place``, what a graph not split at the
    taps runs) against the kernel writing a new tensor: the same bits in the value,
    the store and a pair's residual, for every ``keeps``; untouched rows stay put."""
    kernel = ops._kernel()
    for keeps in (1, 0, 2):
        stores = [torch.zeros((2 * table.shape[2] * hidden.shape[0] + 4, hidden.shape[1]), dtype=hidden.dtype,
                              device=hidden.device) for _ in range(2)]  # fmt: skip
        residuals = [residual.clone(), residual.clone()]
        want = ops.launch(kernel, hidden, residuals[0], table, bank, how, stores[0], site, keeps, keeps == 1)
        value = hidden.clone()
        got = ops.launch(
            kernel, value, residuals[1], table, bank, how, stores[1], site, keeps, keeps == 1, out=value
        )
        assert got is value and torch.equal(got, want), keeps
        assert torch.equal(stores[0], stores[1]) and torch.equal(residuals[0], residuals[1]), keeps
        # and as the operations a graph calls (the kernel on CUDA, tensor operations elsewhere)
        for store in stores:
            store.zero_()
        residuals = [residual.clone(), residual.clone()]
        value = hidden.clone()
        if keeps == 1:
            want = ops.tapped_pair(hidden, residuals[0], table, bank, how, stores[0], site)
            ops.tap_pair_in_place.default(value, residuals[1], table, bank, how, stores[1], site)
        else:  # (a tensor's tap: its second value is the value itself)
            want = ops.tapped(hidden, hidden, table, bank, how, stores[0], site, keeps)
            assert ops.tapped_in_place(value, table, bank, how, stores[1], site, keeps) is value
        assert torch.equal(value, want), keeps
        assert torch.equal(stores[0], stores[1]) and torch.equal(residuals[0], residuals[1]), keeps
    assert not torch.equal(want, hidden)  # some rows were edited


def check_a_value_of_another_width(width, dtype, device, launch) -> None:
    """A tap whose value is ``width`` wide beside a bank and store 576 wide (an MLP's
    neurons): the kernel (``launch(hidden, keeps, store)``) against the tensor
    operations, bit for bit; only the edits that read no bank row (scaled, filled)
    touch it; each kept row lies flat over the store's rows from its destination."""
    generator = torch.Generator().manual_seed(width)
    rows, sites, bank_width = 37, 3, 576
    table, bank, how = busy_tables(rows, bank_width, sites, generator, device=device)
    k = ops.chunks(width, bank_width)
    # room for 2k rows (code 4's two values) per kept row, after row 0
    place = 2 * k * (1 + torch.arange(sites)[None, :] * rows + torch.arange(rows)[:, None])
    table[:rows, 2] = torch.where(table[:rows, 1] > 0, place.to(device), 0).to(torch.int32)
    slots, codes, dest = (table[:, part].t() for part in range(3))
    edited = 0
    for site in range(sites):
        hidden = torch.randn((rows, width), generator=generator).to(dtype).to(device)
        mode = torch.where(slots[site, :rows] >= 0, how[slots[site, :rows].clamp(min=0).long(), 0], -1.0)
        changed = (mode == ops.SCALE) | (mode == ops.FILL)
        for keeps in (0, 2):
            store = torch.zeros((2 * k * (rows * sites + 2), bank_width), dtype=dtype, device=device)
            want_store = store.clone()
            want = ops.steer(hidden, hidden, slots, bank, how, site)
            if keeps:
                ops.keep(want, want, codes, dest, want_store, site)
            got = launch(hidden, table, bank, how, site, keeps, store)
            assert torch.equal(got, want), keeps
            assert torch.equal(got[~changed], hidden[~changed])  # no other edit reaches it
            edited += int((got != hidden).any(-1).sum())  # those do
            assert torch.equal(store[1:], want_store[1:]), keeps
            if keeps:
                flat = store.view(-1)
                for row in range(rows):
                    code, at = int(codes[site, row]), int(dest[site, row]) * bank_width
                    if code in (1, 4):
                        assert torch.equal(flat[at : at + width], got[row])
                    if code == 4:
                        assert torch.equal(flat[at + k * bank_width : at + k * bank_width + width], got[row])
    assert edited  # some rows were scaled or filled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [1536, 100])
def test_the_tap_kernel_on_a_value_of_another_width_than_the_bank(dtype, width):
    def launch(hidden, table, bank, how, site, keeps, store):
        return ops.tapped(hidden, hidden, table, bank, how, store, site, keeps)

    check_a_value_of_another_width(width, dtype, "cuda", launch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [576, 4096])
def test_the_tap_kernel_computes_what_the_tensor_operations_do(dtype, width):
    assert ops._kernel() is not None, "Triton is missing: taps on CUDA would run as tensor operations"
    generator = torch.Generator().manual_seed(width)
    rows, sites = 37, 3
    table, bank, how = busy_tables(rows, width, sites, generator)
    for edits in (torch.zeros_like(how), how):  # additions only, then the other edits too
        for site in range(sites):
            hidden = torch.randn((rows, width), generator=generator).to(dtype).cuda()
            residual = torch.randn((rows, width), generator=generator).to(dtype).cuda()

            def launch(keeps, store, residual, hidden=hidden, site=site, edits=edits):
                if keeps == 1:
                    return ops.tapped_pair(hidden, residual, table, bank, edits, store, site)
                return ops.tapped(hidden, residual, table, bank, edits, store, site, keeps)

            check_against_the_tensor_operations(hidden, residual, table, bank, edits, site, dtype, launch)
            check_in_place(hidden, residual, table, bank, edits, site)
    # the tables do project some rows and patch some (at one site or another)
    assert any(bool(projected_rows(table, how, site, rows).any()) for site in range(sites))
    assert any(bool(patched_rows(table, how, site, rows).any()) for site in range(sites))
