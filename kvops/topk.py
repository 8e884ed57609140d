"""kvops.topk: per-row top-k over rows of ragged lengths, ascending indices, lowest index wins ties.

Three shape classes on the GPU, chosen from the shape, all on the current stream:
- many rows of up to SHORT_ROW keys (at least NATIVE_ROWS_PER_SM per SM; the steady-state round of
  per-(layer, head) decisions: thousands of rows of budget + beta keys): kvops::topk_short_rows_ (csrc/topk), one
  warp per row with its keys in registers, 8-bit digits over shared-memory histograms, several rows per CTA;
- fewer rows, but at least one per SM: a Triton kernel with one small program per row, its keys in registers
  (its threshold search bit by bit), many programs per SM;
- otherwise: the CuTe DSL radix select in topk_cute.py (one 1024-thread CTA per row, the row staged in shared
  memory; faster for a few rows), one kernel per staging-copy width (shapes are dynamic), built ahead of time
  (kvops/_cute.py).
CPU: the same semantics with torch sorts (the Triton kernel under TRITON_INTERPRET=1). Semantics (all): for row
r, the indices of the k largest of scores[r, :lengths[r]] in ascending order; ties go to the lowest index; NaN
ranks below -inf; -0.0 equals +0.0; a row shorter than k is padded with -1.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import _cute
from ._checks import check_bool, check_device, check_int, check_int32, check_no_meta_mix, overlap
from ._dispatch import call, triton_launcher

MAX_K = 2**31 - 1  # indices are int32
SHORT_ROW = 4096    # the widest row the short-row classes serve (csrc/topk/topk.h's kShortRow)
NATIVE_ROWS_PER_SM = 4  # from here the warp-per-row class beats the Triton one (H200, rows of 2176 keys: level
                        # with it at 2.2 rows per SM, 1.8x faster at 8.7)


@triton.jit
def _ukeys(bits, stride, row, at, length):
    """The keys of positions `at` of a row as order-preserving unsigned fp32 patterns (NaN lowest at 0, -0 ==
    +0, as in topk_cute.py); 0 past the length too."""
    b = tl.load(bits + row.to(tl.int64) * stride + at, mask=at < length, other=0)
    key = b ^ ((b >> 31) & 0x7FFFFFFF)                       # signed order
    key = tl.where(key == -1, 0, key)                        # -0.0 ranks with +0.0
    key = tl.where((b & 0x7FFFFFFF) > 0x7F800000, -2147483648, key)  # NaN lowest
    return tl.where(at < length, (key ^ -2147483648).to(tl.uint32, bitcast=True), 0)


@triton.jit
def _place(out, key, at, length, threshold, ties, before, offset):
    """Store the indices `at` (plus `offset`) a row keeps (key > threshold, or == threshold among the first
    `ties` >= 0 of those in index order) at their rank among the kept; `before`: kept in earlier parts. One scan
    counts both kinds (packed in 16-bit halves: a part holds at most SHORT_ROW keys). Returns (kept here, ties
    left)."""
    greater = (key > threshold).to(tl.int32)  # keys past the length are 0 and never above a threshold
    equal = ((at < length) & (key == threshold)).to(tl.int32)
    both = tl.cumsum(greater + (equal << 16), 0)
    greater_before, equal_before = (both & 0xFFFF) - greater, (both >> 16) - equal
    picked = (greater != 0) | ((equal != 0) & (equal_before < ties))
    tl.store(out + before + greater_before + tl.minimum(equal_before, ties), at + offset, mask=picked)
    taken = tl.minimum(tl.sum(equal, 0), ties)
    return tl.sum(greater, 0) + taken, ties - taken


@triton.jit
def _bitwise_threshold(head, rest, k):
    """The largest T with #{key >= T} >= k (0 if there is none), one bit per pass from the top: 32 passes of a
    compare and a count. Keys past the length are 0 and never reach a candidate (>= 1)."""
    threshold = tl.zeros((), tl.uint32)
    for shift in tl.static_range(31, -1, -1):
        candidate = threshold | (tl.full((), 1, tl.uint32) << shift)
        count = tl.sum((head >= candidate).to(tl.int32), 0) + tl.sum((rest >= candidate).to(tl.int32), 0)
        threshold = tl.where(count >= k, candidate, threshold)
    return threshold


@triton.jit
def _short_rows_kernel(bits, stride, lengths, offsets, out, N, k, HEAD: tl.constexpr, REST: tl.constexpr,
                       HAS_OFFSETS: tl.constexpr):
    """One row per program, its keys in registers as a power-of-two head and rest (no padding to the next power
    of two). The k-th largest key T is the largest with #{key >= T} >= k, found bit by bit from the top. Then
    keys > T, and the first k - #{> T} keys == T in index order, land at their exclusive prefix count, so the
    output ascends."""
    row = tl.program_id(0)
    length = tl.minimum(tl.maximum(tl.load(lengths + row), 0), N)
    at_head = tl.arange(0, HEAD)
    at_rest = HEAD + tl.arange(0, REST)
    head = _ukeys(bits, stride, row, at_head, length)
    rest = _ukeys(bits, stride, row, at_rest, length)
    threshold = _bitwise_threshold(head, rest, k)
    greater = tl.sum((head > threshold).to(tl.int32), 0) + tl.sum((rest > threshold).to(tl.int32), 0)
    row_out = out + row.to(tl.int64) * k
    offset = tl.load(offsets + row) if HAS_OFFSETS else 0
    kept, ties = _place(row_out, head, at_head, length, threshold, tl.maximum(k - greater, 0), 0, offset)
    kept_rest, _ = _place(row_out, rest, at_rest, length, threshold, ties, kept, offset)
    kept += kept_rest
    start = 0
    while start < k:  # -1 past the kept ones (a row shorter than k)
        j = start + tl.arange(0, 256)
        tl.store(row_out + j, -1, mask=(j >= kept) & (j < k))
        start += 256


def _short_rows(scores: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor | None, k: int,
                out: torch.Tensor, kernel, num_warps: int = 4) -> None:
    rows, N = scores.shape
    head = triton.next_power_of_2(N + 1) // 2 if N else 1  # the largest power of two <= N
    kernel[(rows,)](scores.view(torch.int32), scores.stride(0), lengths, lengths if offsets is None else offsets,
                    out, N, k, HEAD=head, REST=triton.next_power_of_2(max(1, N - head)),
                    HAS_OFFSETS=offsets is not None, num_warps=num_warps)


def short_row_warps(rows: int, sms: int) -> int:
    """Warps per row of the Triton class: 2 once the rows fill every SM several times over (9216 x 2176: 260 us
    against 340 with 4, H200); 4 for fewer rows, where each row's latency is the time."""
    return 2 if rows >= 4 * sms else 4


