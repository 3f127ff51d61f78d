"""Folders only this process's user can change.

Two things the plugin writes are trusted later: an operation tap's rewritten
forward, which nnsight reads back as source and runs, and a server's record of
spent nonces, where a file that goes missing lets a replay through. Another
local user who can change either folder could run code as the server or replay
a block. So every use opens the folder fresh and checks it: each folder from the
given root down must be a real folder (not a symbolic link), belong to the
effective user and be writable by no one else, or :class:`UnsafeFolderError`.
The checks are made on open descriptors, and files are made relative to them,
so a folder renamed or swapped after its check is never the one written into.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from .errors import PluginError

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeFolderError(PluginError, PermissionError):
    """A folder the plugin trusts could be changed by another user."""


def _checked(descriptor: int, shown: str) -> None:
    found = os.fstat(descriptor)
    if not stat.S_ISDIR(found.st_mode):
        raise UnsafeFolderError(f"{shown} is not a folder")
    if found.st_uid != os.geteuid():
        raise UnsafeFolderError(f"{shown} belongs to another user (uid {found.st_uid})")
    if found.st_mode & 0o022:
        raise UnsafeFolderError(
            f"{shown} can be written by other users (mode {stat.S_IMODE(found.st_mode):o}; "
            f"`chmod go-w {shown}` makes it private)"
        )


def _opened(name: str, parent: int | None, shown: str) -> int:
    """The folder ``name`` (relative to ``parent``), made 0700 if missing."""
    for _ in range(2):
        try:
            return os.open(name, _FOLDER, dir_fd=parent)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):  # made meanwhile: open what is there
                os.mkdir(name, 0o700, dir_fd=parent)
        except OSError as error:
            if error.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafeFolderError(f"{shown} is a symbolic link or not a folder") from None
            raise
    return os.open(name, _FOLDER, dir_fd=parent)


@contextlib.contextmanager
def private_folder(root: str | os.PathLike, *below: str) -> Iterator[int]:
    """An open descriptor of ``root/below...``, each of those folders checked
    (and made, 0700, where missing). The path up to ``root`` is the user's own
    choice and is only made where missing."""
    root = os.path.abspath(os.fspath(root))
    os.makedirs(os.path.dirname(root), exist_ok=True)
    descriptor = _opened(root, None, root)
    try:
        _checked(descriptor, root)
        shown = root
        for name in below:
            shown = os.path.join(shown, name)
            inner = _opened(name, descriptor, shown)
            os.close(descriptor)
            descriptor = inner
            _checked(descriptor, shown)
        yield descriptor
    finally:
        os.close(descriptor)


def read_own(folder: int, name: str) -> bytes | None:
    """The bytes of this user's regular file ``name`` in ``folder`` (None: no such file,
    a link, or someone else's)."""
    try:
        handle = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return None
    with os.fdopen(handle, "rb") as file:
        found = os.fstat(file.fileno())
        if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
            return None
        return file.read()


def write_own(folder: int, name: str, data: bytes) -> None:
    """Put ``data`` in ``folder/name`` whole (a new file, mode 0600, renamed over the old)."""
    scratch = f".{name}.{os.getpid()}.{os.urandom(6).hex()}.tmp"
    handle = os.open(
        scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder
    )
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(scratch, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(scratch, dir_fd=folder)
        raise
