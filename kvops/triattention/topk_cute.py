"""Radix top-k over rows of ragged lengths, in CuTe DSL (one CTA per row).

Keys are the fp32 bit patterns made signed-orderable (NaN lowest, -0 == +0). Eight 4-bit radix passes find
the k-th largest key T: each warp counts its candidates per digit with ballots, the CTA sums the 16-bin
histograms in shared memory and every thread walks them from the top to pick T's digit. A last pass, in index
order, keeps every key > T and the first (k - #greater) keys == T (ties go to the lowest index), writing their
indices in ascending order through a block-wide exclusive scan. Lengths are read on the device.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

THREADS = 512
WARPS = THREADS // 32
BINS = 16
PASSES = 8
INT_MIN = -(2 ** 31)


@cute.jit
def _order_key(bits: Int32) -> Int32:
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip the magnitude so order is signed order
    if key == -1:  # -0.0 ranks with +0.0
        key = Int32(0)
    if (bits & 0x7FFFFFFF) > 0x7F800000:  # NaN ranks below -inf
        key = Int32(INT_MIN)
    return key


@cute.jit
def _block_exclusive_scan(value: Int32, lane: Int32, warp: Int32, sScan: cute.Tensor) -> tuple:
    """(exclusive prefix of value over the CTA in thread order, CTA total). Ends with a barrier."""
    incl = value
    for step in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(incl, 1 << step)
        if lane >= (1 << step):
            incl = incl + up
    if lane == 31:
        sScan[warp] = incl
    cute.arch.sync_threads()
    before = Int32(0)
    total = Int32(0)
    for w in cutlass.range_constexpr(WARPS):
        t = sScan[w]
        if w < warp:
            before = before + t
        total = total + t
    cute.arch.sync_threads()
    return incl - value + before, total


@cute.kernel
def _topk_kernel(mBits: cute.Tensor, mLengths: cute.Tensor, mOut: cute.Tensor, k: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    smem = cutlass.utils.SmemAllocator()
    sHist = smem.allocate_tensor(Int32, cute.make_layout((BINS, WARPS)), byte_alignment=16)
    sTotal = smem.allocate_tensor(Int32, cute.make_layout(BINS), byte_alignment=16)
    sScan = smem.allocate_tensor(Int32, cute.make_layout(WARPS), byte_alignment=16)

    n = mLengths[row]
    if n > mBits.shape[1]:
        n = Int32(mBits.shape[1])
    if n < 0:
        n = Int32(0)

    # Radix select of the k-th largest key, 4 bits per pass from the top, on unsigned-order bits.
    prefix = Int32(0)
    mask = Int32(0)
    remaining = k
    for p in cutlass.range_constexpr(PASSES):
        shift = 28 - 4 * p
        counts = cute.make_rmem_tensor(BINS, Int32)
        for b in cutlass.range_constexpr(BINS):
            counts[b] = Int32(0)
        for base in cutlass.range(0, n, THREADS):
            i = base + tidx
            digit = Int32(BINS)  # no bin: past the row or outside the current prefix
            if i < n:
                u = _order_key(mBits[row, i]) ^ INT_MIN
                if (u & mask) == prefix:
                    digit = (u >> shift) & (BINS - 1)
            for b in cutlass.range_constexpr(BINS):
                counts[b] = counts[b] + cute.arch.popc(cute.arch.vote_ballot_sync(digit == b))
        if lane == 0:
            for b in cutlass.range_constexpr(BINS):
                sHist[b, warp] = counts[b]
        cute.arch.sync_threads()
        if tidx < BINS:
            total = Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                total = total + sHist[tidx, w]
            sTotal[tidx] = total
        cute.arch.sync_threads()
        chosen = Int32(0)
        above = Int32(0)
        done = Int32(0)
        for j in cutlass.range_constexpr(BINS):
            b = BINS - 1 - j
            c = sTotal[b]
            if done == 0:
                if above + c >= remaining:
                    chosen = Int32(b)
                    done = Int32(1)
                else:
                    above = above + c
        remaining = remaining - above
        prefix = prefix | (chosen << shift)
        mask = mask | ((BINS - 1) << shift)
        cute.arch.sync_threads()  # sTotal is read by everyone before the next pass rewrites it

    threshold = prefix ^ INT_MIN  # back to the signed key order
    need = remaining              # keys equal to the threshold still to keep, lowest index first
    if n <= k:
        threshold = Int32(INT_MIN)
        need = n

    # Keep pass, in index order: exclusive scan of (greater, equal) packed in 16-bit halves.
    greater_base = Int32(0)
    equal_base = Int32(0)
    for base in cutlass.range(0, n, THREADS):
        i = base + tidx
        packed = Int32(0)
        if i < n:
            key = _order_key(mBits[row, i])
            if key > threshold:
                packed = Int32(1)
            if key == threshold:
                packed = Int32(1 << 16)
        before, total = _block_exclusive_scan(packed, lane, warp, sScan)
        greater_before = greater_base + (before & 0xFFFF)
        equal_before = equal_base + (before >> 16)
        kept_before = greater_before + cutlass.min(equal_before, need)
        if packed == 1:
            mOut[row, kept_before] = i
        if packed == (1 << 16):
            if equal_before < need:
                mOut[row, kept_before] = i
        greater_base = greater_base + (total & 0xFFFF)
        equal_base = equal_base + (total >> 16)
    kept = cutlass.min(n, k)
    for j in cutlass.range(kept + tidx, k, THREADS):
        mOut[row, j] = Int32(-1)


@cute.jit
def topk_launch(mBits: cute.Tensor, mLengths: cute.Tensor, mOut: cute.Tensor, k: Int32, stream):
    smem_bytes = (BINS * WARPS + BINS + WARPS) * 4 + 64
    _topk_kernel(mBits, mLengths, mOut, k).launch(grid=[mBits.shape[0], 1, 1], block=[THREADS, 1, 1],
                                                  smem=smem_bytes, stream=stream)
