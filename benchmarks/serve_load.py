"""Load on a loopback OpenAI server with the plugin: plain requests against traced ones.

One command starts the stock server (``python -m vllm.entrypoints.openai.api_server``)
with an operator key, warms it up, then runs two phases of ``--clients`` concurrent clients for
``--seconds`` each, against the same server:

- ``plain``: ``/v1/completions`` requests with no block;
- ``traced``: the same requests, each carrying a signed block that saves one
  layer's residual on every step and the logits of the first step.

Blocks are built and signed before the phase starts (each is good once), so the
clients' own CPU time is not charged to the server. With ``--stock`` a third
phase runs the plain load on a second server with the plugin switched off.
Prints requests, errors, requests/s, tokens/s, p50/p99 latency per phase.

    python benchmarks/serve_load.py --clients 8 --seconds 60 --tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle, part"


def build_blocks(count: int, key: str, tokens: int) -> list[dict]:
    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.models.smollm2 import smollm2_path

    model = VLLM(smollm2_path())
    blocks = []
    for _ in range(count):
        with model.requests("unused", key=key) as tracer:
            residual = list().save()
            for step in tracer.iter[:tokens]:
                residual.append(sum(model.model.layers[10].output).clone())
                if step == 0:
                    first_logits = model.logits.save()  # noqa: F841
        blocks.append(tracer.prepared.vllm_xargs[0])
    return blocks


def run_phase(url: str, name: str, clients: int, seconds: float, tokens: int, blocks: list | None) -> dict:
    import httpx

    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    latencies: list[float] = []
    errors = [0]
    first_error: list[str] = []
    produced = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    taken = iter(range(len(blocks or [])))

    def client(index: int) -> None:
        http = httpx.Client(timeout=300)
        count = 0
        while time.monotonic() < deadline:
            body = {
                "model": model,
                "prompt": f"{PROMPT} {index}-{count}.",
                "max_tokens": tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            if blocks is not None:
                with lock:
                    position = next(taken, None)
                if position is None:
                    break
                body["vllm_xargs"] = blocks[position]
            started = time.perf_counter()
            response = http.post(f"{url}/v1/completions", json=body)
            elapsed = time.perf_counter() - started
            with lock:
                if response.status_code == 200:
                    latencies.append(elapsed)
                    produced[0] += response.json()["usage"]["completion_tokens"]
                else:
                    errors[0] += 1
                    if not first_error:
                        first_error.append(f"{response.status_code} {response.text[:300]}")
            count += 1

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started
    ordered = sorted(latencies)

    def percentile(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")

    return {
        "phase": name,
        "requests": len(latencies),
        "errors": errors[0],
        "requests_per_s": len(latencies) / wall,
        "tokens_per_s": produced[0] / wall,
        "p50_s": statistics.median(ordered) if ordered else float("nan"),
        "p99_s": percentile(0.99),
        "first_error": first_error[0] if first_error else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds of unrecorded load first")
    parser.add_argument("--stock", action="store_true", help="also run the plain load with the plugin off")
    args = parser.parse_args()

    import vllm

    import tests.servers as servers
    from vllm_nnsight_plugin.models.smollm2 import smollm2_path
    from vllm_nnsight_plugin.versions import PLUGIN_VERSION

    key = secrets.token_hex(32)
    overrides = {"max_num_seqs": max(16, args.clients)}
    # Enough single-use blocks for the traced phase at the plain phase's pace, and some.
    server = servers.start_server(
        smollm2_path(), "/tmp/serve_load.log", env={"VLLM_NNSIGHT_KEY": key}, **overrides
    )
    try:
        run_phase(server.url, "warm-up", args.clients, args.warmup, args.tokens, None)
        results = [run_phase(server.url, "plain", args.clients, args.seconds, args.tokens, None)]
        needed = int(results[0]["requests"] * 1.5) + args.clients
        blocks = build_blocks(needed, key, args.tokens)
        results.append(run_phase(server.url, "traced", args.clients, args.seconds, args.tokens, blocks))
    finally:
        server.stop()
    if args.stock:
        stock = servers.start_server(
            smollm2_path(), "/tmp/serve_load_stock.log", env={"VLLM_NNSIGHT_DISABLE": "1"}, **overrides
        )
        try:
            results.append(
                run_phase(stock.url, "plain, plugin off", args.clients, args.seconds, args.tokens, None)
            )
        finally:
            stock.stop()

    print(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                "vllm": vllm.__version__,
                "plugin": PLUGIN_VERSION,
                "command": " ".join(sys.argv),
            }
        )
    )
    print(f"{'phase':20} {'requests':>8} {'errors':>6} {'req/s':>7} {'tok/s':>7} {'p50 s':>7} {'p99 s':>7}")
    for r in results:
        print(
            f"{r['phase']:20} {r['requests']:8d} {r['errors']:6d} {r['requests_per_s']:7.2f} "
            f"{r['tokens_per_s']:7.1f} {r['p50_s']:7.2f} {r['p99_s']:7.2f}"
        )
    for r in results:
        if r["first_error"]:
            print(f"first error in {r['phase']}: {r['first_error']}")
    if results[1]["requests"] and results[0]["requests"]:
        print(f"traced/plain: req/s {results[1]['requests_per_s'] / results[0]['requests_per_s']:.3f}")


if __name__ == "__main__":
    main()
