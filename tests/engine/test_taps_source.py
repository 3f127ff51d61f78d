"""Taps on the operations inside a forward (``.source``) and on modules that
return a tensor: the patterns, the rewritten forward, and the lowered blocks
against the Python path on the session engine (``conftest.SESSION_TAPS`` taps
``self_attn_0`` of layer 10's attention and layer 12's MLP output)."""

from __future__ import annotations

import pytest
import torch

from vllm_nnsight_plugin.taps import ops
from vllm_nnsight_plugin.taps.forms import block_form
from vllm_nnsight_plugin.taps.install import TapTables, _tapped_class
from vllm_nnsight_plugin.taps.source import SourceTapError, operations, rewritten_forward
from vllm_nnsight_plugin.taps.spec import TapError, resolve

PROMPT = "The capital of France is"


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x)  # self_proj_0, then h_0
        h = torch.relu(h) + super().__repr__().__len__() * 0  # zero-argument super() still works
        return h * 2


def test_operations_are_nnsights_names_and_a_missing_one_lists_them():
    names = operations(Block)
    assert names[:2] == ["self_proj_0", "h_0"] and "torch_relu_0" in names
    with pytest.raises(SourceTapError, match=r"no operation 'proj_0'.*Its operations: self_proj_0, h_0"):
        rewritten_forward(Block, frozenset({"proj_0"}), lambda m, n, v: v)


class Attention(torch.nn.Module):
    """Shaped as vLLM's: the kernel's value named, then handed to ``o_proj``."""

    def __init__(self):
        super().__init__()
        self.attn, self.o_proj, self.other = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        attn_output = self.attn(x)
        output = self.o_proj(attn_output)
        twice = self.other(x)
        return output + self.other(twice) + twice


def test_a_child_handed_an_operations_value_is_found_from_the_source():
    from vllm.model_executor.models.llama import LlamaAttention

    from vllm_nnsight_plugin.taps.source import handed_to

    assert handed_to(Attention, "self_attn_0") == "o_proj"
    assert handed_to(LlamaAttention, "self_attn_0") == "o_proj"  # the model's own forward
    assert handed_to(Attention, "self_o_proj_0") is None  # returned, not handed on
    assert handed_to(Attention, "self_other_0") is None  # read twice
    assert handed_to(Attention, "no_such_0") is None


def test_a_rewritten_forward_passes_only_the_tapped_value_through_the_tap():
    seen = []

    def tap(module, name, value):
        seen.append(name)
        return value + 1

    block, x = Block(), torch.randn(3, 4)
    want = Block.forward(block, x)
    forward = rewritten_forward(Block, frozenset({"self_proj_0"}), tap)
    got = forward(block, x)
    assert seen == ["self_proj_0"] and torch.allclose(got, 2 * torch.relu(block.proj(x) + 1))
    assert not torch.allclose(got, want)
    untouched = rewritten_forward(Block, frozenset({"self_proj_0"}), lambda m, n, v: v)
    assert torch.equal(untouched(block, x), want)


def test_nnsight_reads_a_rewritten_forward_by_the_models_names_plus_the_tap():
    from nnsight.intervention.source import compiled, decorator_chain

    cls = _tapped_class(Block, frozenset({"self_proj_0"}), True)
    inner, chain = decorator_chain(cls.forward)
    assert len(chain) == 1  # the output wrapper; the operation tap is not mistaken for one
    names = compiled(inner).names
    assert names[:3] == ("self_proj_0", "nnsight_tap_0", "h_0") and "torch_relu_0" in names


def test_source_patterns_resolve_against_each_modules_operations():
    names = [
        "model",
        "model.layers",
        "model.layers.0",
        "model.layers.0.attn",
        "model.layers.1",
        "model.layers.1.attn",
    ]
    ops_of = {"model.layers.0.attn": ["self_qkv_0", "self_attn_0"], "model.layers.1.attn": ["self_attn_0"]}
    got = resolve(
        ["model.layers.*.attn.source.self_attn_0.output", "model.layers.1.output"], names, ops_of.get
    )
    assert got == (
        "model.layers.0.attn.source.self_attn_0",
        "model.layers.1",
        "model.layers.1.attn.source.self_attn_0",
    )
    with pytest.raises(
        TapError, match=r"'model.layers.1.attn' has no operation 'self_qkv_0'.*: self_attn_0\."
    ):
        resolve(["model.layers.*.attn.source.self_qkv_0.output"], names, ops_of.get)


