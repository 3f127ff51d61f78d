"""Copies between a GPU and shared memory, through pinned staging buffers.

A copy between a device and ordinary (pageable) host memory is staged by the
driver, one page at a time; into a freshly made shared-memory file it also takes
a page fault per page, inside the copy. On an H200 host that put a 1.3 GB
capture at over a second each way. Here the copy goes in chunks through two
pinned buffers (the device side of each chunk is a DMA transfer at full speed),
while the host side is an ordinary multi-threaded memory copy, and the next
chunk's transfer overlaps the last chunk's memory copy.

The host side runs on a few threads of its own: vLLM's engine processes run
torch on one thread, and a fresh shared-memory file takes a page fault per page
on first touch, which one thread pays one by one.

Host tensors (a CPU engine) are copied directly. Each process keeps its two
buffers once made; a lock makes them one copy's at a time.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

#: Bytes per staging buffer (two per process, made on the first device copy).
CHUNK_BYTES = 32 << 20

#: Threads for the host side of a chunk (torch's copy lets go of the GIL).
COPY_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))

_lock = threading.Lock()
_buffers: list[Any] = []
_events: list[Any] = []
_threads: list[ThreadPoolExecutor] = []


def _host_copy(target: Any, source: Any) -> None:
    """``target.copy_(source)`` for two flat host tensors, split across threads."""
    numel = source.numel()
    if COPY_THREADS == 1 or numel * source.element_size() < (4 << 20):
        target.copy_(source)
        return
    if not _threads:
        _threads.append(ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="vllm-nnsight-copy"))
    step = -(-numel // COPY_THREADS)
    parts = [(low, min(numel, low + step)) for low in range(0, numel, step)]
    for done in [_threads[0].submit(target[a:b].copy_, source[a:b]) for a, b in parts]:
        done.result()


def _staging() -> tuple[list[Any], list[Any]]:
    import torch

    if not _buffers:
        for _ in range(2):
            _buffers.append(torch.empty(CHUNK_BYTES, dtype=torch.uint8).pin_memory())
            _events.append(None)
    return _buffers, _events


def _chunks(numel: int, element_size: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_BYTES // element_size)
    return [(low, min(numel, low + step)) for low in range(0, numel, step)]


def to_host(source: Any, target: Any) -> None:
    """Copy the flat tensor ``source`` (any device) into the flat host tensor ``target``."""
    import torch

    if source.device.type != "cuda":
        target.copy_(source)
        return
    with _lock, torch.cuda.device(source.device):
        buffers, events = _staging()
        waiting: tuple[int, int, int] | None = None  # a chunk on its way into a buffer
        for turn, (low, high) in enumerate(_chunks(source.numel(), source.element_size())):
            slot = turn % 2
            if events[slot] is not None:
                events[slot].synchronize()  # nothing else is still using the buffer
            stage = buffers[slot].view(source.dtype)[: high - low]
            stage.copy_(source[low:high], non_blocking=True)
            events[slot] = torch.cuda.Event()
            events[slot].record()
            if waiting is not None:
                _land(waiting, buffers, events, source.dtype, target)
            waiting = (slot, low, high)
        if waiting is not None:
            _land(waiting, buffers, events, source.dtype, target)


def _land(chunk: tuple[int, int, int], buffers: list, events: list, dtype: Any, target: Any) -> None:
    slot, low, high = chunk
    events[slot].synchronize()
    _host_copy(target[low:high], buffers[slot].view(dtype)[: high - low])


def to_device(source: Any, device: Any) -> Any:
    """A new tensor on ``device`` with the values of the flat host tensor ``source``.

    Returns before the last transfer has landed; it is ordered on the current
    stream, as any copy is, so whatever reads the tensor sees it whole.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return source.to(device, copy=True)
    target = torch.empty(source.numel(), dtype=source.dtype, device=device)
    with _lock, torch.cuda.device(device):
        buffers, events = _staging()
        for turn, (low, high) in enumerate(_chunks(source.numel(), source.element_size())):
            slot = turn % 2
            if events[slot] is not None:
                events[slot].synchronize()  # its last transfer has left the buffer
            stage = buffers[slot].view(source.dtype)[: high - low]
            _host_copy(stage, source[low:high])
            target[low:high].copy_(stage, non_blocking=True)
            events[slot] = torch.cuda.Event()
            events[slot].record()
    return target
