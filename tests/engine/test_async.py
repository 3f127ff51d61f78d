"""The async engine: ``VLLM(..., mode="async")`` and a stock ``AsyncLLM``."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import vllm_nnsight_plugin
from tests.engines import ENGINE_DEFAULTS

PROMPTS = [f"Note {i}: the capital of France is" for i in range(32)]


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: an ``AsyncLLM`` serves the loop it first ran in."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop

    async def cancel_the_rest():
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    asyncio.run_coroutine_threadsafe(cancel_the_rest(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture(scope="module")
def run(loop):
    return lambda coroutine: asyncio.run_coroutine_threadsafe(coroutine, loop).result(600)


@pytest.fixture(scope="module")
def async_model(smollm2_path, loop):
    from vllm_nnsight_plugin import VLLM

    model = VLLM(smollm2_path, mode="async", dispatch=True, **ENGINE_DEFAULTS)
    yield model
    model.vllm_entrypoint.shutdown()


async def traced(model, prompt):
    with model.trace(prompt, temperature=0.0, max_tokens=4) as tracer:
        hidden = model.model.layers[5].output[0].clone().save()  # noqa: F841 (on output.saves)
    outputs = [output async for output in tracer.backend]
    return outputs[-1], len(outputs)


def test_32_concurrent_traces_from_one_loop(async_model, run, smol):
    async def main():
        return await asyncio.gather(*(traced(async_model, p) for p in PROMPTS))

    results = run(main())
    for prompt, (output, steps) in zip(PROMPTS, results):
        assert output.finished and steps >= 1
        with smol.trace(prompt, temperature=0.0, max_tokens=4) as tracer:
            expected = smol.model.layers[5].output[0].clone().save()
            tokens = tracer.result.save()
        torch.testing.assert_close(output.saves["hidden"], expected, rtol=1e-4, atol=1e-4)
        assert list(output.outputs[0].token_ids) == list(tokens.outputs[0].token_ids)


def test_stock_async_generate_with_a_prepared_block(async_model, run):
    with async_model.requests("The capital of France is", temperature=0.0, max_tokens=3) as tracer:
        hidden = async_model.model.layers[3].output[0].save()  # noqa: F841
    prepared = tracer.prepared
    engine = async_model.vllm_entrypoint

    async def main():
        outputs = [o async for o in engine.generate(prepared.prompts[0], prepared.params[0], "stock-async-1")]
        return outputs[-1]

    output = run(main())
    assert tuple(vllm_nnsight_plugin.saves(output)["hidden"].shape) == (5, 576)
    assert output.outputs[0].text.startswith(" Paris")


def test_an_abandoned_stream_leaves_nothing_behind(async_model, run):
    engine = async_model.vllm_entrypoint

    async def main():
        with async_model.trace("Tell me a story", temperature=0.0, max_tokens=300, ignore_eos=True) as tracer:
            hidden = async_model.model.layers[3].output[0].clone().save()  # noqa: F841
        stream = tracer.backend.__aiter__()
        await stream.__anext__()
        await stream.aclose()
        for _ in range(40):
            if await engine.collective_rpc("nnsight_tracked") == [0]:
                break
            await asyncio.sleep(0.25)
        return await engine.collective_rpc("nnsight_tracked")

    assert run(main()) == [0]


def test_two_traced_requests_may_not_share_an_id(async_model, run):
    from vllm_nnsight_plugin.wire.trust import RefusedBlockError

    def prepared():
        with async_model.requests("The capital of France is", temperature=0.0, max_tokens=2) as tracer:
            hidden = async_model.model.layers[3].output[0].save()  # noqa: F841
        return tracer.prepared

    first, second = prepared(), prepared()
    engine = async_model.vllm_entrypoint

    async def main():
        stream = engine.generate(first.prompts[0], first.params[0], "shared-id")
        with pytest.raises(RefusedBlockError, match="already running"):
            engine.generate(second.prompts[0], second.params[0], "shared-id")
        outputs = [o async for o in stream]
        again = [o async for o in engine.generate(second.prompts[0], second.params[0], "shared-id")]
        return outputs[-1], again[-1]

    done, again = run(main())
    assert vllm_nnsight_plugin.saves(done)["hidden"].shape[0] == 5
    assert vllm_nnsight_plugin.saves(again)["hidden"].shape[0] == 5


def test_edits_on_the_async_engine(async_model, run, smol):
    import nnsight

    from vllm_nnsight_plugin.edits import EditError

    engine = async_model.vllm_entrypoint

    async def main():
        with pytest.raises(EditError, match="async with"):
            with async_model.edit() as (tracer, refused):
                nnsight.save(True)
        async with async_model.edit(name="probe") as (tracer, probe):
            hidden = async_model.model.layers[5].output[0][-1].clone().save()  # noqa: F841
        async with async_model.edit() as (tracer, always):
            seen = nnsight.save(True)  # noqa: F841
        unnamed = await async_model.generate(PROMPTS[:2], temperature=0.0, max_tokens=2, edits=[])
        both = await async_model.generate(PROMPTS[0], temperature=0.0, max_tokens=2, edits=["probe"])
        with async_model.trace(PROMPTS[1], temperature=0.0, max_tokens=2, edits=["probe"]) as tracer:
            result = tracer.result.save()  # noqa: F841
        streamed = [output async for output in tracer.backend]
        # A stock stream of a plain request, with no nnsight in sight: its last output.
        stock = [
            o
            async for o in engine.generate(
                PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=2), "plain-1"
            )
        ]
        await probe.aclear()
        after_probe = await async_model.generate(PROMPTS[0], temperature=0.0, max_tokens=2)
        await async_model.aclear_edits()
        after_all = await async_model.generate(PROMPTS[0], temperature=0.0, max_tokens=2)
        tracked = await engine.collective_rpc("nnsight_tracked")
        return unnamed, both, streamed, stock, after_probe, after_all, tracked

    from vllm import SamplingParams

    unnamed, both, streamed, stock, after_probe, after_all, tracked = run(main())
    assert [sorted(o.saves) for o in unnamed] == [["seen"], ["seen"]]
    assert [sorted(o.saves) for o in both] == [["hidden", "seen"]]
    with smol.trace(PROMPTS[0], temperature=0.0, max_tokens=2):
        want = smol.model.layers[5].output[0][-1].clone().save()
    torch.testing.assert_close(both[0].saves["hidden"], want, rtol=1e-4, atol=1e-4)
    assert streamed[-1].finished and sorted(streamed[-1].saves) == ["hidden", "result", "seen"]
    assert sorted(stock[-1].saves) == ["hidden", "seen"]
    assert sorted(after_probe[0].saves) == ["seen"]
    assert not hasattr(after_all[0], "saves") and async_model.installed_edits() == {}
    assert tracked == [0]
