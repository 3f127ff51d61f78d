"""The workers' RPC methods the front end calls (``worker/extension.py`` defines
them; vLLM's ``collective_rpc`` carries the call): their names, once."""

from __future__ import annotations

#: Wind up finished requests and return what their blocks kept (``returns/outputs``).
COLLECT = "nnsight_collect"
#: Install or clear an edit on every worker (``edits.py``).
EDIT_INSTALL = "nnsight_edit_install"
EDIT_CLEAR = "nnsight_edit_clear"
#: The model's module tree, for a client without vLLM (``server/tree.py``).
TREE = "nnsight_tree"
#: The counts users and benchmarks read (``nnsight_stats`` in the docs).
STATS = "nnsight_stats"

CALLED = (COLLECT, EDIT_INSTALL, EDIT_CLEAR, TREE, STATS)
