"""Large pools of saves travel through shared memory, not through pickled bytes.

A capture of a thousand requests keeps gigabytes. Pickled, each byte is copied
several times on its way home: serialised in the worker, carried as a message,
deserialised in the front end. The worker and the front end run on one host, so a
flat tensor of a pool over ``VLLM_NNSIGHT_SHARED_SAVES_BYTES`` (default 16 MiB; 0
turns this off) is instead copied once into a file in ``/dev/shm`` and the front
end maps it. Space is reserved before anything is written (a full ``/dev/shm``
makes the pool travel pickled, as before), the front end removes each file as it
maps it, and the worker removes any it wrote that nobody opened within two
minutes.

Both ends copy to and from a GPU through pinned buffers (``staging.py``).

Mapping with ``MAP_POPULATE`` was measured and is slower: the kernel maps a
fresh file's pages one thread at a time, where the copies fault them in from
several.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

from ..settings import SHARED_SAVES_BYTES, value
from .staging import to_host

MIN_BYTES_ENV = SHARED_SAVES_BYTES
DEFAULT_MIN_BYTES = 16 << 20
DIRECTORY = "/dev/shm"
PREFIX = "vllm-nnsight-saves-"
UNREAD_S = 120.0

_written: list[tuple[float, str]] = []


def _host() -> str:
    """This machine, as the front end can check it: host name and boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class SharedFlat:
    """A pool's flat tensor, left in a shared-memory file for the front end."""

    path: str
    dtype: Any
    numel: int
    device: str
    host: str


def min_bytes() -> int:
    return int(value(MIN_BYTES_ENV))


def large(flat: Any) -> bool:
    """Whether ``flat`` is worth sending other than pickled (lent or shared)."""
    threshold = min_bytes()
    return 0 < threshold <= flat.numel() * flat.element_size()


def share(flat: Any) -> SharedFlat | None:
    """Copy ``flat`` into a new shared-memory file; None when it stays as it is."""
    if not large(flat) or not os.path.isdir(DIRECTORY):
        return None
    size = flat.numel() * flat.element_size()
    _sweep()
    path = _write(flat, size)
    if path is None:
        return None
    _written.append((time.monotonic(), path))
    return SharedFlat(path, flat.dtype, flat.numel(), str(flat.device), _host())


def _write(flat: Any, size: int) -> str | None:
    """A new file holding ``flat``; None when no room could be reserved for it."""
    import torch

    path = os.path.join(DIRECTORY, PREFIX + secrets.token_hex(12))
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC here, not a fault while writing
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    target = None
    try:
        target = torch.frombuffer(mapping, dtype=flat.dtype, count=flat.numel())
        to_host(flat.reshape(-1), target)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        del target  # before the mapping closes
        mapping.close()
        os.close(fd)
    return path


def opened(shared: SharedFlat) -> Any:
    """The flat tensor, mapped from its file (on the host), and the file removed."""
    import torch

    if shared.host != _host():
        raise RuntimeError(
            "these saves were left in shared memory on another machine "
            f"({shared.host}); set {MIN_BYTES_ENV}=0 on the engine so they travel pickled."
        )
    try:
        fd = os.open(shared.path, os.O_RDONLY)
    except FileNotFoundError:
        raise RuntimeError(
            "these saves were removed from shared memory before they were read (the "
            f"engine removes them after {UNREAD_S:.0f} s)."
        ) from None
    try:
        size = shared.numel * shared.dtype.itemsize
        # Private and writable (never written): a tensor over a read-only buffer warns.
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
        return torch.frombuffer(mapping, dtype=shared.dtype, count=shared.numel)  # holds the mapping
    finally:
        os.close(fd)
        discard(shared)


def discard(shared: SharedFlat) -> None:
    try:
        os.unlink(shared.path)
    except FileNotFoundError:
        pass


def _sweep() -> None:
    """Remove files this worker wrote that nobody opened in time."""
    now = time.monotonic()
    while _written and now - _written[0][0] > UNREAD_S:
        _, path = _written.pop(0)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
