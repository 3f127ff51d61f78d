"""When a collect may read its saves beside the step in flight (``worker/ready.py``)."""

from __future__ import annotations

import torch

from vllm_nnsight_plugin.worker.ready import Ready, outside


def test_a_request_of_the_latest_step_keeps_the_collect_waiting():
    scheduled = {"a-1": 1, "b-2": 3}  # a step's ids, as vLLM's num_scheduled_tokens holds them
    assert outside(["c-3", "d-4"], scheduled)
    assert not outside(["c-3", "b-2"], scheduled)
    assert outside([], scheduled)


def test_without_a_gpu_or_a_step_scheduled_ahead_every_collect_waits_as_before():
    ready = Ready(enabled=True)
    assert ready.enabled == torch.cuda.is_available()
    for enabled in (False, True):
        ready = Ready(enabled=enabled and not torch.cuda.is_available())
        ready.began(type("Output", (), {"num_scheduled_tokens": {"a": 1}})(), tracking=True)
        assert not ready.apart(["b"])  # no mark: no step to read beside
        with ready.reading(["b"]) as apart:
            assert apart is False
        assert ready.beside == 0


def test_a_switch_forgets_the_latest_mark():
    ready = Ready(enabled=False)
    ready._latest = type("Output", (), {"num_scheduled_tokens": {"a": 1}})()  # a step marked earlier
    assert ready.apart(["b"])
    ready.switch(True)  # a mark made before the switch never serves a collect after it
    assert not ready.apart(["b"])
    assert ready.enabled == torch.cuda.is_available()
    ready.switch(False)
    assert not ready.enabled
