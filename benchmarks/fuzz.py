"""Hostile and careless requests against a loopback server with the plugin.

Seeded and bounded: ``--cases`` requests drawn from the kinds below, sent by
``--clients`` threads, with a plain request every ``--plain-every`` cases whose
text must equal the same request's text before the fuzz began. At the end: the
server must answer ``/health``, hold no block, and no canary file (written by a
payload that was decoded) may exist. Counts by kind and outcome are printed and
written as JSON.

Kinds, as someone without the key would send them: random and truncated bytes,
envelopes with every field mutated (wrong types, huge values, unicode, nesting),
oversized envelopes, valid signatures over tampered text, replays, expired and
far-future envelopes, hostile ``vllm_xargs`` shapes, forged control commands.
And signed, as a trusted but careless user would send them: blocks that raise at
a location, write the wrong shape or device, save something huge or unpicklable,
recurse without end, allocate without end (stopped by the memory budget), or never
return (stopped by the step budget).

    python benchmarks/fuzz.py --cases 10000            # starts its own server (SmolLM2)
    python benchmarks/fuzz.py --url URL --key KEY ...  # or one already running

``tests/engine/test_serve.py`` runs a few hundred of these in CI.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import pickle
import random
import secrets
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "The capital of France is"
#: The server settings the fuzz expects (``main`` starts its server with them).
SERVER_ENV = {
    "VLLM_NNSIGHT_STEP_BUDGET_S": "2",
    "VLLM_NNSIGHT_PACK_BUDGET_S": "2",
    "VLLM_NNSIGHT_STEP_MEMORY_BYTES": str(512 << 20),
    "VLLM_NNSIGHT_MAX_PAYLOAD_BYTES": str(256 << 10),
    "VLLM_NNSIGHT_MAX_SAVE_BYTES": str(4 << 20),
}


@dataclass
class Case:
    kind: str
    path: str
    #: The request's bytes; for a block that must arrive valid, made when it is
    #: sent (its signature's lifetime starts then); None: the case before's (a replay).
    body: bytes | Callable[[], bytes] | None
    headers: dict = field(default_factory=dict)
    method: str = "POST"
    #: Statuses this kind may answer with (anything else is counted unexpected).
    expect: frozenset = frozenset({400, 403, 404, 413, 422})
    then: Case | None = None  # sent right after (a replay)


class Canary:
    """Unpickling this writes a file: proof that a payload was decoded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


