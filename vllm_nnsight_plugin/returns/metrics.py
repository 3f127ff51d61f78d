"""Traced requests by the path their block took, in vLLM's own Prometheus metrics.

Counted in the front end as each traced request's reply is put on its output
(``outputs.attach_collected``), so ``vllm serve``'s ``/metrics`` shows them beside
vLLM's own (``prometheus_client``'s default registry, which vLLM exports, in its
multiprocess mode too): ``vllm_nnsight_requests_total{path, form}``, where
``path`` is ``lowered`` (on the tap tables), ``taps`` (Python at the taps of a
compiled forward) or ``python`` (a Python forward, or the sampler alone), and
``form`` the lowered form (empty otherwise: the output carries the reason in
words, and the worker's ``nnsight_stats`` counts them by kind).
"""

from __future__ import annotations

from typing import Any

NAME = "vllm_nnsight_requests"
_COUNTER: list[Any] = []  # built on first use; [None] where prometheus_client is missing


def _counter() -> Any:
    if not _COUNTER:
        try:
            from prometheus_client import Counter
        except ImportError:  # a client without vLLM's server dependencies
            _COUNTER.append(None)
        else:
            _COUNTER.append(
                Counter(
                    NAME,
                    "Traced requests by the path their block took: lowered onto the tap "
                    "tables, Python at the taps of a compiled forward, or Python.",
                    ["path", "form"],
                )
            )
    return _COUNTER[0]


def path_label(path: dict | None) -> tuple[str, str] | None:
    """The (path, form) labels of one output's ``nnsight_path`` (None: no block)."""
    if not path:
        return None
    if path.get("lowered"):
        return "lowered", str(path.get("form") or "")
    if path.get("form") == "taps":
        return "taps", ""
    return "python", ""


def count(outputs: list) -> None:
    """Count each finished traced output once, by its path."""
    counter = None
    for output in outputs:
        label = path_label(getattr(output, "nnsight_path", None))
        if label is None:
            continue
        counter = counter or _counter()
        if counter is None:
            return
        counter.labels(path=label[0], form=label[1]).inc()
