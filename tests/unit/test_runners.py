"""The model runner adapters without an engine (``seams/runner_v1.py``,
``seams/runner_v2.py``): which rows are whose, where a step's samples are thrown
away, which requests a step resumes, the sampler's two calls, and the wraps'
decisions, on records shaped like vLLM's own (V1's persistent batch; V2's
``InputBatch`` as vLLM 0.25.1 and 0.34.0 build it)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_nnsight_plugin.seams import runner_v2
from vllm_nnsight_plugin.seams.runner_v1 import V1Runner
from vllm_nnsight_plugin.seams.runner_v2 import V2Runner, view_of
from vllm_nnsight_plugin.seams.worker import UNCOMPILED_STEP, StepHooks


def v2_batch(
    version: str, scheduled: dict[str, int], computed: dict[str, int], prefill: dict[str, int], pad: int = 0
):
    """An ``InputBatch`` as the V2 runner builds it: requests sorted decode first
    (0.25.1: by token count; 0.34.0: decodes, then the rest by count), offsets
    padded for a CUDA graph's batch with ``pad`` more requests, one logit each."""
    if version == "0.25.1":
        order = sorted(scheduled, key=scheduled.get)
    else:
        order = sorted(scheduled, key=lambda r: (scheduled[r] != 1, scheduled[r]))
    counts = np.array([scheduled[r] for r in order], dtype=np.int32)
    offsets = np.zeros(len(order) + 1 + pad, dtype=np.int32)
    np.cumsum(counts, out=offsets[1 : len(order) + 1])
    offsets[len(order) + 1 :] = offsets[len(order)]  # padding requests have no rows
    fields = dict(
        req_ids=order,
        num_reqs=len(order),
        num_reqs_after_padding=len(order) + pad,
        num_scheduled_tokens=counts,
        query_start_loc_np=offsets,
        num_computed_tokens_np=np.array([computed[r] for r in order], dtype=np.int32),
        prefill_len_np=np.array([prefill[r] for r in order], dtype=np.int32),
        cu_num_logits_np=np.arange(len(order) + 1, dtype=np.int32),
    )
    if version == "0.34.0":
        fields.update(is_prefilling_np=fields["num_computed_tokens_np"] < fields["prefill_len_np"])
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("version", ["0.25.1", "0.34.0"])
def test_v2_rows_follow_the_batchs_order_not_the_schedulers(version):
    """Scheduled ``p`` (a 5-token prompt), ``d1`` and ``d2`` (decodes), ``c`` (the
    first 3-token chunk of a 9-token prompt): the batch puts the decodes first."""
    scheduled = {"p": 5, "d1": 1, "c": 3, "d2": 1}
    computed = {"p": 0, "d1": 7, "c": 0, "d2": 12}
    prefill = {"p": 5, "d1": 6, "c": 9, "d2": 4}
    view = view_of(v2_batch(version, scheduled, computed, prefill, pad=3))
    assert view.req_ids[:2] == ["d1", "d2"] and set(view.req_ids) == set(scheduled)
    assert dict(view.spans()) == scheduled
    starts = dict(zip(view.req_ids, view.bounds[:-1].tolist()))
    assert starts["d1"] == 0 and starts["d2"] == 1 and len(view.bounds) == 5  # padding ignored
    assert view.rows() == {rid: row for row, rid in enumerate(view.req_ids)}  # one logit each
    # Only the chunk that does not reach its prompt's end has its sample thrown away.
    assert dict(zip(view.req_ids, view.discarded.tolist())) == {
        "d1": False,
        "d2": False,
        "p": False,
        "c": True,
    }
    row = view.req_ids.index("c")
    assert view.computed[row] + scheduled["c"] < view.prefill[row]


