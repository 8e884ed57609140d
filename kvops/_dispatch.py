"""How a kvops op reaches its kernel: the launchable Triton kernel per device, and the eager bypass of the
dispatcher."""

from __future__ import annotations

import os

import torch
from torch._library.triton import is_wrap_triton_enabled, set_wrap_triton_enabled
from torch.library import wrap_triton


def triton_launcher(kernel, device: torch.device):
    """The launchable kernel for tensors on `device`, or None where the op's plain-torch path runs instead (CPU
    without TRITON_INTERPRET=1). The interpreter launches the kernel directly: torch 2.11's wrap_triton rejects
    interpreted kernels."""
    if device.type == "cpu":
        return kernel if os.environ.get("TRITON_INTERPRET") == "1" else None
    # the kernel itself where wrap_triton would launch it straight anyway (an eager call), without importing the
    # higher-order op's machinery at the first call (seconds)
    return wrap_triton(kernel) if is_wrap_triton_enabled() else kernel


def eager_bypass(t: torch.Tensor) -> bool:
    """Whether a wrapper may call its op's CUDA implementation directly, skipping the dispatcher (quack's eager
    bypass; the dispatch of a custom op costs more than a kernel launch): for CUDA tensors, outside torch.compile,
    which keeps tracing the registered op and its fake."""
    return t.is_cuda and not torch.compiler.is_compiling()


def call_triton_op(op, launch, *args) -> None:
    """``op(*args)`` for a ``triton_op`` whose function is `launch`; under the eager bypass (probed on args[0]),
    `launch` itself, its Triton kernels launched straight as triton_op's own eager dispatch launches them (through
    wrap_triton's higher-order op an eager launch costs about 1 ms)."""
    if eager_bypass(args[0]):
        with set_wrap_triton_enabled(False):
            launch(*args)
    else:
        op(*args)
