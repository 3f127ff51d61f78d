"""``vllm-nnsight`` (or ``python -m vllm_nnsight_plugin``): the main job.

Runs the two first examples of the docs, reading one activation and steering
one layer, on the embedded SmolLM2-135M-Instruct, and prints what came back.
"""

from __future__ import annotations

import argparse
import os
import time


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization)
    if args.dtype:
        kwargs["dtype"] = args.dtype
    return kwargs


def demo(args: argparse.Namespace) -> None:
    import torch

    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.models.smollm2 import smollm2_path

    path = args.model or smollm2_path()
    started = time.time()
    model = VLLM(path, dispatch=True, **_engine_kwargs(args))
    print(f"engine ready in {time.time() - started:.0f} s: {path}")
    prompt = "The capital of France is"

    # Read one activation.
    with model.trace(prompt, temperature=0.0):
        resid = model.model.layers[10].output[0].clone().save()
        logits = model.logits.save()
    print("\n== read one activation")
    print(f"layer 10 hidden state: {tuple(resid.shape)} (prompt tokens x d_model)")
    print(f"next token from the logits: {model.tokenizer.decode(logits.argmax(-1))!r}")

    # Steer one layer, on every step of generation.
    hidden = resid.shape[-1]
    torch.manual_seed(0)
    vector = torch.randn(hidden)
    vector = vector / vector.norm()
    with model.trace(prompt, temperature=0.0, max_tokens=16, ignore_eos=True) as tracer:
        for _ in tracer.iter[:16]:
            model.model.layers[10].output[0][:] += args.scale * vector
        steered = tracer.result.save()
    plain = model.generate(prompt, temperature=0.0, max_tokens=16)[0]
    print("\n== steer one layer")
    print(f"plain:   {prompt}{plain.outputs[0].text!r}")
    print(f"steered: {prompt}{steered.outputs[0].text!r}  (layer 10 += {args.scale} x unit vector)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm-nnsight", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=float(os.environ.get("VLLM_NNSIGHT_MEMORY", "0.3")),
        help="vLLM's memory fraction (on CPU it sizes the KV cache; keep <= 0.3 there)",
    )
    parser.add_argument("--scale", type=float, default=40.0, help="steering strength")
    demo(parser.parse_args(argv))


if __name__ == "__main__":
    main()
