"""What every kvops CuTe DSL op shares: a compile cache that refuses to compile inside a CUDA-graph capture,
dynamic-layout tensor arguments, and the current torch stream."""

from __future__ import annotations

import threading
from typing import Callable, Hashable

import torch

_compiled: dict[Hashable, object] = {}
_lock = threading.Lock()


def compiled(what: str, key: Hashable, build: Callable[[], object]):
    """The compiled kernel for `key` (device, dtype, constexprs), built once by `build()`."""
    fn = _compiled.get(key)
    if fn is not None:
        return fn
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}: the CuTe kernel for {key} is not compiled yet and a CUDA graph is being "
                           f"captured; call it once with the same shapes before capturing (warm-up)")
    with _lock:
        if key not in _compiled:
            _compiled[key] = build()
    return _compiled[key]


def dynamic(*tensors: torch.Tensor) -> list:
    """CuTe views of torch tensors with dynamic shapes and strides (one compile serves every shape)."""
    from cutlass.cute.runtime import from_dlpack

    return [from_dlpack(t).mark_layout_dynamic(leading_dim=t.dim() - 1) for t in tensors]


def stream(device: torch.device | None):
    """The current torch stream of `device` as a CUDA driver stream (None: the null stream, to compile only)."""
    from cuda.bindings import driver

    return driver.CUstream(0 if device is None else torch.cuda.current_stream(device).cuda_stream)


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
