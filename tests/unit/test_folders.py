"""Nothing another local user writes runs in the worker or lets a replay through:
the folders the plugin trusts (an operation tap's forwards, the shared nonces)
are checked on every use, and nnsight reads a tap's forward from the text the
plugin wrote, not from the disk. The other user is a real second uid."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from vllm_nnsight_plugin.folders import UnsafeFolderError, private_folder
from vllm_nnsight_plugin.taps.source import rewritten_forward
from vllm_nnsight_plugin.wire.trust import NonceBook, UntrustedBlockError

OTHER = 4242  # another local user


def as_other(*command: str) -> subprocess.CompletedProcess:
    """Run ``command`` as the other user (this suite runs as root, as CI does)."""
    assert os.geteuid() == 0, "the tests of a second local user need root to become one"
    return subprocess.run(
        ["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )


class Tapped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.proj(x)
        return torch.relu(h) * 2


class Through:
    """A tap that passes the value on (an object, as the real one is: nnsight takes a
    plain function in a forward's closure for a decorator's wrapped function)."""

    def __call__(self, module, name, value):
        return value


THROUGH = Through()


def evil_copy(path: str, canary: Path) -> str:
    """The forward's text with a first line that writes the canary: what an attacker swaps in."""
    lines = Path(path).read_text().splitlines(True)
    body = lines[2]  # the first line of the forward's body
    indent = body[: len(body) - len(body.lstrip())]
    lines.insert(2, f"{indent}open({str(canary)!r}, 'w').write(str(__import__('os').getuid()))\n")
    return "".join(lines)


def nnsight_runs(forward) -> torch.Tensor:
    """What nnsight does with a forward a ``.source`` read reaches: read its source
    back, instrument it, compile it and call it."""
    from nnsight.intervention.source import FORWARD_CACHE, instrument

    FORWARD_CACHE.pop(forward.__code__, None)
    instrumented, compiled = instrument(forward, lambda name, fn, *args, **kwargs: fn(*args, **kwargs))
    assert "nnsight_tap" in compiled.source and "open(" not in compiled.source
    return instrumented(Tapped(), torch.randn(2, 4))


@pytest.fixture
def tmp_path():
    """A folder in ``/tmp`` that the other user can reach (pytest's own are private to root)."""
    import shutil
    import tempfile

    made = Path(tempfile.mkdtemp(prefix="vllm-nnsight-folders-"))
    os.chmod(made, 0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("VLLM_NNSIGHT_CACHE", str(root))
    return root


def test_a_cache_folder_another_user_owns_is_not_used_and_their_swap_runs_nothing(cache, tmp_path):
    """The review's attack: the other user makes ``taps`` (mode 777) before the
    server writes there, then swaps the written forward for their own."""
    canary = tmp_path / "canary"
    os.chmod(tmp_path, 0o1777)  # a home like /tmp: everyone may make folders in it
    made = as_other("sh", "-c", f"mkdir -p {cache}/taps && chmod 777 {cache} {cache}/taps")
    assert made.returncode == 0, made.stderr
    forward = rewritten_forward(Tapped, frozenset({"self_proj_0"}), THROUGH)
    written = forward.__code__.co_filename
    assert not written.startswith(str(cache))  # a folder of the server's own instead
    assert os.stat(Path(written).parent).st_uid == 0 and os.stat(Path(written).parent).st_mode & 0o077 == 0
    assert forward(Tapped(), torch.randn(2, 4)).shape == (2, 4)
    taps = cache / "taps"
    evil = tmp_path / "evil.py"
    evil.write_text(evil_copy(written, canary))
    os.chmod(evil, 0o644)
    for target in (taps / Path(written).name, Path(written)):  # where it would have gone, and where it went
        as_other("sh", "-c", f"cp {evil} {target}.x && mv -f {target}.x {target}")
    assert Path(written).read_text() != evil.read_text()  # the server's folder: they cannot write there
    nnsight_runs(forward)
    assert not canary.exists()


@pytest.mark.parametrize("whose", ["root", "taps"])
def test_every_folder_from_the_cache_root_down_must_be_the_servers_own(cache, whose):
    (cache / "taps").mkdir(parents=True, mode=0o700)
    os.chmod(cache, 0o700)
    os.chown(cache if whose == "root" else cache / "taps", OTHER, OTHER)
    forward = rewritten_forward(Tapped, frozenset({"self_proj_0"}), THROUGH)
    assert not forward.__code__.co_filename.startswith(str(cache))
    with pytest.raises(UnsafeFolderError, match="belongs to another user"):
        with private_folder(cache, "taps"):
            pass


def test_a_link_or_a_folder_others_can_write_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UnsafeFolderError, match="symbolic link"):
        with private_folder(tmp_path / "link"):
            pass
    os.chmod(real, 0o770)
    with pytest.raises(UnsafeFolderError, match="can be written by other users"):
        with private_folder(real):
            pass
    os.chmod(real, 0o755)
    with private_folder(real, "made") as folder:
        assert os.fstat(folder).st_mode & 0o777 == 0o700


