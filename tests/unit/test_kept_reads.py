"""A collect's single reads gathered in one copy equal each read's own copy."""

from __future__ import annotations

import pytest
import torch

from vllm_nnsight_plugin.taps.kept import Lowered, kept_saves, read_together, single_read

SELECTS = [None, 0, -1, 2, -3, slice(None), slice(-2, None), slice(1, 3), slice(0, None, 2), slice(5, 9)]


def _read(base: int, select: object) -> Lowered:
    return Lowered(
        site=0,
        start=0,
        stop=None,
        result=None,
        code=1,
        name=f"r{base}",
        select=select,
        single=True,
        base=base,
    )


def test_gathered_reads_equal_their_own_copies() -> None:
    store = torch.randn(64, 8)
    reads = [(_read(4 * i, select), 3 + i % 2) for i, select in enumerate(SELECTS)]
    assert all(single_read(lowered, done) for lowered, done in reads)
    together = read_together(store, reads)
    for (lowered, done), found in zip(reads, together, strict=True):
        alone = kept_saves(lowered, store, 1, done, done)
        assert found.keys() == alone.keys()
        value, own = found[lowered.name], alone[lowered.name]
        assert value.shape == own.shape and value.dtype == own.dtype and value.is_contiguous()
        assert torch.equal(value, own)
    store.zero_()  # a gathered copy, not views of the store (whose rows go back to be written)
    assert any(
        found[lowered.name].abs().sum() > 0 for (lowered, _), found in zip(reads, together, strict=True)
    )


@pytest.mark.parametrize(
    ("select", "done", "gathered"),
    [
        (5, 3, False),  # out of range: its own read raises, for it alone
        (-4, 3, False),
        (slice(None, None, -1), 3, False),  # a step back: left to its own read
        ([0, 1], 3, False),
        (torch.tensor(0), 3, False),
        (0, 0, False),  # nothing kept
        (2, 3, True),
    ],
)
def test_which_reads_are_gathered(select: object, done: int, gathered: bool) -> None:
    assert single_read(_read(0, select), done) is gathered


def test_only_a_single_read_that_keeps_is_gathered() -> None:
    steers = Lowered(site=0, start=0, stop=None, result=None, code=0, single=True)
    rows_each_step = Lowered(site=0, start=0, stop=None, result=None, code=1, name="rows", select=-1)
    assert not single_read(steers, 1) and not single_read(rows_each_step, 1)


def test_rows_outside_the_store_are_refused_on_the_host():
    """Never an index past the store on the device (a device-side assert there):
    the collect then reads each request on its own."""
    store = torch.randn(8, 4)
    with pytest.raises(IndexError):
        read_together(store, [(_read(6, None), 3), (_read(0, -1), 1)])
