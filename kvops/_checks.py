"""Argument checks shared by every public entry: clear ValueError/TypeError naming the argument, raised before
anything changes."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

INT32_MAX = 2**31 - 1  # every kernel indexes positions, lengths and list entries in int32


def check_int(what: str, name: str, value, minimum: int = 0, maximum: int | None = None) -> int:
    """A Python int (not a bool) in [minimum, maximum]; returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{what}: {name} must be {bound}, got {value}")
    return value


def check_number(what: str, name: str, value, low: float | None = None, *, strict: bool = False):
    """A finite real number (an int or float, not a bool), >= low (> low when strict) when low is given; returns
    it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what}: {name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or (low is not None and (value <= low if strict else value < low)):
        rule = "finite" if low is None else f"finite and {'>' if strict else '>='} {low}"
        raise ValueError(f"{what}: {name} must be {rule}, got {value!r}")
    return value


def check_bool(what: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what}: {name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_device(what: str, device: torch.device | None = None, **tensors) -> torch.device:
    """Every keyword is a tensor or a sequence of tensors; all must sit on one real device (`device` when given,
    else the first tensor's), never on "meta" (that would run the fake kernels and change nothing). Returns it."""
    for name, value in tensors.items():
        seq = value if isinstance(value, (list, tuple)) else (value,)
        if all(isinstance(t, torch.Tensor) for t in seq):  # fast path: one pass, messages only on failure
            found = {t.device for t in seq}
            if len(found) == 1 and (device is None or device in found) and next(iter(found)).type != "meta":
                device = next(iter(found))
                continue
        items = [(name, value)] if not isinstance(value, (list, tuple)) \
            else [(f"{name}[{i}]", t) for i, t in enumerate(value)]
        for label, t in items:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}: {label} must be a tensor, got {type(t).__name__}")
            if t.device.type == "meta":
                raise ValueError(f"{what}: {label} is a meta tensor; kvops ops need real data on one device")
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(f"{what}: {label} is on {t.device}, expected {device} (where the other tensors live)")
    return device


def check_no_meta_mix(what: str, *args) -> None:
    """For fake kernels: real tensors mixed with meta ones would dispatch to the fake and change nothing."""
    flat = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
    if len({t.device.type == "meta" for t in flat}) > 1:
        raise ValueError(f"{what}: meta tensors mixed with real ones; kvops ops need real data on one device")


def check_device_or_host(what: str, device: torch.device, **tensors) -> None:
    """Each keyword is a tensor on `device` or on the host (pinned memory the kernels reach, or a host value)."""
    for name, t in tensors.items():
        if check_device(what, **{name: t}).type != "cpu":
            check_device(what, device, **{name: t})


def check_int32(what: str, device: torch.device | None = None, **tensors: tuple[torch.Tensor, int]) -> torch.device:
    """Each keyword is (tensor, ndim); all must be int32 tensors on one real device (`device` when given,
    else the first tensor's), which is returned. 1-D ones (per-request or per-row values: the kernels index them
    by request) must be contiguous; callers check the layout of the others."""
    for name, (t, ndim) in tensors.items():
        device = check_device(what, device, **{name: t})
        if t.dtype != torch.int32:
            raise ValueError(f"{what}: {name} must be int32, got {t.dtype}")
        if t.dim() != ndim:
            raise ValueError(f"{what}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if ndim == 1 and not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous, got stride {t.stride()}")
    return device


def check_float32(what: str, device: torch.device, **tensors: tuple[torch.Tensor, tuple[int, ...]]) -> None:
    """Each keyword is (tensor, shape): a contiguous float32 tensor of exactly that shape on `device`."""
    for name, (t, shape) in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != tuple(shape) \
                or t.device != device or not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous float32 {list(shape)} on {device}, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))} on "
                             f"{getattr(t, 'device', None)}")