def _short_rows_native(scores: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor | None, k: int,
                       out: torch.Tensor) -> None:
    """kvops::topk_short_rows_ (csrc/topk): one warp per row, its keys in registers."""
    torch.ops.kvops.topk_short_rows_(scores, lengths, offsets, k, out)


@torch.library.register_fake("kvops::topk_short_rows_")
def _short_rows_native_fake(scores, lengths, offsets, k, out):
    check_no_meta_mix("topk_short_rows_", scores, lengths, offsets, out)


def topk_spec(vector: bool) -> _cute.Spec:
    """The CuTe class as an ahead-of-time spec (kvops/_cute.py). vector: rows start 16-byte aligned with a row
    stride that is a multiple of 4 keys (16-byte staging copies)."""
    def build(target: str):
        from cutlass import Int32

        from .topk_cute import TopK

        scores = _cute.fake(Int32, 2, align=16 if vector else 4, divisibility=4 if vector else 1)
        return _cute.ffi_compile(TopK(vector), [scores, _cute.fake(Int32, 1, 4), _cute.fake(Int32, 2, 4), Int32(0)],
                                 target)

    return _cute.Spec(f"topk_{'vector' if vector else 'scalar'}", build)


SPECS = {vector: topk_spec(vector) for vector in (True, False)}


