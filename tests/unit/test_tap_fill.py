"""A decode step that repeats the last one skips the tables' fill and upload
(``TapTables._repeats``): every step's table, counters and kept rows must be what
a full fill makes, whatever the requests do between steps."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_nnsight_plugin.taps.install import Lowered, TapTables
from vllm_nnsight_plugin.taps.ops import KEEP_BOTH, KEEP_FIRST, KEEP_SUM

SITES = ("model.layers.0", "model.layers.1", "model.layers.2")


def _tables() -> TapTables:
    return TapTables(SITES, max_tokens=64, hidden=4, entries=32, device="cpu", store_size=4096)


def _lowered(kind: str, rng: random.Random) -> tuple[Lowered, dict]:
    """One request's block of ``kind``, and the keywords ``TapTables.add`` takes for it."""
    site = rng.randrange(len(SITES))
    if kind == "steer":
        return Lowered(site, 0, None, None), {"vector": torch.randn(4)}
    if kind == "window":  # a steer of some steps only (``tracer.iter[a:b]``)
        start = rng.randrange(3)
        return Lowered(site, start, start + rng.randrange(1, 5), None), {"vector": torch.randn(4)}
    if kind == "last":  # a steer of each step's last row
        return Lowered(site, 0, None, None, select=-1), {"vector": torch.randn(4)}
    if kind == "sites":  # one vector at several taps
        others = tuple(s for s in range(len(SITES)) if s != site)[:1]
        return Lowered(site, 0, None, None), {"vector": torch.randn(4), "also": others}
    if kind == "served":  # read at the sampler: each step's rows over the last step's
        lowered = Lowered(site, 0, None, None, code=KEEP_BOTH, replay=True)
        return lowered, {"room": 64 * 2}
    if kind == "keep":  # every row of every step, at a place that moves
        return Lowered(site, 0, None, None, code=KEEP_SUM, name="rows"), {"room": 256}
    if kind == "keep_last":
        return Lowered(site, 0, None, None, code=KEEP_FIRST, name="rows", select=-1), {"room": 64}
    if kind == "keep_first":  # each step's first row (``[0]``)
        return Lowered(site, 0, None, None, code=KEEP_FIRST, name="rows", select=0), {"room": 64}
    if kind == "keep_row":  # row 2 of each step: none of a decode step's
        return Lowered(site, 0, None, None, code=KEEP_FIRST, name="rows", select=2), {"room": 64}
    if kind == "keep_full":  # room for a few steps: the rest go nowhere
        return Lowered(site, 0, None, None, code=KEEP_FIRST, name="rows", select=-1), {"room": 3}
    if kind == "keep_window":  # every row of some steps, at several taps
        start = rng.randrange(3)
        others = tuple(s for s in range(len(SITES)) if s != site)
        lowered = Lowered(site, start, start + rng.randrange(1, 6), None, code=KEEP_FIRST, name="rows")
        return lowered, {"room": 64, "also": others}
    raise AssertionError(kind)


KINDS = (
    "steer", "window", "last", "sites", "served", "keep", "keep_last", "keep_first", "keep_row", "keep_full",
    "keep_window",
)  # fmt: skip


def _state(tables: TapTables) -> tuple:
    return (
        tables._table.clone(),
        tables._steps.copy(),
        tables._done.copy(),
        tables._first.copy(),
        tables._busy.copy(),
        tables.kept_rows,
        {rid: dict(low.irregular) for rid, low in tables.requests.items()},
    )


def _same(a: tuple, b: tuple) -> None:
    assert torch.equal(a[0], b[0])
    for x, y in zip(a[1:5], b[1:5]):
        assert np.array_equal(x, y)
    assert a[5:] == b[5:]


@pytest.mark.parametrize("seed", range(16))
def test_a_repeated_fill_leaves_what_a_full_fill_leaves(seed: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # some with no keep that moves, some with nothing else
    kinds = KINDS if seed % 3 else ("steer", "window", "last", "sites", "served")
    if seed % 4 == 1:
        kinds = ("keep", "keep_last", "keep_first", "keep_row", "keep_full", "keep_window")
    fast, full = _tables(), _tables()
    running: list[str] = []  # in row order
    prompt: dict[str, int] = {}
    made = 0
    for _ in range(40):
        roll = rng.random()
        if roll < 0.15 or not running:  # a new request, prefilled this step
            made += 1
            rid = f"r{made}"
            lowered, kwargs = _lowered(rng.choice(kinds), rng)
            twin = Lowered(**{k: v for k, v in vars(lowered).items() if k != "irregular"})
            added = fast.add(rid, lowered, **kwargs)
            assert full.add(rid, twin, **kwargs) == added
            running.insert(rng.randrange(len(running) + 1), rid)
            prompt[rid] = rng.randrange(2, 6)
        elif roll < 0.22:  # one finishes
            rid = running.pop(rng.randrange(len(running)))
            for tables in (fast, full):
                taken = tables.forget(rid)
                if taken is not None:
                    tables.release(taken[0])
        elif roll < 0.26:  # the batch is reordered
            rng.shuffle(running)
        counts = [prompt.pop(rid, 1) for rid in running]
        starts = list(np.cumsum([0, *counts[:-1]]))
        bounds = [*starts, sum(counts)]
        fast.fill(list(running), bounds)
        full._repeat = None  # never repeats
        full.fill(list(running), bounds)
        _same(_state(fast), _state(full))
    assert fast.repeated > 0 and full.repeated == 0


def test_a_step_repeats_only_while_nothing_of_it_changed():
    tables = _tables()
    assert tables.add("a", Lowered(0, 0, None, None), torch.randn(4))
    assert tables.add("b", Lowered(1, 1, 3, None), torch.randn(4))  # steps 1 and 2 only
    tables.fill(["a", "b"], [0, 3, 5])  # the prompts
    tables.fill(["a", "b"], [0, 1, 2])  # b's window opens: written
    tables.fill(["a", "b"], [0, 1, 2])
    assert tables.repeated == 1
    tables.fill(["a", "b"], [0, 1, 2])  # b's window has closed: written
    assert tables.repeated == 1
    tables.fill(["b", "a"], [0, 1, 2])  # another order
    assert tables.repeated == 1
    tables.fill(["b", "a"], [0, 1, 2])
    assert tables.repeated == 2
    assert tables.add("c", Lowered(0, 0, None, None), torch.randn(4))  # added, not in this step
    tables.fill(["b", "a"], [0, 1, 2])
    assert tables.repeated == 2
    assert tables.steps("a") == 7 and tables.steps("b") == 7
    assert tables.stats()["fills_repeated"] == 2
