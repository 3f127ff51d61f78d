"""``vllm-nnsight`` (or ``python -m vllm_nnsight_plugin``).

    vllm-nnsight [demo] [--model PATH] [-v]   read one activation, steer one layer
    vllm-nnsight doctor                       what this install would do
    vllm-nnsight bench [--prompts N ...]      what the plugin costs here

The demo runs the docs' first two examples on the embedded SmolLM2-135M-Instruct
and prints what came back; vLLM's own logs stay at warnings unless ``-v``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .settings import MEMORY, value


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization)
    if args.dtype:
        kwargs["dtype"] = args.dtype
    if not args.verbose:
        kwargs["use_tqdm_on_load"] = False
    return kwargs


def quiet() -> None:
    """vLLM's logs at warnings and on stderr (stdout keeps the results), and
    Python's warnings off, in this process and the engine processes it starts
    (set before vLLM is imported)."""
    import logging
    import warnings

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    warnings.simplefilter("ignore")
    logging.getLogger("vllm_nnsight_plugin").setLevel(logging.WARNING)


def demo(args: argparse.Namespace) -> None:
    if not args.verbose:
        quiet()
    import torch

    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.models.smollm2 import smollm2_path

    path = args.model or smollm2_path()
    if args.model is None and not args.dtype:
        args.dtype = "float32"  # the embedded checkpoint's own weights
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
    plain = model.generate(prompt, temperature=0.0, max_tokens=16, use_tqdm=args.verbose)[0]
    print("\n== steer one layer")
    print(f"plain:   {prompt}{plain.outputs[0].text!r}")
    print(f"steered: {prompt}{steered.outputs[0].text!r}  (layer 10 += {args.scale} x unit vector)")


def demo_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-nnsight [demo]", description="read one activation, steer one layer"
    )
    parser.add_argument("--model", help="a local checkpoint (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=float(value(MEMORY)),
        help="vLLM's memory fraction (on CPU it sizes the KV cache; keep <= 0.3 there)",
    )
    parser.add_argument("--scale", type=float, default=40.0, help="steering strength")
    parser.add_argument("-v", "--verbose", action="store_true", help="vLLM's own logs and progress bars too")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    command = argv.pop(0) if argv and argv[0] in ("demo", "doctor", "bench") else "demo"
    if command == "doctor":
        from .doctor import main as doctor

        raise SystemExit(doctor())
    if command == "bench":
        from .bench import main as bench

        bench(argv)
        return
    demo(demo_parser().parse_args(argv))


if __name__ == "__main__":
    main()