@torch.library.custom_op("kvops::topk_", mutates_args={"out"})
def _topk_op(scores: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor | None, k: int,
             out: torch.Tensor) -> None:
    rows, N = scores.shape
    interpreted = triton_launcher(_short_rows_kernel, scores.device)  # the kernel on the CPU, for tests
    if interpreted is not None and N <= SHORT_ROW:
        _short_rows(scores, lengths, offsets, k, out, interpreted)
        return
    n = lengths.clamp(0, N).long()
    col = torch.arange(N, device=scores.device)
    category = torch.where(col[None] >= n[:, None], 2, torch.isnan(scores).long())  # 0 value, 1 NaN, 2 past end
    value = torch.where(scores == 0, 0.0, scores).nan_to_num(nan=0.0)  # -0 == +0
    order = value.sort(dim=1, descending=True, stable=True).indices
    order = order.gather(1, category.gather(1, order).sort(dim=1, stable=True).indices)
    top = order[:, :k]
    picked = torch.where(category.gather(1, top) == 2, N, top)
    picked = torch.nn.functional.pad(picked, (0, k - picked.shape[1]), value=N).sort(dim=1).values  # k > N
    offset = 0 if offsets is None else offsets.view(-1, 1)
    out.copy_(torch.where(picked == N, -1, picked + offset).to(torch.int32))


@_topk_op.register_kernel("cuda")
def _topk_cuda(scores, lengths, offsets, k, out):
    device = scores.device
    rows, N = scores.shape
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if N <= SHORT_ROW and rows >= NATIVE_ROWS_PER_SM * sms and k >= 1:
        _short_rows_native(scores, lengths, offsets, k, out)
        return
    if N <= SHORT_ROW and rows >= sms:
        _short_rows(scores, lengths, offsets, k, out, _short_rows_kernel, short_row_warps(rows, sms))
        return
    vector = scores.data_ptr() % 16 == 0 and scores.stride(0) % 4 == 0 and scores.shape[1] % 4 == 0
    # the kernel reads the fp32 bit patterns
    _cute.ffi_function(SPECS[vector], _cute.arch(device))(scores.view(torch.int32), lengths, out, k)
    if offsets is not None:  # fewer rows than SMs here: one small elementwise pass
        out.copy_(torch.where(out >= 0, out + offsets.view(-1, 1), out))


@_topk_op.register_fake
def _topk_fake(scores, lengths, offsets, k, out):
    return None


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
        if out.shape[0] and any(overlap(out, t) for t in (scores, lengths, offsets) if t is not None):
            raise ValueError(f"{what}: out shares memory with scores, lengths or offsets")
    if k and scores.shape[0]:
        call(_topk_op, _topk_cuda, scores, lengths, offsets, k, out)
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


def topk_reference(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """The independent reference (float64, Python sorts, CPU): int32 [rows, k]: per row, the ascending indices of
    the k largest of scores[row, :length]; ties go to the lowest index; NaN ranks below -inf; -1 fills a row
    shorter than k."""
    out = torch.full((scores.shape[0], k), -1, dtype=torch.int32)
    for row in range(scores.shape[0]):
        n = int(lengths[row])
        vals = scores[row, :n].double().cpu().nan_to_num(nan=-float("inf"))
        nan = torch.isnan(scores[row, :n].cpu())
        # lexicographic: value descending (NaN last), then index ascending
        order = sorted(range(n), key=lambda i: (bool(nan[i]), -float(vals[i]), i))[:k]
        out[row, :len(order)] = torch.tensor(sorted(order), dtype=torch.int32)
    return out
