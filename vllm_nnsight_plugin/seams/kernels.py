"""Worker seam: a Python step on a compiled engine runs the kernels an eager engine runs.

A vLLM ``CustomOp`` (RMSNorm, SiluAndMul, rotary embedding, ...) picks its
implementation once, at construction: under torch.compile ``custom_ops`` is
"none", so every op keeps ``forward_native`` for Inductor to fuse. A step that
bypasses the compiled module (because a block asks for a module location) would
then run those unfused native versions, several kernels each, with no Inductor to
fuse them: on Qwen3-8B that made a one-token trace five times slower than on an
eager engine. For those steps only, each op's dispatch is pointed at the
platform's own kernel (what ``CustomOp.dispatch_forward`` picks for an enabled op)
and, on vLLM releases that route RMSNorm through ``vllm.ir``, the IR ops are given
the priority an engine without Inductor gets. Compiled and graphed steps never
see the switch: it is made after the compiled module has been bypassed and undone
when the forward returns.

Read on vLLM 0.25.1 and 0.32: ``CustomOp.forward`` calls ``self._forward_method``,
set in ``CustomOp.__init__`` (``model_executor/custom_op.py``); ``vllm.ir.op.IrOp``
keeps a ``registry`` and a ``set_priority`` context manager (``ir/op.py``).
``tests/engine/test_seams.py`` checks both.
"""

from __future__ import annotations

import contextlib
from typing import Any

#: The CustomOp attribute its ``forward`` dispatches through.
FORWARD_METHOD = "_forward_method"
#: The IR provider an engine without Inductor puts first where it is supported
#: (``CudaPlatform.get_default_ir_op_priority``: ``["vllm_c", "native"]``).
_IR_PROVIDERS = ("vllm_c",)


def _platform_method(op: Any) -> str:
    """The method ``CustomOp.dispatch_forward`` picks for an enabled op on this platform."""
    from vllm.platforms import current_platform as platform

    if platform.is_rocm():
        return "forward_hip"
    if platform.is_cpu():
        return "forward_cpu"
    if platform.is_tpu():
        return "forward_tpu"
    if platform.is_xpu():
        return "forward_xpu"
    if platform.is_out_of_tree():
        return "forward_oot"
    return "forward_cuda"


def _disabled_by_user(op: Any, custom_ops: list[str]) -> bool:
    """An op the operator switched off (``custom_ops=["-name"]``) stays native."""
    return f"-{getattr(type(op), 'name', '')}" in custom_ops


class EagerKernels:
    """Each CustomOp of one model, with the kernel to switch it to for a Python step."""

    def __init__(self, module: Any, custom_ops: list[str] | None = None) -> None:
        from vllm.model_executor.custom_op import CustomOp

        custom_ops = list(custom_ops or ())
        self.switches: list[tuple[Any, Any, Any]] = []  # (op, compiled-engine method, eager one)
        for op in module.modules():
            if not isinstance(op, CustomOp) or FORWARD_METHOD not in op.__dict__:
                continue
            if _disabled_by_user(op, custom_ops):
                continue
            current = op.__dict__[FORWARD_METHOD]
            eager = getattr(op, _platform_method(op))
            if getattr(current, "__func__", None) is not getattr(eager, "__func__", None):
                self.switches.append((op, current, eager))
        self.ir_priorities = _ir_priorities()
        self._stack: contextlib.ExitStack | None = None

    def __len__(self) -> int:
        return len(self.switches) + len(self.ir_priorities)

    def use(self) -> None:
        """Switch to the eager kernels (idempotent)."""
        if self._stack is not None:
            return
        for op, _, eager in self.switches:
            op.__dict__[FORWARD_METHOD] = eager
        stack = contextlib.ExitStack()
        for ir_op, priority in self.ir_priorities:
            stack.enter_context(ir_op.set_priority(priority))
        self._stack = stack

    def restore(self) -> None:
        """Back to what the compiled engine chose (idempotent)."""
        stack, self._stack = self._stack, None
        if stack is None:
            return
        for op, compiled, _ in self.switches:
            op.__dict__[FORWARD_METHOD] = compiled
        stack.close()

    @property
    def in_use(self) -> bool:
        return self._stack is not None


def _ir_priorities() -> list[tuple[Any, list[str]]]:
    """IR ops whose priority skips a supported fused provider (none before ``vllm.ir``)."""
    try:
        from vllm.ir.op import IrOp
    except ImportError:
        return []
    found = []
    for ir_op in IrOp.registry.values():
        current = ir_op.get_priority()
        fused = [
            p
            for p in _IR_PROVIDERS
            if p in ir_op.impls and getattr(ir_op.impls[p], "supported", False) and p not in current
        ]
        if fused and current:
            found.append((ir_op, fused + [p for p in current if p not in fused]))
    return found


def eager_kernels(module: Any, vllm_config: Any) -> EagerKernels | None:
    """The switch for a compiled engine's Python steps, or None when there is nothing to switch."""
    kernels = EagerKernels(module, getattr(vllm_config.compilation_config, "custom_ops", None))
    return kernels if len(kernels) else None
