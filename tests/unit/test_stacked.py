"""Saves that travel stacked come back as the list the block built (no engine)."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from nnsight.modeling.vllm.collect import dumps_compact

from vllm_nnsight_plugin.returns.outputs import merge_replies
from vllm_nnsight_plugin.returns.pool import Pool, Pooler
from vllm_nnsight_plugin.returns.stacked import Stacked, stack_entry, stackable
from vllm_nnsight_plugin.wire.envelope import Limits
from vllm_nnsight_plugin.worker.collect import pack, pack_all, pool_part


def travel_all(entries: dict, limits: Limits | None = None) -> dict:
    """Entries of one collect through the worker's packing (stacked lists, one
    pool of tensors, replies of tensors alone in one part) and the front end's merge."""
    pooler = Pooler()
    parts = pack_all(list(entries), entries, limits or Limits(), None, pooler)
    return merge_replies([parts + pool_part(pooler)])


def travel_each(entries: dict, limits: Limits | None = None) -> dict:
    """The same, each request packed on its own."""
    pooler = Pooler()
    parts = [pack(rid, entry, limits or Limits(), None, pooler) for rid, entry in entries.items()]
    return merge_replies([parts + pool_part(pooler)])


def travel(entry: dict) -> dict:
    return travel_all({"r": entry})["r"]


def general(entry: dict) -> dict:
    """The same entry through the general path (no stacking)."""
    return merge_replies([[dumps_compact({"r": entry})]])["r"]


def test_a_list_of_rows_comes_back_as_the_same_list_of_views():
    slab = torch.randn(40, 8)
    rows = [slab[:5].clone()] + [slab[5 + i : 6 + i].clone() for i in range(7)]  # prompt, then a row a step
    entry = {"saves": {"rows": rows, "n": 3}, "error": None, "sequences": {}}
    back = travel(entry)["saves"]
    assert isinstance(back["rows"], list) and len(back["rows"]) == len(rows)
    for got, want in zip(back["rows"], rows):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    bases = {row.untyped_storage().data_ptr() for row in back["rows"]}
    assert len(bases) == 1  # views of one tensor: one storage travelled
    assert back["n"] == 3
    # Views do not overlap: writing one leaves the others as they were.
    back["rows"][1].zero_()
    torch.testing.assert_close(back["rows"][2], rows[2], rtol=0, atol=0)


