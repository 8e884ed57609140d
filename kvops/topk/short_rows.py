"""kvops.topk's Triton class: one small program per row of at most SHORT_ROW keys (ops.py picks it for at least
one row per SM but fewer than NATIVE_ROWS_PER_SM), the row's keys in registers, its threshold found bit by bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def sort_key(b):
    """The key of fp32 bit patterns `b` (int32): kvops/topk/reference.py's sort_keys, the one rule, written in
    Triton (radix_cute.py's _ukey and csrc/topk/topk.h's ukey mirror it; the tests check all three against it)."""
    key = b ^ ((b >> 31) & 0x7FFFFFFF)                       # signed order
    key = tl.where(key == -1, 0, key)                        # -0.0 ranks with +0.0
    key = tl.where((b & 0x7FFFFFFF) > 0x7F800000, -2147483648, key)  # NaN lowest
    return (key ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _ukeys(bits, stride, row, at, length):
    """The keys (sort_key) of positions `at` of a row; 0 past the length too."""
    b = tl.load(bits + row.to(tl.int64) * stride + at, mask=at < length, other=0)
    return tl.where(at < length, sort_key(b), 0)


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


def short_rows(scores: torch.Tensor, lengths: torch.Tensor, offsets: torch.Tensor | None, k: int,
               out: torch.Tensor, num_warps: int = 4) -> None:
    """The Triton class: kvops.topk's semantics written into `out` for rows of at most SHORT_ROW keys, one
    program per row (on CPU tensors only under TRITON_INTERPRET=1). Arguments as kvops.topk takes them, k >= 1."""
    rows, N = scores.shape
    head = triton.next_power_of_2(N + 1) // 2 if N else 1  # the largest power of two <= N
    _short_rows_kernel[(rows,)](scores.view(torch.int32), scores.stride(0), lengths, lengths if offsets is None else offsets,
                    out, N, k, HEAD=head, REST=triton.next_power_of_2(max(1, N - head)),
                    HAS_OFFSETS=offsets is not None, num_warps=num_warps)


def short_row_warps(rows: int, sms: int) -> int:
    """Warps per row of the Triton class: 2 once the rows fill every SM several times over (9216 x 2176: 260 us
    against 340 with 4, H200); 4 for fewer rows, where each row's latency is the time."""
    return 2 if rows >= 4 * sms else 4
