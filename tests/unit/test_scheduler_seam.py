"""The scheduler wrap's two orders, on stand-in schedulers (no engine): traced
requests first among the running, a waiting traced prompt whole; and the steps
where it reads nothing (every slot taken, a running list of traced requests alone)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_nnsight_plugin.seams import engine


def request(rid: str, tokens: int = 48) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, num_tokens=tokens, num_computed_tokens=0)


def scheduler(running: list, waiting: list, traced: set, slots: int = 4, budget: int = 64) -> SimpleNamespace:
    live = {r.request_id: r for r in [*running, *waiting]}
    found = SimpleNamespace(
        requests=live,
        running=list(running),
        waiting=list(waiting),
        max_num_running_reqs=slots,
        max_num_scheduled_tokens=budget,
        scheduler_config=SimpleNamespace(enable_chunked_prefill=True, long_prefill_token_threshold=0),
    )
    found.__dict__["_nnsight_traced"] = set(traced)
    found.__dict__["_nnsight_waiting"] = {r.request_id: r for r in waiting if r.request_id in traced}
    return found


def run(found: SimpleNamespace, new: tuple[str, ...] = ()) -> list:
    """One ``schedule`` through the wrap; what the original saw of the config."""
    seen = []

    def original(self):
        seen.append(self.scheduler_config)
        return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=rid) for rid in new])

    engine.scheduled(found, original)
    return seen


def ids(requests: list) -> list[str]:
    return [r.request_id for r in requests]


def test_a_plain_request_last_is_left_where_it_is_and_a_traced_one_last_moves_the_plain_ones_back():
    t1, p1, t2, p2 = request("t1"), request("p1"), request("t2"), request("p2")
    found = scheduler([t1, p1, t2], [], {"t1", "t2"})
    run(found)
    assert ids(found.running) == ["t1", "t2", "p1"]  # stable among each kind
    found = scheduler([t1, p1, t2, p2], [], {"t1", "t2"}, slots=8)
    run(found)
    assert ids(found.running) == ["t1", "p1", "t2", "p2"]  # the last is plain: preempted first already


class Sorts(list):
    """A running list that counts its sorts."""

    sorted = 0

    def sort(self, **kwargs):
        self.sorted += 1
        super().sort(**kwargs)


def test_a_running_list_of_traced_requests_alone_is_not_sorted():
    running = [request(f"t{i}") for i in range(4)]
    found = scheduler(running, [], {r.request_id for r in running})
    found.running = Sorts(running)
    run(found)
    assert found.running.sorted == 0 and ids(found.running) == ["t0", "t1", "t2", "t3"]
    found.running.insert(0, request("p9"))  # a plain one first, a traced one last: sorted
    found.requests["p9"] = found.running[0]
    found.max_num_running_reqs = 8
    run(found)
    assert found.running.sorted == 1 and ids(found.running) == ["t0", "t1", "t2", "t3", "p9"]


def test_finished_ids_leave_the_books_once_they_outnumber_the_live_ones():
    live = [request("t0"), request("t1")]
    stale = {f"gone{i}" for i in range(engine._STALE)}
    found = scheduler(live, [], {"t0", "t1", *stale}, slots=8)
    run(found)
    assert len(found.__dict__["_nnsight_traced"]) == 2 + engine._STALE  # within the margin: kept
    found.__dict__["_nnsight_traced"].add("one-more")
    run(found)
    assert found.__dict__["_nnsight_traced"] == {"t0", "t1"}


def test_a_waiting_traced_prompt_is_scheduled_whole_while_every_waiting_prompt_fits():
    running, waiting = [request("p0")], [request("t1"), request("p2")]
    found = scheduler(running, waiting, {"t1"})
    config = found.scheduler_config
    (seen,) = run(found, new=("t1",))
    assert isinstance(seen, engine._Unchunked) and seen.enable_chunked_prefill is False
    assert found.scheduler_config is config  # put back after the call
    assert found.__dict__["_nnsight_waiting"] == {}  # scheduled: no longer waiting


def test_a_prompt_longer_than_the_budget_keeps_chunking_on_for_all():
    found = scheduler([request("p0")], [request("t1"), request("p2", tokens=100)], {"t1"}, budget=64)
    (seen,) = run(found)
    assert seen is found.scheduler_config  # else the long prompt would wait forever


def test_an_aborted_waiting_request_leaves_the_books_and_with_none_left_nothing_changes():
    found = scheduler([request("p0")], [request("t1")], {"t1"})
    del found.requests["t1"]  # aborted before it ran
    found.waiting = []
    (seen,) = run(found)
    assert seen is found.scheduler_config and found.__dict__["_nnsight_waiting"] == {}


def test_a_step_with_every_slot_taken_reads_nothing_of_the_waiting_requests():
    running = [request(f"p{i}") for i in range(4)]
    waiting = [request("t9")]
    found = scheduler(running, waiting, {"t9"}, slots=4)
    del found.requests["t9"]  # aborted: a read would drop it
    (seen,) = run(found)
    assert seen is found.scheduler_config  # the config as it is
    assert "t9" in found.__dict__["_nnsight_waiting"]  # not read this step
    found.running.pop()  # a slot frees: the next step reads and drops it
    run(found)
    assert found.__dict__["_nnsight_waiting"] == {}


def test_the_admission_limit_is_the_newer_releases_attribute_where_they_have_it():
    found = scheduler([request("p0"), request("p1")], [request("t2")], {"t2"}, slots=8)
    found.max_num_active_reqs = 2  # (0.32 on: admission into running, apart from the slots)
    assert engine._no_room(found)
    del found.max_num_active_reqs, found.max_num_running_reqs
    assert not engine._no_room(found)  # neither: the reads run
