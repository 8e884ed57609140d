"""How a kvops op reaches its kernel: the launchable Triton kernel per device, and ``python_op``, the one way a
Python op (Triton or CuTe kernels) is registered: the custom op, its fake and the eager bypass of the dispatcher."""

from __future__ import annotations

import os
from typing import Callable

import torch


def triton_launcher(kernel, device: torch.device):
    """`kernel` (a ``kvops._triton.Kernel``: its prebuilt cubin on the GPU, Triton's interpreter on the CPU) where
    it can run on `device`'s tensors, or None where the op's plain-torch path runs instead (CPU without
    TRITON_INTERPRET=1)."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    return kernel


def eager_bypass(t: torch.Tensor) -> bool:
    """Whether an op may call its CUDA implementation directly, skipping the dispatcher (quack's eager bypass; the
    dispatch of a custom op costs more than a kernel launch): for CUDA tensors, outside torch.compile, which keeps
    tracing the registered op and its fake."""
    return t.is_cuda and not torch.compiler.is_compiling()


def _first_tensor(args) -> torch.Tensor:
    """The tensor the bypass is decided on: the first tensor argument (a list's first element counts)."""
    for a in args:
        if isinstance(a, (list, tuple)) and a:
            a = a[0]
        if isinstance(a, torch.Tensor):
            return a
    raise TypeError("a kvops op needs a tensor argument")


def python_op(name: str, mutates_args: set[str], cuda: Callable | None = None, check: Callable | None = None):
    """Register a function that writes its outputs in place (launching its kernels on the current stream) as the
    op ``kvops::<name>``, and return the op's entry point.

    Parameters
    ----------
    name : str
        The op's name in the ``kvops`` namespace.
    mutates_args : set of str
        The arguments the op writes.
    cuda : callable, optional
        The op's CUDA implementation, registered for the CUDA key; without it the decorated function serves
        every device.
    check : callable, optional
        The op's own argument checks (its arguments; raises): run by the fake, so a compiled call refuses at its
        trace what an eager one refuses (fake tensors keep their inputs' storages: ``kvops._checks.overlap``).
        The implementations call it themselves.

    Returns
    -------
    A decorator. It registers the decorated function (annotated: its annotations give the schema) for every device,
    `cuda` for CUDA tensors, and a fake that runs `check` or nothing (the op returns nothing, so ``torch.compile``
    traces it and calls it opaquely). It returns a plain function with the op's arguments: for CUDA tensors outside
    ``torch.compile`` it calls the CUDA implementation directly (``eager_bypass``), else the registered op; its
    ``op`` attribute is the registered op. A plain function rather than a callable object, which torch.compile
    could not trace with ``fullgraph=True``; a plain custom op rather than ``torch.library.triton_op``: that one
    parses its function's source and imports torch._inductor when it is registered, seconds of every ``import
    kvops``, for an inlining of kernels that only launch.
    """
    def register(fn):
        op = torch.library.custom_op(f"kvops::{name}", mutates_args=mutates_args)(fn)
        if cuda is not None:
            op.register_kernel("cuda")(cuda)
        op.register_fake(check if check is not None else lambda *args, **kwargs: None)
        direct = fn if cuda is None else cuda

        def entry(*args, **kwargs) -> None:
            (direct if eager_bypass(_first_tensor(args)) else op)(*args, **kwargs)

        entry.__name__ = entry.__qualname__ = fn.__name__
        entry.__doc__ = fn.__doc__
        entry.op = op
        return entry

    return register
