"""kvops::topk_ and its entry point kvops.topk: per-row top-k over rows of ragged lengths, ascending indices,
lowest index wins ties (docs/topk.md).

Three shape classes on the GPU, chosen from the shape, all built ahead of time and on the current stream:
- at least one row per SM, each of up to SHORT_ROW keys (the steady-state rounds: hundreds to thousands of rows of
  budget + beta keys): kvops::topk_short_rows_ (csrc/topk), one warp per row with its keys in registers, 8-bit
  digits over shared-memory histograms, up to four rows per CTA (fewer when the rows are few, so that they reach
  every SM);
- at most a quarter as many rows as SMs, each longer than LONG_ROW keys: kvops::topk_long_rows_ (csrc/topk), each
  row cut into slices that several CTAs rank together in one launch (on the H200 from 131072 keys at 32 rows and
  below; at 64 rows or 32768 keys the CuTe class is faster: benchmarks/RESULTS.md);
- otherwise: the CuTe DSL radix select in radix_cute.py (one 1024-thread CTA per row, the row staged in shared
  memory; faster for a few rows), one kernel per staging-copy width (shapes are dynamic), built ahead of time
  (kvops/_cute.py).
CPU: reference.py's topk_torch. Semantics (all): for row r, the indices of the k largest of
scores[r, :lengths[r]] in ascending order; ties go to the lowest index; NaN ranks below -inf; -0.0 equals +0.0; a
row shorter than k is padded with -1.
"""

from __future__ import annotations

import functools
import os

import torch

from .. import _cute
from .._checks import INT32_MAX, check_bool, check_device, check_int, check_int32, check_no_meta_mix, overlap
from .._dispatch import python_op
from .reference import topk_torch

MAX_K = INT32_MAX  # indices are int32
SHORT_ROW = 4096    # the widest row the short-row class serves (csrc/topk/topk.h's kShortRow)
LONG_ROW = 65536    # rows longer than this, at most a quarter as many as SMs, go to the multi-CTA class (measured)


def short_rows_native(scores: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor | None, k: int,
                      out: torch.Tensor) -> None:
    """kvops::topk_short_rows_ (csrc/topk), the native class: one warp per row of at most SHORT_ROW keys, its keys
    in registers; arguments as kvops.topk takes them, k >= 1 (checked by the op)."""
    torch.ops.kvops.topk_short_rows_(scores, lengths, offsets, k, out)


@torch.library.register_fake("kvops::topk_short_rows_")
def _short_rows_native_fake(scores, lengths, offsets, k, out):
    check_no_meta_mix("topk_short_rows_", scores, lengths, offsets, out)


def long_rows_native(scores: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor | None, k: int,
                     out: torch.Tensor) -> None:
    """kvops::topk_long_rows_ (csrc/topk), the native multi-CTA class: rows of any width, each cut into slices
    that several CTAs rank together in one launch (as many CTAs as the GPU holds at once); arguments as
    kvops.topk takes them, k >= 1 (checked by the op)."""
    torch.ops.kvops.topk_long_rows_(scores, lengths, offsets, k, out)


@torch.library.register_fake("kvops::topk_long_rows_")
def _long_rows_native_fake(scores, lengths, offsets, k, out):
    check_no_meta_mix("topk_long_rows_", scores, lengths, offsets, out)


def topk_spec(vector: bool) -> _cute.Spec:
    """The CuTe class as an ahead-of-time spec (kvops/_cute.py). vector: rows start 16-byte aligned with a row
    stride that is a multiple of 4 keys (16-byte staging copies)."""
    def build(target: str):
        from cutlass import Int32

        from .radix_cute import TopK

        scores = _cute.fake(Int32, 2, align=16 if vector else 4, divisibility=4 if vector else 1)
        return _cute.ffi_compile(TopK(vector), [scores, _cute.fake(Int32, 1, 4), _cute.fake(Int32, 1, 4), Int32(0),
                                                _cute.fake(Int32, 2, 4), Int32(0)], target)

    return _cute.Spec(f"topk_{'vector' if vector else 'scalar'}", build)


SPECS = {vector: topk_spec(vector) for vector in (True, False)}


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def cute_rows(scores: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor | None, k: int,
              out: torch.Tensor) -> None:
    """The CuTe class (radix_cute.py, one CTA per row) called directly on CUDA tensors kvops.topk's checks have
    passed, k >= 1."""
    vector = scores.data_ptr() % 16 == 0 and scores.stride(0) % 4 == 0 and scores.shape[1] % 4 == 0
    # the kernel reads the fp32 bit patterns; without offsets it is handed the lengths, which it does not read
    _cute.ffi_function(SPECS[vector], _cute.arch(scores.device))(scores.view(torch.int32), lengths,
                                                                lengths if offsets is None else offsets,
                                                                int(offsets is not None), out, k)


