"""kvops.topk: per-row top-k over rows of ragged lengths, ascending indices, lowest index wins ties.

GPU: the CuTe DSL radix select in topk_cute.py, compiled once per device and staging-copy width (shapes are
dynamic) and launched on the current stream. CPU: the same semantics with torch sorts. Semantics (both): for row r, the indices of the
k largest of scores[r, :lengths[r]] in ascending order; ties go to the lowest index; NaN ranks below -inf;
-0.0 equals +0.0; a row shorter than k is padded with -1.
"""

from __future__ import annotations

import torch

from .._checks import check_device, check_int, check_int32, overlap
from . import _cute

MAX_K = 2**31 - 1  # indices are int32


def compile_topk(device: torch.device | None, vector: bool = True):
    """Compile the CuTe kernel (shapes are dynamic: one compile serves all); device None: compile only (CI).
    vector: rows start 16-byte aligned and the row length is a multiple of 4 (16-byte staging copies)."""
    import cutlass
    import cutlass.cute as cute

    from .topk_cute import TopK

    dummy = [torch.zeros(s, dtype=torch.int32, device=device or "cpu") for s in ((2, 8), (2,), (2, 4))]
    return cute.compile(TopK(vector), *_cute.dynamic(*dummy), cutlass.Int32(4), _cute.stream(device))


@torch.library.custom_op("kvops::topk_", mutates_args={"out"})
def _topk_op(scores: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor) -> None:
    rows, N = scores.shape
    n = lengths.clamp(0, N).long()
    col = torch.arange(N, device=scores.device)
    category = torch.where(col[None] >= n[:, None], 2, torch.isnan(scores).long())  # 0 value, 1 NaN, 2 past end
    value = torch.where(scores == 0, 0.0, scores).nan_to_num(nan=0.0)  # -0 == +0
    order = value.sort(dim=1, descending=True, stable=True).indices
    order = order.gather(1, category.gather(1, order).sort(dim=1, stable=True).indices)
    top = order[:, :k]
    picked = torch.where(category.gather(1, top) == 2, N, top)
    picked = torch.nn.functional.pad(picked, (0, k - picked.shape[1]), value=N).sort(dim=1).values  # k > N
    out.copy_(torch.where(picked == N, -1, picked).to(torch.int32))


@_topk_op.register_kernel("cuda")
def _topk_cuda(scores, lengths, k, out):
    from cutlass import Int32

    device = scores.device
    vector = scores.data_ptr() % 16 == 0 and scores.stride(0) % 4 == 0 and scores.shape[1] % 4 == 0
    fn = _cute.compiled("kvops.topk", ("topk", _cute.device_index(device), vector),
                        lambda: compile_topk(device, vector))
    # the kernel reads the fp32 bit patterns
    fn(*_cute.dynamic(scores.view(torch.int32), lengths, out), Int32(k), _cute.stream(scores.device))


@_topk_op.register_fake
def _topk_fake(scores, lengths, k, out):
    return None


def topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per row, the ascending indices of the k largest of ``scores[row, :lengths[row]]``.

    Parameters
    ----------
    scores : torch.Tensor
        float32 ``[rows, N]`` with a contiguous last dim. Ties go to the lowest index, NaN ranks below -inf and
        -0.0 equals +0.0.
    lengths : torch.Tensor
        int32 ``[rows]`` on the same device, read on the device and clamped to [0, N].
    k : int
        Indices per row, >= 0; a row shorter than k is padded with -1.
    out : torch.Tensor, optional
        A bound int32 ``[rows, k]`` buffer to write (graph-capturable once warm); must not share memory with the
        inputs.

    Returns
    -------
    torch.Tensor
        int32 ``[rows, k]`` (``out`` when given).
    """
    what = "topk"
    device = check_device(what, scores=scores)
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError(f"{what}: scores must be a 2-D float32 tensor, got {scores.dtype} {tuple(scores.shape)}")
    if scores.stride(1) != 1 and scores.shape[1] > 1:
        raise ValueError(f"{what}: scores needs a contiguous last dim, got strides {scores.stride()}")
    check_int32(what, device, lengths=(lengths, 1))
    if lengths.shape[0] != scores.shape[0]:
        raise ValueError(f"{what}: lengths must be int32 [{scores.shape[0]}] (one per row), got {tuple(lengths.shape)}")
    check_int(what, "k", k, 0, MAX_K)
    shape = (scores.shape[0], k)
    if out is None:
        out = torch.empty(shape, dtype=torch.int32, device=device)
    else:
        check_int32(what, device, out=(out, 2))
        if tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"{what}: out must be a contiguous int32 {list(shape)} tensor, got {tuple(out.shape)}")
        if out.shape[0] and (overlap(out, scores) or overlap(out, lengths)):
            raise ValueError(f"{what}: out shares memory with scores or lengths")
    if k and scores.shape[0]:
        _topk_op(scores, lengths, k, out)
    return out
