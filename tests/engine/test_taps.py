"""Taps: patterns, the lowering of the user docs' steering loop, the tables, and
the lowered path against the Python path on the session engine (eager, fp32,
tapped at layers 10 and 20: ``conftest.SESSION_TAPS``), where the two must agree
bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams

from tests.engines import DEVICE
from vllm_nnsight_plugin import VLLM
from vllm_nnsight_plugin.returns.cached import CachedSteps
from vllm_nnsight_plugin.taps.forms import Index, block_form
from vllm_nnsight_plugin.taps.install import Lowered, TapTables, _tapped_class, returns_tuple
from vllm_nnsight_plugin.taps.kept import Regions
from vllm_nnsight_plugin.taps.ops import KEEP_BOTH, KEEP_FIRST, KEEP_SECOND, KEEP_SUM
from vllm_nnsight_plugin.taps.spec import TapError, parse, resolve

PROMPT = "The capital of France is"
NAMES = ["model", "model.embed_tokens", "model.layers", "model.layers.0", "model.layers.1", "model.norm"]


# ---------------------------------------------------------------- patterns
def test_patterns_resolve_in_model_order_and_refuse_what_does_not_exist():
    assert parse("model.layers.1.output, model.layers.0.output") == (
        "model.layers.1.output",
        "model.layers.0.output",
    )
    assert parse('["model.norm.output"]') == ("model.norm.output",)
    assert resolve(["model.layers.*.output"], NAMES) == ("model.layers.0", "model.layers.1")
    assert resolve(["model.layers.1.output", "model.layers.*.output"], NAMES) == (
        "model.layers.0",
        "model.layers.1",
    )
    with pytest.raises(TapError, match=r"names no module.*model\.layers\.\*\.output"):
        resolve(["model.layer.3.output"], NAMES)
    with pytest.raises(TapError, match="a tap is a module's output"):
        resolve(["model.layers.0.input"], NAMES)
    with pytest.raises(TapError, match="a tap is a module's output"):
        resolve(["model.layers.0.source.output"], NAMES)
    with pytest.raises(TapError, match="strings"):
        parse(["model.norm.output", 3])


# ---------------------------------------------------------------- lowering
@pytest.mark.parametrize(
    "source",
    [
        "for _ in tracer.iter[:16]:\n    model.model.layers[10].output[0][:] += 60.0 * vector\n",
        "for _ in tracer.iter[2:steps]:\n    model.model.layers[i].output[0][:] += vector\nout = tracer.result.save()\n",
        "for step in tracer.all():\n    layer.output[0][:] += -(a * v) / 2\n",
        # the docs' spelling: the tap's value named, the vector moved to it
        "for _ in tracer.iter[:12]:\n    hidden = layer.output[0]\n    hidden[:] += 40.0 * v.to(hidden.device)\n",
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[:] += v\n",
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h += s * v.to(h)\n",
        "for _ in tracer.all():\n    h = layer.output[0]\n    h[:] += (v.to(h.dtype) - w.to(dev)) * 2\n",
        "for _ in tracer.iter[:3]:\n    h = layer.mlp.output\n    h[:] += v\n",
    ],
)
def test_the_steering_loop_forms_are_recognised(source):
    form = block_form(source)
    assert form is not None and form.vector is not None and not form.code
    assert form.alias is None or form.alias not in form.names


@pytest.mark.parametrize(
    ("source", "select"),
    [
        ("for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[-1] += 2.0 * v.to(h)\n", -1),
        ("for _ in tracer.all():\n    layer.output[0][-1] += v\n", -1),
        ("for _ in tracer.iter[:3]:\n    layer.output[0][0] += v\n", 0),
        ("for _ in tracer.iter[:3]:\n    layer.mlp.output[-1] += v\n", -1),  # a tensor's last row
        ("h = layer.output[0]\nh[-1] += v\nout = tracer.result.save()\n", -1),  # the first step only
        # the last k rows of each step (all of a step with fewer)
        ("for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[-2:] += v\n", slice(-2, None)),
        ("for _ in tracer.all():\n    layer.output[0][-1:] += v\n", slice(-1, None)),
    ],
)
def test_steering_one_row_of_each_step_is_recognised(source, select):
    """The prompt's last (or first) row on the first step, then the new token's
    row: a row every step has."""
    form = block_form(source)
    assert form is not None and form.vector is not None and form.select == select


@pytest.mark.parametrize(
    ("source", "over"),
    [
        (
            "for _ in tracer.iter[:4]:\n    for i in (8, 10, 12):\n"
            "        model.model.layers[i].output[0][:] += 4.0 * v\n",
            ("i", (8, 10, 12)),
        ),
        (
            "for _ in tracer.all():\n    for index in range(8, 13):\n"
            "        hidden = model.model.layers[index].output[0]\n        hidden[:] += v.to(hidden)\n",
            ("index", ("range", 8, 13)),
        ),
        (
            "for _ in tracer.iter[:4]:\n    for i in chosen:\n        model.model.layers[i].output[0][-1] += v\n",
            ("i", Index("chosen")),
        ),
    ],
)
def test_steering_several_layers_in_a_loop_is_recognised(source, over):
    form = block_form(source)
    assert form is not None and form.vector is not None and form.over == over


@pytest.mark.parametrize(
    "source",
    [
        # the vector reads the layer; the loop is not over the layers; a loop that
        # is not over whole numbers; more in the inner loop; an else
        "for _ in tracer.iter[:4]:\n    for i in (8, 10):\n        model.model.layers[i].output[0][:] += i * v\n",
        "for _ in tracer.iter[:4]:\n    for i in (8, 10):\n        model.model.layers[10].output[0][:] += v\n",
        "for _ in tracer.iter[:4]:\n    for i in (8, 10):\n        model.model.blocks[i].output[0][:] += v\n",
        "for _ in tracer.iter[:4]:\n    for i in (8, x):\n        model.model.layers[i].output[0][:] += v\n",
        "for _ in tracer.iter[:4]:\n    for i in f(3):\n        model.model.layers[i].output[0][:] += v\n",
        "for _ in tracer.iter[:4]:\n    for i in (8, 10):\n        model.model.layers[i].output[0][:] += v\n"
        "        model.model.layers[i].output[0][:] += v\n        x = 1\n",
        "for _ in tracer.iter[:4]:\n    for i in (8, 10):\n        model.model.layers[i].output[0][:] += v\n"
        "    else:\n        pass\n",
        "for i in (8, 10):\n    model.model.layers[i].output[0][:] += v\n",  # no step loop
        # the steps read a name the inner loop rebinds (Python reads the captured one)
        "for _ in tracer.iter[:i]:\n    for i in (8, 10):\n        model.model.layers[i].output[0][:] += v\n",
        # layers counted by the step, or by the loop's own name
        "for step in tracer.iter[:4]:\n    for i in range(step):\n        model.model.layers[i].output[0][:] += v\n",
        "for _ in tracer.iter[:4]:\n    for i in range(i):\n        model.model.layers[i].output[0][:] += v\n",
        "rows = list().save()\nfor step in tracer.all():\n    for i in range(2, step):\n"
        "        rows.append(model.model.layers[i].output[0].clone())\n",
    ],
)
def test_other_loops_over_layers_run_as_python(source):
    assert block_form(source) is None


@pytest.mark.parametrize(
    ("source", "over", "select", "code"),
    [
        (
            "rows = list().save()\nfor _ in tracer.iter[:4]:\n    for i in (10, 20):\n"
            "        rows.append(model.model.layers[i].output[0][-1].clone())\n",
            ("i", (10, 20)),
            -1,
            KEEP_FIRST,
        ),
        (
            "rows = list().save()\nfor _ in tracer.all():\n    for i in range(30):\n"
            "        rows.append(model.model.layers[i].output[0] + model.model.layers[i].output[1])\n",
            ("i", ("range", 30)),
            None,
            KEEP_SUM,
        ),
        (
            "rows = list().save()\nfor step in tracer.iter[1:n]:\n    for layer in chosen:\n"
            "        rows.append(model.model.layers[layer].output[1].clone())\n",
            ("layer", Index("chosen")),
            None,
            KEEP_SECOND,
        ),
        (  # a probe over a captured count of layers
            "rows = list().save()\nfor _ in tracer.iter[:tokens]:\n    for i in range(layers):\n"
            "        rows.append(model.model.layers[i].output[0][-1].clone())\n",
            ("i", ("range", Index("layers"))),
            -1,
            KEEP_FIRST,
        ),
    ],
)
def test_keeping_several_layers_in_a_loop_is_recognised(source, over, select, code):
    form = block_form(source)
    assert form is not None and form.kept == "rows" and form.over == over
    assert form.select == select and form.code == code and form.vector is None


@pytest.mark.parametrize(
    "source",
    [
        # not over the layers; the steps read the loop's name; two statements inside;
        # the kept list is the loop's name; a first-step read has no loop
        "rows = list().save()\nfor _ in tracer.iter[:4]:\n    for i in (10, 20):\n"
        "        rows.append(model.model.layers[10].output[0].clone())\n",
        "rows = list().save()\nfor _ in tracer.iter[:i]:\n    for i in (10, 20):\n"
        "        rows.append(model.model.layers[i].output[0].clone())\n",
        "rows = list().save()\nfor _ in tracer.iter[:4]:\n    for i in (10, 20):\n"
        "        rows.append(model.model.layers[i].output[0].clone())\n        x = 1\n",
        "rows = list().save()\nfor _ in tracer.iter[:4]:\n    for rows in (10, 20):\n"
        "        rows.append(model.model.layers[rows].output[0].clone())\n",
        "for i in (10, 20):\n    first = model.model.layers[i].output[0].clone().save()\n",
    ],
)
def test_other_keeps_over_layers_run_as_python(source):
    assert block_form(source) is None


def test_a_keep_at_several_taps_saves_the_list_its_loop_builds():
    """Each tap's rows in a region of their own; the saves interleave them as the
    loop appends: each step's rows at every tap before the next step's."""
    tables = TapTables(("a", "b", "c"), max_tokens=8, hidden=3, entries=8, device="cpu", store_size=64)
    last = Lowered(0, 0, None, None, code=KEEP_FIRST, name="last", select=-1)
    every = Lowered(0, 0, 2, None, code=KEEP_SUM, name="every")
    assert tables.add("l", last, room=3, also=(2,))
    assert tables.add("e", every, room=5, also=(1, 2))
    assert not tables.add(
        "x", Lowered(0, 0, 1, None, code=KEEP_FIRST, name="x", single=True), room=3, also=(1,)
    )
    steps = []
    for req_ids, starts, counts in [(["l", "e"], [0, 3], [3, 2]), (["e", "l"], [0, 1], [1, 1])]:
        tables.fill(req_ids, bounds(starts, counts))
        hidden, residual = torch.randn(3, 8, 3), torch.randn(3, 8, 3)
        for site in range(3):
            torch.ops.vllm_nnsight.keep(
                hidden[site], residual[site], tables.codes, tables.dest, tables.store, site
            )
        steps.append((hidden, residual))
    saved = {}
    for name in ("l", "e"):
        lowered, forwards = tables.forget(name)
        assert forwards == 2 and not tables.overflowed(lowered)
        saved.update(tables.saves(lowered))
        tables.release(lowered)
    (h0, r0), (h1, r1) = steps
    rows = saved["last"].unstack()  # step 0 at a, at c; step 1 at a, at c
    assert [tuple(r.shape) for r in rows] == [(3,)] * 4
    for got, want in zip(rows, [h0[0, 2], h0[2, 2], h1[0, 1], h1[2, 1]]):
        assert torch.equal(got, want)
    rows = saved["every"].unstack()  # the sum at a, b, c on step 0, then step 1
    assert [tuple(r.shape) for r in rows] == [(2, 3)] * 3 + [(1, 3)] * 3
    wants = [h0[s, 3:5] + r0[s, 3:5] for s in range(3)] + [h1[s, 0:1] + r1[s, 0:1] for s in range(3)]
    for got, want in zip(rows, wants):
        assert torch.equal(got, want)
    assert tables.regions.free_rows() == 63


def test_a_range_of_captured_counts_is_read_as_the_layers_it_names():
    """``range(layers)`` (a probe of every layer) lowers over the layers the
    captured numbers name; anything but whole numbers, or a ``range`` of the
    block's own, runs as Python."""
    from types import SimpleNamespace

    from vllm_nnsight_plugin.taps.lower import Unlowered, _layers

    class Model:
        pass

    model = Model()
    sites = tuple(f"model.layers.{i}" for i in range(4))
    tables = SimpleNamespace(
        site_of={path: i for i, path in enumerate(sites)}, means=lambda site, whole: True
    )
    form = block_form(
        "rows = list().save()\nfor _ in tracer.iter[:4]:\n    for i in range(first, layers):\n"
        "        rows.append(model.model.layers[i].output[0][-1].clone())\n"
    )
    scope = {"model": model, "first": 1, "layers": 4}
    found = _layers(form, scope, model, tables)
    assert not isinstance(found, Unlowered) and found[0]["i"] == 1 and found[1] == (2, 3)
    for bad in ({**scope, "layers": 4.0}, {**scope, "first": None}, {**scope, "range": range}):
        assert isinstance(_layers(form, bad, model, tables), Unlowered)


