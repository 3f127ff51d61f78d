"""GPU smoke run of the plugin on a CUDA vLLM (0.25.1 on the H200 machine).

    python scripts/gpu_smoke.py eager  MODEL_DIR
    python scripts/gpu_smoke.py graphs MODEL_DIR
    python scripts/gpu_smoke.py async  MODEL_DIR

Each mode starts one engine and prints ``RESULT {json}`` lines, one per check,
with ``ok`` true or false and what was seen.

On the device (after the kit of ``../shared/gpu/`` is stashed and installed into
``/tmp/site``), vLLM finds the plugin through its entry point, so give the tree
a minimal installed-package record before running::

    . /tmp/site/vllmkit_env.sh
    D=/tmp/site/vllm_nnsight_plugin-0.1.0.dist-info; mkdir -p $D
    printf 'Metadata-Version: 2.1\nName: vllm-nnsight-plugin\nVersion: 0.1.0\n' > $D/METADATA
    printf '[vllm.general_plugins]\nnnsight = vllm_nnsight_plugin.plugin:register\n' > $D/entry_points.txt
    export PYTHONPATH=$PYTHONPATH:$PWD
    python3 scripts/gpu_smoke.py eager .vllmkit/models/tiny-qwen3
"""

from __future__ import annotations

import json
import sys
import time
import traceback

PROMPT = "the capital of france is"


def result(name: str, ok: bool, **seen) -> None:
    print("RESULT " + json.dumps({"check": name, "ok": bool(ok), **seen}, default=str), flush=True)


def check(name: str, fn) -> None:
    try:
        fn()
    except Exception as error:  # report and go on: one run, many checks
        result(name, False, error=repr(error)[:800], tb=traceback.format_exc()[-1500:])


def main(mode: str, path: str) -> None:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    from vllm_nnsight_plugin import VLLM

    started = time.time()
    llm = LLM(
        path,
        dtype="bfloat16",
        max_model_len=256,
        gpu_memory_utilization=0.3,
        enforce_eager=(mode == "eager"),
    )
    config = llm.llm_engine.vllm_config
    result(
        "engine",
        True,
        mode=mode,
        vllm=vllm.__version__,
        torch=torch.__version__,
        startup_s=round(time.time() - started, 1),
        extension=config.parallel_config.worker_extension_cls,
        compilation=str(config.compilation_config.mode),
        cudagraph=str(config.compilation_config.cudagraph_mode),
    )
    model = VLLM(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)

    def plain_ids():
        return list(llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids)

    base = plain_ids()

    def logits_read():
        with model.trace(PROMPT, temperature=0.0, max_tokens=1):
            logits = model.logits.save()
        result("logits", int(logits.argmax(-1)) == base[0], shape=tuple(logits.shape))

    check("logits", logits_read)

    def module_read():
        with model.trace(PROMPT, temperature=0.0, max_tokens=3) as tracer:
            shapes = list().save()
            for _ in tracer.iter[:3]:
                shapes.append(tuple(model.model.layers[0].output[0].shape))
        result("module_read", len(shapes) == 3 and shapes[1][0] == 1, shapes=shapes)

    if mode == "eager":
        check("module_read", module_read)

        def steer():
            vector = torch.randn(
                llm.llm_engine.model_config.get_hidden_size(), dtype=torch.bfloat16, device="cuda"
            )
            with model.trace(PROMPT, temperature=0.0, max_tokens=8) as tracer:
                for _ in tracer.iter[:8]:
                    model.model.layers[0].output[0][:] += 50.0 * vector
                out = tracer.result.save()
            steered = list(out.outputs[0].token_ids)
            after = plain_ids()
            result("steer", steered != base and after == base, steered=steered, base=base, after=after)

        check("steer", steer)

        def view_vs_clone():
            layer = model.model.layers[0]
            with model.trace(PROMPT, temperature=0.0, max_tokens=1):
                view = layer.output[1].save()
                copy = layer.output[1].clone().save()
            result("view_vs_clone", True, max_diff=float((view.float() - copy.float()).abs().max()))

        check("view_vs_clone", view_vs_clone)

        def invokes():
            prompts = ["paris is in", "the capital of japan is", "berlin is the capital of"]
            with model.trace(temperature=0.0, max_tokens=1) as tracer:
                for prompt in prompts:
                    with tracer.invoke(prompt):
                        stream = sum(model.model.layers[1].output).save()
            result("invokes", len(stream) == 3, shapes=[tuple(s.shape) for s in stream])

        check("invokes", invokes)
    else:

        def module_on_graphs():
            # A module location on a graphed engine runs its step's forward as
            # Python (eager kernels); the other steps keep the graphs.
            with model.trace(PROMPT, temperature=0.0, max_tokens=2):
                hidden = model.model.layers[0].output[0].save()
            result("module_on_graphs", hidden.ndim == 2 and hidden.shape[0] > 0, shape=tuple(hidden.shape))

        check("module_on_graphs", module_on_graphs)

    def block_error():
        try:
            with model.trace(PROMPT, temperature=0.0):
                model.logits.save()
                1 / 0  # noqa: B018
        except Exception as error:
            ok = "ZeroDivisionError" in str(error) and plain_ids() == base
            result("block_error", ok)
            return
        result("block_error", False, error="no error raised")

    check("block_error", block_error)
    result(
        "tracked", llm.collective_rpc("nnsight_tracked") == [0], tracked=llm.collective_rpc("nnsight_tracked")
    )
    result("plain_unchanged", plain_ids() == base, base=base)


