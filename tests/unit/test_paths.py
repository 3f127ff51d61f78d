"""Which path a traced request takes, and the first reason it runs as Python:
the reasons worked out from a block and the engine's taps, the worker's record,
and its way onto the output. No engine here: ``test_taps.py`` has the engine's."""

from __future__ import annotations

import torch

from vllm_nnsight_plugin.returns.outputs import attach, merge_replies
from vllm_nnsight_plugin.taps.lower import LoweredBlock, Unlowered, lower
from vllm_nnsight_plugin.wire.reply import merged as empty_merged
from vllm_nnsight_plugin.wire.reply import request_reply
from vllm_nnsight_plugin.worker.lowering import Lowering
from vllm_nnsight_plugin.worker.paths import AT_SAMPLER, EDITED, NO_TAPS, Paths


class Model:
    path = "model"


class Tracer:
    pass


class Tables:
    """What ``lower`` asks of the tap tables: which module paths are taps."""

    site_of = {"model.layers.10": 0, "model.layers.11": 1, "model.layers.12": 2}
    hidden = 8
    device = torch.device("cpu")

    def means(self, site, whole, any_width=False):
        return not whole

    def width(self, site):
        return self.hidden


def why(source: str, **scope) -> Unlowered | LoweredBlock:
    model = Model()
    return lower(
        source, {"model": model, "tracer": Tracer(), **scope}, model, Tracer, Tables(), torch.float32
    )


def test_a_block_on_a_location_that_is_not_a_tap_says_which():
    got = why("for _ in tracer.iter[:3]:\n    h = model.model.layers[3].mlp.act_fn.output\n    h[:] *= 0\n")
    assert got == Unlowered(
        "not_a_tap", "it reads `model.model.layers.3.mlp.act_fn`, which is not a tap on this engine"
    )
    # One of the forms, on a layer that is not a tap: the same reason.
    got = why("for _ in tracer.iter[:3]:\n    model.model.layers[4].output[0][:] += v\n", v=torch.ones(8))
    assert got.kind == "not_a_tap" and "`model.model.layers.4`" in got.reason


def test_a_branch_the_sampler_and_several_locations_are_told_apart():
    tap = "model.model.layers[10].output[0]"
    assert (
        why(f"for _ in tracer.iter[:3]:\n    h = {tap}\n    if h.norm() > 1:\n        h[:] *= 0.5\n").kind
        == "branch"
    )
    assert why("for _ in tracer.iter[:3]:\n    model.logits[:, 5] = 0\n").kind == "sampler"
    two = f"for _ in tracer.iter[:3]:\n    a = {tap}.clone().save()\n    b = model.model.layers[10].input.save()\n"
    assert why(two).reason == "it works on more than one location in a step"
    assert why(f"x = {tap}.sum().save()\n").reason.startswith("its statements are not one of the forms")


def test_a_form_whose_values_do_not_fit_says_why():
    steer = "for _ in tracer.iter[:steps]:\n    model.model.layers[10].output[0][:] += v\n"
    assert isinstance(why(steer, v=torch.ones(8), steps=3), LoweredBlock)
    assert why(steer, v=torch.ones(7), steps=3).kind == "vector"  # not the tap's width
    assert (
        why(steer, v=torch.ones(8), steps=2.5).reason
        == "its steps are not whole numbers read without running code"
    )
    assert (
        why(steer.replace("tracer.iter", "other.iter"), v=torch.ones(8), steps=3, other=object()).kind
        == "form"
    )


def test_the_first_reason_stands_and_each_request_is_counted_once():
    paths = Paths()
    paths.python("a", *EDITED)
    paths.python("a", *NO_TAPS)
    paths.lowered("b", "steer")
    paths.python("c", *NO_TAPS)
    paths.at_taps("d", "form", "a Python `if` or `while` decides what it does")
    paths.at_taps("d", "form", "counted once")
    assert paths.stats() == {
        "python_blocks": 3,
        "python_why": {"edits": 1, "no_taps": 1, "form": 1},
        "python_at_taps": 1,
    }
    assert paths.take(["d"]) == {
        "lowered": False,
        "form": "taps",
        "reason": "a Python `if` or `while` decides what it does",
    }
    assert paths.take(["a-0", "a"]) == {"lowered": False, "form": None, "reason": EDITED[1]}
    assert paths.take(["a"]) is None  # taken once
    assert paths.take(["b"]) == {"lowered": True, "form": "steer", "reason": None}
    paths.keep_only({"e"})
    assert paths.taken == {}


def test_the_path_reaches_the_output_from_the_first_rank_that_has_one():
    import pickle

    lowered = {"lowered": True, "form": "keep", "reason": None}
    replies = [
        [pickle.dumps({"r": {**request_reply(), "path": None}})],
        [pickle.dumps({"r": {"path": lowered}})],
    ]
    merged = merge_replies(replies)
    assert merged["r"]["path"] == lowered

    class Output:
        outputs = ()

    output = Output()
    attach(output, merged["r"])
    assert output.nnsight_path == lowered
    attach(output, empty_merged())
    assert output.nnsight_path is None


