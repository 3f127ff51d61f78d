"""Every environment variable the plugin reads or sets, by name.

They share vLLM's ``VLLM_`` prefix, and vLLM checks each ``VLLM_*`` variable it
finds against its own list when it builds an engine: an unknown one is a
warning in every process, or, with ``--fail-on-environ-validation``, a refusal
to start. :func:`known_to_vllm` adds these names to that list, each reading as
None there, so vLLM neither warns about them nor fails on them, and they cannot
change vLLM's compile-cache key (the names are always the same, the values are
not read). ``docs/security.md`` says what each one does.
"""

from __future__ import annotations

ENVIRONMENT: tuple[str, ...] = (
    "VLLM_NNSIGHT_KEY",
    "VLLM_NNSIGHT_KEY_FILE",
    "VLLM_NNSIGHT_LOCAL_KEY",
    "VLLM_NNSIGHT_MAX_TTL_S",
    "VLLM_NNSIGHT_MAX_PAYLOAD_BYTES",
    "VLLM_NNSIGHT_MAX_SAVE_BYTES",
    "VLLM_NNSIGHT_UNCOLLECTED_S",
    "VLLM_NNSIGHT_DISABLE",
    "VLLM_NNSIGHT_SWITCHED_OFF",
    "VLLM_NNSIGHT_TAPS",
    "VLLM_NNSIGHT_EAGER_STEPS",
    "VLLM_NNSIGHT_KEPT_BYTES",
    "VLLM_NNSIGHT_SHARED_SAVES_BYTES",
    "VLLM_NNSIGHT_LEND_SAVES",
    "VLLM_NNSIGHT_TRUST_SERVER",
    "VLLM_NNSIGHT_CACHE",
    "VLLM_NNSIGHT_SMOLLM2_GGUF",
    "VLLM_NNSIGHT_MEMORY",
)


def _unread() -> None:
    return None


def known_to_vllm() -> None:
    """Add :data:`ENVIRONMENT` to vLLM's list of its own variables (see the module
    docstring); a vLLM without that list is left alone."""
    try:
        import vllm.envs as envs
    except ImportError:
        return
    known = getattr(envs, "environment_variables", None)
    if isinstance(known, dict):
        for name in ENVIRONMENT:
            known.setdefault(name, _unread)
