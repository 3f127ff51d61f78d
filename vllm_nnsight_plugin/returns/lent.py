"""Large pools on a GPU go home as a CUDA IPC handle: they never leave the device.

The front end shares a host, and a GPU, with the engine's worker (vLLM's engine
core is a child process of it), so the flat tensor of a collect's pool can stay
where it was made: the worker hands over torch's IPC handle for it, and the
front end opens it and copies each request's part into storage of its own, one
device-to-device copy each. Through host memory (``shared.py``) a 1.3 GB capture
paid a copy down, a copy back and the kernel's page work for a new file: about
half a second of a six-second job on an H200. ``VLLM_NNSIGHT_LEND_SAVES=0``
turns this off (pools then go through shared memory, as on a CPU engine).

Lifetime: torch counts the front end's references in shared memory. The worker
drops its own as soon as the pool is sent; torch frees the memory once the front
end's last view of it is gone (``torch.cuda.ipc_collect``, at the worker's next
lend). The front end opens every lent tensor of a reply it reads, and lets go of
it once the requests have their copies (``Pool.close``). A front end that never
reads a reply (it died) leaves that pool allocated until the worker exits.

Only a worker whose front end is another process lends (in one process there is
no handle to open), and only the first tensor-parallel rank, whose reply is the
one the front end keeps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..settings import LEND_SAVES, value

_counts = {"pools_lent": 0, "bytes_lent": 0}


@dataclass(frozen=True)
class LentFlat:
    """A pool's flat tensor, left on its GPU for the front end to open."""

    rebuild: tuple  # torch's IPC description of it (``reduce_tensor``'s arguments)
    device: str
    pid: int  # the process that lent it


def enabled() -> bool:
    return bool(value(LEND_SAVES))


def lend(flat: Any) -> LentFlat | None:
    """``flat``'s IPC handle, or None when it cannot be lent (it then goes by shared memory)."""
    if not enabled() or flat.device.type != "cuda":
        return None
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    if _counts["pools_lent"]:
        torch.cuda.ipc_collect()  # free what the front end has let go of since
    try:
        rebuild, arguments = reduce_tensor(flat)
    except Exception:  # e.g. an allocator whose memory cannot be shared
        return None
    if getattr(rebuild, "__name__", "") != "rebuild_cuda_tensor":
        return None
    _counts["pools_lent"] += 1
    _counts["bytes_lent"] += flat.numel() * flat.element_size()
    return LentFlat(arguments, str(flat.device), os.getpid())


def stats() -> dict[str, int]:
    """How many flat tensors this process lent, and their bytes (``nnsight_stats``)."""
    return dict(_counts)


def opened(lent: LentFlat) -> Any:
    """The lent tensor, opened from its handle on its device."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if lent.pid == os.getpid():
        raise RuntimeError("a pool lent on the device came back to the process that lent it")
    try:
        return rebuild_cuda_tensor(*lent.rebuild)
    except Exception as error:
        raise RuntimeError(
            f"the engine left these saves on its GPU ({lent.device}) and this process could "
            f"not open them ({error}). Start the engine with {LEND_SAVES}=0 so they travel "
            "through host memory."
        ) from error
