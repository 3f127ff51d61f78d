"""A served model's module tree and tokenizer, as JSON for a client with no vLLM.

A client that traces against a server only needs the tree to write blocks
against (names, nesting, what prints) and the tokenizer to read tokens; the
forward runs in the server's workers. With vLLM installed the client builds the
tree itself on meta; without it, the server describes the tree its workers
really hold (:func:`describe`, read by ``GET /v1/nnsight/model``) and the
client rebuilds a stand-in of it (:func:`rebuild`): one ``nn.Module`` per
module, each of a class with the server's class name and printed the way the
server's prints, holding its parameters on meta. Module paths are the worker's
own, so every envoy a block names resolves there (``wire/references.py``).

Pure functions of their inputs: no vLLM, no network.
"""

from __future__ import annotations

import base64
import json
import os
import re
import tempfile
from typing import Any

import torch

from ..errors import PluginError

#: The description's format; a client refuses one it does not know.
TREE_VERSION = 1
#: Tokenizer files travel whole; anything larger is left out (the client then has none).
MAX_TOKENIZER_BYTES = 64 * 1024 * 1024
_MAX_REPR_CHARS = 2000


class TreeError(PluginError, ValueError):
    """A server's tree description this client cannot use."""


def describe(module: torch.nn.Module) -> list[dict]:
    """Every module of ``module`` (itself first) with its class, how it prints,
    and the shape and dtype of its own parameters. A module held at several paths
    (vLLM shares one rotary embedding between every layer's attention) is
    described at its first and named as ``same`` at the others, so the client's
    tree shares it too, as the workers' does: nnsight lists a shared module at its
    first path only, and a block can name no other."""
    entries: list[dict] = []
    first: dict[int, str] = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        if id(sub) in first:
            entries.append({"path": path, "same": first[id(sub)]})
            continue
        first[id(sub)] = path
        try:
            shown = sub.extra_repr()
        except Exception:  # a module whose extra_repr needs state it does not have
            shown = ""
        entries.append(
            {
                "path": path,
                "class": type(sub).__name__,
                "module": type(sub).__module__,
                "repr": shown[:_MAX_REPR_CHARS],
                "params": {
                    name: [list(param.shape), str(param.dtype).removeprefix("torch.")]
                    for name, param in sub.named_parameters(recurse=False)
                },
            }
        )
    return entries


class _Served(torch.nn.Module):
    """A module of a served model, on meta: it has the server's names and shapes
    and no forward (the server's workers run the real one)."""

    def extra_repr(self) -> str:
        return self.__dict__.get("_served_repr", "")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{type(self).__name__} is a served model's module: its forward runs on the "
            "server, inside a trace."
        )


#: torch's own containers stay themselves (indexing, printing): they hold, never compute.
_CONTAINERS = {
    "ModuleList": torch.nn.ModuleList,
    "ModuleDict": torch.nn.ModuleDict,
    "Sequential": torch.nn.Sequential,
}


def rebuild(entries: list[dict]) -> torch.nn.Module:
    """The tree :func:`describe` described, as stand-in modules on meta."""
    if not isinstance(entries, list) or not entries or not isinstance(entries[0], dict):
        raise TreeError("the server sent no module tree")
    classes: dict[tuple[str, str], type] = {}
    built: dict[str, torch.nn.Module] = {}
    for entry in entries:
        if isinstance(entry, dict) and "same" in entry:
            path, same = str(entry.get("path", "")), str(entry["same"])
            if not same or path.startswith(same + "."):  # a module inside itself: a tree without end
                raise TreeError(f"the server's module tree puts {same!r} inside itself")
            _attach(built, path, built.get(same), shared=True)
            continue
        try:
            path, name, where = str(entry["path"]), str(entry["class"]), str(entry["module"])
            params = dict(entry.get("params") or {})
        except (KeyError, TypeError, ValueError):
            raise TreeError("the server's module tree is malformed") from None
        if not name.isidentifier():
            raise TreeError(f"the server's module tree names a class {name[:80]!r}")
        cls = _CONTAINERS.get(name) if where == "torch.nn.modules.container" else None
        cls = cls or classes.get((where, name))
        if cls is None:
            cls = classes[(where, name)] = type(name, (_Served,), {"__module__": where, "__qualname__": name})
        module = cls()
        if isinstance(module, _Served):
            module.__dict__["_served_repr"] = str(entry.get("repr") or "")
        for param_name, spec in params.items():
            try:
                shape, dtype = spec
                tensor = torch.empty(tuple(int(n) for n in shape), dtype=_dtype(dtype), device="meta")
                module.register_parameter(str(param_name), torch.nn.Parameter(tensor, requires_grad=False))
            except (TypeError, ValueError, KeyError, RuntimeError) as error:
                if isinstance(error, TreeError):
                    raise
                raise TreeError(f"the server's module tree has a malformed parameter at {path!r}") from None
        _attach(built, path, module)
    if "" not in built:
        raise TreeError("the server's module tree has no root")
    return built[""]


