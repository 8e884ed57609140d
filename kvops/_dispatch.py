"""How a kvops op reaches its kernel: the launchable Triton kernel per device, the registration of a Python op, and
the eager bypass of the dispatcher."""

from __future__ import annotations

import os

import torch


def triton_launcher(kernel, device: torch.device):
    """`kernel` where it can run on `device`'s tensors, or None where the op's plain-torch path runs instead (CPU
    without TRITON_INTERPRET=1)."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    return kernel


def python_op(name: str, mutates_args: set[str]):
    """Register a function that writes its outputs in place (and launches its kernels on the current stream) as
    the op ``kvops::<name>`` for every device, with a fake that does nothing: ``torch.compile`` traces the op
    and calls it opaquely. A plain custom op rather than ``torch.library.triton_op``: that one parses its
    function's source and imports torch._inductor when it is registered, seconds of every ``import kvops``, for
    an inlining of kernels that only launch."""
    def register(fn):
        op = torch.library.custom_op(f"kvops::{name}", mutates_args=mutates_args)(fn)
        op.register_fake(lambda *args, **kwargs: None)
        return op

    return register


def eager_bypass(t: torch.Tensor) -> bool:
    """Whether a wrapper may call its op's CUDA implementation directly, skipping the dispatcher (quack's eager
    bypass; the dispatch of a custom op costs more than a kernel launch): for CUDA tensors, outside torch.compile,
    which keeps tracing the registered op and its fake."""
    return t.is_cuda and not torch.compiler.is_compiling()


def call(op, impl, *args) -> None:
    """``op(*args)``, or under the eager bypass (probed on args[0]) its implementation `impl` itself."""
    (impl if eager_bypass(args[0]) else op)(*args)
