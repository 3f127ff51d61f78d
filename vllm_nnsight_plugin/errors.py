"""The root of the plugin's errors.

Every error the plugin raises on purpose, in the client, the front end or a
worker, is a :class:`PluginError` and keeps the built-in base it had (``except
ValueError`` still catches an envelope refused as malformed). In the process that
raises it, ``except vllm_nnsight_plugin.PluginError`` tells the plugin's refusals
and limits from everything else; an error a worker ends a request with reaches
the client as nnsight raises a block's error there (its type's name, message and
traceback). Imports nothing, so every process can load it.
"""

from __future__ import annotations


class PluginError(Exception):
    """An error of the plugin's own: a request refused, a limit reached, a setting
    or a version it cannot use. A block's own exception is raised as it was."""
