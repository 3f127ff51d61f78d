"""What the client says, before a trace goes, of the locations a block names that no
tap of its compiled engine serves (``taps/replay.untapped``, read off the module
tree with ``taps/install.served_locations``; the warning itself on a compiled
engine is in ``tests/engine/test_compiled.py``)."""

from __future__ import annotations

import pytest

from tests.conftest import SESSION_TAPS
from vllm_nnsight_plugin import VLLM
from vllm_nnsight_plugin.client.model import _untapped_message
from vllm_nnsight_plugin.taps.install import served_locations
from vllm_nnsight_plugin.taps.replay import untapped
from vllm_nnsight_plugin.taps.spec import parse


@pytest.fixture(scope="module")
def tree(smollm2_path):
    return VLLM(smollm2_path)  # the module tree on meta: no engine


SOURCE = """
model.model.layers[10].self_attn.attn.inputs[0][0].clone().save()
model.model.layers[10].output[0].clone().save()
layer.output[0].clone().save()
model.model.layers[5].mlp.output.clone().save()
model.model.layers[5].mlp.output.clone().save()
model.model.layers[12].mlp.act_fn.output.clone().save()
model.model.norm.output[0].clone().save()
model.logits.clone().save()
for each in model.model.layers:
    each.output[0].clone().save()
"""


def test_the_untapped_locations_a_block_names_each_once(tree):
    served = served_locations(tree._module, parse(SESSION_TAPS))
    scope = {"model": tree, "layer": tree.model.layers[3]}
    found = untapped(SOURCE, scope, tree, served)
    assert sorted(found) == ["model.model.layers.3.output", "model.model.layers.5.mlp.output"]
    # no taps at all: every location it names, the loop's own not followed
    bare = served_locations(tree._module, ())
    found = untapped(SOURCE, scope, tree, bare)
    assert len(found) == len(set(found)) and set(found) == {
        "model.model.layers.10.self_attn.attn.inputs",
        "model.model.layers.10.output",
        "model.model.layers.3.output",
        "model.model.layers.5.mlp.output",
        "model.model.layers.12.mlp.act_fn.output",
        "model.model.norm.output",
    }
    assert untapped(None, scope, tree, served) == ()


def test_the_message_names_the_tap_that_would_serve_it():
    said = _untapped_message("model.model.layers.3.output")
    assert "`model.model.layers.3.output` is not a tap" in said and "taps=['model.layers.3.output']" in said
    assert "taps=['model.layers.3.mlp.inputs']" in _untapped_message("model.model.layers.3.mlp.input")
