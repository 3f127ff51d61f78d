"""The worker extension's name, and how a user's own extension is composed with it:
vLLM takes one ``worker_extension_cls``, so a user's class and the plugin's are
joined under a name that encodes the user's class."""

from __future__ import annotations

#: Qualified name of the worker extension (see ``worker/extension.py``).
EXTENSION = "vllm_nnsight_plugin.worker.extension.NNsightWorkerExtension"

#: The module vLLM resolves the configured extension class through; its
#: ``__getattr__`` answers composed names.
_EXTENSION_MODULE = EXTENSION.rsplit(".", 1)[0]
#: A composed extension's class name is this prefix and the user class's
#: qualified name, UTF-8, in hex.
COMPOSED_PREFIX = "With_"


def composed_name(user_qualname: str) -> str:
    """The qualified name that resolves to ``user class + NNsightWorkerExtension``."""
    return f"{_EXTENSION_MODULE}.{COMPOSED_PREFIX}{user_qualname.encode('utf-8').hex()}"


def composed_user(class_name: str) -> str | None:
    """The user class's qualified name in a composed class name; ``None`` if it is not one."""
    if not class_name.startswith(COMPOSED_PREFIX):
        return None
    return bytes.fromhex(class_name[len(COMPOSED_PREFIX) :]).decode("utf-8")


def extension_for(current: str | None) -> str:
    """The ``worker_extension_cls`` to configure, given the one already set."""
    if not current or current == EXTENSION:
        return EXTENSION
    if current.startswith(f"{_EXTENSION_MODULE}.{COMPOSED_PREFIX}"):
        return current
    return composed_name(current)
