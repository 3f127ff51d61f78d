"""Load, disconnects, soak and a killed engine, against a real loopback server.

Each job starts the stock OpenAI server (``python -m vllm.entrypoints.openai.api_server``)
with the plugin and an operator key, on the tiny random Qwen3 (``models/tiny.py``)
so two CPU cores can hold the load, runs, stops it, and prints a JSON report:

- ``load``: ``--requests`` at once (1,000), half carrying a signed block, half
  plain, half through the ``openai`` client and half raw HTTP, half streaming.
  Before it, the same number of plain requests at once, on this server (after
  the same warm-up as the other) and on one with the plugin switched off. Lost requests, p50/p99 latency of each kind, and the
  ratios the operators' page quotes.
- ``disconnects``: ``--requests`` (500) traced streaming requests whose clients
  drop mid-stream or abort before the answer; afterwards the workers must hold
  no block and their memory must return to where it was.
- ``soak``: ``--requests`` (10,000) mixed requests (traced with saves, traced
  and failing, plain, plain choosing an installed edit) with an edit installed
  through ``model.edit()``; memory, threads and open files of every server
  process and nnsight's save set, sampled as it goes.
- ``kill``: under load, the engine core is killed; every request in flight must
  end (with an error) and the front end must not hang; the log must hold no key
  and no signature.
- ``door``: what refusing a sender without the key costs: large and odd
  envelopes, each timed, with ``/health`` polled meanwhile.

    python benchmarks/reliability.py load --requests 1000
    python benchmarks/reliability.py disconnects --requests 500
    python benchmarks/reliability.py soak --requests 10000
    python benchmarks/reliability.py kill
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import secrets
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "Once upon a time"
TOKENS = 8


# ---------------------------------------------------------------------- shared
def start(key: str, log: str, *, plugin: bool = True, **overrides: Any) -> Any:
    import tests.servers as servers
    from vllm_nnsight_plugin.models.tiny import tiny_qwen3_path

    env = {"VLLM_NNSIGHT_KEY": key, "VLLM_SERVER_DEV_MODE": "1"}
    if not plugin:
        env["VLLM_NNSIGHT_DISABLE"] = "1"
    settings = {"max_num_seqs": 256, "max_model_len": 256, **overrides}
    return servers.start_server(tiny_qwen3_path(), log, env=env, **settings)


def block_bytes(kind: str = "reads") -> bytes:
    """A block's serialized bytes, sealed afresh (with its own nonce) per request."""
    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.models.tiny import tiny_qwen3_path
    from vllm_nnsight_plugin.versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
    from vllm_nnsight_plugin.wire.envelope import open_envelope

    model = VLLM(tiny_qwen3_path())
    with model.requests("unused", key="k" * 64) as tracer:
        if kind == "reads":
            rows = list().save()
            for _ in tracer.iter[:TOKENS]:
                rows.append(model.model.layers[1].output[0][-1].clone())
        else:
            model.model.layers[1].output[0].save()
            raise ValueError("a failing block, on purpose")
    value = tracer.prepared.vllm_xargs[0]["nnsight"]
    return open_envelope(
        value, nnsight_version=SUPPORTED_NNSIGHT, plugin_version=PLUGIN_VERSION
    ).block_bytes()


def sealed(block: bytes, key: str) -> str:
    from vllm_nnsight_plugin.versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
    from vllm_nnsight_plugin.wire.envelope import seal

    return seal(block, nnsight_version=SUPPORTED_NNSIGHT, plugin_version=PLUGIN_VERSION, key=key)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else float("nan")


def latency_summary(values: list[float]) -> dict:
    return {
        "n": len(values),
        "p50_s": round(statistics.median(values), 3) if values else None,
        "p99_s": round(percentile(values, 0.99), 3) if values else None,
    }


def processes(server: Any) -> dict[str, Any]:
    """The server's processes by role: the front end, the engine core, the workers."""
    import psutil

    root = psutil.Process(server.process.pid)
    found = {"front end": [root], "engine core": [], "worker": []}
    for child in root.children(recursive=True):
        try:
            name = " ".join(child.cmdline()) + child.name()
        except psutil.Error:
            continue
        if "EngineCore" in name:
            found["engine core"].append(child)
        elif "Worker" in name:
            found["worker"].append(child)
    return found