@pytest.mark.parametrize(
    "source, code, select",
    [
        (
            "rows = list().save()\nfor _ in tracer.iter[:4]:\n    rows.append(model.model.layers[1].mlp.output.clone())\n",
            1,
            None,
        ),
        ("last = model.model.layers[1].self_attn.source.self_attn_0.output[-1].clone().save()\n", 1, -1),
        ("first = model.model.layers[1].mlp.output.clone().save()\n", 1, None),
    ],
)
def test_a_tensor_taps_keeping_forms_are_recognised_as_whole(source, code, select):
    form = block_form(source)
    assert form is not None and form.whole and form.code == code and form.select == select


def test_a_tensor_taps_steering_form_is_recognised_as_whole():
    form = block_form("for _ in tracer.all():\n    model.model.layers[1].mlp.output[:] += v\n")
    assert form is not None and form.whole and form.vector is not None
    assert not block_form("for _ in tracer.all():\n    model.model.layers[1].output[0][:] += v\n").whole


def test_a_block_is_lowered_only_where_it_reads_the_tap_as_its_value_is():
    from vllm_nnsight_plugin.taps.install import _apply

    tables = TapTables(("a", "b", "c", "d"), 8, 4, 4, "cpu", tuple_sites=frozenset({0}), store_size=8)
    assert not tables.means(1, True)  # never ran: its width is unknown
    assert tables.means(0, False)  # a tuple's first value is the hidden state
    _apply(tables, 0, (torch.zeros(3, 4), torch.zeros(3, 4)))  # what the taps see as the forward runs
    _apply(tables, 1, torch.zeros(3, 4))
    _apply(tables, 2, torch.zeros(3, 6))
    _apply(tables, 3, (torch.zeros(3, 4), None))
    assert tables.means(0, False) and not tables.means(0, True)  # a tuple: output[0]
    assert tables.means(1, True) and not tables.means(1, False)  # a tensor: output
    assert not tables.means(2, True)  # another width: Python
    assert not tables.means(3, True) and not tables.means(3, False)  # (hidden, None): a tuple, no pair
    wide = torch.randn(3, 6)
    assert torch.equal(ops.steer(wide, wide, tables.slots, tables.bank, tables.how, 2), wide)
    ops.forget_seen(tables.slots, tables.codes)  # what new tables at this address do first
    assert not tables.means(1, True)


# ---------------------------------------------------------------- on the engine
ATTENTION = "model.layers.10.self_attn.source.self_attn_0"


@pytest.fixture(scope="module", autouse=True)
def one_forward_run(request):
    """A tensor tap's width is learnt from a forward: an eager CPU engine runs none
    before it serves (a GPU engine does), so its first traced request at such a tap
    runs as Python. One plain step first, so every test here sees a known width."""
    if "smollm2_llm" in request.fixturenames or any(
        "smollm2_llm" in item.fixturenames for item in request.session.items if item.module is request.module
    ):
        from vllm import SamplingParams

        llm = request.getfixturevalue("smollm2_llm")
        llm.generate([PROMPT], SamplingParams(max_tokens=1), use_tqdm=False)


def stats(llm) -> dict:
    (found,) = llm.collective_rpc("nnsight_stats")
    return found


def steer_lowered(model, vector, steps=4):
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps, logprobs=3) as tracer:
        for _ in tracer.iter[:steps]:
            model.model.layers[10].self_attn.source.self_attn_0.output[:] += 3.0 * vector
        out = tracer.result.save()
    return out


def steer_python(model, vector, steps=4):
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps, logprobs=3) as tracer:
        for _ in tracer.iter[:steps]:
            value = model.model.layers[10].self_attn.source.self_attn_0.output
            value[:] = value + 3.0 * vector
        out = tracer.result.save()
    return out


def keep_lowered(model, steps=4):
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps) as tracer:
        attention = list().save()
        for _ in tracer.iter[:steps]:
            attention.append(model.model.layers[10].self_attn.source.self_attn_0.output.clone())
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps) as tracer:
        mlp = list().save()
        for _ in tracer.iter[:steps]:
            mlp.append(model.model.layers[12].mlp.output.clone())
    return attention, mlp


def keep_python(model, steps=4):
    with model.trace(PROMPT, temperature=0.0, max_tokens=steps) as tracer:
        attention, mlp = list().save(), list().save()
        for _ in tracer.iter[:steps]:
            attention.append(model.model.layers[10].self_attn.source.self_attn_0.output.clone())
            mlp.append(model.model.layers[12].mlp.output.clone())
    return attention, mlp


