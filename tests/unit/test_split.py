"""A block split in two: its statements on taps (one of the lowered forms) and the
rest, left to Python at the sampler. The split is read from the source alone;
``test_taps.py`` runs split blocks on an engine against the Python path."""

from __future__ import annotations

import pytest

from vllm_nnsight_plugin.taps.forms import block_form, split

STEER_AND_DRAW = """drawn = list().save()
for _ in tracer.all():
    hidden = layer.output[0]
    hidden[:] += sign * 4.0 * direction.to(hidden)
    drawn.append(model.samples.item())
"""

FIRST_STEP_AND_LOGITS = """hidden = layer.output[0]
hidden[:] += scale * direction.to(hidden)
probs = model.logits.float().softmax(-1)[0]
p = probs[good].item().save()
"""

KEEP_AND_RESULT = """rows = list().save()
drawn = list().save()
for _ in tracer.iter[:steps]:
    rows.append(model.model.layers[10].output[0][-1].clone())
    drawn.append(model.samples.item())
out = tracer.result.save()
"""


@pytest.mark.parametrize(
    "source, taps, rest",
    [
        (
            STEER_AND_DRAW,
            "for _ in tracer.all():\n    hidden = layer.output[0]\n    hidden[:] += sign * 4.0 * direction.to(hidden)\n",
            "drawn = list().save()\nfor _ in tracer.all():\n\n\n    drawn.append(model.samples.item())\n",
        ),
        (
            FIRST_STEP_AND_LOGITS,
            "hidden = layer.output[0]\nhidden[:] += scale * direction.to(hidden)\n",
            "\n\nprobs = model.logits.float().softmax(-1)[0]\np = probs[good].item().save()\n",
        ),
        (
            KEEP_AND_RESULT,
            "rows = list().save()\nfor _ in tracer.iter[:steps]:\n"
            "    rows.append(model.model.layers[10].output[0][-1].clone())\n",
            "\ndrawn = list().save()\nfor _ in tracer.iter[:steps]:\n\n    drawn.append(model.samples.item())\n"
            "out = tracer.result.save()\n",
        ),
    ],
)
def test_a_block_splits_into_a_form_on_taps_and_statements_at_the_sampler(source, taps, rest):
    assert block_form(source) is None  # whole, it is none of the forms
    parts = split(source)
    assert parts is not None and (parts.taps, parts.rest) == (taps, rest)
    # the rest keeps its lines where the user wrote them (its tracebacks point there)
    assert len(parts.rest.splitlines()) == len(source.splitlines())
    assert block_form(parts.taps) is not None


def test_the_result_may_follow_a_loop_gone_whole_to_the_taps():
    """``tracer.result`` is the finished output whenever it is read."""
    source = "drawn = model.samples.save()\nfor _ in tracer.iter[:3]:\n    layer.output[0][:] += v\n"
    assert split(source) is None  # the sampler first: not Python's order
    parts = split("for _ in tracer.iter[:3]:\n    layer.output[0][:] += v\nout = tracer.result.save()\n")
    assert parts is not None and parts.rest == "\n\nout = tracer.result.save()\n"


def test_the_first_step_steering_form_edits_step_zero_only():
    form = block_form("hidden = layer.output[0]\nhidden[:] += 2.0 * v\n")
    assert form is not None and (form.start, form.stop, form.tracer) == (0, 1, None)
    form = block_form("layer.output[0][:] += v\nout = tracer.result.save()\n")
    assert (form.start, form.stop, form.tracer, form.result) == (0, 1, "tracer", "out")


@pytest.mark.parametrize(
    "source",
    [
        # the rest reads what the taps part named
        "for _ in tracer.all():\n    hidden = layer.output[0]\n    hidden[:] += v\n    x = hidden.sum().save()\n",
        # a sampler statement before the edit, in Python's order: not this split
        "for _ in tracer.all():\n    d = model.samples.item()\n    layer.output[0][:] += v\n",
        "p = model.logits.save()\nlayer.output[0][:] += v\n",
        # the rest rebinds a value the taps part uses
        "layer.output[0][:] += v\nv = model.logits.sum()\n",
        # the rest fills the list the taps part keeps
        "rows = list().save()\nfor _ in tracer.all():\n    rows.append(layer.output[0].clone())\n"
        "    rows.append(model.samples)\n",
        # nothing left for the sampler, or nothing on a location
        "for _ in tracer.all():\n    layer.output[0][:] += v\n",
        "x = model.logits.save()\n",
        # one line holding statements of both parts
        "layer.output[0][:] += v; x = model.logits.save()\n",
        # the sampler's part leaves the loop early, which would end the edit too
        "for _ in tracer.iter[:9]:\n    layer.output[0][:] += v\n    if model.samples.item() == 2:\n        break\n",
        # after a loop gone whole to the taps, a read of the logits would come steps early
        "for _ in tracer.iter[:3]:\n    layer.output[0][:] += v\nx = model.logits.save()\n",
        "for _ in tracer.iter[:3]:\n    layer.output[0][:] += v\nfor _ in tracer.iter[3:5]:\n"
        "    x = model.samples.save()\n",
        # an invoke inside
        "layer.output[0][:] += v\nwith tracer.invoke('x'):\n    y = model.logits.save()\n",
    ],
)
def test_blocks_without_that_split_have_none(source):
    assert split(source) is None


def test_a_builtin_the_taps_part_rebinds_is_not_shared():
    source = (
        "for _ in tracer.all():\n    list = layer.output[0]\n    list[:] += v\n    x = list.sum().save()\n"
    )
    assert split(source) is None
