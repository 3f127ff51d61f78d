"""The tap kernel (``taps/ops.py``), run by Triton's interpreter on the CPU, against
the tensor operations it stands for, bit for bit: the checks of
``tests/gpu/test_gpu_kernel.py`` without a GPU, so every change to the kernel's
arithmetic is caught here too. The interpreter is chosen as Triton is imported,
hence a process of its own. No engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")  # the CPU wheel of vLLM brings it

CHECK = r"""
import sys
import torch
from vllm_nnsight_plugin.taps import ops
from tests.gpu.test_gpu_kernel import (
    busy_tables, check_a_value_of_another_width, check_against_the_tensor_operations, check_in_place, patched_rows,
    projected_rows,
)

assert ops._kernel() is not None
dtype = getattr(torch, sys.argv[1])
for width in (576, 100):
    generator = torch.Generator().manual_seed(width)
    rows, sites = 37, 3
    table, bank, how = busy_tables(rows, width, sites, generator, device="cpu")
    for edits in (torch.zeros_like(how), how):  # additions only, then the other edits too
        for site in range(sites):
            hidden = torch.randn((rows, width), generator=generator).to(dtype)
            residual = torch.randn((rows, width), generator=generator).to(dtype)

            def launch(keeps, store, residual):
                return ops.launch(
                    ops._kernel(), hidden, residual, table, bank, edits, store, site, keeps, keeps == 1
                )

            check_against_the_tensor_operations(hidden, residual, table, bank, edits, site, dtype, launch)
            check_in_place(hidden, residual, table, bank, edits, site)
    assert bool(projected_rows(table, how, 0, rows).any()) and bool(patched_rows(table, how, 0, rows).any())
for width in (1536, 100):  # another width than the bank's: an MLP's neurons, a narrower value
    def launch(hidden, table, bank, how, site, keeps, store):
        return ops.launch(ops._kernel(), hidden, hidden, table, bank, how, store, site, keeps)

    check_a_value_of_another_width(width, dtype, "cpu", launch)
print("same")
"""


# Not bfloat16: the interpreter casts float32 to it by truncating where CUDA rounds
# to nearest (the GPU test checks bfloat16 bit for bit).
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_tap_kernel_computes_what_the_tensor_operations_do_in_the_interpreter(dtype):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", CHECK, dtype], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("same"), done.stderr[-3000:]