def _offsets_meet(delta: int, dims: Sequence[tuple[int, int]]) -> bool:
    """Whether delta = sum_i stride_i * j_i with |j_i| < size_i for dims (stride, size) sorted by stride,
    largest first: an element of one view sits `delta` elements after an element of the other. Exact for the
    nested layouts pools use; a layout with many candidate digits is taken to overlap."""
    if not dims:
        return delta == 0
    (stride, size), rest = dims[0], dims[1:]
    reach = sum((n - 1) * s for s, n in rest)  # what the inner dims can still add or take away
    lo, hi = max(-(size - 1), -((reach - delta) // stride)), min(size - 1, (delta + reach) // stride)
    if hi - lo > 8:
        return True
    return any(_offsets_meet(delta - j * stride, rest) for j in range(lo, hi + 1))


def _storage(t: torch.Tensor) -> int:
    """What identifies a tensor's memory: its address, or for a fake tensor (torch.compile's, which has none) its
    storage, which the fakes of views of one traced input share."""
    storage = t.untyped_storage()
    return storage._cdata if is_fake(t) else storage.data_ptr()


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share at least one byte of memory (same storage, intersecting elements). Works on the
    fake tensors torch.compile traces with, which keep their inputs' storages and offsets: the ops' fakes run the
    same checks, so a compiled call refuses what an eager one does. False in code Dynamo traces (there the op's
    fake checks)."""
    if torch.compiler.is_dynamo_compiling() or a.numel() == 0 or b.numel() == 0 or a.device != b.device or _storage(a) != _storage(b):
        return False
    span = lambda t: (t.storage_offset() * t.itemsize,  # noqa: E731  (bytes into the shared storage)
                      (t.storage_offset() + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.itemsize)
    (a0, a1), (b0, b1) = span(a), span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if (a.shape, a.stride(), a.dtype) != (b.shape, b.stride(), b.dtype) or (b0 - a0) % a.itemsize:
        return True  # interleaved views of different geometry: treated as aliasing
    dims = sorted(((s, n) for s, n in zip(a.stride(), a.shape) if n > 1), reverse=True)
    return _offsets_meet((b0 - a0) // a.itemsize, dims)


def check_disjoint(what: str, name: str, tensors: Sequence[torch.Tensor],
                   others: Iterable[tuple[str, torch.Tensor]] = ()) -> None:
    """No two of `tensors` (and none of them with a named tensor of `others`) share memory: the same pool passed
    twice would be moved or encoded twice. Fake tensors too (``overlap``): the ops' fakes call it while
    torch.compile traces (in code Dynamo traces it checks nothing: the fake does)."""
    if torch.compiler.is_dynamo_compiling():
        return
    others = list(others)
    storages = [_storage(t) for t in tensors]
    shared = set(storages)
    if len(shared) == len(storages) and not any(_storage(t) in shared for _, t in others):
        return  # the usual case: every pool its own allocation
    for i in range(len(tensors)):
        for j in range(i + 1, len(tensors)):
            if storages[i] == storages[j] and overlap(tensors[i], tensors[j]):
                raise ValueError(f"{what}: {name}[{i}] and {name}[{j}] share memory; each must be its own "
                                 f"tensor (the same pool passed twice would be changed twice)")
    for other, t in others:
        for i, p in enumerate(tensors):
            if overlap(p, t):
                raise ValueError(f"{what}: {other} shares memory with {name}[{i}]")


def check_nonnegative(what: str, name: str, t: torch.Tensor) -> None:
    """Every value of the 1-D integer tensor `t` >= 0 when it is on the host, read on each call (no sync, as
    kvops.topk reads host offsets); a device one is trusted (reading it would sync; callers' validate does).
    Eager only: a traced call has no values."""
    if t.device.type != "cpu" or torch.compiler.is_compiling() or t.numel() == 0:
        return
    bad = t < 0
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{what}: {name}[{i}] = {int(t[i])}; it must be >= 0")


def check_hashable(what: str, name: str, value) -> None:
    """A value usable as a dict key (request ids key every table of a cache or a manager)."""
    try:
        hash(value)
    except TypeError:
        raise TypeError(f"{what}: {name} must be hashable (it keys the request tables), got "
                        f"{type(value).__name__} {value!r}") from None


def check_choice(what: str, name: str, value, choices: Sequence[str]) -> str:
    """One of the strings `choices` (a str first: a list would fail the membership test obscurely); returns it."""
    if not isinstance(value, str):
        raise TypeError(f"{what}: {name} must be a str, one of {tuple(choices)}, got {type(value).__name__} {value!r}")
    if value not in choices:
        raise ValueError(f"{what}: {name} must be one of {tuple(choices)}, got {value!r}")
    return value


def as_device(what: str, device, name: str = "device") -> torch.device:
    """`device` (a torch.device, its name or a CUDA index) as a torch.device, or an error naming it."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise TypeError(f"{what}: {name} must be a torch.device, a device string or a CUDA index, got "
                        f"{type(device).__name__} {device!r}")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"{what}: {name} must be a torch.device, a device string or a CUDA index, got "
                         f"{device!r}") from None