def footprint(server: Any) -> dict:
    """RSS (MiB), threads and open files of each role's processes."""
    import psutil

    report = {}
    for role, procs in processes(server).items():
        rss = threads = files = 0
        for proc in procs:
            try:
                rss += proc.memory_info().rss
                threads += proc.num_threads()
                files += proc.num_fds()
            except psutil.Error:
                pass
        report[role] = {"rss_mib": round(rss / 2**20, 1), "threads": threads, "fds": files}
    return report


def worker_stats(url: str) -> dict:
    import httpx

    response = httpx.post(f"{url}/collective_rpc", json={"method": "nnsight_stats"}, timeout=30)
    results = response.json().get("results") or [{}]
    return results[0]


async def one_request(
    http: Any,
    api: Any,
    url: str,
    model: str,
    *,
    envelope: str | None,
    openai_client: bool,
    stream: bool,
    drop_after: int | None = None,
    edits: str | None = None,
) -> dict:
    """One completion; what happened to it."""
    xargs: dict = {}
    if envelope is not None:
        xargs["nnsight"] = envelope
    if edits is not None:
        xargs["nnsight_edits"] = edits
    started = time.perf_counter()
    outcome: dict = {"ok": False}
    try:
        if openai_client:
            extra = {"vllm_xargs": xargs} if xargs else None
            if stream:
                chunks = await api.completions.create(
                    model=model,
                    prompt=PROMPT,
                    max_tokens=TOKENS,
                    temperature=0.0,
                    stream=True,
                    extra_body=extra,
                )
                seen, last = 0, None
                async for chunk in chunks:
                    seen += 1
                    last = chunk
                    if drop_after is not None and seen >= drop_after:
                        await chunks.close()
                        return {"ok": True, "dropped": True, "s": time.perf_counter() - started}
                outcome["ok"] = last is not None and (
                    envelope is None or "nnsight" in (last.model_extra or {})
                )
            else:
                reply = await api.completions.create(
                    model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0.0, extra_body=extra
                )
                outcome["ok"] = bool(reply.choices) and (
                    envelope is None or "nnsight" in (reply.model_extra or {})
                )
        else:
            body = {
                "model": model,
                "prompt": PROMPT,
                "max_tokens": TOKENS,
                "temperature": 0.0,
                "stream": stream,
            }
            if xargs:
                body["vllm_xargs"] = xargs
            if stream:
                async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                    outcome["status"] = response.status_code
                    seen, saves = 0, False
                    async for line in response.aiter_lines():
                        seen += 1
                        saves = saves or '"nnsight"' in line
                        if drop_after is not None and seen >= drop_after:
                            return {"ok": True, "dropped": True, "s": time.perf_counter() - started}
                    outcome["ok"] = response.status_code == 200 and (envelope is None or saves)
            else:
                response = await http.post(f"{url}/v1/completions", json=body)
                outcome["status"] = response.status_code
                outcome["ok"] = response.status_code == 200 and (
                    envelope is None or "nnsight" in response.json()
                )
    except Exception as error:  # a failure is an outcome here, counted
        outcome["error"] = f"{type(error).__name__}: {str(error)[:200]}"
    outcome["s"] = time.perf_counter() - started
    return outcome


def clients(url: str, connections: int) -> tuple[Any, Any]:
    import httpx
    import openai

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    http = httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits)
    api = openai.AsyncOpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        http_client=httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits),
        max_retries=0,
    )
    return http, api