def _attach(
    built: dict[str, torch.nn.Module], path: str, module: torch.nn.Module | None, shared: bool = False
) -> None:
    """Put ``module`` at ``path`` under its parent (a shared one: again, where it
    is held a second time)."""
    if module is None:
        raise TreeError(f"the server's module tree shares {path!r} with a module it has not listed")
    if path in built:
        raise TreeError(f"the server's module tree lists {path!r} twice")
    if path:
        parent, _, child = path.rpartition(".")
        if parent not in built:
            raise TreeError(f"the server's module tree lists {path!r} before its parent")
        built[parent].add_module(child, module)
    elif built or shared:
        raise TreeError("the server's module tree has two roots")
    built[path] = module


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise TreeError(f"the server's module tree names a dtype {str(name)[:40]!r}")
    return dtype


# ---------------------------------------------------------------------- tokenizer
def tokenizer_files(tokenizer: Any) -> dict[str, str]:
    """A Hugging Face tokenizer's files (name -> base64), as ``save_pretrained``
    writes them; empty when it cannot be saved or is too large to send."""
    if not hasattr(tokenizer, "save_pretrained"):
        return {}
    with tempfile.TemporaryDirectory() as folder:
        try:
            tokenizer.save_pretrained(folder)
        except Exception:
            return {}
        files, total = {}, 0
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if not os.path.isfile(path) or not tokenizer_file(name):  # the only files a client takes
                continue
            with open(path, "rb") as handle:
                data = handle.read()
            total += len(data)
            if total > MAX_TOKENIZER_BYTES:
                return {}
            files[name] = base64.b64encode(data).decode("ascii")
    _name_the_class(files, tokenizer)
    return files


def _name_the_class(files: dict[str, str], tokenizer: Any) -> None:
    """vLLM hands out its tokenizer as a subclass made at run time (``Cached...``),
    a class ``AutoTokenizer`` cannot find: name the transformers class it wraps."""
    config = files.get("tokenizer_config.json")
    if config is None:
        return
    known = next(
        (k.__name__ for k in type(tokenizer).__mro__ if k.__module__.startswith("transformers.")), None
    )
    if known is None:
        return
    document = json.loads(base64.b64decode(config))
    document["tokenizer_class"] = known
    files["tokenizer_config.json"] = base64.b64encode(json.dumps(document).encode("utf-8")).decode("ascii")


def load_tokenizer(files: dict[str, str]) -> Any:
    """The tokenizer :func:`tokenizer_files` sent (None if it sent none).

    The files come from a server (or from whoever sits between it and here on
    plain HTTP), so they are data only: a file that is not one a tokenizer is
    saved as, or an ``auto_map`` (transformers' way of naming Python to run from
    the tokenizer's folder) anywhere in one, refuses the whole tokenizer, and
    transformers is told to run no code from the folder and fetch nothing."""
    if not files:
        return None
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as folder:
        for name, data in files.items():
            if not tokenizer_file(name):
                raise TreeError(
                    f"the server sent a tokenizer file named {str(name)[:80]!r}, which is not one a "
                    "tokenizer is saved as; the client takes tokenizer files only"
                )
            content = base64.b64decode(data)
            if name.endswith(".json"):
                _refuse_code(name, content)
            with open(os.path.join(folder, name), "wb") as handle:
                handle.write(content)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


#: The files a Hugging Face tokenizer is saved as (and ``*.model``: SentencePiece).
_TOKENIZER_FILES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    }
)


def tokenizer_file(name: object) -> bool:
    """Whether ``name`` is one a tokenizer's file is saved as (and nothing else: no path)."""
    if not isinstance(name, str) or os.path.basename(name) != name or name.startswith("."):
        return False
    return name in _TOKENIZER_FILES or re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*\.model", name) is not None


def _refuse_code(name: str, content: bytes) -> None:
    try:
        document = json.loads(content)
    except (ValueError, RecursionError):
        raise TreeError(f"the server's tokenizer file {name} is not JSON") from None
    stack = [document]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "auto_map" in item:
                raise TreeError(
                    f"the server's tokenizer file {name} names code to run (auto_map); the client "
                    "runs no code a server sends, so it takes no such tokenizer"
                )
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
