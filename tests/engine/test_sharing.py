"""Many requests of one block, and saves that go home stacked, on a real engine.

The fast paths (one compiled code object per block, lists of tensors sent as one
tensor) must give exactly what the general path gives."""

from __future__ import annotations

import torch

PROMPT = "The capital of France is"


def test_invokes_of_one_block_each_see_their_own_captured_values(smol):
    scales = [0.0, 3.0, -2.0]
    with smol.trace(temperature=0.0, max_tokens=1) as tracer:
        for scale in scales:
            with tracer.invoke(PROMPT):
                hidden = smol.model.layers[5].output[0]
                hidden[:] += scale
                seen = smol.model.layers[5].output[0].clone().save()
    assert len(seen) == 3
    plain = seen[0]
    for scale, value in zip(scales, seen):
        # a mix-up would be off by >= 2; GPU kernels differ by ~1e-3 between batch rows
        torch.testing.assert_close(value, plain + scale, rtol=1e-2, atol=1e-2)


def test_a_list_saved_every_step_comes_back_exactly_as_built(smol):
    steps = 6
    with smol.trace(PROMPT, temperature=0.0, max_tokens=steps, ignore_eos=True) as tracer:
        rows = list().save()  # stackable: one tensor per step, prompt rows first
        pairs = list().save()  # tuples never stack: the general path, for reference
        for _ in tracer.iter[:steps]:
            hidden = smol.model.layers[10].output[0]
            rows.append(hidden.clone())
            pairs.append((hidden.clone(), hidden.shape[0]))
    assert len(rows) == len(pairs) == steps
    assert [tuple(r.shape) for r in rows] == [(5, 576)] + [(1, 576)] * (steps - 1)
    for row, (reference, count) in zip(rows, pairs):
        assert row.shape[0] == count
        torch.testing.assert_close(row, reference, rtol=0, atol=0)


def test_saves_that_do_not_stack_still_come_back_right(smol):
    with smol.trace(PROMPT, temperature=0.0, max_tokens=3, ignore_eos=True) as tracer:
        ragged = list().save()  # the width changes: stays a plain list
        objects = list().save()
        tokens = list().save()  # 0-dim tensors: stacked on a new dim, back as scalars
        for step in tracer.iter[:3]:
            hidden = smol.model.layers[2].output[0]
            ragged.append(hidden[:, : 10 + step].clone())
            objects.append({"step": step, "rows": hidden.shape[0]})
            tokens.append(smol.samples[0, 0].clone())
        out = tracer.result.save()
    assert [tuple(r.shape) for r in ragged] == [(5, 10), (1, 11), (1, 12)]
    assert objects == [{"step": 0, "rows": 5}, {"step": 1, "rows": 1}, {"step": 2, "rows": 1}]
    assert [t.dim() for t in tokens] == [0, 0, 0]
    assert [int(t) for t in tokens] == list(out.outputs[0].token_ids)


def test_many_requests_of_one_block_match_one_at_a_time(smol):
    prompts = [f"{PROMPT} {word}" for word in ("a", "the", "not", "also")]
    with smol.trace(temperature=0.0, max_tokens=1) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                last = smol.model.layers[7].output[0][-1].clone().save()
    together = last
    for prompt, value in zip(prompts, together):
        with smol.trace(prompt, temperature=0.0, max_tokens=1):
            alone = smol.model.layers[7].output[0][-1].clone().save()
        # batched and alone differ by GPU kernel choice (~3e-4 in fp32); another
        # prompt's row would differ by far more
        torch.testing.assert_close(value, alone, rtol=1e-3, atol=1e-3)