# ---------------------------------------------------------------------- the cases
class Maker:
    """Draws cases; holds what signed ones need (the key, blocks, the model name)."""

    def __init__(
        self, rng: random.Random, key: str, model_name: str, canaries: Path, blocks: dict, payload_limit: int
    ) -> None:
        self.rng, self.key, self.model_name, self.canaries, self.blocks = (
            rng,
            key,
            model_name,
            canaries,
            blocks,
        )
        self.payload_limit = payload_limit
        self.count = 0

    def completion(self, xargs: Any = None, **fields: Any) -> bytes:
        body = {"model": self.model_name, "prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, **fields}
        if xargs is not None:
            body["vllm_xargs"] = xargs
        return json.dumps(body).encode()

    def canary(self, **seal_kwargs: Any) -> str:
        from vllm_nnsight_plugin.versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
        from vllm_nnsight_plugin.wire.envelope import seal

        self.count += 1
        path = self.canaries / f"c{self.count}"
        return seal(
            pickle.dumps(Canary(str(path))),
            nnsight_version=seal_kwargs.pop("nnsight_version", SUPPORTED_NNSIGHT),
            plugin_version=PLUGIN_VERSION,
            **seal_kwargs,
        )

    def junk(self, size: int) -> str:
        alphabet = 'AZaz09+/=.:é\u202e\x00{}[]"\\ \n' + "ž𝕏"
        return "".join(self.rng.choice(alphabet) for _ in range(size))

    def mutated_document(self) -> str:
        """An envelope whose JSON fields are each of a random wrong kind, signed with a wrong key or none."""
        from vllm_nnsight_plugin.wire.envelope import ENVELOPE_VERSION, sign

        rng = self.rng
        document: dict[str, Any] = {
            "v": ENVELOPE_VERSION,
            "nnsight": "0.8.1",
            "plugin": "0.1.0",
            "payload": "eA==",
        }
        for name in rng.sample(
            ["v", "nnsight", "plugin", "payload", "created", "expires", "nonce", "extra"], 3
        ):
            document[name] = rng.choice(
                [
                    None,
                    True,
                    -1,
                    10**40,
                    float("1e308"),
                    "",
                    self.junk(rng.randint(1, 64)),
                    [1, [2, [3]]],
                    {"a": {"b": {}}},
                    "x" * rng.randint(1000, 50_000),
                    json.loads("[" * 200 + "]" * 200),
                ]
            )
        body = "nns2:" + base64.b64encode(json.dumps(document).encode()).decode()
        return rng.choice([body, sign(body, "w" * 64), body + "." + self.junk(64)])

    def attacker(self) -> Case:
        rng, path = self.rng, "/v1/completions"
        kind = rng.choice(
            [
                "random bytes",
                "truncated JSON",
                "mutated envelope",
                "not an envelope",
                "oversized",
                "tampered after signing",
                "wrong key",
                "expired",
                "far future",
                "made before start",
                "hostile xargs",
                "forged local signature",
                "forged command",
                "unsigned tree",
                "chat envelope",
            ]
        )
        if kind == "random bytes":
            return Case(kind, path, rng.randbytes(rng.randint(0, 4096)), {"content-type": "application/json"})
        if kind == "truncated JSON":
            whole = self.completion({"nnsight": self.canary(key=self.key)})
            return Case(
                kind, path, whole[: rng.randint(0, len(whole) - 1)], {"content-type": "application/json"}
            )
        if kind == "mutated envelope":
            return Case(kind, path, self.completion({"nnsight": self.mutated_document()}))
        if kind == "not an envelope":
            value = rng.choice([self.junk(rng.randint(0, 300)), 12, 1.5, True, None, ["nns2:"], {"v": 1}])
            return Case(kind, path, self.completion({"nnsight": value}), expect=frozenset({400, 403, 422}))
        if kind == "oversized":
            from vllm_nnsight_plugin.wire.envelope import sign

            size = self.payload_limit * 2
            value = "nns2:" + "A" * size
            value = rng.choice([value, sign(value, self.key)])
            return Case(kind, path, self.completion({"nnsight": value}), expect=frozenset({413}))
        if kind == "tampered after signing":
            from vllm_nnsight_plugin.wire.envelope import split_signature

            body, signature = split_signature(self.canary(key=self.key))
            at = rng.randrange(5, len(body))
            flipped = body[:at] + ("B" if body[at] != "B" else "C") + body[at + 1 :]
            return Case(
                kind, path, self.completion({"nnsight": f"{flipped}.{signature}"}), expect=frozenset({403})
            )
        if kind == "wrong key":
            return Case(
                kind,
                path,
                self.completion({"nnsight": self.canary(key=secrets.token_hex(32))}),
                expect=frozenset({403}),
            )
        if kind == "expired":
            return Case(
                kind,
                path,
                self.completion({"nnsight": self.canary(key=self.key, ttl_s=-5)}),
                expect=frozenset({403}),
            )
        if kind == "far future":
            return Case(
                kind,
                path,
                self.completion({"nnsight": self.canary(key=self.key, ttl_s=10**9)}),
                expect=frozenset({403}),
            )
        if kind == "made before start":
            from vllm_nnsight_plugin.wire import envelope as wire

            real = wire.time.time
            wire.time.time = lambda: real() - 3600
            try:
                old = self.canary(key=self.key, ttl_s=7200)
            finally:
                wire.time.time = real
            return Case(kind, path, self.completion({"nnsight": old}), expect=frozenset({403}))
        if kind == "hostile xargs":
            xargs = rng.choice(
                [
                    [self.canary()],
                    "nns2:",
                    {"nnsight": {"nested": [1, 2]}},
                    {"nnsight_vouched": "yes", "nnsight": self.canary()},
                    {"nnsight_edits": self.junk(100)},
                    {"nnsight_edits": ["x"] * 1000},
                    {"nnsight_edit_mark": self.junk(80)},
                    {"nnsight_edits": '["' + "a" * 10_000 + '"]'},
                    {str(i): i for i in range(2000)},
                ]
            )
            # A mark or an edit choice alone is a plain request with those fields dropped or refused.
            return Case(kind, path, self.completion(xargs), expect=frozenset({200, 400, 403, 422}))
        if kind == "forged local signature":
            xargs = {"nnsight": self.canary(), "nnsight_local_sig": "0" * 64}
            return Case(kind, path, self.completion(xargs), expect=frozenset({403}))
        if kind == "forged command":
            from vllm_nnsight_plugin.wire.edits import sign_command

            body = json.dumps({"block": self.canary(), "name": self.junk(10)}).encode()
            header = rng.choice(
                [
                    sign_command("w" * 64, "POST", "/v1/nnsight/edits", body),
                    self.junk(rng.randint(0, 600)),
                    sign_command(self.key, "POST", "/v1/nnsight/edits", b"other body"),
                    sign_command(self.key, "DELETE", "/v1/nnsight/edits", body),
                ]
            )
            # Raw bytes (non-ASCII included): all but the control characters HTTP cannot carry.
            printable = "".join(c for c in header if c.isprintable()).strip()  # what HTTP can carry
            headers = {"x-nnsight-signature": printable.encode("utf-8")}
            return Case(
                kind,
                "/v1/nnsight/edits",
                body,
                {**headers, "content-type": "application/json"},
                expect=frozenset({403, 413}),
            )
        if kind == "unsigned tree":
            return Case(kind, "/v1/nnsight/model", b"", method="GET", expect=frozenset({403}))
        body = json.dumps(
            {
                "model": self.model_name,
                "max_tokens": 3,
                "messages": [{"role": "user", "content": self.junk(40)}],
                "vllm_xargs": {"nnsight": self.canary()},
            }
        ).encode()
        return Case(kind, "/v1/chat/completions", body, expect=frozenset({403}))

    def replay(self) -> Case:
        """A good signed block, then the same bytes again."""
        from vllm_nnsight_plugin.versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
        from vllm_nnsight_plugin.wire.envelope import seal

        def body() -> bytes:
            envelope = seal(
                self.blocks["reads"],
                nnsight_version=SUPPORTED_NNSIGHT,
                plugin_version=PLUGIN_VERSION,
                key=self.key,
            )
            return self.completion({"nnsight": envelope})

        again = Case("replay (second use)", "/v1/completions", None, expect=frozenset({403}))
        return Case("replay (first use)", "/v1/completions", body, expect=frozenset({200}), then=again)

    def careless(self) -> Case:
        from vllm_nnsight_plugin.versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
        from vllm_nnsight_plugin.wire.envelope import seal

        weights = {name: 1 for name in self.blocks}
        weights["forever"] = weights["hoards memory"] = 0.05  # each costs a budget
        name = self.rng.choices(list(weights), list(weights.values()))[0]
        expect = {"reads": {200}, "cast dtype": {200}}.get(name, {422})

        def body() -> bytes:
            envelope = seal(
                self.blocks[name],
                nnsight_version=SUPPORTED_NNSIGHT,
                plugin_version=PLUGIN_VERSION,
                key=self.key,
            )
            return self.completion({"nnsight": envelope})

        return Case(f"signed: {name}", "/v1/completions", body, expect=frozenset(expect))

    def draw(self) -> Case:
        roll = self.rng.random()
        if roll < 0.7:
            return self.attacker()
        if roll < 0.75:
            return self.replay()
        return self.careless()


def careless_blocks(model: Any) -> dict[str, bytes]:
    """Each careless block's serialized bytes (sealed afresh per case)."""
    import threading as _threading

    import torch

    from vllm_nnsight_plugin.versions import PLUGIN_VERSION, SUPPORTED_NNSIGHT
    from vllm_nnsight_plugin.wire.envelope import open_envelope

    def built(tracer: Any) -> bytes:
        value = tracer.prepared.vllm_xargs[0]["nnsight"]
        return open_envelope(
            value, nnsight_version=SUPPORTED_NNSIGHT, plugin_version=PLUGIN_VERSION
        ).block_bytes()

    key = "k" * 64  # any: only the bytes are kept
    blocks = {}
    layers = model.model.layers
    with model.requests("unused", key=key) as tracer:
        hidden = layers[0].output[0].clone().save()  # noqa: F841
    blocks["reads"] = built(tracer)
    with model.requests("unused", key=key) as tracer:
        layers[0].output[0].save()
        raise KeyError("on purpose")
    blocks["raises"] = built(tracer)
    with model.requests("unused", key=key) as tracer:
        layers[0].mlp.output = torch.zeros(2, 3)
    blocks["wrong shape"] = built(tracer)
    with model.requests("unused", key=key) as tracer:
        layers[0].mlp.output = layers[0].mlp.output.to("meta")
    blocks["wrong device"] = built(tracer)
    with model.requests("unused", key=key) as tracer:
        layers[0].mlp.output = layers[0].mlp.output.to(torch.float64)
    blocks["cast dtype"] = built(tracer)
    with model.requests("unused", key=key) as tracer:
        big = torch.zeros(8 << 20).save()  # noqa: F841 - 32 MiB, over the 4 MiB limit
    blocks["huge save"] = built(tracer)
    with model.requests("unused", key=key) as tracer:
        lock = _threading.Lock().save()  # noqa: F841
    blocks["unpicklable save"] = built(tracer)
    with model.requests("unused", key=key) as tracer:

        def deeper(n):
            return deeper(n + 1)

        deeper(0)
    blocks["recursion"] = built(tracer)
    with model.requests("unused", key=key) as tracer:
        layers[1].output[0].save()
        layers[0].output[0].save()
    blocks["out of order"] = built(tracer)
    with model.requests("unused", key=key) as tracer:
        layers[0].output[0].save()
        while True:
            pass
    blocks["forever"] = built(tracer)
    with model.requests("unused", key=key) as tracer:
        kept = []
        while True:
            kept.append(torch.ones(1 << 18))  # 1 MiB a turn, until the memory budget stops it
    blocks["hoards memory"] = built(tracer)
    return blocks


# ---------------------------------------------------------------------- the run
@dataclass
class Report:
    outcomes: Counter = field(default_factory=Counter)  # (kind, status, type) -> count
    unexpected: list = field(default_factory=list)
    server_errors: int = 0
    plain_checked: int = 0
    plain_mismatches: int = 0
    transport_errors: int = 0
    canaries: list = field(default_factory=list)
    still_serving: bool = False
    tracked_after: int | None = None
    seconds: float = 0.0

    def summary(self) -> dict:
        by_kind: dict[str, dict[str, int]] = {}
        for (kind, status, kind_of_error), count in sorted(self.outcomes.items()):
            by_kind.setdefault(kind, {})[f"{status} {kind_of_error}".strip()] = count
        return {
            "cases": sum(self.outcomes.values()),
            "seconds": round(self.seconds, 1),
            "by_kind": by_kind,
            "unexpected": len(self.unexpected),
            "unexpected_examples": self.unexpected[:10],
            "server_errors_5xx": self.server_errors,
            "transport_errors": self.transport_errors,
            "plain_checked": self.plain_checked,
            "plain_mismatches": self.plain_mismatches,
            "canaries_written": len(self.canaries),
            "still_serving": self.still_serving,
            "blocks_held_after": self.tracked_after,
        }


def fuzz(
    url: str,
    key: str,
    cases: int,
    model: Any,
    *,
    seed: int = 0,
    clients: int = 4,
    plain_every: int = 25,
    payload_limit: int = int(SERVER_ENV["VLLM_NNSIGHT_MAX_PAYLOAD_BYTES"]),
) -> Report:
    """Send ``cases`` drawn cases to the server at ``url`` (see the module docstring);
    ``model`` is the client's tree of the model it serves, to build blocks with."""
    import httpx

    report = Report()
    http = httpx.Client(timeout=httpx.Timeout(10.0, read=120.0))
    model_name = http.get(f"{url}/v1/models").json()["data"][0]["id"]
    plain_body = {"model": model_name, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0}
    baseline = http.post(f"{url}/v1/completions", json=plain_body).json()["choices"][0]["text"]
    canaries = Path(tempfile.mkdtemp(prefix="fuzz-canaries-"))
    maker = Maker(random.Random(seed), key, model_name, canaries, careless_blocks(model), payload_limit)
    drawn = [maker.draw() for _ in range(cases)]
    lock = threading.Lock()

    def send(case: Case) -> None:
        while case is not None:
            body = case.body() if callable(case.body) else case.body
            if case.then is not None and case.then.body is None:
                case.then.body = body
            try:
                headers = {"content-type": "application/json", **case.headers}
                response = http.request(case.method, url + case.path, content=body, headers=headers)
            except httpx.HTTPError as error:
                with lock:
                    report.transport_errors += 1
                    report.unexpected.append(f"{case.kind}: {type(error).__name__}")
                return
            kind_of_error = ""
            try:
                document = response.json()
                error = document.get("error") if isinstance(document, dict) else None
                if isinstance(error, dict):
                    kind_of_error = str(error.get("type", ""))[:60]
            except ValueError:
                pass
            with lock:
                report.outcomes[(case.kind, response.status_code, kind_of_error)] += 1
                if response.status_code >= 500:
                    report.server_errors += 1
                if (
                    response.status_code not in case.expect
                    or len(response.content) > 64 << 10
                    and response.status_code >= 400
                ):
                    report.unexpected.append(f"{case.kind}: {response.status_code} {response.text[:200]}")
            case = case.then

    def plain() -> None:
        text = http.post(f"{url}/v1/completions", json=plain_body).json()["choices"][0]["text"]
        with lock:
            report.plain_checked += 1
            report.plain_mismatches += text != baseline

    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        futures = []
        for index, case in enumerate(drawn):
            futures.append(pool.submit(send, case))
            if index % plain_every == 0:
                futures.append(pool.submit(plain))
        for future in futures:
            future.result()
    report.seconds = time.monotonic() - started
    report.canaries = sorted(os.listdir(canaries))
    try:
        report.still_serving = http.get(f"{url}/health").status_code == 200 and (
            http.post(f"{url}/v1/completions", json=plain_body).json()["choices"][0]["text"] == baseline
        )
        rpc = http.post(f"{url}/collective_rpc", json={"method": "nnsight_tracked"})
        if rpc.status_code == 200:
            report.tracked_after = sum(int(x) for x in rpc.json()["results"])
    except httpx.HTTPError:
        report.still_serving = False
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--url", help="a running server (started with the settings in SERVER_ENV)")
    parser.add_argument("--key", help="its operator key")
    parser.add_argument("--out", help="where to write the JSON report")
    args = parser.parse_args()

    import platform

    import vllm

    import tests.servers as servers
    from vllm_nnsight_plugin import VLLM
    from vllm_nnsight_plugin.models.smollm2 import smollm2_path

    path = smollm2_path()
    server = None
    url, key = args.url, args.key
    if url is None:
        key = secrets.token_hex(32)
        env = {**SERVER_ENV, "VLLM_NNSIGHT_KEY": key, "VLLM_SERVER_DEV_MODE": "1"}
        server = servers.start_server(path, "/tmp/fuzz-server.log", env=env, max_num_seqs=16)
        url = server.url
    try:
        report = fuzz(url, key, args.cases, VLLM(path), seed=args.seed, clients=args.clients)
    finally:
        if server is not None:
            server.stop()
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "versions": {"vllm": vllm.__version__},
        "command": " ".join(sys.argv),
        **report.summary(),
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    bad = summary["unexpected"] or summary["server_errors_5xx"] or summary["plain_mismatches"]
    sys.exit(1 if bad or summary["canaries_written"] or not summary["still_serving"] else 0)


if __name__ == "__main__":
    main()