def test_the_names_a_steering_vector_reads():
    form = block_form(
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[:] += (v.to(h.dtype) - w.to(dev)) * 2\n"
    )
    assert form.alias == "h" and form.names == {"v", "w", "dev"} and form.tap == ("layer",)
    assert block_form("for _ in tracer.iter[:3]:\n    h = layer.mlp.output\n    h[:] += v\n").whole


def test_bounds_and_layers_named_by_attributes_are_read_without_running_the_objects_code():
    """``tracer.iter[:cfg.steps]`` and ``layers[cfg.layer]`` lower when reading
    them runs nothing of the object's own; a property or a custom lookup does."""
    import types
    from dataclasses import dataclass

    from vllm_nnsight_plugin.taps.forms import Index
    from vllm_nnsight_plugin.taps.lower import _number, _site

    form = block_form(
        "for _ in tracer.iter[:cfg.run.steps]:\n    model.model.layers[cfg.layer].output[0][:] += v\n"
    )
    assert form.stop == Index("cfg", ("run", "steps")) and form.tap[-1] == Index("cfg", ("layer",))

    @dataclass
    class Run:
        steps: int = 4

    class Counted:
        layer = 7  # a plain class value

        @property
        def steps(self):
            raise AssertionError("ran the object's code")

    class Lookup:
        def __getattr__(self, name):
            raise AssertionError("ran the object's code")

    cfg = types.SimpleNamespace(run=Run(), layer=3)
    assert _number(form.stop, {"cfg": cfg}) == 4 and _number(Index("cfg", ("layer",)), {"cfg": cfg}) == 3
    assert _number(Index("c", ("layer",)), {"c": Counted()}) == 7
    assert _number(Index("c", ("steps",)), {"c": Counted()}) is None  # a property: Python reads it
    assert _number(Index("c", ("steps",)), {"c": Lookup()}) is None
    assert _number(Index("c", ("__class__",)), {"c": cfg}) is None
    assert _number(Index("c", ("layer",)), {"c": types.SimpleNamespace(layer=2.0)}) is None  # not whole

    class Model:
        pass

    model = Model()
    assert _site(form.tap, {"model": model, "cfg": cfg}, model) == "model.layers.3"
    assert _site(form.tap, {"model": model, "cfg": Counted()}, model) == "model.layers.7"
    assert _site(form.tap, {"model": model, "cfg": Lookup()}, model) is None


def test_a_vector_moved_to_the_taps_value_is_worked_out_as_the_block_would():
    """At admission the tap's value is not there yet: ``.to(hidden)`` reads only its
    dtype and device, the model's, and gives what the block computes each step."""
    from vllm_nnsight_plugin.taps.lower import _vector

    source = "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[:] += {}\n"
    torch.manual_seed(0)
    v, w = torch.randn(8), torch.randn(8, dtype=torch.float64)
    scope = {"v": v, "w": w, "dev": torch.device("cpu"), "half": torch.bfloat16, "s": 3}

    def worked_out(vector, dtype=torch.bfloat16):
        return _vector(block_form(source.format(vector)), scope, 8, dtype, torch.device("cpu"))

    hidden = torch.zeros(4, 8, dtype=torch.bfloat16)  # what the block would see
    for vector, want in [
        ("s * v.to(h)", 3 * v.to(hidden)),
        ("40.0 * v.to(h.device)", 40.0 * v.to(hidden.device)),
        ("(v.to(h.dtype) - w.to(v)) * 2", (v.to(hidden.dtype) - w.to(v)) * 2),
        ("v.to(half)", v.to(torch.bfloat16)),
    ]:
        got = worked_out(vector)
        assert got is not None and got.dtype == want.dtype and torch.equal(got, want), vector
    assert worked_out("w.to(dev)") is None  # float64: not what the tables add exactly
    assert worked_out("v.to(h)", dtype=torch.float64) is None  # a dtype the tables do not run
    assert (
        _vector(block_form(source.format("v.to(dev)")), {**scope, "dev": "cpu"}, 8, torch.bfloat16, "cpu")
        is None
    )


@pytest.mark.parametrize(
    "source",
    [
        # a second edit, a read, a save, another statement: Python
        "for _ in tracer.iter[:3]:\n    layer.output[0][:] += v\n    layer.output[0][:] += v\n",
        "x = 1\nfor _ in tracer.iter[:3]:\n    layer.output[0][:] += v\n",
        # the loop variable, a call, a step in the slice, a part of the rows, the residual
        "for s in tracer.iter[:3]:\n    layer.output[0][:] += s * v\n",
        "for _ in tracer.iter[:3]:\n    layer.output[0][:] += v.to('cuda')\n",
        # the tap's value read as more than its dtype and device, or edited otherwise
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[:] += h.norm() * v\n",
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[:] += v.to(h.shape)\n",
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[:] += h\n",
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[1] += v\n",  # not on every step
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[1:] += v\n",  # rows not counted from the end
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[:, 5] += v\n",
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    g[:] += v\n",
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[:] -= v\n",
        "for _ in tracer.iter[:3]:\n    h = layer.output[1]\n    h[:] += v\n",
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[:] = h + v\n",
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    layer.output[0][:] += v\n",
        "for _ in tracer.iter[:3]:\n    v = layer.output[0]\n    v[:] += v.to(v)\n",
        "for _ in tracer.iter[:3]:\n    h = layer.output[0]\n    h[:] += v.to(h, copy=True)\n",
        "for _ in tracer.iter[::2]:\n    layer.output[0][:] += v\n",
        "for _ in tracer.iter[:3]:\n    layer.output[0][-2] += v\n",
        "for _ in tracer.iter[:3]:\n    layer.output[0][k] += v\n",
        "for _ in tracer.iter[:3]:\n    layer.output[1][:] += v\n",
        "for _ in tracer.iter[:3]:\n    layer.output[0][:] -= v\n",
        "for _ in tracer.iter[-2:]:\n    layer.output[0][:] += v\n",
        "layer.output[0][2] += v\n",  # the first step only, on a row a prompt may not have
        "h = layer.output[0]\nh += v\nh[-1] += v\n",
    ],
)
def test_anything_else_runs_as_python(source):
    assert block_form(source) is None