def _check_out(scores, lengths, offsets, out) -> None:
    """out shares no memory with the inputs: checked in the op itself, so a compiled call (whose traced tensors
    have no addresses) refuses what an eager one does."""
    if out.numel() and any(overlap(out, t) for t in (scores, lengths, offsets) if t is not None):
        raise ValueError("topk: out shares memory with scores, lengths or offsets")


def _topk_cuda(scores, lengths, offsets, k, out):
    _check_out(scores, lengths, offsets, out)
    device = scores.device
    rows, N = scores.shape
    if k < 1 or rows == 0:  # nothing to write (kvops.topk never calls with these)
        return
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if N <= SHORT_ROW and rows >= sms:
        short_rows_native(scores, lengths, offsets, k, out)
    elif N > LONG_ROW and 4 * rows <= sms:  # a few long rows, each given several CTAs
        long_rows_native(scores, lengths, offsets, k, out)
    else:
        cute_rows(scores, lengths, offsets, k, out)


@python_op("topk_", mutates_args={"out"}, cuda=_topk_cuda, check=lambda s, n, o, k, out: _check_out(s, n, o, out))
def _topk_op(scores: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor | None, k: int,
             out: torch.Tensor) -> None:
    _check_out(scores, lengths, offsets, out)
    topk_torch(scores, lengths, offsets, k, out)


def topk(scores: torch.Tensor, lengths: torch.Tensor, k: int, out: torch.Tensor | None = None,
         offsets: torch.Tensor | None = None, validate: bool = False) -> torch.Tensor:
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
    offsets : torch.Tensor, optional
        int32 ``[rows]`` on the same device, added to every index a row keeps (not to the -1 padding): e.g. the
        cache position of the row's first scored token. Each must lie in [0, 2**31 - N], so that a kept index
        (< N) plus its offset is a position that fits int32 and never -1. Host offsets are checked on every call;
        device offsets are read on the device, like lengths, and trusted (a check would be a sync) unless
        `validate` or ``KVOPS_DEBUG=1``; outside the range they give indices that wrap or read as padding.
    validate : bool
        Read device offsets back and check their range (a sync); raises ValueError naming the row.

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
    if offsets is not None:
        check_int32(what, device, offsets=(offsets, 1))
        if offsets.shape[0] != scores.shape[0]:
            raise ValueError(f"{what}: offsets must be int32 [{scores.shape[0]}] (one per row), got "
                             f"{tuple(offsets.shape)}")
    check_int(what, "k", k, 0, MAX_K)
    check_bool(what, "validate", validate)
    if offsets is not None and (offsets.device.type == "cpu" or validate or os.environ.get("KVOPS_DEBUG") == "1"):
        _check_offsets(what, offsets, scores.shape[1])
    shape = (scores.shape[0], k)
    if out is None:
        out = torch.empty(shape, dtype=torch.int32, device=device)
    else:
        check_int32(what, device, out=(out, 2))
        if tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"{what}: out must be a contiguous int32 {list(shape)} tensor, got {tuple(out.shape)}")
    if k and scores.shape[0]:
        _topk_op(scores, lengths, offsets, k, out)
    return out


def topk_unchecked(scores: torch.Tensor, lengths: torch.Tensor, k: int, offsets: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """kvops.topk on arguments its checks have passed (the selector's fresh rows): no Python check per call."""
    out = torch.empty((scores.shape[0], k), dtype=torch.int32, device=scores.device)
    if k and scores.shape[0]:
        _topk_op(scores, lengths, offsets, k, out)
    return out


def _check_offsets(what: str, offsets: torch.Tensor, N: int) -> None:
    """Every offset in [0, 2**31 - N]: an index below N plus it fits int32 and is never -1 (reads it back: host
    offsets cost no sync; device ones only under validate). Eager only: a traced call has no values."""
    if torch.compiler.is_compiling() or offsets.numel() == 0:
        return
    limit = MAX_K - max(N - 1, 0)
    host = offsets.cpu()
    bad = (host < 0) | (host > limit)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise ValueError(f"{what}: offsets[{row}] = {int(host[row])} is outside [0, {limit}]: a kept index "
                         f"(< N = {N}) plus its offset must fit int32 and never be -1 (the padding)")