def model_name(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


# ---------------------------------------------------------------------- jobs
async def _burst(
    url: str, count: int, key: str | None, block: bytes | None, traced_share: float
) -> list[dict]:
    http, api = clients(url, count)
    model = model_name(url)
    traced = [block is not None and i % 2 == 0 and i < 2 * count * traced_share for i in range(count)]
    requests = [
        one_request(
            http,
            api,
            url,
            model,
            envelope=sealed(block, key) if traced[i] else None,
            openai_client=(i // 2) % 2 == 0,
            stream=(i // 4) % 2 == 0,
        )
        for i in range(count)
    ]
    results = await asyncio.gather(*requests)
    await http.aclose()
    return [{**result, "traced": was} for was, result in zip(traced, results)]


def load(args: argparse.Namespace) -> dict:
    """The mixed burst on the plugin's server, then plain bursts on it and on a
    stock server (the plugin switched off) up side by side, in alternating order
    round by round: on two shared cores one burst's p99 moves by several percent
    from the next, so the comparison is made within each round and the median
    round is reported beside the pooled figures."""
    key = secrets.token_hex(32)
    block = block_bytes()
    report: dict = {}
    server = start(key, "/tmp/reliability-load.log")
    stock = None
    try:
        asyncio.run(_burst(server.url, 64, key, block, 0.5))
        mixed = asyncio.run(_burst(server.url, args.requests, key, block, 0.5))
        report["engine_alive"] = worker_stats(server.url).get("tracked") == 0
        stock = start(key, "/tmp/reliability-stock.log", plugin=False)
        plain: list[dict] = []
        plain_stock: list[dict] = []
        rounds = []
        for round_ in range(args.rounds):
            order = [(server, plain), (stock, plain_stock)]
            p99 = {}
            for target, into in order if round_ % 2 == 0 else order[::-1]:
                asyncio.run(_burst(target.url, 64, None, None, 0.0))  # each burst after the same warm-up
                burst = asyncio.run(_burst(target.url, args.requests, None, None, 0.0))
                into.extend(burst)
                p99[target is server] = latency_summary([r["s"] for r in burst if r["ok"]])["p99_s"]
            rounds.append(round(p99[True] / p99[False], 3))
    finally:
        server.stop()
        if stock is not None:
            stock.stop()
    traced_s = [r["s"] for r in mixed if r["traced"] and r["ok"]]
    plain_mixed_s = [r["s"] for r in mixed if not r["traced"] and r["ok"]]
    everything = mixed + plain + plain_stock
    report.update(
        requests=len(everything),
        lost=sum(not r["ok"] for r in everything),
        first_errors=[r.get("error") or r.get("status") for r in everything if not r["ok"]][:5],
        mixed_traced=latency_summary(traced_s),
        mixed_plain=latency_summary(plain_mixed_s),
        plain_with_plugin=latency_summary([r["s"] for r in plain if r["ok"]]),
        plain_without_plugin=latency_summary([r["s"] for r in plain_stock if r["ok"]]),
        plain_p99_plugin_over_stock_by_round=rounds,
        plain_p99_plugin_over_stock_median_round=statistics.median(rounds),
    )
    report["traced_p99_over_plain_p99"] = round(
        report["mixed_traced"]["p99_s"] / report["mixed_plain"]["p99_s"], 3
    )
    report["plain_p99_plugin_over_stock"] = round(
        report["plain_with_plugin"]["p99_s"] / report["plain_without_plugin"]["p99_s"], 3
    )
    return report


async def _drops(url: str, count: int, key: str, block: bytes, seed: int) -> list[dict]:
    rng = random.Random(seed)
    http, api = clients(url, count)
    model = model_name(url)

    async def dropped(i: int) -> dict:
        request = one_request(
            http,
            api,
            url,
            model,
            envelope=sealed(block, key),
            openai_client=i % 2 == 0,
            stream=True,
            drop_after=rng.randint(1, 4),
        )
        if i % 3 == 0:  # abort before the answer: the task is cancelled mid-request
            task = asyncio.ensure_future(request)
            await asyncio.sleep(rng.uniform(0.0, 0.5))
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return {"ok": True, "aborted": True}
            return {"ok": True, "aborted": False}
        return await request

    results = await asyncio.gather(*(dropped(i) for i in range(count)))
    await http.aclose()
    return results


def disconnects(args: argparse.Namespace) -> dict:
    key = secrets.token_hex(32)
    block = block_bytes()
    server = start(key, "/tmp/reliability-drops.log")
    try:
        asyncio.run(_burst(server.url, 64, key, block, 0.5))
        time.sleep(2)
        before = footprint(server)
        results = asyncio.run(_drops(server.url, args.requests, key, block, args.seed))
        deadline = time.monotonic() + 60
        tracked = None
        while time.monotonic() < deadline:
            tracked = worker_stats(server.url).get("tracked")
            if tracked == 0:
                break
            time.sleep(1)
        asyncio.run(_burst(server.url, 64, key, block, 0.5))  # the same warm load again, then measure
        time.sleep(2)
        after = footprint(server)
        stats = worker_stats(server.url)
    finally:
        server.stop()
    growth = {
        role: round(after[role]["rss_mib"] / max(before[role]["rss_mib"], 1e-9) - 1, 4) for role in before
    }
    return {
        "requests": len(results),
        "aborted_before_answer": sum(bool(r.get("aborted")) for r in results),
        "dropped_mid_stream": sum(bool(r.get("dropped")) for r in results),
        "client_errors": [r.get("error") for r in results if r.get("error")][:5],
        "blocks_held_after": tracked,
        "saves_tracked_after": stats.get("saves_tracked"),
        "footprint_before": before,
        "footprint_after": after,
        "rss_growth": growth,
    }


async def _soak_wave(
    url: str,
    http: Any,
    api: Any,
    model: str,
    key: str,
    blocks: dict,
    index: int,
    size: int,
    rng: random.Random,
) -> list[dict]:
    tasks = []
    for i in range(size):
        roll = rng.random()
        if roll < 0.4:
            kind, envelope, edits = "traced", sealed(blocks["reads"], key), None
        elif roll < 0.5:
            kind, envelope, edits = "failing", sealed(blocks["fails"], key), None
        elif roll < 0.9:
            kind, envelope, edits = "plain", None, None
        else:
            kind, envelope, edits = "plain, edits chosen", None, '["probe"]'
        request = one_request(
            http,
            api,
            url,
            model,
            envelope=envelope,
            openai_client=(index + i) % 2 == 0,
            stream=(index + i) % 3 == 0,
            edits=edits,
        )
        tasks.append((kind, request))
    results = await asyncio.gather(*(task for _, task in tasks))
    return [{**result, "kind": kind} for (kind, _), result in zip(tasks, results)]


def soak(args: argparse.Namespace) -> dict:
    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.models.tiny import tiny_qwen3_path

    key = secrets.token_hex(32)
    blocks = {"reads": block_bytes(), "fails": block_bytes("fails")}
    server = start(key, "/tmp/reliability-soak.log")
    samples, outcomes, errors = [], {}, []
    rng = random.Random(args.seed)
    try:
        model = VLLM(tiny_qwen3_path())
        with model.edit(serve=server.url, key=key, name="probe") as (tracer, probe):
            norm = model.model.layers[2].output[0][-1].norm().save()  # noqa: F841
        wave = 64

        async def run_all() -> None:
            http, api = clients(server.url, wave)
            name = model_name(server.url)
            done = 0
            while done < args.requests:
                results = await _soak_wave(server.url, http, api, name, key, blocks, done, wave, rng)
                for result in results:
                    key_of = (result["kind"], "ok" if result["ok"] else "failed")
                    outcomes[key_of] = outcomes.get(key_of, 0) + 1
                    if not result["ok"] and result["kind"] != "failing" and len(errors) < 5:
                        errors.append(result.get("error") or result.get("status"))
                done += wave
                if done % (wave * 16) == 0:
                    stats = worker_stats(server.url)
                    samples.append(
                        {
                            "requests": done,
                            **footprint(server),
                            "saves_tracked": stats.get("saves_tracked"),
                            "tracked": stats.get("tracked"),
                        }
                    )
            await http.aclose()

        asyncio.run(run_all())
        probe.clear()
    finally:
        server.stop()
    warm = samples[len(samples) // 10] if samples else {}
    last = samples[-1] if samples else {}
    growth = {
        role: round(last[role]["rss_mib"] / warm[role]["rss_mib"] - 1, 4)
        for role in ("front end", "engine core", "worker")
        if role in warm and warm[role]["rss_mib"]
    }
    return {
        "requests": sum(outcomes.values()),
        "outcomes": {f"{kind}: {how}": count for (kind, how), count in sorted(outcomes.items())},
        "unexpected_failures": errors,
        "rss_growth_after_warmup": growth,
        "threads": {role: (warm[role]["threads"], last[role]["threads"]) for role in growth},
        "fds": {role: (warm[role]["fds"], last[role]["fds"]) for role in growth},
        "saves_tracked": [s["saves_tracked"] for s in samples],
        "samples": samples,
    }


def kill(args: argparse.Namespace) -> dict:
    key = secrets.token_hex(32)
    block = block_bytes()
    log = "/tmp/reliability-kill.log"
    server = start(key, log)
    sent: list[str] = []
    try:
        asyncio.run(_burst(server.url, 32, key, block, 0.5))

        async def load_and_kill() -> list[dict]:
            http, api = clients(server.url, args.requests)
            name = model_name(server.url)
            tasks = []
            for i in range(args.requests):
                envelope = sealed(block, key) if i % 2 == 0 else None
                if envelope:
                    sent.append(envelope)
                tasks.append(
                    asyncio.ensure_future(
                        asyncio.wait_for(
                            one_request(
                                http,
                                api,
                                server.url,
                                name,
                                envelope=envelope,
                                openai_client=i % 4 < 2,
                                stream=i % 3 == 0,
                            ),
                            timeout=120,
                        )
                    )
                )
            await asyncio.sleep(1.0)
            for proc in processes(server)["engine core"]:
                os.kill(proc.pid, signal.SIGKILL)
            killed_at = time.perf_counter()
            results = []
            for task in tasks:
                try:
                    results.append(await task)
                except asyncio.TimeoutError:
                    results.append({"ok": False, "hung": True})
            for result in results:
                result["after_kill_s"] = time.perf_counter() - killed_at
            return results

        results = asyncio.run(load_and_kill())
        try:
            server.process.wait(60)
            exited = True
        except Exception:
            exited = False
    finally:
        server.stop()
    text = Path(log).read_text(errors="replace")
    signatures = [envelope.rpartition(".")[2] for envelope in sent]
    return {
        "requests": len(results),
        "completed_before_kill": sum(r.get("ok", False) for r in results),
        "ended_with_an_error": sum(not r.get("ok", False) and not r.get("hung") for r in results),
        "hung": sum(bool(r.get("hung")) for r in results),
        "front_end_exited_within_60_s": exited,
        "key_in_log": key in text,
        "signatures_in_log": sum(signature in text for signature in signatures),
    }


async def _timed(url: str, body: bytes) -> tuple:
    """Send one request while polling ``/health``: the answer, its time, the polls' times."""
    import httpx

    stalls: list[float] = []
    done = asyncio.Event()

    async def poll_health() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            while not done.is_set():
                started = time.perf_counter()
                await client.get(f"{url}/health")
                stalls.append(time.perf_counter() - started)
                await asyncio.sleep(0.05)

    async def send() -> Any:
        async with httpx.AsyncClient(timeout=600) as client:
            try:
                return await client.post(
                    f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}
                )
            finally:
                done.set()

    started = time.perf_counter()
    response, _ = await asyncio.gather(send(), poll_health())
    return response, time.perf_counter() - started, stalls


def door(args: argparse.Namespace) -> dict:
    """What a refusal costs: envelopes an attacker without the key sends, large and
    odd, each timed, with ``/health`` polled meanwhile."""
    import base64

    key = secrets.token_hex(32)
    server = start(key, "/tmp/reliability-door.log")
    cases = {}
    try:
        name = model_name(server.url)

        def fields_envelope(megabytes: float) -> str:
            count = int(megabytes * 2**20 / 40)
            document = {
                "v": 2,
                "nnsight": "0.8.1",
                "plugin": "0",
                "payload": "eA==",
                **{f"f{i}": "x" * 30 for i in range(count)},
            }
            return "nns2:" + base64.b64encode(json.dumps(document).encode()).decode()

        nested = "nns2:" + base64.b64encode(("[" * 100_000 + "]" * 100_000).encode()).decode()
        cases_in = {
            "unknown fields, 1.2 MB": fields_envelope(1.2),
            "unknown fields, 22 MB": fields_envelope(16.5),  # 22 MB once base64'd
            "deep nesting": nested,
            "deep nesting, forged signature": nested + "." + "0" * 64,
            "non-ASCII signature": fields_envelope(0.01) + "." + "é" * 64,
        }
        for label, envelope in cases_in.items():
            body = json.dumps(
                {"model": name, "prompt": PROMPT, "max_tokens": 2, "vllm_xargs": {"nnsight": envelope}}
            )
            response, seconds, stalls = asyncio.run(_timed(server.url, body.encode()))
            cases[label] = {
                "bytes_in": len(body),
                "status": response.status_code,
                "type": (response.json().get("error") or {}).get("type") if response.content else None,
                "bytes_out": len(response.content),
                "seconds": round(seconds, 3),
                "health_worst_s": round(max(stalls), 3) if stalls else None,
            }
        rss = footprint(server)["front end"]["rss_mib"]
    finally:
        server.stop()
    return {"cases": cases, "front_end_rss_mib_after": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", choices=["load", "disconnects", "soak", "kill", "door"])
    parser.add_argument("--requests", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rounds", type=int, default=3, help="load: plain bursts on each server, alternating"
    )
    parser.add_argument("--out", help="where to write the JSON report")
    args = parser.parse_args()
    args.requests = (
        args.requests or {"load": 1000, "disconnects": 500, "soak": 10_000, "kill": 200, "door": 0}[args.job]
    )

    import vllm

    started = time.monotonic()
    report = {"load": load, "disconnects": disconnects, "soak": soak, "kill": kill, "door": door}[args.job](
        args
    )
    summary = {
        "job": args.job,
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "vllm": vllm.__version__,
        "command": " ".join(sys.argv),
        "seconds": round(time.monotonic() - started, 1),
        **report,
    }
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