def test_stacked_and_general_paths_agree():
    steps = [torch.randn(1, 16, dtype=torch.bfloat16) for _ in range(6)]
    tops = [torch.tensor(i) for i in range(4)]  # 0-dimensional: stacked on a new dim
    entry = {"saves": {"steps": steps, "tops": tops}, "error": None, "sequences": {}}
    stacked, plain = travel(entry)["saves"], general(entry)["saves"]
    for name in ("steps", "tops"):
        assert [t.shape for t in stacked[name]] == [t.shape for t in plain[name]]
        for a, b in zip(stacked[name], plain[name]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            assert a.dtype == b.dtype


def test_lists_that_do_not_stack_travel_as_they_are():
    base = torch.randn(4, 8)
    cases = {
        "ragged": [torch.randn(2, 8), torch.randn(2, 4)],
        "mixed": [torch.randn(2), "not a tensor", 3],
        "dtypes": [torch.randn(2), torch.randn(2).double()],
        "shared": [base, base],  # one tensor twice: a pickle keeps that, a stack could not
        "strided": [torch.randn(3, 4).t(), torch.randn(3, 4).t()],
        "one": [torch.randn(3)],
        "tuple": (torch.randn(2), torch.randn(2)),
    }
    for name, value in cases.items():
        assert not stackable(value), name
    packed = stack_entry({"saves": dict(cases), "sequences": {}, "error": None})
    assert not any(isinstance(v, Stacked) for v in packed["saves"].values())
    back = travel({"saves": dict(cases), "error": None, "sequences": {}})["saves"]
    assert back["mixed"][1:] == ["not a tensor", 3]
    assert back["shared"][0] is back["shared"][1]
    assert not back["strided"][0].is_contiguous()
    assert isinstance(back["tuple"], tuple)


def test_per_sequence_saves_stack_and_the_flat_view_stays_the_same_object():
    first = {"rows": [torch.randn(1, 4) for _ in range(3)]}
    second = {"rows": [torch.randn(1, 4) for _ in range(3)]}
    entry = {
        "saves": first,
        "error": None,
        "sequences": {0: {"saves": first, "edits": {}}, 1: {"saves": second, "edits": {}}},
    }
    packed = stack_entry(entry)
    assert packed["saves"] is packed["sequences"][0]["saves"]
    back = travel(entry)
    assert back["saves"]["rows"] is back["sequences"][0]["rows"]
    for got, want in zip(back["sequences"][1]["rows"], second["rows"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_stacked_list_is_one_record_in_the_pickle():
    rows = [torch.randn(1, 64) for _ in range(128)]
    stacked = pickle.dumps(stack_entry({"saves": {"rows": rows}, "sequences": {}}))
    general_ = pickle.dumps({"saves": {"rows": rows}, "sequences": {}})
    assert len(stacked) < len(general_)


def test_one_collect_sends_its_tensors_in_one_pool():
    rows = {f"r{i}": torch.randn(64) for i in range(50)}
    steps = {f"r{i}": [torch.randn(1, 8) for _ in range(3)] for i in range(50)}
    entries = {
        rid: {"saves": {"last": rows[rid], "steps": steps[rid], "n": i}, "error": None, "sequences": {}}
        for i, rid in enumerate(rows)
    }
    pooler = Pooler()
    parts = [pack(rid, entry, Limits(), None, pooler) for rid, entry in entries.items()]
    extra = pool_part(pooler)
    assert len(extra) == 1 and isinstance(pickle.loads(extra[0]), Pool)
    assert all(len(part) < 2_000 for part in parts)  # references only: the tensors are in the pool
    back = merge_replies([parts + extra])
    for i, rid in enumerate(rows):
        torch.testing.assert_close(back[rid]["saves"]["last"], rows[rid], rtol=0, atol=0)
        for got, want in zip(back[rid]["saves"]["steps"], steps[rid]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert back[rid]["saves"]["n"] == i
    # Each request's tensors are views of a copy of its own part of the pool: one
    # storage per request, holding that request's bytes and no other's.
    for rid in rows:
        saves = back[rid]["saves"]
        storage = saves["last"].untyped_storage()
        assert all(s.untyped_storage().data_ptr() == storage.data_ptr() for s in saves["steps"])
        assert storage.nbytes() == (64 + 3 * 8) * 4
    buffer = io.BytesIO()
    torch.save(back["r0"]["saves"], buffer)  # what a server puts in one response
    assert len(buffer.getvalue()) < 4_000  # one request's 352 bytes of tensors, not fifty


def test_a_tensor_saved_twice_stays_one_tensor_and_dtypes_pool_apart():
    shared = torch.randn(4, 4)
    entry = {
        "saves": {"a": shared, "b": shared, "half": torch.randn(3).half(), "ints": torch.arange(5)},
        "error": None,
        "sequences": {},
    }
    back = travel(entry)["saves"]
    assert back["a"] is back["b"]
    assert back["half"].dtype == torch.float16 and back["ints"].dtype == torch.int64
    torch.testing.assert_close(back["ints"], torch.arange(5))


def test_the_save_limit_counts_pooled_tensors_and_fails_only_that_request():
    big = {"saves": {"x": torch.zeros(1024)}, "error": None, "sequences": {}}
    small = {"saves": {"x": torch.ones(4)}, "error": None, "sequences": {}}
    back = travel_all({"big": big, "small": small}, Limits(max_save_bytes=2048))
    assert back["big"]["saves"] == {} and "SaveLimitError" in repr(back["big"]["error"])
    torch.testing.assert_close(back["small"]["saves"]["x"], torch.ones(4))


class Holder:
    """A user object that keeps a tensor (pickled by reference to this module)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_a_tensor_referred_to_twice_stays_one_object_as_on_the_general_path():
    rows = [torch.randn(1, 4) for _ in range(3)]
    inner = torch.randn(5)
    held = torch.randn(2)
    entry = {
        "saves": {
            "rows": rows,
            "last": rows[-1],
            "a": inner,
            "d": {"x": inner},
            "h": Holder(held),
            "t": held,
        },
        "error": None,
        "sequences": {},
    }
    whole = torch.randn(2, 3)
    entry["saves"]["whole"], entry["saves"]["flat"] = whole, whole.view(6)  # one storage
    sharing = []
    for back in (travel(entry)["saves"], general(entry)["saves"]):
        sharing.append(
            back["whole"].untyped_storage().data_ptr() == back["flat"].untyped_storage().data_ptr()
        )
        torch.testing.assert_close(back["flat"], whole.view(6), rtol=0, atol=0)
        assert back["last"] is back["rows"][-1]
        assert back["a"] is back["d"]["x"]
        assert back["t"] is back["h"].tensor
        torch.testing.assert_close(back["rows"][0], rows[0], rtol=0, atol=0)
    assert sharing[0] == sharing[1]  # two views of one storage: as the general path sends them


def test_a_large_pool_goes_through_shared_memory_and_leaves_no_file(monkeypatch):
    import glob

    from vllm_nnsight_plugin.returns import shared

    monkeypatch.setenv(shared.MIN_BYTES_ENV, "4096")
    before = set(glob.glob(f"{shared.DIRECTORY}/{shared.PREFIX}*"))
    kept = {f"r{i}": [torch.randn(5, 64) for _ in range(4)] for i in range(8)}
    small = {f"r{i}": torch.arange(3, dtype=torch.int64) for i in range(8)}  # under the threshold
    entries = {
        rid: {"saves": {"rows": kept[rid], "ids": small[rid]}, "error": None, "sequences": {}} for rid in kept
    }
    pooler = Pooler()
    parts = [pack(rid, entry, Limits(), None, pooler) for rid, entry in entries.items()]
    extra = pool_part(pooler)
    assert len(extra[0]) < 4_000  # the float rows are in a file, not in the message
    written = set(glob.glob(f"{shared.DIRECTORY}/{shared.PREFIX}*")) - before
    assert len(written) == 1
    back = merge_replies([parts + extra])
    for rid in kept:
        for got, want in zip(back[rid]["saves"]["rows"], kept[rid], strict=True):
            assert torch.equal(got, want)
        assert torch.equal(back[rid]["saves"]["ids"], small[rid])
        assert back[rid]["saves"]["rows"][0].untyped_storage().nbytes() == 4 * 5 * 64 * 4  # its own
    assert not (set(glob.glob(f"{shared.DIRECTORY}/{shared.PREFIX}*")) - before)  # removed once read
    # a pool nobody reads (another rank's copy) is removed too
    pooler = Pooler()
    parts = [pack(rid, entry, Limits(), None, pooler) for rid, entry in entries.items()]
    other = pool_part(pooler)
    pickle.loads(other[0]).close()
    assert not (set(glob.glob(f"{shared.DIRECTORY}/{shared.PREFIX}*")) - before)
    monkeypatch.setenv(shared.MIN_BYTES_ENV, "0")  # off: the pool travels pickled
    pooler = Pooler()
    parts = [pack(rid, entry, Limits(), None, pooler) for rid, entry in entries.items()]
    assert len(pool_part(pooler)[0]) > 8 * 4 * 5 * 64 * 4


def test_a_large_save_is_a_flat_of_its_own_where_joining_would_crowd_the_device(monkeypatch):
    """Where joining a collect's saves would need more than half the device's free
    memory, a tensor over ``OWN_FLAT_BYTES`` is not copied into the joined flat (a
    probe's rows would need their size again); small ones still are, and with room
    all of them are."""
    import vllm_nnsight_plugin.returns.pool as pool_module

    monkeypatch.setattr(pool_module, "OWN_FLAT_BYTES", 4096)
    monkeypatch.setattr(pool_module, "_room", lambda device: 16 << 10)  # a device nearly full
    big = [torch.randn(64, 32) for _ in range(2)]  # 8 KiB each
    small = [torch.randn(4) for _ in range(2)]
    pooler = Pooler()
    for large, tiny in zip(big, small):
        _, taken = pooler.swap({"saves": {"large": large, "tiny": tiny}, "sequences": {}})
        pooler.add(taken)
    pool = pooler.pool()
    assert sorted(flat.numel() for flat in pool.flats) == [2 * 4, 64 * 32, 64 * 32]  # small ones joined
    assert {flat.data_ptr() for flat in pool.flats} >= {t.data_ptr() for t in big}  # not copied
    slab = torch.randn(4, 64, 32)
    pooler = Pooler()
    pooler.add(pooler.swap({"saves": {"part": slab[1]}, "sequences": {}})[1])
    (flat,) = pooler.pool().flats  # a view of a larger tensor: copied, so only its part travels
    assert flat.untyped_storage().nbytes() == 64 * 32 * 4 and torch.equal(flat, slab[1].reshape(-1))
    entries = {
        f"r{i}": {"saves": {"large": big[i], "tiny": small[i]}, "error": None, "sequences": {}}
        for i in range(2)
    }
    back = travel_all(entries)
    for i in range(2):
        saves = back[f"r{i}"]["saves"]
        assert torch.equal(saves["large"], big[i]) and torch.equal(saves["tiny"], small[i])
        assert saves["large"].data_ptr() != big[i].data_ptr()  # the front end's own copy
    monkeypatch.setattr(pool_module, "_room", lambda device: float("inf"))
    pooler = Pooler()
    for large in big:
        pooler.add(pooler.swap({"saves": {"large": large}, "sequences": {}})[1])
    assert [flat.numel() for flat in pooler.pool().flats] == [2 * 64 * 32]  # room: one joined flat


def test_an_entry_of_tensors_alone_takes_the_short_way_and_comes_back_the_same():
    from vllm_nnsight_plugin.worker.collect import _only_tensors

    last, kept = torch.randn(4096, dtype=torch.bfloat16), torch.randn(3, 8)
    entry = {
        "saves": {"last": last, "kept": kept},
        "error": None,
        "sequences": {},
        "edits": {},
        "path": {"lowered": True},
    }
    assert _only_tensors(entry)
    back, plain = travel(dict(entry)), general(dict(entry))
    assert back["path"] == {"lowered": True}
    for name in ("last", "kept"):
        assert back["saves"][name].dtype == plain["saves"][name].dtype
        torch.testing.assert_close(back["saves"][name], plain["saves"][name], rtol=0, atol=0)
    # anything else is the general path's: one tensor under two names stays one
    # object, views of one storage stay views of one, lists are stacked, errors kept
    assert not _only_tensors({**entry, "saves": {"a": last, "b": last}})
    assert not _only_tensors({**entry, "saves": {"a": kept[0], "b": kept[1]}})
    assert not _only_tensors({**entry, "saves": {"a": last, "rows": [kept]}})
    assert not _only_tensors({**entry, "error": {"type_name": "ValueError"}})
    assert not _only_tensors({**entry, "edits": {"e": kept}})
    empty = {**entry, "saves": {}, "sequences": {0: {"saves": {}, "edits": {}}}}
    assert _only_tensors({**entry, "saves": {}})  # a lowered edit's reply: nothing to pool
    assert not _only_tensors(empty)  # (sequence 0's dicts are not the flat ones)
    assert travel({**entry, "saves": {}})["saves"] == general({**entry, "saves": {}})["saves"] == {}
    assert not _only_tensors({k: v for k, v in entry.items() if k != "saves"})
    assert not _only_tensors({**entry, "other": object()})  # anything else: the general path
    one = {**entry, "sequences": {0: {"saves": entry["saves"], "edits": entry["edits"]}}}
    assert _only_tensors(one)  # sequence 0's dicts are the flat ones (nnsight's reply)
    assert torch.equal(travel(one)["sequences"][0]["last"], general(one)["sequences"][0]["last"])
    assert not _only_tensors({**entry, "sequences": {0: {"saves": dict(entry["saves"])}}})
    assert not _only_tensors({**entry, "sequences": {0: {"saves": entry["saves"]}, 1: {}}})
    twice = travel({**entry, "saves": {"a": last, "b": last}})["saves"]
    assert twice["a"] is twice["b"]


def test_a_pickled_pool_carries_its_flats_as_their_bytes_and_rebuilds_them_exactly():
    """A pool's plain flat tensors travel as bytes: the same values, dtypes and
    shapes come back, each writable and of its own storage; anything else (a
    tensor of another dtype, a flat already sent another way) as it was."""
    from vllm_nnsight_plugin.returns.pool import _as_bytes, _Bytes

    flats = [
        torch.randn(37, dtype=torch.bfloat16),
        torch.randn(5),
        torch.arange(-4, 4, dtype=torch.int64),
        torch.tensor([True, False, True]),
        torch.randn(3, dtype=torch.float16),
        torch.empty(0),
        torch.randn(4, dtype=torch.complex64),  # not a dtype pools send as bytes
    ]
    places = {i: (i, 0, tuple(flat.shape)) for i, flat in enumerate(flats)}
    back = pickle.loads(pickle.dumps(Pool("p", flats, places)))
    assert back.id == "p" and back.places == places
    for got, want in zip(back.flats, flats):
        assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device
        assert torch.equal(got, want)
        assert want.numel() == 0 or got.untyped_storage().data_ptr() != want.untyped_storage().data_ptr()
    back.flats[0][0] = 1.0  # writable: a request's saves are the user's to change
    assert isinstance(_as_bytes(flats[0]), _Bytes)
    assert _as_bytes(flats[-1]) is flats[-1]
    assert _as_bytes(torch.randn(2, 3)) is not None and not isinstance(_as_bytes(torch.randn(2, 3)), _Bytes)
    assert not isinstance(_as_bytes(torch.randn(8)[::2]), _Bytes)  # not contiguous: as torch sends it
    assert not isinstance(_as_bytes(torch.randn(3, requires_grad=True)), _Bytes)
    # a whole collect through the worker's packing and the front end's merge
    entries = {
        f"r{i}": {"saves": {"row": torch.randn(16, dtype=torch.bfloat16)}, "error": None} for i in range(3)
    }
    merged = travel_all({rid: {**entry, "sequences": {}} for rid, entry in entries.items()})
    for rid, entry in entries.items():
        assert torch.equal(merged[rid]["saves"]["row"], entry["saves"]["row"])


def test_replies_of_tensors_alone_share_one_part_and_come_back_as_packed_one_by_one():
    """A collect's replies of tensors alone travel in one part; what comes home is
    what packing each on its own brings: the same values, each request's tensors
    in storage of its own, and a request over the save limit fails alone."""
    rows = torch.randn(6, 32)

    def kept(i: int) -> dict:
        saves, edits = {"last": rows[i].clone()}, {}  # sequence 0's dicts are the flat ones, as nnsight's
        return {
            "saves": saves,
            "error": None,
            "edits": edits,
            "sequences": {0: {"saves": saves, "edits": edits}},
        }

    entries = {f"r{i}": kept(i) for i in range(4)}
    entries["listed"] = {
        "saves": {"rows": [rows[4:5].clone(), rows[5:6].clone()]},
        "error": None,
        "sequences": {},
    }
    entries["big"] = {"saves": {"big": torch.randn(64, 1024)}, "error": None, "edits": {}, "sequences": {}}
    entries["edit"] = {"saves": {}, "error": None, "edits": {}, "sequences": {}, "path": ("lowered", "steer")}
    limits = Limits(max_save_bytes=64 * 1024 * 4 + 1000)  # "big" is within the limit, not its margin
    pooler = Pooler()
    parts = pack_all(list(entries), entries, limits, None, pooler)
    assert len(parts) == 3  # the listed rows and the big tensor on their own; the rest in one
    together, each = travel_all(entries, limits), travel_each(entries, limits)
    assert set(together) == set(each) == set(entries)
    for rid in entries:
        assert together[rid]["error"] == each[rid]["error"] and together[rid]["path"] == each[rid]["path"]
        for key in ("saves", "edits"):
            assert together[rid][key].keys() == each[rid][key].keys()
        assert together[rid]["sequences"].keys() == each[rid]["sequences"].keys()
    for i in range(4):
        back = together[f"r{i}"]
        assert torch.equal(back["saves"]["last"], rows[i]) and torch.equal(
            back["sequences"][0]["last"], rows[i]
        )
    assert len({together[f"r{i}"]["saves"]["last"].untyped_storage().data_ptr() for i in range(4)}) == 4
    assert torch.equal(together["big"]["saves"]["big"], entries["big"]["saves"]["big"])
    over = Limits(max_save_bytes=100)
    failed = travel_all({"r0": kept(0), "r1": {"saves": {}, "error": None, "sequences": {}}}, over)
    assert "over this engine's limit" in str(failed["r0"]["error"]) and failed["r1"]["error"] is None


def test_the_collector_is_paused_while_a_list_is_made_and_left_as_it_was():
    """``uncollected`` (around ``unstack`` and a collect's whole merge) pauses Python's
    cyclic collector and puts it back as it found it, also when the body raises."""
    import gc

    from vllm_nnsight_plugin.returns.stacked import uncollected

    assert gc.isenabled()
    with uncollected():
        assert not gc.isenabled()
        with uncollected():  # nested: the outer one resumes it
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), uncollected():
        raise ValueError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with uncollected():
            pass
        assert not gc.isenabled()  # a caller's own pause is kept
    finally:
        gc.enable()
    rows = torch.arange(12.0).view(4, 3)
    assert [r.tolist() for r in Stacked(rows, None).unstack()] == rows.tolist()
    assert [r.shape[0] for r in Stacked(rows, (1, 3)).unstack()] == [1, 3]