def test_a_servers_path_is_kept_only_in_its_documented_shape():
    from vllm_nnsight_plugin.client.remote import served_path

    sent = {"lowered": False, "form": None, "reason": "it reads `model.x`, which is not a tap on this engine"}
    assert served_path(sent) == sent
    assert served_path({"lowered": True, "form": "steer", "reason": None, "extra": 1}) == {
        "lowered": True,
        "form": "steer",
        "reason": None,
    }
    assert served_path({"lowered": 1, "form": "steer"}) is None  # not a bool
    assert served_path({"lowered": False, "reason": {"x": 1}}) is None
    assert served_path("lowered") is None and served_path(None) is None
    assert len(served_path({"lowered": False, "reason": "x" * 10**6})["reason"]) == 20_000


def test_a_block_that_never_reaches_a_module_is_at_the_sampler_on_any_engine():
    """Nothing of it can go on the tables (admission marks it: ``reach.py``), so
    its reason is the sampler's, not that of the forms, and it is not looked at."""

    class Mediator:
        needs_forward = False

    class Request:
        id = "r"
        mediator = Mediator()

    lowering = Lowering(runner=None)
    assert not lowering.lower(Request(), tables=None, model=None, rows=5, most=10)
    assert lowering.paths.take(["r"]) == {"lowered": False, "form": None, "reason": AT_SAMPLER[1]}
    assert lowering.stats()["python_why"] == {"sampler": 1}


def test_steering_several_layers_needs_each_a_tap_once_in_the_models_order():
    """Python adds at each layer as the model reaches it: the lowered block adds
    the same vector at each of their taps (``also``), or runs as Python."""
    loop = "for _ in tracer.iter[:3]:\n    for i in {}:\n        model.model.layers[i].output[0][:] += v\n"
    v = torch.ones(8)
    got = why(loop.format("(10, 12)"), v=v)
    assert isinstance(got, LoweredBlock) and got.site == "model.layers.10" and got.also == (2,)
    got = why(loop.format("layers"), v=v, layers=range(10, 13))
    assert isinstance(got, LoweredBlock) and got.also == (1, 2)
    assert why(loop.format("(12, 10)"), v=v).reason.startswith("its layers are not whole numbers, each once")
    assert why(loop.format("(10, 10)"), v=v).kind == "form"
    assert why(loop.format("layers"), v=v, layers=[10, 11.0]).kind == "form"
    assert why(loop.format("range(10, 13)"), v=v, range=lambda *a: [10]).kind == "form"  # not the builtin
    assert why(loop.format("(10, 13)"), v=v) == Unlowered(
        "not_a_tap", "it reads `model.model.layers.13`, which is not a tap on this engine"
    )


def test_traced_outputs_are_counted_by_path_in_the_prometheus_registry():
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from vllm_nnsight_plugin.returns.metrics import count, path_label

    def value(path, form=""):
        return REGISTRY.get_sample_value("vllm_nnsight_requests_total", {"path": path, "form": form}) or 0.0

    assert path_label(None) is None
    assert path_label({"lowered": True, "form": "steer", "reason": None}) == ("lowered", "steer")
    assert path_label({"lowered": False, "form": "taps", "reason": "x"}) == ("taps", "")
    assert path_label({"lowered": False, "form": None, "reason": "x"}) == ("python", "")
    before = value("taps"), value("lowered", "keep")
    outputs = [
        SimpleNamespace(nnsight_path={"lowered": False, "form": "taps", "reason": "x"}),
        SimpleNamespace(nnsight_path={"lowered": True, "form": "keep", "reason": None}),
        SimpleNamespace(nnsight_path=None),  # a plain request
        SimpleNamespace(),
        SimpleNamespace(nnsight_path={"lowered": True, "form": "keep", "reason": None}),
    ]
    count(outputs)
    assert (value("taps"), value("lowered", "keep")) == (before[0] + 1, before[1] + 2)


def test_each_workers_step_counts_add_only_what_it_did_since_its_last_reply():
    import pickle

    from prometheus_client import REGISTRY

    from vllm_nnsight_plugin.returns.metrics import StepCounts
    from vllm_nnsight_plugin.returns.outputs import merge_replies

    def value(name, forward):
        return REGISTRY.get_sample_value(name, {"forward": forward}) or 0.0

    before = value("vllm_nnsight_steps_total", "taps"), value("vllm_nnsight_step_seconds_total", "python")
    # two replies of one worker (a request's entry beside its counts), then another worker's
    first = [pickle.dumps({"r": {"path": None}}), pickle.dumps(StepCounts(-7, 2, 0.5, 3, 0.25))]
    assert set(merge_replies([first])) == {"r"}  # the counts are no request's
    merge_replies(
        [[pickle.dumps(StepCounts(-7, 2, 0.75, 5, 0.25))], [pickle.dumps(StepCounts(-8, 0, 0.0, 1, 0.1))]]
    )
    after = value("vllm_nnsight_steps_total", "taps"), value("vllm_nnsight_step_seconds_total", "python")
    assert after[0] - before[0] == 3 + 2 + 1
    assert abs(after[1] - before[1] - 0.75) < 1e-9
