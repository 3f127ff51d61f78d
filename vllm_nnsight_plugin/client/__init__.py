"""The client: builds blocks with nnsight's tracer and sends them (``model.py``).

Importing nnsight puts ``.save`` on every object, and anyio refuses to define a
class whose public attributes lack type annotations, which from then on every
class has. anyio defines most of its classes on first use (an async ``httpx``
or ``openai`` client's first request), so a program that imported this client
would fail there. They are defined here, before the client imports nnsight.
"""

from __future__ import annotations


def _define_anyio_first() -> None:
    try:
        import anyio._backends._asyncio  # noqa: F401
        import anyio.abc
    except Exception:  # not installed, or nnsight was imported first: nothing to do here
        return
    for name in getattr(anyio.abc, "__all__", ()):
        getattr(anyio.abc, name, None)


_define_anyio_first()