def test_v2_a_resumed_request_is_a_new_one_whose_block_the_worker_holds():
    """V2 frees a preempted request and later sends it as new, its prefill being its
    prompt and what it had generated; a new request the worker does not hold is new."""
    runner = V2Runner()
    step = SimpleNamespace(scheduled_new_reqs=[], preempted_req_ids={"plain", "traced", "ended"})
    assert runner.resumed(step, {"traced": object()}) == set()
    step = SimpleNamespace(scheduled_new_reqs=[], preempted_req_ids=set(), finished_req_ids={"ended"})
    assert runner.resumed(step, {}) == set()
    new = [SimpleNamespace(req_id=name) for name in ("plain", "traced", "fresh", "ended")]
    step = SimpleNamespace(scheduled_new_reqs=new, preempted_req_ids=None)
    assert runner.resumed(step, {"traced": object()}) == {"plain", "traced"}  # "ended" came back anew
    assert runner.preempted == set()
    recompute = view_of(v2_batch("0.34.0", {"back": 4}, {"back": 0}, {"back": 10}))
    assert recompute.discarded.tolist() == [True]  # a chunk of its recompute: sat out
    last = view_of(v2_batch("0.34.0", {"back": 6}, {"back": 4}, {"back": 10}))
    assert last.discarded.tolist() == [False]


def test_v1_rows_come_from_the_persistent_batch_and_vllms_own_discard_mask():
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=3, req_ids=["a", "b", "c", None]),
        query_start_loc=SimpleNamespace(np=np.array([0, 4, 5, 8, 8, 8])),
        requests={
            "a": SimpleNamespace(num_computed_tokens=0, num_prompt_tokens=4),
            "b": SimpleNamespace(num_computed_tokens=9, num_prompt_tokens=3),
            "c": SimpleNamespace(num_computed_tokens=0, num_prompt_tokens=7),
        },
        discard_request_mask=SimpleNamespace(np=np.array([False, False, True, False])),
    )
    view = V1Runner().view(runner)
    assert view.spans() == [("a", 4), ("b", 1), ("c", 3)]
    assert view.discarded.tolist() == [False, False, True]
    assert view.prefill.tolist() == [4, 3, 7] and view.computed.tolist() == [0, 9, 0]
    ids, bounds = V1Runner().rows(runner)
    assert list(ids) == ["a", "b", "c"] and bounds.tolist() == [0, 4, 5, 8]
    cached = SimpleNamespace(resumed_req_ids={"b"})
    assert V1Runner().resumed(SimpleNamespace(scheduled_cached_reqs=cached), {}) == {"b"}


class Drawn:
    def __init__(self, ids):
        self.sampled_token_ids = ids


class PlainSampler:
    """A V2 sampler's shape: a plain object called as ``sampler(logits, input_batch)``."""

    def __init__(self):
        self.seen = []

    def __call__(self, logits, input_batch):
        self.seen.append(logits.clone())
        return Drawn(logits.argmax(-1, keepdim=True))


class WatermarkSampler(PlainSampler):
    pass


def test_v2_the_sampler_is_called_between_the_workers_hooks_and_stays_what_it_was():
    runner = SimpleNamespace(sampler=WatermarkSampler())
    other = WatermarkSampler()
    calls = []

    def on_logits(logits):
        calls.append("logits")
        edited = logits.clone()
        edited[:, 0] = 100.0
        return edited

    def on_samples(ids):
        calls.append("samples")
        return ids + 1

    V2Runner().hook_sampler(runner, on_logits, on_samples)
    assert (
        isinstance(runner.sampler, WatermarkSampler) and type(runner.sampler).__name__ == "WatermarkSampler"
    )
    logits = torch.zeros(2, 4)
    logits[:, 3] = 1.0
    drawn = runner.sampler(logits, None)
    assert calls == ["logits", "samples"] and drawn.sampled_token_ids.tolist() == [[1], [1]]
    assert runner.sampler.seen[0][:, 0].tolist() == [100.0, 100.0]  # it drew from the edited logits
    assert other(logits, None).sampled_token_ids.tolist() == [[3], [3]]  # another sampler: untouched
    V2Runner().hook_sampler(runner, lambda logits: None, lambda ids: None)  # twice: still one subclass
    assert type(runner.sampler).__mro__[1] is WatermarkSampler
    assert runner.sampler(logits, None).sampled_token_ids.tolist() == [[3], [3]]