def main_async(path: str) -> None:
    """The async engine: concurrent traces, a stock ``generate`` with prepared
    requests, a block nobody vouched for, and no state left behind."""
    import asyncio

    import vllm
    from vllm import SamplingParams

    import vllm_nnsight_plugin
    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.wire.envelope import EXTRA_ARGS_KEY
    from vllm_nnsight_plugin.wire.trust import RefusedBlockError

    started = time.time()
    model = VLLM(
        path, mode="async", dispatch=True, dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3
    )
    engine = model.vllm_entrypoint
    result("async_engine", True, vllm=vllm.__version__, startup_s=round(time.time() - started, 1))
    prompts = [f"{PROMPT} {i}" for i in range(8)]

    async def traced(prompt):
        with model.trace(prompt, temperature=0.0, max_tokens=3) as tracer:
            hidden = model.model.layers[0].output[0].clone().save()  # noqa: F841
        return await tracer.backend

    async def run():
        finals = await asyncio.gather(*(traced(p) for p in prompts))
        shapes = [tuple(f.saves["hidden"].shape) for f in finals]
        result("async_traces", all(s[0] > 1 for s in shapes), shapes=shapes)

        with model.requests(PROMPT, temperature=0.0, max_tokens=2) as tracer:
            hidden = model.model.layers[0].output[0].clone().save()  # noqa: F841
        prepared = tracer.prepared
        outputs = [o async for o in engine.generate(prepared.prompts[0], prepared.params[0], "stock-1")]
        saved = vllm_nnsight_plugin.saves(outputs[-1])
        result("async_stock_generate", "hidden" in saved, shape=tuple(saved["hidden"].shape))

        envelope = prepared.params[0].extra_args[EXTRA_ARGS_KEY]
        unvouched = SamplingParams(temperature=0.0, max_tokens=2, extra_args={EXTRA_ARGS_KEY: envelope})
        try:
            _ = [o async for o in engine.generate(PROMPT, unvouched, "unvouched-1")]
            result("async_unvouched_refused", False, error="no error raised")
        except RefusedBlockError as error:
            result("async_unvouched_refused", True, error=str(error)[:200])
        result("async_tracked", await engine.collective_rpc("nnsight_tracked") == [0])

    check("async", lambda: asyncio.run(run()))
    engine.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "async":
        main_async(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
