"""Triton kernels of a module, jitted on first use: braidtrain imports without triton.

A kernel module (swiglu.py, rmsnorm.py) keeps its kernels as plain functions whose annotations stay
strings (`from __future__ import annotations`) and whose bodies name `tl`; `Kernels(__name__, *fns)`
imports triton when a tensor first asks for them, binds `triton` and `tl` in that module (where the
kernels resolve them) and jits the functions, once. Off CUDA the module runs its torch reference,
unless TRITON_INTERPRET=1 was set before triton's first import (the tests: Triton's interpreter runs
the kernels on CPU tensors).
"""

from __future__ import annotations

import os
import sys
from contextlib import nullcontext

import torch


class Kernels:
    def __init__(self, module: str, *fns):
        self.module, self.fns = module, fns
        self.jitted: tuple | None = None
        self.missing = False  # triton failed to import: stop asking

    def run_on(self, t: torch.Tensor) -> bool:
        """Whether the kernels run for t: a CUDA tensor (or TRITON_INTERPRET=1: any), and triton
        imports (then they are jitted: `self.jitted`, in `fns`' order)."""
        if self.missing or not (t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"):
            return False
        if self.jitted is None:
            try:
                import triton
                import triton.language as tl
            except ImportError:  # a CPU-only install: the module's reference (asked once)
                self.missing = True
                return False
            module = sys.modules[self.module]
            module.triton, module.tl = triton, tl
            self.jitted = tuple(triton.jit(f) for f in self.fns)
        return True


def on(device: torch.device):
    """Triton launches on the current CUDA device: make it `device` while launching (if it is not already)."""
    if device.type != "cuda" or device.index in (None, torch.cuda.current_device()):
        return nullcontext()
    return torch.cuda.device(device)
