"""Engine settings every test engine and test server shares (small, fp32, eager)."""

import contextlib
import os
from collections.abc import Iterator

ENGINE_DEFAULTS = dict(
    dtype="float32",
    max_model_len=512,
    gpu_memory_utilization=0.3,
    kv_cache_memory_bytes=512 * 1024 * 1024,
    max_num_seqs=16,
    enforce_eager=True,
)


@contextlib.contextmanager
def environment(env: dict[str, str] | None) -> Iterator[None]:
    """``env`` set in this process while an engine starts (the processes it spawns
    inherit it), and put back afterwards."""
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
