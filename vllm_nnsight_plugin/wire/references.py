"""The module tree travels as references, not copies.

nnsight pickles a block with every envoy it can reach, and each envoy with its
children: a block that names one layer carries the whole tree, some 4,000
objects for a 30-layer model, once per request. Both ends already hold the same
tree (the client's on the meta device, the worker's over the live model), so
each envoy is sent as a persistent id naming its path, and the worker resolves
it to its own envoy at that path. nnsight's pickler references any object with a
``_persistent_id`` in its ``__dict__``; the worker's unpickler looks ids up in
the map it is given and refuses any other.

A trace's blocks are pickled by the plugin's own pickler (``client/_nnsight.py``),
which asks :func:`reference_of` instead: inside :func:`envoys_as_references` the
model's envoys are references without a tag being put on (and taken off) each of
them, which cost a one-token trace more than its pickle. :func:`envoys_by_reference`
tags them for nnsight's own pickler (an installed edit's block).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

_PREFIX = "Envoy:"
_TAG = "_persistent_id"


def envoy_id(path: str) -> str:
    return _PREFIX + path


_TREE = "_vllm_nnsight_references"


def _references(model: Any) -> dict[int, tuple[Any, str]]:
    """Every envoy of ``model`` with its id, by the envoy's ``id()``: walked once per
    model and kept on it (walking the tree costs more than a small trace; the
    envoys are held, so no id is another object's while it is kept). An envoy
    added to the tree later is not listed: it travels as a copy, as nnsight
    would send it."""
    found = model.__dict__.get(_TREE)
    if found is None:
        found = model.__dict__[_TREE] = {id(e): (e, envoy_id(e.path)) for e in model.modules()}
    return found


#: The envoys the plugin's pickler sends as references in this context.
_AS_REFERENCES: contextvars.ContextVar[dict[int, tuple[Any, str]] | None] = contextvars.ContextVar(
    "vllm_nnsight_references", default=None
)


@contextlib.contextmanager
def envoys_as_references(model: Any) -> Iterator[None]:
    """While the plugin's pickler runs in this context, every envoy of ``model`` is
    a reference (:func:`reference_of`). No envoy is touched, so another thread's
    pickling, or another pickler, sees them as they are."""
    token = _AS_REFERENCES.set(_references(model))
    try:
        yield
    finally:
        _AS_REFERENCES.reset(token)


def _reference_in(found: dict[int, tuple[Any, str]], obj: Any) -> str | None:
    """``obj``'s id in a model's :func:`_references`, if it is that very envoy."""
    kept = found.get(id(obj))
    return kept[1] if kept is not None and kept[0] is obj else None


def envoy_of(model: Any, obj: Any) -> bool:
    """Whether ``obj`` is one of ``model``'s envoys (held by the model for its life)."""
    return _reference_in(_references(model), obj) is not None


def reference_of(obj: Any) -> str | None:
    """The id ``obj`` travels as, if it is an envoy of the model of the current
    :func:`envoys_as_references`; else None."""
    found = _AS_REFERENCES.get()
    return None if found is None else _reference_in(found, obj)


#: Per model: how many threads are serializing blocks against it now, and the
#: envoys tagged for them. The tags live on the shared envoys, so they go on with
#: the first and come off with the last: one thread's untagging must not turn
#: another's references into copies halfway through its pickling.
_USERS: dict[int, tuple[int, list]] = {}
_USERS_LOCK = threading.Lock()


@contextlib.contextmanager
def envoys_by_reference(model: Any) -> Iterator[None]:
    """While blocks are serialized, make every envoy of ``model`` a reference."""
    key = id(model)
    with _USERS_LOCK:
        users, tagged = _USERS.get(key, (0, []))
        if not users:
            for envoy, reference in _references(model).values():
                if _TAG not in envoy.__dict__:
                    envoy.__dict__[_TAG] = reference
                    tagged.append(envoy)
        _USERS[key] = (users + 1, tagged)
    try:
        yield
    finally:
        with _USERS_LOCK:
            users, tagged = _USERS.pop(key)
            if users > 1:
                _USERS[key] = (users - 1, tagged)
            else:
                for envoy in tagged:
                    envoy.__dict__.pop(_TAG, None)


def envoy_references(model: Any) -> dict[str, Any]:
    """The worker's side: each id resolves to the worker's own envoy."""
    return {envoy_id(envoy.path): envoy for envoy in model.modules()}
