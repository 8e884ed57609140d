"""Argument checks shared by the Python wrappers: clear ValueErrors naming the argument."""

from __future__ import annotations

import torch


def check_int32(what: str, device: torch.device | None = None, **tensors: tuple[torch.Tensor, int]) -> torch.device:
    """Each keyword is (tensor, ndim); all must be int32 tensors on one device (`device` when given,
    else the first tensor's), which is returned."""
    for name, (t, ndim) in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise ValueError(f"{what}: {name} must be int32, got {t.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"{what}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{what}: {name} is on {t.device}, expected {device} (where the pools and indices live)")
    return device


def check_float32(what: str, device: torch.device, **tensors: tuple[torch.Tensor, tuple[int, ...]]) -> None:
    """Each keyword is (tensor, shape): a contiguous float32 tensor of exactly that shape on `device`."""
    for name, (t, shape) in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != tuple(shape) \
                or t.device != device or not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous float32 {list(shape)} on {device}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))} on "
                             f"{getattr(t, 'device', None)}")
