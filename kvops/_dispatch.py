"""How a kvops Triton op reaches its kernel on each device."""

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