KEEP_LOOP = "rows = list().save()\nfor _ in tracer.iter[:8]:\n    rows.append({})\n"


@pytest.mark.parametrize(
    ("source", "code", "select"),
    [
        (KEEP_LOOP.format("layer.output[0].clone()"), KEEP_FIRST, None),
        (KEEP_LOOP.format("model.model.layers[i].output[1].clone()"), KEEP_SECOND, None),
        (KEEP_LOOP.format("layer.output[0] + layer.output[1]"), KEEP_SUM, None),
        (
            KEEP_LOOP.format("(layer.output[1] + layer.output[0]).clone()") + "out = tracer.result.save()\n",
            KEEP_SUM,
            None,
        ),
        (KEEP_LOOP.format("layer.output[0][-1].clone()"), KEEP_FIRST, -1),
        (KEEP_LOOP.format("layer.output[1].clone()[0]"), KEEP_SECOND, 0),
        (KEEP_LOOP.format("(layer.output[0] + layer.output[1])[-1]"), KEEP_SUM, -1),
        (
            "rows = list().save()\nfor _ in tracer.all():\n    rows.append(layer.output[0].clone())\n",
            KEEP_FIRST,
            None,
        ),
        ("first = layer.output[0].clone().save()\n", KEEP_FIRST, None),
        ("last = layer.output[0][-1].clone().save()\n", KEEP_FIRST, -1),
        ("last = layer.output[0].clone()[2:4].save()\n", KEEP_FIRST, slice(2, 4)),
        ("s = (layer.output[0] + layer.output[1])[-1].save()\nout = tracer.result.save()\n", KEEP_SUM, -1),
    ],
)
def test_the_keeping_forms_are_recognised(source, code, select):
    form = block_form(source)
    assert form is not None and form.code == code and form.select == select and form.vector is None


@pytest.mark.parametrize(
    "source",
    [
        "cache = tracer.cache(modules=[model.model.layers[10]])\n",
        "cache = tracer.cache([layer])\n",
        "cache = tracer.cache(modules=[model.model.layers[i]])\nout = tracer.result.save()\n",
    ],
)
def test_a_cache_of_one_tap_is_recognised(source):
    form = block_form(source)
    assert form is not None and form.cache and form.code == KEEP_BOTH and form.stop is None


@pytest.mark.parametrize(
    "source",
    [
        "cache = tracer.cache()\n",  # every module
        "cache = tracer.cache(modules=[layer, other])\n",
        "cache = tracer.cache(modules=[layer], device=None)\n",
        "cache = tracer.cache(modules=[layer], include_inputs=True)\n",
        "cache = tracer.cache(modules=(layer,))\n",
        "cache = tracer.cache(modules=[layer])\nx = 1\n",
        "layer = tracer.cache(modules=[layer])\n",
    ],
)
def test_other_caches_run_as_python(source):
    assert block_form(source) is None


@pytest.mark.parametrize(
    "source",
    [
        KEEP_LOOP.format("layer.output[0]"),  # a view of vLLM's buffer: its value may change
        KEEP_LOOP.format("layer.output[0][-1]"),  # a view of one row
        KEEP_LOOP.format("layer.output[0][1].clone()"),  # a row a decode step does not have
        KEEP_LOOP.format("layer.output[0][-2].clone()"),
        KEEP_LOOP.format("layer.output[0][-1:].clone()"),  # a slice of the rows
        KEEP_LOOP.format("layer.output[0][k].clone()"),
        KEEP_LOOP.format("layer.output[0].clone().cpu()"),
        KEEP_LOOP.format("layer.output[0] + other.output[1]"),
        KEEP_LOOP.format("layer.output[0] - layer.output[1]"),
        "rows = []\nfor _ in tracer.iter[:8]:\n    rows.append(layer.output[0].clone())\n",
        "rows = list().save()\nfor _ in tracer.iter[:8]:\n    other.append(layer.output[0].clone())\n",
        "rows = list().save()\nfor i in tracer.iter[:8]:\n    rows.append(model.model.layers[i].output[0].clone())\n",
        "first = layer.output[0].save()\n",  # a view
        "first = layer.output[0][-1].save()\n",
        "first = layer.output[0][k].clone().save()\n",
        "first = layer.output[0].clone().save()\nsecond = layer.output[1].clone().save()\n",
    ],
)
def test_other_reads_run_as_python(source):
    assert block_form(source) is None