def test_nnsight_reads_the_text_the_plugin_wrote_not_the_disk(cache, tmp_path):
    """Whoever changes the file afterwards (here the server's own user, the only
    one who can), nnsight compiles the forward as written: the text is held in
    ``linecache`` with no modification time, which it never checks against the disk."""
    canary = tmp_path / "canary"
    forward = rewritten_forward(Tapped, frozenset({"self_proj_0"}), THROUGH)
    written = Path(forward.__code__.co_filename)
    assert written.parent == cache / "taps"
    swapped = evil_copy(str(written), canary)
    written.write_text(swapped)
    later = time.time() + 60
    os.utime(written, (later, later))
    nnsight_runs(forward)
    assert not canary.exists()


def test_the_nonce_folder_is_checked_on_every_use(tmp_path, monkeypatch):
    """Not once per process: a folder that later turns another user's, or open to
    others, or a link, refuses the next claim (a replay could otherwise go through)."""
    import vllm_nnsight_plugin.wire.trust as trust

    directory = tmp_path / "nonces"
    monkeypatch.setenv(trust.NONCE_DIR_ENV, str(directory))
    assert NonceBook().claim("one", time.time() + 60, time.time())
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    os.chmod(directory, 0o777)
    with pytest.raises(UntrustedBlockError, match="not its own.*can be written by other users"):
        NonceBook().claim("two", time.time() + 60, time.time())
    os.chmod(directory, 0o700)
    os.chown(directory, OTHER, OTHER)
    with pytest.raises(UntrustedBlockError, match="not its own.*belongs to another user"):
        NonceBook().claim("three", time.time() + 60, time.time())
    os.chown(directory, 0, 0)
    assert NonceBook().claim("four", time.time() + 60, time.time())
    # The other user swaps the folder for a link to one of theirs: refused, and nothing written there.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER, OTHER)
    directory.rename(tmp_path / "moved")
    directory.symlink_to(theirs)
    with pytest.raises(UntrustedBlockError, match="not its own.*symbolic link"):
        NonceBook().claim("five", time.time() + 60, time.time())
    assert list(theirs.iterdir()) == []


def test_a_nonce_folder_that_goes_is_made_again(tmp_path, monkeypatch):
    import shutil

    import vllm_nnsight_plugin.wire.trust as trust

    directory = tmp_path / "nonces"
    monkeypatch.setenv(trust.NONCE_DIR_ENV, str(directory))
    assert NonceBook().claim("one", time.time() + 60, time.time())
    shutil.rmtree(directory)
    assert NonceBook().claim("two", time.time() + 60, time.time())
    assert [p.name for p in directory.iterdir()] == [trust.hashlib.sha256(b"two").hexdigest()[:40]]