class FakeV2:
    """A V2 runner's calls in the order ``execute_model`` makes them."""

    def __init__(self, batch):
        self.batch = batch
        self.eager_asked = []
        self.dispatch = runner_v2._dispatching(self._dispatch)
        self.__dict__["prepare"] = runner_v2._laid_out(self.hooks)(type(self).prepare_inputs)

    def _dispatch(self, manager, *args, need_eager=False, **kwargs):
        self.eager_asked.append(need_eager)
        return (SimpleNamespace(cg_mode="NONE" if need_eager else "FULL"), None)

    def prepare_inputs(self, scheduler_output, *args):
        return self.batch

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        self.dispatch(None, 1, 1, need_eager=False)
        return self.prepare(self, scheduler_output)


def test_v2_wraps_skip_warm_up_runs_ask_for_eager_steps_and_keep_the_step_batch():
    seen = []
    hooks = StepHooks(
        on_step=lambda runner, output: seen.append(("step", output)),
        on_step_failed=lambda runner: seen.append(("failed",)),
        on_loaded=lambda runner: None,
        on_layout=lambda runner: seen.append(("layout", runner.__dict__[runner_v2.BATCH])),
    )
    FakeV2.hooks = hooks
    batch = v2_batch("0.34.0", {"a": 2}, {"a": 0}, {"a": 2})
    runner = FakeV2(batch)
    execute = runner_v2._stepping(hooks)(FakeV2.execute_model)
    execute(runner, "warm-up", None, True)  # a dummy run: no step, no layout
    execute(runner, "warm-up", dummy_run=True)
    assert seen == [] and runner_v2.BATCH not in runner.__dict__
    execute(runner, "step-1")
    assert seen == [("step", "step-1"), ("layout", batch)] and runner.eager_asked[-1] is False
    V2Runner().ask_eager(runner, True)
    assert runner.__dict__[UNCOMPILED_STEP] is True
    execute(runner, "step-2")
    assert runner.eager_asked[-1] is True and runner.__dict__["_nnsight_graph_modes"] == {
        "FULL": 1,
        "NONE": 1,
    }
    V2Runner().ask_eager(runner, False)
    runner.prepare = lambda *args: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        execute(runner, "step-3")
    assert seen[-1] == ("failed",) and runner_v2._RUNNING == []


def _v2_dispatch(modes: dict):
    """``dispatch_cg_and_sync_dp`` with vLLM's parameters, answering by whether the
    batch is a uniform decode: ``modes[True]`` or ``modes[False]``."""
    calls = []

    def dispatch_cg_and_sync_dp(
        cudagraph_manager,
        num_reqs,
        num_tokens,
        uniform_token_count,
        dp_size,
        dp_rank,
        need_eager=False,
        **rest,
    ):
        calls.append((uniform_token_count, need_eager))
        mode = "NONE" if need_eager else modes[uniform_token_count is not None]
        return (SimpleNamespace(cg_mode=SimpleNamespace(name=mode)), None)

    return dispatch_cg_and_sync_dp, calls


def test_v2_a_step_at_the_taps_is_dispatched_to_the_piece_graphs_never_one_of_the_whole_forward():
    from vllm_nnsight_plugin.seams.worker import PIECEWISE_STEP

    runner = SimpleNamespace()
    original, calls = _v2_dispatch({True: "FULL", False: "PIECEWISE"})
    wrapped = runner_v2._dispatching(original)
    runner_v2._RUNNING.append(runner)
    try:
        V2Runner().ask_pieces(runner, True)
        assert runner.__dict__[PIECEWISE_STEP] is True
        desc, _ = wrapped("manager", 64, 64, 1, 1, 0, need_eager=False)  # a uniform decode of 64
        assert desc.cg_mode.name == "PIECEWISE" and calls[-1] == (None, False)
        # an engine whose mixed batches replay one graph too: no graph at all, never that one
        original, calls = _v2_dispatch({True: "FULL", False: "FULL"})
        desc, _ = runner_v2._dispatching(original)("manager", 64, 64, 1, 1, 0)
        assert desc.cg_mode.name == "NONE" and calls == [(None, False), (1, True)]
        # data parallel: the ranks agree on a mode, so no graph for this step
        original, calls = _v2_dispatch({True: "FULL", False: "PIECEWISE"})
        desc, _ = runner_v2._dispatching(original)("manager", 64, 64, 1, 2, 0)
        assert desc.cg_mode.name == "NONE" and calls == [(1, True)]
        V2Runner().ask_pieces(runner, False)
        original, calls = _v2_dispatch({True: "FULL", False: "PIECEWISE"})
        desc, _ = runner_v2._dispatching(original)("manager", 64, 64, 1, 1, 0)
        assert desc.cg_mode.name == "FULL" and calls == [(1, False)]
    finally:
        runner_v2._RUNNING.pop()


