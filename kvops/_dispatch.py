"""How a kvops op reaches its kernel: the launchable Triton kernel per device, and the eager bypass of the
dispatcher."""

from __future__ import annotations

import os

import torch
from torch.library import wrap_triton


def triton_launcher(kernel, device: torch.device):
    """The launchable kernel for tensors on `device`, or None where the op's plain-torch path runs instead (CPU
    without TRITON_INTERPRET=1). The interpreter launches the kernel directly: torch 2.11's wrap_triton rejects
    interpreted kernels."""
    if device.type == "cpu":
        return kernel if os.environ.get("TRITON_INTERPRET") == "1" else None
    return wrap_triton(kernel)


def eager_bypass(t: torch.Tensor) -> bool:
    """Whether a wrapper may call its op's CUDA implementation directly, skipping the dispatcher (quack's eager
    bypass; the dispatch of a custom op costs more than a kernel launch): for CUDA tensors, outside torch.compile,
    which keeps tracing the registered op and its fake."""
    return t.is_cuda and not torch.compiler.is_compiling()