def test_an_operation_tap_steers_lowered_as_the_python_path_does(smollm2_llm, smol):
    from tests.engine.test_taps import same_generation

    taps = stats(smollm2_llm)["taps"]
    assert taps.index("model.layers.10") < taps.index(ATTENTION) < taps.index("model.layers.12.mlp")
    torch.manual_seed(3)
    vector = torch.randn(576)
    before = stats(smollm2_llm)["lowered_by"]["steer"]
    lowered = steer_lowered(smol, vector)
    assert stats(smollm2_llm)["lowered_by"]["steer"] - before == 1
    python = steer_python(smol, vector)
    assert stats(smollm2_llm)["lowered_by"]["steer"] - before == 1
    same_generation([lowered], [python])
    plain = steer_lowered(smol, torch.zeros(576))
    assert list(plain.outputs[0].token_ids) != list(lowered.outputs[0].token_ids)  # it steered


def test_an_operation_and_a_tensor_module_keep_their_rows_lowered(smollm2_llm, smol):
    before = stats(smollm2_llm)["lowered_by"]["keep"]
    attention, mlp = keep_lowered(smol)
    assert stats(smollm2_llm)["lowered_by"]["keep"] - before == 2
    want_attention, want_mlp = keep_python(smol)
    assert stats(smollm2_llm)["lowered_by"]["keep"] - before == 2
    for got, want in ((attention, want_attention), (mlp, want_mlp)):
        assert [t.shape for t in got] == [t.shape for t in want] and got[0].shape[0] > 1
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the attention's output is what o_proj reads
    with smol.trace(PROMPT, temperature=0.0, max_tokens=1):
        o_proj = smol.model.layers[10].self_attn.o_proj.input.save()
    assert torch.equal(attention[0], o_proj)


def test_a_whole_first_step_read_comes_back_as_the_python_path_saves_it(smollm2_llm, smol):
    before = stats(smollm2_llm)["lowered_by"]["read"]
    with smol.trace(PROMPT, temperature=0.0, max_tokens=2):
        hidden = smol.model.layers[20].output[0].clone().save()
    with smol.trace(PROMPT, temperature=0.0, max_tokens=2):
        mlp = smol.model.layers[12].mlp.output.clone().save()
    assert stats(smollm2_llm)["lowered_by"]["read"] - before == 2
    with smol.trace(PROMPT, temperature=0.0, max_tokens=2):
        want_mlp = smol.model.layers[12].mlp.output.clone().save()
        want_hidden = smol.model.layers[20].output[0].clone().save()
    assert hidden.shape == want_hidden.shape == (5, 576) and torch.equal(hidden, want_hidden)
    assert mlp.shape == want_mlp.shape and torch.equal(mlp, want_mlp)


def test_a_first_step_read_of_a_tensor_tap_is_lowered(smollm2_llm, smol):
    before = stats(smollm2_llm)["lowered_by"]["read"]
    with smol.trace(PROMPT, temperature=0.0, max_tokens=2):
        last = smol.model.layers[12].mlp.output[-1].clone().save()
    assert stats(smollm2_llm)["lowered_by"]["read"] - before == 1
    with smol.trace(PROMPT, temperature=0.0, max_tokens=2):
        out = smol.model.layers[12].mlp.output
        want = out[-1].clone().save()
    assert torch.equal(last, want)


def test_a_python_source_read_beside_a_lowered_request_keeps_both(smollm2_llm, smol):
    """nnsight instruments the tapped attention for the Python request; the
    lowered request beside it in the same steps is still steered."""
    torch.manual_seed(4)
    vector = torch.randn(576)
    alone = steer_lowered(smol, vector, steps=3)
    before = stats(smollm2_llm)["lowered_by"]["steer"]
    with smol.trace(temperature=0.0, max_tokens=3, logprobs=3) as tracer:
        with tracer.invoke(PROMPT):
            for _ in tracer.iter[:3]:
                smol.model.layers[10].self_attn.source.self_attn_0.output[:] += 3.0 * vector
            steered = tracer.result.save()
        with tracer.invoke("Paris is a city in"):
            read = smol.model.layers[10].self_attn.source.self_attn_0.output.clone().save()
    assert stats(smollm2_llm)["lowered_by"]["steer"] - before == 1
    assert list(steered.outputs[0].token_ids) == list(alone.outputs[0].token_ids)
    with smol.trace("Paris is a city in", temperature=0.0, max_tokens=1):
        want = smol.model.layers[10].self_attn.o_proj.input.save()
    torch.testing.assert_close(read, want, rtol=1e-5, atol=1e-5)


def test_a_forward_that_closes_over_names_is_refused_when_the_taps_are_read():
    scale = 2.0

    class Scaled(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) * scale

    names = ["model", "model.act"]
    with pytest.raises(TapError, match="closes over scale"):
        resolve(["model.act.source.torch_relu_0.output"], names, lambda path: operations(Scaled))