def test_v1_a_step_at_the_taps_rules_out_graphs_of_the_whole_forward_for_that_call_only():
    from vllm.config.compilation import CUDAGraphMode

    from vllm_nnsight_plugin.seams import runner_v1
    from vllm_nnsight_plugin.seams.worker import PIECEWISE_STEP

    class Dispatcher:
        def dispatch(self, num_tokens, uniform_decode=False, valid_modes=None, invalid_modes=None):
            allowed = set(valid_modes or (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL))
            allowed -= set(invalid_modes or ())
            for mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):
                if mode in allowed and (mode is not CUDAGraphMode.FULL or uniform_decode):
                    return mode, num_tokens
            raise AssertionError("no mode")

    def determine(self, num_tokens, force_eager=False):
        valid = {CUDAGraphMode.NONE} if force_eager else None
        mode, tokens = self.cudagraph_dispatcher.dispatch(num_tokens, uniform_decode=True, valid_modes=valid)
        return mode, tokens

    runner = SimpleNamespace(
        cudagraph_dispatcher=Dispatcher(),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1)),
    )
    runner.__dict__[PIECEWISE_STEP] = True
    assert runner_v1._in_pieces(runner, determine, (64,), {})[0] is CUDAGraphMode.PIECEWISE
    assert "dispatch" not in runner.cudagraph_dispatcher.__dict__  # the dispatcher as it was
    assert determine(runner, 64)[0] is CUDAGraphMode.FULL
    runner.vllm_config.parallel_config.data_parallel_size = 2
    assert runner_v1._in_pieces(runner, determine, (64,), {}) is None


def test_the_graph_is_split_at_the_taps_only_where_vllm_splits_it_and_replays_pieces():
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    from vllm_nnsight_plugin.seams.worker import split_graph_at
    from vllm_nnsight_plugin.taps import ops

    def config(**changes):
        compilation = dict(
            mode=CompilationMode.VLLM_COMPILE,
            splitting_ops=["vllm::unified_attention_with_output"],
            use_inductor_graph_partition=False,
            cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        )
        eager = changes.pop("enforce_eager", False)
        compilation.update(changes)
        return SimpleNamespace(
            model_config=SimpleNamespace(enforce_eager=eager),
            compilation_config=SimpleNamespace(**compilation),
        )

    split = config()
    assert split_graph_at(split, ops.SPLITTING) is True
    assert split.compilation_config.splitting_ops == ["vllm::unified_attention_with_output", *ops.SPLITTING]
    assert split_graph_at(split, ops.SPLITTING) is True  # once each
    assert len(split.compilation_config.splitting_ops) == 3
    for whole in (
        config(enforce_eager=True),
        config(mode=CompilationMode.NONE),
        config(splitting_ops=[]),  # full graphs only, or sequence parallelism
        config(use_inductor_graph_partition=True),
        config(cudagraph_mode=CUDAGraphMode.FULL),
        config(cudagraph_mode=CUDAGraphMode.NONE),
    ):
        before = list(whole.compilation_config.splitting_ops)
        assert split_graph_at(whole, ops.SPLITTING) is False
        assert whole.compilation_config.splitting_ops == before
