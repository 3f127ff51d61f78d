"""A block's body skipped where it is written (``client/skip.py``): run once, by
nnsight, whichever skip this Python gets. On 3.12 and later the client's line
events are in place, and a trace sets no global trace function."""

from __future__ import annotations

import sys
import threading

import nnsight
import nnsight.tracing.tracer as nnsight_tracer
import pytest
import torch

from vllm_nnsight_plugin.client import skip

LOCAL_EVENTS = sys.version_info >= (3, 12)
NETS: dict = {}


@pytest.fixture(scope="module")
def model():
    assert skip.install() is LOCAL_EVENTS
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    NETS["net"] = net  # the reference: the module run without nnsight
    return nnsight.NNsight(net)


def _trace(model, x: torch.Tensor, ran: list) -> torch.Tensor:
    with model.trace(x):
        ran.append(1)  # a side effect: once, by nnsight, never where it is written too
        out = model[0].output.clone().save()
    return out


def test_the_body_runs_once_and_saves_what_it_read(model):
    x = torch.randn(3, 4)
    ran: list = []
    out = _trace(model, x, ran)
    assert ran == [1]
    assert torch.equal(out, NETS["net"][0](x))


def test_a_header_over_several_lines_binds_before_the_body_is_skipped(model):
    x = torch.randn(2, 4)
    ran = []
    with model.trace(
        x,
    ) as tracer:
        ran.append(tracer)
        out = model[1].output.save()
    assert len(ran) == 1 and ran[0] is tracer
    assert torch.equal(out, NETS["net"](x))


def test_traces_at_one_site_in_a_loop(model):
    for _ in range(5):
        x = torch.randn(1, 4)
        ran: list = []
        with model.trace() as tracer:
            with tracer.invoke(x):
                ran.append(1)
                out = model[1].output.save()
        assert ran == [1]
        assert torch.equal(out, NETS["net"](x))


def test_threads_tracing_at_the_same_site(model):
    failures: list = []

    def work(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(20):
            x = torch.randn(2, 4, generator=generator)
            ran: list = []
            out = _trace(model, x, ran)
            if ran != [1] or not torch.equal(out, NETS["net"][0](x)):
                failures.append(seed)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert skip._armed == {}  # every arm fired and was disarmed


def test_a_trace_function_already_set_is_kept(model):
    lines: list = []

    def tracer(frame, event, arg):  # a debugger's or coverage's, in miniature
        lines.append(event)
        return None

    sys.settrace(tracer)
    try:
        ran: list = []
        out = _trace(model, torch.ones(1, 4), ran)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)
    assert ran == [1] and out.shape == (1, 4)
    assert lines  # it kept seeing calls


def test_shapes_nnsight_cannot_skip_are_refused_in_its_words(model):
    with pytest.raises(ValueError, match="must start on its own line"):
        with model.trace(torch.ones(1, 4)): out = model.output.save()  # noqa: E701, F841  # fmt: skip
    with pytest.raises(ValueError, match="cannot start with `try:`"):
        with model.trace(torch.ones(1, 4)):
            try:
                out = model.output.save()  # noqa: F841
            finally:
                pass
    assert _trace(model, torch.ones(1, 4), []).shape == (1, 4)  # and the next block runs


def test_which_skip_and_how_often_the_trace_function_is_set(model):
    """Each set or clear of the global trace function is audited. nnsight's own
    skip sets one, Python clears it as the hook raises, and nnsight puts back
    what there was: three a block. The line skip sets none: the one left is
    nnsight's put-back of what there was (nothing), which changes nothing."""
    assert (nnsight_tracer.skip_context is skip.skip_body) is LOCAL_EVENTS
    calls: list = []

    def audit(event: str, args: tuple) -> None:
        if event == "sys.settrace":
            calls.append(args)

    sys.addaudithook(audit)  # (for the rest of the process: it only appends here)
    calls.clear()
    _trace(model, torch.ones(1, 4), [])
    seen = len(calls)
    assert seen == (1 if LOCAL_EVENTS else 3)
