"""Traced requests by the path their block took, and the steps they cost, in
vLLM's own Prometheus metrics.

Counted in the front end as each traced request's reply is put on its output
(``outputs.attach_collected``), so ``vllm serve``'s ``/metrics`` shows them beside
vLLM's own (``prometheus_client``'s default registry, which vLLM exports, in its
multiprocess mode too): ``vllm_nnsight_requests_total{path, form}``, where
``path`` is ``lowered`` (on the tap tables), ``taps`` (Python at the taps of a
compiled forward) or ``python`` (a Python forward, or the sampler alone), and
``form`` the lowered form (empty otherwise: the output carries the reason in
words, and the worker's ``nnsight_stats`` counts them by kind).

Each collect's reply also carries the answering worker's running counts of the
steps whose forward ran as Python or at the taps, and the seconds those steps
took (:class:`StepCounts`): ``vllm_nnsight_steps_total{forward}`` and
``vllm_nnsight_step_seconds_total{forward}``, ``forward`` being ``python`` or
``taps``. They move when traced requests finish, which is when such steps have
run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NAME = "vllm_nnsight_requests"
STEPS, SECONDS = "vllm_nnsight_steps", "vllm_nnsight_step_seconds"
_BUILT: dict[str, Any] = {}  # name -> counter, built on first use (None: no prometheus_client)
_HELP = {
    NAME: (
        "Traced requests by the path their block took: lowered onto the tap tables, "
        "Python at the taps of a compiled forward, or Python.",
        ["path", "form"],
    ),
    STEPS: ("Steps whose forward ran as Python, or at the taps, for traced requests.", ["forward"]),
    SECONDS: ("Seconds of the steps vllm_nnsight_steps counts.", ["forward"]),
}


def _counter(name: str = NAME) -> Any:
    if name not in _BUILT:
        try:
            from prometheus_client import Counter
        except ImportError:  # a client without vLLM's server dependencies
            _BUILT[name] = None
        else:
            description, labels = _HELP[name]
            _BUILT[name] = Counter(name, description, labels)
    return _BUILT[name]


@dataclass(frozen=True)
class StepCounts:
    """One worker's running counts (a part of its collect reply): the steps whose
    forward ran as Python or at the taps, and their seconds. ``worker`` tells
    workers apart (its process id), so each adds only what it did since its last."""

    worker: int
    python_steps: int
    python_seconds: float
    taps_steps: int
    taps_seconds: float


_LAST: dict[int, StepCounts] = {}


def observe(counts: StepCounts) -> None:
    """Add what a worker did since its last reply to the step counters."""
    last = _LAST.get(counts.worker)
    _LAST[counts.worker] = counts
    steps, seconds = _counter(STEPS), _counter(SECONDS)
    if steps is None or seconds is None:
        return
    for forward in ("python", "taps"):
        now_steps, now_seconds = getattr(counts, f"{forward}_steps"), getattr(counts, f"{forward}_seconds")
        before_steps = getattr(last, f"{forward}_steps") if last else 0
        before_seconds = getattr(last, f"{forward}_seconds") if last else 0.0
        if now_steps > before_steps:
            steps.labels(forward=forward).inc(now_steps - before_steps)
        if now_seconds > before_seconds:
            seconds.labels(forward=forward).inc(now_seconds - before_seconds)


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
    """Count each finished traced output once, by its path (one increment per
    path: a sweep finishes a thousand requests at a time)."""
    labels: dict[tuple[str, str], int] = {}
    for output in outputs:
        label = path_label(getattr(output, "nnsight_path", None))
        if label is not None:
            labels[label] = labels.get(label, 0) + 1
    counter = _counter() if labels else None
    if counter is None:
        return
    for (path, form), n in labels.items():
        counter.labels(path=path, form=form).inc(n)