def test_only_a_forward_that_always_returns_a_tuple_is_read_as_one():
    class Layer(torch.nn.Module):
        def forward(self, x):
            def helper():
                return x

            return x, helper()

    class Maybe(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x
            return x, x

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x

    assert returns_tuple(Layer) and not returns_tuple(Maybe) and not returns_tuple(Plain)


class _Pair(torch.nn.Module):
    def forward(self, x, residual):
        return x * 2, x + residual


class _Alone(torch.nn.Module):  # as gemma4's and minicpm's decoder layers in vLLM
    def forward(self, x, residual):
        return x * 2, None


def test_the_default_taps_every_decoder_layer_that_returns_hidden_and_residual():
    """``"layers"`` never stops an engine: a model whose layers return no residual
    (``return hidden, None``) or sit nowhere known gets no taps."""
    from vllm_nnsight_plugin.taps.install import _decoder_layers

    def model(layer: type, where: str = "layers") -> torch.nn.Module:
        root, inner = torch.nn.Module(), torch.nn.Module()
        setattr(inner, where, torch.nn.ModuleList([layer(), layer()]))
        root.model = inner
        return root

    assert _decoder_layers(model(_Pair)) == ("model.layers.0", "model.layers.1")
    assert returns_tuple(_Pair, exactly=2) and not returns_tuple(_Alone)
    assert _decoder_layers(model(_Alone)) == ()
    assert _decoder_layers(model(_Pair, where="blocks")) == ()


def test_a_tap_on_a_value_whose_second_is_not_a_tensor_steers_and_keeps_nothing_else():
    from vllm_nnsight_plugin.taps.install import _apply

    for one_op in (False, True):
        tables = TapTables(
            ("l",), max_tokens=4, hidden=3, entries=2, device="cpu", store_size=8, one_op=one_op
        )
        tables.bank[0] = torch.tensor([1.0, 2.0, 3.0])
        tables.slots[0, :2] = 0
        hidden = torch.zeros(2, 3)
        out = _apply(tables, 0, (hidden, None))
        assert out[1] is None and torch.equal(out[0], torch.tensor([[1.0, 2.0, 3.0]] * 2))


def steering(site, start, stop, result=None):
    return Lowered(site, start, stop, result)


def bounds(starts, counts):
    """Row offsets as the runner holds them: each request's first row, then the end."""
    assert all(a + n == b for a, n, b in zip(starts, counts, starts[1:]))
    return [*starts, starts[-1] + counts[-1]] if starts else [0]


def test_the_tables_point_each_steps_rows_at_their_requests():
    tables = TapTables(("model.layers.0", "model.layers.1"), max_tokens=16, hidden=4, entries=4, device="cpu")
    assert tables.add("a", steering(1, 0, 2), torch.ones(4))
    assert tables.add("b", steering(0, 1, None, "out"), torch.full((1, 4), 2.0))
    assert tables.idle() is False
    tables.fill(["a", "plain", "b"], bounds([0, 5, 6], [5, 1, 3]))  # the prompt step
    want = torch.full((2, 16), -1, dtype=torch.int32)
    want[1, 0:5] = tables.requests["a"].entry
    assert torch.equal(tables.slots, want)  # b starts on its second step
    tables.fill(["b", "a"], bounds([0, 1], [1, 1]))
    want = torch.full((2, 16), -1, dtype=torch.int32)
    want[0, 0] = tables.requests["b"].entry
    want[1, 1] = tables.requests["a"].entry
    assert torch.equal(tables.slots, want)
    tables.fill(["b", "a"], bounds([0, 1], [1, 1]))  # a's window is over
    want[1, 1] = -1
    assert torch.equal(tables.slots, want)
    hidden = torch.arange(8.0).reshape(2, 4)
    out = torch.ops.vllm_nnsight.steer(hidden, hidden, tables.slots, tables.bank, tables.how, 0)
    assert torch.equal(out, torch.stack([hidden[0] + 2.0, hidden[1]]))
    assert tables.forget("a")[1] == 3 and tables.forget("b")[1] == 3  # forwards each was in
    tables.fill(["plain"], bounds([0], [1]))
    assert torch.equal(tables.slots, torch.full((2, 16), -1, dtype=torch.int32)) and tables.idle()
    for name in "wxyz":
        assert tables.add(name, steering(0, 0, None), torch.ones(4))
    assert not tables.add("full", steering(0, 0, None), torch.ones(4))  # runs as Python


def test_a_steer_of_one_row_points_only_that_row_of_each_step_at_its_vector():
    tables = TapTables(("model.layers.0",), max_tokens=16, hidden=4, entries=4, device="cpu")
    last, first = steering(0, 0, None), steering(0, 0, None)
    last.select, first.select = -1, 0
    assert tables.add("last", last, torch.ones(4)) and tables.add("first", first, torch.full((4,), 2.0))
    assert tables.add("all", steering(0, 0, None), torch.full((4,), 3.0))
    tables.fill(["last", "first", "all"], bounds([0, 4, 7], [4, 3, 2]))  # the prompts
    want = torch.full((1, 16), -1, dtype=torch.int32)
    want[0, 3], want[0, 4], want[0, 7:9] = last.entry, first.entry, tables.requests["all"].entry
    assert torch.equal(tables.slots, want)
    tables.fill(["first", "last", "all"], bounds([0, 1, 2], [1, 1, 1]))  # one row each: that row
    want = torch.full((1, 16), -1, dtype=torch.int32)
    want[0, :3] = torch.tensor([first.entry, last.entry, tables.requests["all"].entry])
    assert torch.equal(tables.slots, want)
    hidden = torch.zeros(3, 4)
    out = torch.ops.vllm_nnsight.steer(hidden, hidden, tables.slots, tables.bank, tables.how, 0)
    assert torch.equal(out, torch.tensor([[2.0] * 4, [1.0] * 4, [3.0] * 4]))


def test_a_steer_of_the_last_rows_points_those_rows_of_each_step_at_its_vector():
    """``hidden[-2:] += v``: the prompt's last two rows, then each step's one row."""
    tables = TapTables(("model.layers.0",), max_tokens=16, hidden=4, entries=4, device="cpu")
    two, three = steering(0, 0, None), steering(0, 0, None)
    two.select, three.select = slice(-2, None), slice(-3, None)
    assert tables.add("two", two, torch.ones(4)) and tables.add("three", three, torch.full((4,), 2.0))
    tables.fill(["two", "three"], bounds([0, 5], [5, 2]))  # prompts of 5 and 2 rows
    want = torch.full((1, 16), -1, dtype=torch.int32)
    want[0, 3:5], want[0, 5:7] = two.entry, three.entry  # all of a prompt shorter than k
    assert torch.equal(tables.slots, want)
    tables.fill(["three", "two"], bounds([0, 1], [1, 1]))
    want = torch.full((1, 16), -1, dtype=torch.int32)
    want[0, :2] = torch.tensor([three.entry, two.entry])
    assert torch.equal(tables.slots, want)


def test_a_module_that_returns_what_it_was_handed_is_edited_into_a_new_tensor():
    """A tapped module's output is edited in place only where it is none of the
    values the module was handed: a module returning its input gets a new tensor,
    and its caller's value stays as it was."""
    from vllm_nnsight_plugin.taps import install

    class Same(torch.nn.Module):
        def forward(self, x):
            return x

    class Fresh(torch.nn.Module):
        def forward(self, x):
            return x * 1.0

    for module, in_place in ((Same(), False), (Fresh(), True)):
        tables = TapTables(
            ("a",), max_tokens=8, hidden=3, entries=4, device="cpu", store_size=64, one_op=True
        )
        tables.bank.copy_(torch.ones(4, 3))
        tables.slots[0, :2] = 0  # both rows steered by bank row 0, an addition
        install._tap(module, {None: 0}, tables)
        given = torch.zeros(2, 3)
        seen = []
        original = install.ops.tapped_in_place
        install.ops.tapped_in_place = lambda value, *rest, seen=seen, original=original: (
            seen.append(value) or original(value, *rest)
        )
        try:
            out = module(given)
        finally:
            install.ops.tapped_in_place = original
        assert torch.equal(out, torch.ones(2, 3))  # steered either way
        assert torch.equal(given, torch.zeros(2, 3))  # the caller's value untouched
        assert bool(seen) == in_place


def test_one_operation_a_tap_computes_what_steer_and_keep_do():
    """``ops.tap`` (chosen with ``VLLM_NNSIGHT_TAP_KERNEL=1``; one kernel on CUDA,
    ``tests/gpu/test_gpu_kernel.py``) on the tables' own layout: every keep code,
    on a tuple, a tensor and a one-value tuple; over the value itself where the
    graph is not split at the taps and the value may be edited in place (a
    module's output), into a new tensor where either is not so."""
    from vllm_nnsight_plugin.taps.install import _apply

    generator = torch.Generator().manual_seed(0)
    found = []
    for one_op, split, may in (
        (False, False, True),
        (True, False, True),
        (True, True, True),
        (True, False, False),
    ):
        in_place = one_op and may and not split
        tables = TapTables(
            ("a", "b"), max_tokens=8, hidden=3, entries=4, device="cpu", store_size=64, one_op=one_op
        )
        tables.split = split
        tables.bank.copy_(torch.randn(4, 3, generator=torch.Generator().manual_seed(1)))
        tables.slots[0, :5] = torch.tensor([0, -1, 2, -1, 3], dtype=torch.int32)
        tables.codes[0, :5] = torch.tensor([1, 2, 3, 4, 0], dtype=torch.int32)
        tables.dest[0, :5] = torch.tensor([2, 4, 6, 8, 0], dtype=torch.int32)
        generator.manual_seed(2)
        hidden, residual = torch.randn(5, 3, generator=generator), torch.randn(5, 3, generator=generator)
        given = (hidden.clone(), residual.clone())
        pair = _apply(tables, 0, given, in_place=may)
        assert (pair[0] is given[0]) == in_place and pair[1] is given[1]
        kept_pair = tables.store.clone()
        value = hidden.clone()
        tensor = _apply(tables, 0, value, in_place=may)
        assert (tensor is value) == in_place
        assert torch.equal(value, tensor if in_place else hidden)  # a new tensor leaves the value be
        kept_tensor = tables.store.clone()
        found.append(
            (pair, kept_pair, tensor, kept_tensor, _apply(tables, 0, (hidden.clone(),), in_place=may))
        )
    for pair1, kept_pair1, tensor1, kept_tensor1, single1 in found[1:]:
        pair, kept_pair, tensor, kept_tensor, single = found[0]
        assert torch.equal(pair[0], pair1[0]) and torch.equal(pair[1], pair1[1])
        assert torch.equal(tensor, tensor1) and torch.equal(single[0], single1[0])
        # row 0 of the store: where rows nobody keeps go
        assert torch.equal(kept_pair[1:], kept_pair1[1:]) and torch.equal(kept_tensor[1:], kept_tensor1[1:])
    pair, kept_pair, tensor, kept_tensor, _ = found[0]
    assert not torch.equal(kept_pair, kept_tensor) and kept_pair[2:10].abs().sum() > 0
    assert not torch.equal(tensor, hidden) and torch.equal(tensor[1], hidden[1])  # row 1: nobody's


def test_a_tap_run_from_python_copies_its_value_at_a_site_no_entry_of_the_step_touches(monkeypatch):
    """Once only ``fill`` writes the tables (``only_filled``, as ``install`` says), a
    tap run from Python at a site the step's entries leave alone copies its value and
    computes nothing (``ops.quiet``); at a site they touch it runs in full. Values,
    the residual and the kept rows are those of every tap run in full."""
    from vllm_nnsight_plugin.taps import ops
    from vllm_nnsight_plugin.taps.install import _apply

    computed = []
    steered = ops._steered
    monkeypatch.setattr(ops, "_steered", lambda *a, **k: computed.append(a[5]) or steered(*a, **k))
    generator = torch.Generator().manual_seed(3)
    hidden, residual = torch.randn(5, 3, generator=generator), torch.randn(5, 3, generator=generator)
    found = {}
    for told in (False, True):
        for one_op in (False, True):
            computed.clear()
            tables = TapTables(
                ("a", "b"), max_tokens=8, hidden=3, entries=4, device="cpu", store_size=64, one_op=one_op
            )
            if told:
                tables.only_filled()
            assert tables.add("steered", steering(0, 0, None), torch.tensor([1.0, 2.0, 3.0]))
            kept = Lowered(1, 0, None, None, code=KEEP_SUM)
            assert tables.add("kept", kept, room=8)
            # the first step: the steered request's rows only; the keeping one is not in it
            tables.fill(["steered", "plain"], bounds([0, 2], [2, 3]))
            at_a = _apply(tables, 0, (hidden.clone(), residual.clone()))
            at_b = _apply(tables, 1, (hidden.clone(), residual.clone()))
            first = list(computed)
            # the next: the keeping request's rows at "b" only
            tables.fill(["plain", "kept"], bounds([0, 3], [3, 2]))
            again_a = _apply(tables, 0, hidden.clone())
            again_b = _apply(tables, 1, (hidden.clone(), residual.clone()))
            found[told, one_op] = (at_a, at_b, again_a, again_b, tables.store.clone())
            assert first == ([0, 1] if not told else [0])
            assert computed == first + ([0, 1] if not told else [1])
    for one_op in (False, True):
        full, quiet = found[False, one_op], found[True, one_op]
        assert all(torch.equal(x, y) for a, b in zip(full[:2], quiet[:2]) for x, y in zip(a, b))
        assert torch.equal(full[2], quiet[2]) and torch.equal(full[3][0], quiet[3][0])
        assert torch.equal(full[4][1:], quiet[4][1:])  # row 0: where rows nobody keeps go
    at_a, at_b, _, _, store = found[True, True]
    assert torch.equal(at_a[0][:2], hidden[:2] + torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(at_a[0][2:], hidden[2:]) and torch.equal(at_b[0], hidden)
    assert store[1:].abs().sum() > 0  # the keeping request's rows were kept


def test_a_request_steering_several_layers_takes_an_entry_at_each_and_one_row_of_the_bank():
    tables = TapTables(
        tuple(f"model.layers.{i}" for i in range(3)), max_tokens=16, hidden=4, entries=4, device="cpu"
    )
    several = steering(0, 0, None)
    assert tables.add("several", several, torch.ones(4), also=(2,))
    assert tables.add("one", steering(1, 0, None), torch.full((4,), 2.0))
    assert not tables.add("full", steering(1, 0, None), torch.ones(4), also=(2,))  # one entry left
    tables.fill(["several", "one"], bounds([0, 3], [3, 2]))
    assert several.entry != tables._also_of["several"][0]  # an entry at each tap
    want = torch.full((3, 16), -1, dtype=torch.int32)
    want[0, 0:3], want[2, 0:3], want[1, 3:5] = several.slot, several.slot, tables.requests["one"].slot
    assert torch.equal(tables.slots, want)  # one row of the bank, the vector's
    out = torch.ops.vllm_nnsight.steer(
        torch.zeros(5, 4), torch.zeros(5, 4), tables.slots, tables.bank, tables.how, 2
    )
    assert torch.equal(out, torch.tensor([[1.0] * 4] * 3 + [[0.0] * 4] * 2))
    assert tables.steps("several") == 1
    assert tables.forget("several")[1] == 1 and len(tables.free) == 3  # both entries back
    tables.fill(["several", "one"], bounds([0, 1], [1, 1]))
    want = torch.full((3, 16), -1, dtype=torch.int32)
    want[1, 1] = tables.requests["one"].slot
    assert torch.equal(tables.slots, want)
    assert len(tables.bank_free) == 3  # its row of the bank back too


def test_a_finished_request_gives_its_entries_back_and_keeps_its_rows_until_read():
    """Entries are few and the requests of a long trace many: a request that
    finished frees its entries at once (``retire``), the rows it kept stay in its
    region until its saves are read."""
    tables = TapTables(("model.layers.0",), max_tokens=8, hidden=3, entries=2, device="cpu", store_size=32)
    first = Lowered(0, 0, None, None, code=KEEP_FIRST, name="rows")
    assert tables.add("first", first, None, room=8)
    assert tables.add("steer", steering(0, 0, None), torch.ones(3))
    assert not tables.add("late", Lowered(0, 0, None, None, code=KEEP_FIRST, name="rows"), None, room=8)
    tables.fill(["first"], bounds([0], [2]))
    hidden = torch.arange(6.0).reshape(2, 3)
    torch.ops.vllm_nnsight.keep(hidden, hidden, tables.codes, tables.dest, tables.store, 0)
    tables.retire("first")
    assert tables.steps("first") == 1 and len(tables.free) == 1
    late = Lowered(0, 0, None, None, code=KEEP_FIRST, name="rows")
    assert tables.add("late", late, None, room=8)  # the finished request's entry
    assert late.base != first.base  # but not its region, which holds its rows
    taken = tables.forget("first")
    assert taken is not None and taken[1] == 1
    assert torch.equal(tables.saves(first)["rows"][0], hidden)
    tables.release(first)
    tables.retire("first")  # once forgotten, nothing to retire
    tables = TapTables(
        ("model.layers.0", "model.layers.1"), max_tokens=8, hidden=3, entries=4, device="cpu", store_size=32
    )
    keep = Lowered(1, 0, 3, None, code=KEEP_SUM, name="rows")
    read = Lowered(0, 0, 1, "out", code=KEEP_SECOND, name="last", select=-1, single=True)
    assert tables.add("k", keep, room=2 + 4) and tables.add("r", read, room=4)
    assert not tables.add("k", keep, room=6)  # one entry per request
    assert not tables.add("huge", Lowered(0, 0, None, None, code=KEEP_FIRST, name="x"), room=32)  # no room
    steps = []
    for req_ids, starts, counts in [
        (["k", "p", "r"], [0, 2, 3], [2, 1, 4]),
        (["p", "k", "r"], [0, 1, 2], [1, 1, 1]),
    ]:
        tables.fill(req_ids, bounds(starts, counts))
        hidden, residual = torch.randn(8, 3), torch.randn(8, 3)
        torch.ops.vllm_nnsight.keep(hidden, residual, tables.codes, tables.dest, tables.store, 1)
        torch.ops.vllm_nnsight.keep(hidden, residual, tables.codes, tables.dest, tables.store, 0)
        steps.append((hidden, residual))
    (h0, r0), (h1, r1) = steps
    lowered, forwards = tables.forget("k")
    kept = tables.saves(lowered)["rows"].unstack()
    tables.release(lowered)
    assert forwards == 2 and [t.shape for t in kept] == [(2, 3), (1, 3)]
    assert torch.equal(kept[0], h0[0:2] + r0[0:2]) and torch.equal(kept[1], h1[1:2] + r1[1:2])
    lowered, _ = tables.forget("r")
    last = tables.saves(lowered)
    tables.release(lowered)
    assert torch.equal(last["last"], r0[6]) and last["last"].shape == (3,)
    assert tables.kept_rows == 2 + 4 + 1 and tables.regions.free_rows() == 31
    tables.fill([], bounds([], []))
    assert tables.idle() and not tables.codes.any() and not tables.dest.any()


def test_a_keep_of_one_row_each_step_keeps_that_row_only():
    """``rows.append(<tap>.output[0][-1].clone())``: the prompt's last row, then
    each step's; ``[0]``: the first. Beside a keep of every row, in one step."""
    tables = TapTables(("model.layers.0",), max_tokens=8, hidden=3, entries=4, device="cpu", store_size=32)
    last = Lowered(0, 0, None, None, code=KEEP_FIRST, name="last", select=-1)
    first = Lowered(0, 0, None, None, code=KEEP_SECOND, name="first", select=0)
    every = Lowered(0, 0, None, None, code=KEEP_FIRST, name="every")
    assert tables.add("l", last, room=8) and tables.add("f", first, room=8) and tables.add("e", every, room=8)
    steps = []
    for req_ids, starts, counts in [
        (["l", "f", "e"], [0, 3, 5], [3, 2, 2]),
        (["e", "l", "f"], [0, 1, 2], [1, 1, 1]),
        (["f", "l", "e"], [0, 1, 2], [1, 1, 1]),
    ]:
        tables.fill(req_ids, bounds(starts, counts))
        hidden, residual = torch.randn(8, 3), torch.randn(8, 3)
        torch.ops.vllm_nnsight.keep(hidden, residual, tables.codes, tables.dest, tables.store, 0)
        steps.append((hidden, residual))
    saved = {}
    for name in ("l", "f", "e"):
        lowered, _ = tables.forget(name)
        saved.update(tables.saves(lowered))
        tables.release(lowered)
    (h0, r0), (h1, r1), (h2, r2) = steps
    rows = saved["last"].unstack()
    assert [tuple(r.shape) for r in rows] == [(3,)] * 3
    assert torch.equal(rows[0], h0[2]) and torch.equal(rows[1], h1[1]) and torch.equal(rows[2], h2[1])
    rows = saved["first"].unstack()
    assert torch.equal(rows[0], r0[3]) and torch.equal(rows[1], r1[2]) and torch.equal(rows[2], r2[0])
    rows = saved["every"].unstack()
    assert [tuple(r.shape) for r in rows] == [(2, 3), (1, 3), (1, 3)] and torch.equal(rows[0], h0[5:7])
    assert tables.kept_rows == 3 + 3 + 4 and tables.regions.free_rows() == 31


def test_a_cache_keeps_both_outputs_of_each_row_in_pairs():
    tables = TapTables(("model.layers.0",), max_tokens=8, hidden=3, entries=4, device="cpu", store_size=32)
    cache = Lowered(0, 0, None, None, code=KEEP_BOTH, name="cache", cache="model.model.layers.0")
    assert tables.add("c", cache, room=(3 + 2) * cache.stride)
    steps = []
    for req_ids, starts, counts in [(["p", "c"], [0, 1], [1, 3]), (["c", "p"], [0, 1], [1, 1])]:
        tables.fill(req_ids, bounds(starts, counts))
        hidden, residual = torch.randn(8, 3), torch.randn(8, 3)
        torch.ops.vllm_nnsight.keep(hidden, residual, tables.codes, tables.dest, tables.store, 0)
        steps.append((hidden, residual))
    (h0, r0), (h1, r1) = steps
    lowered, forwards = tables.forget("c")
    assert not tables.overflowed(lowered)
    kept = tables.saves(lowered)["cache"]
    tables.release(lowered)
    assert isinstance(kept, CachedSteps) and kept.path == "model.model.layers.0" and forwards == 2
    hidden, residual = kept.hidden.unstack(), kept.residual.unstack()
    assert torch.equal(hidden[0], h0[1:4]) and torch.equal(residual[0], r0[1:4])
    assert torch.equal(hidden[1], h1[0:1]) and torch.equal(residual[1], r1[0:1])
    assert tables.regions.free_rows() == 31


def test_source_sees_through_the_tap_to_the_modules_own_forward():
    from nnsight.intervention.source import compiled, decorator_chain

    class Layer(torch.nn.Module):
        def forward(self, x, residual):
            hidden = torch.relu(x)
            return hidden, residual

    inner, chain = decorator_chain(_tapped_class(Layer, frozenset(), True).forward)
    assert inner is Layer.forward and len(chain) == 1
    assert compiled(inner).names == ("torch_relu_0", "hidden_0")


def source_reads(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=1):
        tapped = model.model.layers[10].source.self_self_attn_0.output.save()
        untapped = model.model.layers[11].source.self_self_attn_0.output.save()
    return tapped, untapped


def direct_read(model):
    with model.trace(PROMPT, temperature=0.0, max_tokens=1):
        direct = model.model.layers[10].self_attn.output.save()
    return direct


def test_a_tapped_modules_operations_are_read_by_their_own_names(smol):
    tapped, untapped = source_reads(smol)
    assert torch.equal(tapped, direct_read(smol)) and tapped.shape == untapped.shape


def test_the_store_hands_out_and_merges_regions():
    regions = Regions(10)
    assert [regions.take(3), regions.take(3), regions.take(3), regions.take(1)] == [1, 4, 7, None]
    regions.give(4, 3)
    assert regions.take(4) is None and regions.take(2) == 4
    regions.give(1, 3)
    regions.give(7, 3)
    regions.give(4, 2)
    assert regions.free_rows() == 9 and regions.take(9) == 1


def test_a_tap_whose_forward_may_not_return_a_tuple_takes_no_output_0_block():
    from vllm_nnsight_plugin.taps.install import _apply

    tables = TapTables(("model.norm",), 4, 2, 2, "cpu", tuple_sites=frozenset(), store_size=4)
    _apply(tables, 0, torch.zeros(3, 2))
    assert not tables.means(0, whole=False) and tables.means(0, whole=True)
    one = TapTables(("model.norm",), 4, 2, 2, "cpu", tuple_sites=frozenset(), store_size=4, one_op=True)
    _apply(one, 0, torch.zeros(3, 2))  # the one operation notes the same
    assert not one.means(0, whole=False) and one.means(0, whole=True)
    _apply(one, 0, (torch.zeros(3, 2),))  # a tuple of one: never read as a tensor
    assert not one.means(0, whole=True)


# ---------------------------------------------------------------- on the engine
def lowered_count(llm) -> int:
    (stats,) = llm.collective_rpc("nnsight_stats")
    return stats["lowered"]


def steer_seeds_loop(model, vectors, layer=10, steps=5):
    """The user docs' steering loop, one invoke per vector: lowered onto the taps."""
    with model.trace(temperature=0.0, max_tokens=steps, logprobs=3) as tracer:
        for vector in vectors:
            with tracer.invoke(PROMPT):
                for _ in tracer.iter[:steps]:
                    model.model.layers[layer].output[0][:] += 6.0 * vector
                out = tracer.result.save()
    return out if len(vectors) > 1 else [out]


def steer_as_python(model, vectors, layer=10, steps=5):
    """The same edit written so that it is not lowered (an assignment, not ``+=``):
    it runs as Python."""
    with model.trace(temperature=0.0, max_tokens=steps, logprobs=3) as tracer:
        for vector in vectors:
            with tracer.invoke(PROMPT):
                for _ in tracer.iter[:steps]:
                    hidden = model.model.layers[layer].output[0]
                    hidden[:] = hidden + 6.0 * vector
                out = tracer.result.save()
    return out if len(vectors) > 1 else [out]


#: How far a log-probability moves when the same requests are batched otherwise
#: (the front end hands requests to the engine one by one, so which share a step
#: depends on timing), about four times what stock vLLM shows
#: (``benchmarks/batching_noise.py``): up to 1.8e-5 with vLLM 0.32 on a CPU, and
#: up to 2.5e-3 with vLLM 0.25.1 on an H200 (fp32, eager, either runner), whose
#: kernels change with the batch's size.
BATCHING_NOISE = 1e-2 if DEVICE == "cuda" else 1e-4


def same_generation(got, want, exact: bool = True) -> None:
    """Same tokens; the same log-probabilities, bit for bit or within
    :data:`BATCHING_NOISE` (then a near-tie at the edge of the top-k may be kept
    by one side only). Exact only for requests traced alone: vLLM may schedule
    the requests of one trace into different batches from run to run, and a
    batch's shape moves the last bits of its arithmetic."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids), f"request {i}"
        for step, (step_a, step_b) in enumerate(
            zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)
        ):
            got_step = {t: p.logprob for t, p in step_a.items()}
            want_step = {t: p.logprob for t, p in step_b.items()}
            if exact:
                assert got_step == want_step, f"request {i}, step {step}"
            else:
                shared = got_step.keys() & want_step.keys()
                gap = max((abs(got_step[t] - want_step[t]) for t in shared), default=0.0)
                assert gap < BATCHING_NOISE, f"request {i}, step {step}: {gap:.3g}"
                # A token in one top-k only must be a near-tie at its edge: within the
                # tolerance of the other's lowest kept log-probability.
                for token in got_step.keys() ^ want_step.keys():
                    mine, other = (got_step, want_step) if token in got_step else (want_step, got_step)
                    assert abs(mine[token] - min(other.values())) < BATCHING_NOISE, (
                        f"request {i}, step {step}"
                    )


def test_the_seeds_steering_loop_is_lowered_and_equals_the_python_path_bit_for_bit(smollm2_llm, smol):
    torch.manual_seed(1)
    vectors = [torch.randn(576).to(DEVICE) for _ in range(3)]
    before = lowered_count(smollm2_llm)
    for vector in vectors:  # alone: bit for bit
        same_generation(steer_seeds_loop(smol, [vector]), steer_as_python(smol, [vector]))
    assert lowered_count(smollm2_llm) - before == 3
    lowered = steer_seeds_loop(smol, vectors)  # together, one trace
    assert lowered_count(smollm2_llm) - before == 6
    python = steer_as_python(smol, vectors)
    assert lowered_count(smollm2_llm) - before == 6
    same_generation(lowered, python, exact=False)
    plain = smollm2_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert list(plain[0].outputs[0].token_ids) != list(lowered[0].outputs[0].token_ids)  # it steered
    (stats,) = smollm2_llm.collective_rpc("nnsight_stats")
    assert stats["tracked"] == 0 and stats["lowered_now"] == 0


def steer_as_the_docs_write_it(model, vector, steps=5):
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps, logprobs=3) as tracer:
        for _ in tracer.iter[:steps]:
            hidden = model.model.layers[10].output[0]
            hidden[:] += 6.0 * vector.to(hidden)  # the engine's dtype and device
        out = tracer.result.save()
    return out


def test_the_docs_steering_loop_is_lowered_and_equals_the_python_path_bit_for_bit(smollm2_llm, smol):
    """The tap's value named, the vector moved to it, as the docs write it."""
    torch.manual_seed(4)
    vector = torch.randn(576)  # the client's, moved where the engine runs by the block
    before = lowered_count(smollm2_llm)
    lowered = steer_as_the_docs_write_it(smol, vector)
    assert lowered_count(smollm2_llm) - before == 1
    python = steer_as_python(smol, [vector.to(DEVICE)])
    assert lowered_count(smollm2_llm) - before == 1
    same_generation([lowered], python)
    plain = smollm2_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert list(plain[0].outputs[0].token_ids) != list(lowered.outputs[0].token_ids)  # it steered


def test_a_steer_of_the_newest_row_is_lowered_and_equals_the_python_path_bit_for_bit(smollm2_llm, smol):
    """``hidden[-1] += v``: the prompt's last row on the first step, then each new
    token's row; ``[0]`` the first. Against the same edit written to run as Python."""
    torch.manual_seed(7)
    vector = torch.randn(576)
    on_device = vector.to(DEVICE)

    def last(model):
        with model.trace(PROMPT, temperature=0.0, max_tokens=5, logprobs=3) as tracer:
            for _ in tracer.iter[:5]:
                hidden = model.model.layers[10].output[0]
                hidden[-1] += 8.0 * vector.to(hidden)
            out = tracer.result.save()
        return out

    def first(model):
        with model.trace(PROMPT, temperature=0.0, max_tokens=5, logprobs=3) as tracer:
            for _ in tracer.iter[:5]:
                model.model.layers[10].output[0][0] += 8.0 * on_device
            out = tracer.result.save()
        return out

    def as_python(model, row):  # an assignment, not ``+=``: not lowered
        with model.trace(PROMPT, temperature=0.0, max_tokens=5, logprobs=3) as tracer:
            for _ in tracer.iter[:5]:
                hidden = model.model.layers[10].output[0]
                hidden[row] = hidden[row] + 8.0 * vector.to(hidden)
            out = tracer.result.save()
        return out

    for steer, row in ((last, -1), (first, 0)):
        before = lowered_count(smollm2_llm)
        lowered = steer(smol)
        assert lowered_count(smollm2_llm) - before == 1, row
        assert lowered.nnsight_path["form"] == "steer"
        python = as_python(smol, row)
        assert lowered_count(smollm2_llm) - before == 1, row
        same_generation([lowered], [python])
        plain = smollm2_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
        assert list(plain[0].outputs[0].token_ids) != list(lowered.outputs[0].token_ids)  # it steered


def test_steering_several_layers_in_a_loop_is_lowered_and_equals_the_python_path_bit_for_bit(
    smollm2_llm, smol
):
    """``for i in (10, 20): ...`` inside the step loop: the same vector added at each
    layer as the model reaches it, one entry of the tables per layer."""
    torch.manual_seed(8)
    vector = torch.randn(576)
    layers = [10, 20]

    def lowered_block(model):
        with model.trace(PROMPT, temperature=0.0, max_tokens=5, logprobs=3) as tracer:
            for _ in tracer.iter[:5]:
                for i in layers:
                    hidden = model.model.layers[i].output[0]
                    hidden[:] += 4.0 * vector.to(hidden)
            out = tracer.result.save()
        return out

    def python_block(model):
        with model.trace(PROMPT, temperature=0.0, max_tokens=5, logprobs=3) as tracer:
            for _ in tracer.iter[:5]:
                for i in layers:
                    hidden = model.model.layers[i].output[0]
                    hidden[:] = hidden + 4.0 * vector.to(hidden)
            out = tracer.result.save()
        return out

    before = lowered_count(smollm2_llm)
    lowered = lowered_block(smol)
    assert lowered_count(smollm2_llm) - before == 1 and lowered.nnsight_path["form"] == "steer"
    python = python_block(smol)
    assert lowered_count(smollm2_llm) - before == 1
    same_generation([lowered], [python])
    one = steer_as_the_docs_write_it(smol, vector * 4.0 / 6.0)  # layer 10 alone: not the same
    first = [{t: p.logprob for t, p in out.outputs[0].logprobs[0].items()} for out in (one, lowered)]
    assert first[0] != first[1]
    (stats,) = smollm2_llm.collective_rpc("nnsight_stats")
    assert stats["lowered_now"] == 0  # every entry given back


def test_lowered_python_and_plain_requests_share_steps(smollm2_llm, smol):
    torch.manual_seed(2)
    vector = torch.randn(576).to(DEVICE)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3)

    # A batch of three: layer 20 steered on every step (lowered, or the same written
    # as Python), a Python block reading and steering from its second step, a
    # plain request.
    def lowered(model):
        with model.trace(temperature=0.0, max_tokens=4, logprobs=3) as tracer:
            with tracer.invoke(PROMPT):
                for _ in tracer.iter[:4]:
                    model.model.layers[20].output[0][:] += 4.0 * vector
                first = tracer.result.save()
            with tracer.invoke(PROMPT):
                reads = list().save()
                for _ in tracer.iter[1:4]:
                    reads.append(model.model.layers[20].output[0].clone())
                    model.model.layers[20].output[0][:] += 4.0 * vector
                second = tracer.result.save()
            with tracer.invoke("Water boils at"):
                third = tracer.result.save()
        return [first, second, third], reads

    def python(model):
        with model.trace(temperature=0.0, max_tokens=4, logprobs=3) as tracer:
            with tracer.invoke(PROMPT):
                for _ in tracer.iter[:4]:
                    hidden = model.model.layers[20].output[0]
                    hidden[:] = hidden + 4.0 * vector
                first = tracer.result.save()
            with tracer.invoke(PROMPT):
                reads = list().save()
                for _ in tracer.iter[1:4]:
                    reads.append(model.model.layers[20].output[0].clone())
                    model.model.layers[20].output[0][:] += 4.0 * vector
                second = tracer.result.save()
            with tracer.invoke("Water boils at"):
                third = tracer.result.save()
        return [first, second, third], reads

    before = lowered_count(smollm2_llm)
    got, got_reads = lowered(smol)
    assert lowered_count(smollm2_llm) - before == 1
    want, want_reads = python(smol)
    assert lowered_count(smollm2_llm) - before == 1
    same_generation(got, want, exact=False)
    assert [tuple(r.shape) for r in got_reads] == [(1, 576)] * 3
    for a, b in zip(got_reads, want_reads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    plain = smollm2_llm.generate([PROMPT], params, use_tqdm=False)
    assert list(plain[0].outputs[0].token_ids) != list(got[0].outputs[0].token_ids)


def test_the_line_after_the_loop_runs_only_if_the_loop_ends_on_both_paths(smollm2_llm, smol):
    vector = torch.ones(576).to(DEVICE)

    def short_lowered():  # the loop asks for more steps than the request has
        with smol.trace(PROMPT, temperature=0.0, max_tokens=2) as tracer:
            for _ in tracer.iter[:3]:
                smol.model.layers[10].output[0][:] += vector
            out = tracer.result.save()
        return out

    def short_python():
        with smol.trace(PROMPT, temperature=0.0, max_tokens=2) as tracer:
            for _ in tracer.iter[:3]:
                hidden = smol.model.layers[10].output[0]
                hidden[:] = hidden + vector
            out = tracer.result.save()
        return out

    def forever_lowered():
        with smol.trace(PROMPT, temperature=0.0, max_tokens=2) as tracer:
            for _ in tracer.all():
                smol.model.layers[10].output[0][:] += vector
            out = tracer.result.save()
        return out

    before = lowered_count(smollm2_llm)
    for block in (short_lowered, short_python, forever_lowered):
        with pytest.raises(UnboundLocalError):
            block()  # nothing was saved under out
    assert lowered_count(smollm2_llm) - before == 2


def test_a_block_that_cannot_be_lowered_exactly_runs_as_python(smollm2_llm, smol):
    before = lowered_count(smollm2_llm)
    wide, ones = torch.ones(576, dtype=torch.float64).to(DEVICE), torch.ones(576).to(DEVICE)
    with smol.trace(PROMPT, temperature=0.0, max_tokens=2) as tracer:  # a vector of another dtype
        for _ in tracer.iter[:2]:
            smol.model.layers[10].output[0][:] += wide
        out = tracer.result.save()
    with smol.trace(PROMPT, temperature=0.0, max_tokens=2) as tracer:  # not a tap
        for _ in tracer.iter[:2]:
            smol.model.layers[11].output[0][:] += ones
    assert lowered_count(smollm2_llm) == before
    assert len(out.outputs[0].token_ids) == 2


def test_taps_are_given_when_the_engine_is_built(smollm2_llm):
    with pytest.raises(ValueError, match="taps are part of how an engine is built"):
        VLLM(smollm2_llm, taps=["model.layers.*.output"])


def test_taps_from_the_environment_go_into_the_hashed_engine_config(monkeypatch, smollm2_path):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_nnsight_plugin.front import taps_into_config
    from vllm_nnsight_plugin.taps.spec import OPERATIONS, kernel_chosen
    from vllm_nnsight_plugin.versions import PLUGIN_VERSION

    monkeypatch.setenv("VLLM_NNSIGHT_TAPS", "model.layers.3.output,model.layers.4.output")
    args = EngineArgs(model=smollm2_path)
    taps_into_config(args)
    assert args.additional_config == {
        "nnsight_taps": ["model.layers.3.output", "model.layers.4.output"],
        "nnsight_taps_plugin": f"{PLUGIN_VERSION}+ops{OPERATIONS}",
    }
    assert not kernel_chosen(SimpleNamespace(additional_config=args.additional_config))
    monkeypatch.setenv("VLLM_NNSIGHT_TAP_KERNEL", "1")  # one operation a tap: other graphs
    kernel = EngineArgs(model=smollm2_path)
    taps_into_config(kernel)
    assert kernel.additional_config["nnsight_taps_plugin"] == f"{PLUGIN_VERSION}+ops{OPERATIONS}+kernel"
    assert kernel_chosen(SimpleNamespace(additional_config=kernel.additional_config))
    monkeypatch.delenv("VLLM_NNSIGHT_TAP_KERNEL")
    given = EngineArgs(
        model=smollm2_path, additional_config={"nnsight_taps": ["model.norm.output"], "other": 1}
    )
    taps_into_config(given)  # the engine's own list wins over the environment
    assert (
        given.additional_config["nnsight_taps"] == ["model.norm.output"]
        and given.additional_config["other"] == 1
    )
    monkeypatch.delenv("VLLM_NNSIGHT_TAPS")
    plain = EngineArgs(model=smollm2_path)
    taps_into_config(plain)
    assert not plain.additional_config  # no taps: the config (and its hash) is untouched


def test_an_engine_nobody_gave_taps_taps_every_decoder_layer_where_a_tap_is_one_kernel(monkeypatch):
    from vllm_nnsight_plugin.seams.frontend import cuda_with_triton
    from vllm_nnsight_plugin.taps.spec import taps_for

    monkeypatch.delenv("VLLM_NNSIGHT_TAPS", raising=False)
    monkeypatch.setenv("VLLM_NNSIGHT_TAP_KERNEL", "1")
    assert taps_for({}, cuda_with_triton) == (("layers",), True)
    assert taps_for(None, cuda_with_triton) == (("layers",), True)
    assert taps_for({"nnsight_taps": "none"}, cuda_with_triton) == ((), True)  # the operator's word wins
    assert taps_for({"nnsight_taps": []}, cuda_with_triton) == ((), True)
    assert taps_for({"nnsight_taps": ["model.norm.output"]}, cuda_with_triton) == (
        ("model.norm.output",),
        True,
    )
    monkeypatch.setenv("VLLM_NNSIGHT_TAPS", "none")
    assert taps_for({}, cuda_with_triton) == ((), True)
    monkeypatch.setenv("VLLM_NNSIGHT_TAPS", "model.layers.3.output")
    assert taps_for({}, cuda_with_triton) == (("model.layers.3.output",), True)
    monkeypatch.delenv("VLLM_NNSIGHT_TAPS")
    monkeypatch.setenv("VLLM_NNSIGHT_TAP_KERNEL", "0")  # taps as tensor operations: none by default
    assert taps_for({}, cuda_with_triton) == ((), False)
    monkeypatch.delenv("VLLM_NNSIGHT_TAP_KERNEL")  # unset: the kernel where CUDA and Triton are
    assert not cuda_with_triton()  # this CPU
    assert taps_for({}, cuda_with_triton) == ((), False)
    assert taps_for({}, lambda: True) == (("layers",), True)  # what a CUDA engine gets


def test_layers_names_every_decoder_layer_wherever_the_model_keeps_them():
    from vllm_nnsight_plugin.taps.spec import decoder_layers

    llama = [
        "",
        "model",
        "model.embed_tokens",
        "model.layers",
        "model.layers.0",
        "model.layers.0.mlp",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]
    assert decoder_layers(llama) == "model.layers.*.output"
    assert resolve(parse("layers"), llama) == ("model.layers.0", "model.layers.1")
    assert resolve(parse(["layers", "model.norm.output"]), llama) == (
        "model.layers.0",
        "model.layers.1",
        "model.norm",
    )
    gpt2 = ["transformer", "transformer.h", "transformer.h.0", "transformer.h.1", "lm_head"]
    assert resolve(parse("layers"), gpt2) == ("transformer.h.0", "transformer.h.1")
    vision = ["vision_tower.blocks.0", "language_model.model.layers.0", "language_model.model.layers.1"]
    assert resolve(["layers"], vision) == ("language_model.model.layers.0", "language_model.model.layers.1")
    assert resolve(["layers"], ["encoder", "encoder.stages.0"]) == ()  # nowhere known: no taps
    assert parse("none") == parse([]) == parse("") == ()
    with pytest.raises(TapError, match="names no module"):  # a pattern still names something
        resolve(["model.blocks.*.output"], llama)


def test_a_prompt_split_by_chunked_prefill_is_never_lowered():
    from types import SimpleNamespace

    from vllm_nnsight_plugin.seams import whole_prompt_scheduled as _whole_prompt

    data = SimpleNamespace(req_id="r", prompt_token_ids=list(range(10)), num_computed_tokens=0)
    assert _whole_prompt(data, SimpleNamespace(num_scheduled_tokens={"r": 10}))
    assert not _whole_prompt(
        data, SimpleNamespace(num_scheduled_tokens={"r": 4})
    )  # the Python path refuses it
    assert not _whole_prompt(
        SimpleNamespace(req_id="r", prompt_token_ids=None), SimpleNamespace(num_scheduled_tokens={})
    )


def steer_sequences(model, vector):
    with model.trace(PROMPT, temperature=1.0, seed=0, n=2, max_tokens=4) as tracer:
        for _ in tracer.iter[:4]:
            model.model.layers[10].output[0][:] += vector
        out = tracer.result.save()
    return out


def test_a_request_that_samples_several_sequences_runs_as_python(smollm2_llm, smol):
    """``n > 1``: each sequence's values come back as nnsight gives them, from the
    Python path (the tables hold one entry per request)."""
    torch.manual_seed(0)
    vector = torch.randn(576).to(DEVICE)
    vector = 60.0 * vector / vector.norm()
    ((before,), out) = smollm2_llm.collective_rpc("nnsight_stats"), steer_sequences(smol, vector)
    (after,) = smollm2_llm.collective_rpc("nnsight_stats")
    assert after["lowered"] == before["lowered"] and after["tracked"] == 0
    assert len(out.outputs) == 2 and all(len(o.token_ids) == 4 for o in out.outputs)
    plain = smollm2_llm.generate(
        [PROMPT], SamplingParams(temperature=1.0, seed=0, n=2, max_tokens=4), use_tqdm=False
    )[0]
    assert sorted(map(list, (o.token_ids for o in out.outputs))) != sorted(
        map(list, (o.token_ids for o in plain.outputs))
    )  # the edit landed on the Python path


def test_the_output_says_which_path_each_request_took_and_why(smollm2_llm, smol):
    """On ``tracer.result`` and on the stock ``RequestOutput``: lowered, with its
    form, or Python with the first reason; ``nnsight_stats`` counts the reasons."""
    import vllm_nnsight_plugin

    torch.manual_seed(5)
    vector = torch.randn(576)
    half = vector.half().to(DEVICE)  # where the engine runs: only its dtype differs
    (before,) = smollm2_llm.collective_rpc("nnsight_stats")
    with smol.trace(temperature=0.0, max_tokens=2) as tracer:
        with tracer.invoke(PROMPT):
            for _ in tracer.iter[:2]:
                hidden = smol.model.layers[10].output[0]
                hidden[:] += 1.0 * vector.to(hidden)
            lowered = tracer.result.save()
        with tracer.invoke(PROMPT):
            for _ in tracer.iter[:2]:
                act = smol.model.layers[3].mlp.act_fn.output
                act[:] *= 1.0
            python = tracer.result.save()
        with tracer.invoke(PROMPT):  # nothing at a module location: nothing to lower
            result_only = tracer.result.save()
        with tracer.invoke(PROMPT):  # split, its part on the tap with a float16 vector
            drawn = list().save()
            for _ in tracer.iter[:2]:
                hidden = smol.model.layers[10].output[0]
                hidden[:] += 1.0 * half
                drawn.append(smol.samples.item())
            narrow = tracer.result.save()
    assert lowered.nnsight_path == {"lowered": True, "form": "steer", "reason": None}
    assert python.nnsight_path == {
        "lowered": False,
        "form": None,
        "reason": "it reads `model.model.layers.3.mlp.act_fn`, which is not a tap on this engine",
    }
    assert not result_only.nnsight_path["lowered"] and result_only.nnsight_path["reason"].startswith(
        "it reads only what the sampler serves"
    )
    assert not narrow.nnsight_path["lowered"] and narrow.nnsight_path["reason"].startswith("its vector")
    with smol.requests(PROMPT, temperature=0.0, max_tokens=2) as tracer:
        kept = smol.model.layers[20].output[0][-1].clone().save()  # noqa: F841
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    prepared = tracer.prepared
    outs = smollm2_llm.generate(prepared.prompts + [PROMPT], prepared.params + [plain], use_tqdm=False)
    assert tuple(vllm_nnsight_plugin.saves(outs[0])["kept"].shape) == (576,)
    assert outs[0].nnsight_path == {"lowered": True, "form": "read", "reason": None}
    assert not hasattr(outs[1], "nnsight_path")  # a plain request gets none of it
    (after,) = smollm2_llm.collective_rpc("nnsight_stats")
    assert after["python_blocks"] - before["python_blocks"] == 3
    for kind in ("not_a_tap", "sampler", "vector"):
        assert after["python_why"][kind] - before["python_why"].get(kind, 0) == 1


def test_a_steering_loop_beside_what_the_sampler_serves_is_split_and_equals_python(smollm2_llm, smol):
    """The edit runs on the tap in the forward, the reads of the samples and the
    result as Python at the sampler: the same tokens, draws and log-probabilities
    as the whole block run as Python."""
    torch.manual_seed(6)
    vector = torch.randn(576)

    def split_block():
        with smol.trace(PROMPT, temperature=0.0, max_tokens=5, logprobs=3) as tracer:
            drawn = list().save()
            for _ in tracer.iter[:5]:
                hidden = smol.model.layers[10].output[0]
                hidden[:] += 6.0 * vector.to(hidden)
                drawn.append(smol.samples.item())
            out = tracer.result.save()
        return drawn, out

    def python_block():
        with smol.trace(PROMPT, temperature=0.0, max_tokens=5, logprobs=3) as tracer:
            drawn = list().save()
            for _ in tracer.iter[:5]:
                hidden = smol.model.layers[10].output[0]
                hidden[:] = hidden + 6.0 * vector.to(hidden)
                drawn.append(smol.samples.item())
            out = tracer.result.save()
        return drawn, out

    before = lowered_count(smollm2_llm)
    got_drawn, got = split_block()
    assert lowered_count(smollm2_llm) - before == 1
    want_drawn, want = python_block()
    assert lowered_count(smollm2_llm) - before == 1
    assert got.nnsight_path == {"lowered": True, "form": "steer, Python at the sampler", "reason": None}
    assert want.nnsight_path["lowered"] is False
    same_generation([got], [want])
    assert got_drawn == want_drawn == list(got.outputs[0].token_ids)
    plain = smollm2_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert list(plain[0].outputs[0].token_ids) != got_drawn  # it steered


def test_a_first_step_edit_beside_a_read_of_the_logits_is_split_and_equals_python(smollm2_llm, smol):
    torch.manual_seed(7)
    vector = torch.randn(576)
    before = lowered_count(smollm2_llm)
    with smol.trace(PROMPT, temperature=0.0, max_tokens=2) as tracer:
        hidden = smol.model.layers[20].output[0]
        hidden[:] += 4.0 * vector.to(hidden)
        got = smol.logits.clone().save()
        got_out = tracer.result.save()
    assert lowered_count(smollm2_llm) - before == 1
    with smol.trace(PROMPT, temperature=0.0, max_tokens=2) as tracer:
        hidden = smol.model.layers[20].output[0]
        hidden[:] = hidden + 4.0 * vector.to(hidden)
        want = smol.logits.clone().save()
        want_out = tracer.result.save()
    assert lowered_count(smollm2_llm) - before == 1
    assert torch.equal(got, want)
    assert list(got_out.outputs[0].token_ids) == list(want_out.outputs[0].token_ids)
    with smol.trace(PROMPT, temperature=0.0, max_tokens=1):
        plain = smol.logits.clone().save()
    assert not torch.equal(plain, got)  # it edited


def test_a_keep_beside_the_samples_is_split_and_keeps_what_python_keeps(smollm2_llm, smol):
    before = lowered_count(smollm2_llm)
    with smol.trace(PROMPT, temperature=0.0, max_tokens=4) as tracer:
        rows = list().save()
        drawn = list().save()
        for _ in tracer.iter[:4]:
            rows.append(smol.model.layers[10].output[0][-1].clone())
            drawn.append(smol.samples.item())
    assert lowered_count(smollm2_llm) - before == 1
    with smol.trace(PROMPT, temperature=0.0, max_tokens=4) as tracer:
        python_rows = list().save()
        python_drawn = list().save()
        for _ in tracer.iter[:4]:
            smol.model.embed_tokens.output.clone()  # no tap: the block runs as Python
            hidden = smol.model.layers[10].output[0]
            python_rows.append(hidden[-1].clone())
            python_drawn.append(smol.samples.item())
    assert lowered_count(smollm2_llm) - before == 1
    assert drawn == python_drawn and len(rows) == len(python_rows) == 4
    assert all(torch.equal(a, b) for a, b in zip(rows, python_rows))


def test_the_store_by_default_takes_a_share_of_a_gpu_and_a_fixed_size_elsewhere(monkeypatch):
    from vllm_nnsight_plugin.taps.kept import KEPT_BYTES_ENV, store_rows

    monkeypatch.delenv(KEPT_BYTES_ENV, raising=False)
    row = 4096 * 2  # a bf16 row of Qwen3-8B's width
    h200 = 150_000_000_000
    assert store_rows(row, cuda=True, device_bytes=h200) == int(h200 * 0.03) // row
    assert store_rows(row, cuda=True, device_bytes=16 << 30) == (1 << 30) // row  # at least 1 GiB
    assert store_rows(row, cuda=False, device_bytes=h200) == (128 << 20) // row
    monkeypatch.setenv(KEPT_BYTES_ENV, str(64 << 20))
    assert store_rows(row, cuda=True, device_bytes=h200) == (64 << 20) // row  # the operator's size wins
