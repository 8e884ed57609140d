"""Radix top-k over rows of ragged lengths, in CuTe DSL (one CTA per row).

Keys are the fp32 bit patterns made order-preserving as unsigned ints (NaN lowest, -0 == +0). The k-th
largest key T is found in three radix passes of 11, 11 and 10 bits with shared-memory histograms. The first
pass reads the row; a row of up to CANDIDATES keys is staged in shared memory on the way, so the row is read
from global memory once. Longer rows copy the keys that share T's top 11 bits (a few percent of a row of scores)
to shared memory instead. The next two passes histogram shared memory only. A last pass in index order keeps
every key > T and the first (k - #greater) keys == T (lowest index wins ties) and writes their indices in
ascending order through a block-wide exclusive scan. Lengths are read on the device; rows longer than k keep k,
shorter rows keep all and pad with -1.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

THREADS = 512
WARPS = THREADS // 32
PER_THREAD = 8          # consecutive elements per thread and sweep step, all loaded before any is used
HIST = 2048             # bins of the widest digit
DIGITS = ((21, 11), (10, 11), (0, 10))  # (shift, bits) per radix pass, most significant first
CANDIDATES = 32768      # keys kept in shared memory (128 KiB, a multiple of the sweep step): a whole row up to this
                        # length, else those sharing the top digit; more: every pass reads the row
SIGN = -(2 ** 31)


def _i32(value: int) -> int:
    """A 32-bit pattern as a Python int that fits Int32 (trace-time constants must not widen to 64 bits)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= (1 << 31) else value


@dsl_user_op
def _smem_add(ptr: cute.Pointer, value: Int32, *, loc=None, ip=None) -> Int32:
    """atomicAdd on shared memory (the llvm dialect op, which every CuTe DSL version shares)."""
    return Int32(llvm.atomicrmw(llvm.AtomicBinOp.add, ptr.llvm_ptr, Int32(value).ir_value(loc=loc, ip=ip),
                                llvm.AtomicOrdering.monotonic, loc=loc, ip=ip))


@cute.jit
def _ukey(bits: Int32) -> Int32:
    """Order-preserving key as unsigned bits (held in an Int32): larger float -> larger unsigned key."""
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order: negative floats get their magnitude flipped
    if key == -1:  # -0.0 ranks with +0.0
        key = Int32(0)
    if (bits & 0x7FFFFFFF) > 0x7F800000:  # NaN ranks below -inf
        key = Int32(SIGN)
    return key ^ SIGN


@cute.jit
def _ugt(a: Int32, b: Int32) -> cutlass.Boolean:
    return (a ^ SIGN) > (b ^ SIGN)  # unsigned a > b


@cute.jit
def _block_exclusive_scan(value: Int32, lane: Int32, warp: Int32, sScan: cute.Tensor) -> tuple:
    """(exclusive prefix of value over the CTA in thread order, CTA total). Ends with a barrier."""
    incl = value
    for step in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(incl, 1 << step, mask_and_clamp=0)  # shfl.up needs clamp 0
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


@cute.jit
def _select_bin(sHist: cute.Tensor, bins: cutlass.Constexpr[int], remaining: Int32, lane: Int32, warp: Int32,
                sPick: cute.Tensor):
    """Warp 0 finds, from the top bin down, the bin holding the remaining-th largest key; writes
    (bin, count of keys above it) to sPick. The caller synchronizes."""
    if warp == 0:
        per_lane = bins // 32
        top = bins - 1 - lane * per_lane  # lane l owns bins top, top-1, ... (descending)
        mine = Int32(0)
        for j in cutlass.range_constexpr(per_lane):
            mine = mine + sHist[top - j]
        incl = mine
        for step in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(incl, 1 << step, mask_and_clamp=0)  # shfl.up needs clamp 0
            if lane >= (1 << step):
                incl = incl + up
        above = incl - mine
        if above < remaining:
            if incl >= remaining:  # exactly one lane: walk its bins
                done = Int32(0)
                for j in cutlass.range_constexpr(per_lane):
                    c = sHist[top - j]
                    if done == 0:
                        if above + c >= remaining:
                            sPick[0] = top - j
                            sPick[1] = above
                            done = Int32(1)
                        else:
                            above = above + c


@cute.jit
def _index(base: Int32, tidx: Int32, e: int, consecutive: cutlass.Constexpr[bool]) -> Int32:
    """Element e of this thread in the sweep step at base: consecutive per thread (index order follows thread
    order, which the keep pass's scan needs) or strided by THREADS (each load instruction coalesced)."""
    if cutlass.const_expr(consecutive):
        return base + tidx * PER_THREAD + e
    else:
        return base + e * THREADS + tidx


@cute.jit
def _load_keys(mBits: cute.Tensor, row: Int32, sCols: cute.Tensor, staged: cutlass.Boolean, base: Int32,
               tidx: Int32, n: Int32, keys: cute.Tensor, consecutive: cutlass.Constexpr[bool]):
    """This thread's PER_THREAD keys of the sweep step at base. From global memory, every load is issued before
    any key is used (indices past the row read its last key, so no load is conditional); from a row staged in
    shared memory (consecutive order only), as vector loads of the thread's column (the row's capacity covers
    the last step). The caller masks by index."""
    if staged:
        keys.store(sCols[None, base // PER_THREAD + tidx].load())
    else:
        for e in cutlass.range_constexpr(PER_THREAD):
            keys[e] = mBits[row, cutlass.min(_index(base, tidx, e, consecutive), n - 1)]
        for e in cutlass.range_constexpr(PER_THREAD):
            keys[e] = _ukey(keys[e])


@cute.kernel
def _topk_kernel(mBits: cute.Tensor, mLengths: cute.Tensor, mOut: cute.Tensor, k: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    smem = cutlass.utils.SmemAllocator()
    sHist = smem.allocate_tensor(Int32, cute.make_layout(HIST), byte_alignment=16)
    sCand = smem.allocate_tensor(Int32, cute.make_layout(CANDIDATES), byte_alignment=16)
    sCols = cute.make_tensor(sCand.iterator, cute.make_layout((PER_THREAD, CANDIDATES // PER_THREAD)))
    sScan = smem.allocate_tensor(Int32, cute.make_layout(WARPS), byte_alignment=16)
    sPick = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)  # bin, above, candidate count

    n = mLengths[row]
    if n > mBits.shape[1]:
        n = Int32(mBits.shape[1])
    if n < 0:
        n = Int32(0)
    step = THREADS * PER_THREAD
    keys = cute.make_rmem_tensor(PER_THREAD, Int32)
    staged = n > k and n <= CANDIDATES  # the first pass stages the row in sCand; later sweeps read it there

    threshold = Int32(0)  # unsigned-order key of the k-th largest
    need = n              # keys equal to the threshold to keep (lowest index first)
    if n > k:
        prefix = Int32(0)
        mask = Int32(0)
        remaining = k
        count = Int32(0)
        for p in cutlass.range_constexpr(len(DIGITS)):
            shift, width = DIGITS[p]
            bins = 1 << width
            for b in cutlass.range(tidx, bins, THREADS):
                sHist[b] = Int32(0)
            if tidx == 0:
                sPick[0] = Int32(0)
                sPick[1] = Int32(0)
                sPick[2] = Int32(0)
            cute.arch.sync_threads()
            use_cand = p > 0 and count <= CANDIDATES
            if use_cand:
                for j in cutlass.range(tidx, count, THREADS):
                    u = sCand[j]
                    if (u & mask) == prefix:
                        _smem_add(sHist.iterator + ((u >> shift) & (bins - 1)), 1)
            else:
                for base in cutlass.range(0, n, step):
                    _load_keys(mBits, row, sCols, False, base, tidx, n, keys, False)
                    for e in cutlass.range_constexpr(PER_THREAD):
                        i = _index(base, tidx, e, False)
                        if i < n:
                            u = keys[e]
                            if p == 0 and staged:
                                sCand[i] = u
                            if (u & mask) == prefix:
                                _smem_add(sHist.iterator + ((u >> shift) & (bins - 1)), 1)
            cute.arch.sync_threads()
            _select_bin(sHist, bins, remaining, lane, warp, sPick)
            cute.arch.sync_threads()
            chosen = sPick[0]
            remaining = remaining - sPick[1]
            if p == 0:
                count = sHist[chosen]
                if staged:
                    count = n  # the candidates are the whole staged row (the next passes mask by prefix)
            prefix = prefix | (chosen << shift)
            mask = mask | _i32((bins - 1) << shift)
            if p == 0:
                if not staged and count <= CANDIDATES:  # keep the keys sharing the top digit for the next passes
                    for base in cutlass.range(0, n, step):
                        _load_keys(mBits, row, sCols, False, base, tidx, n, keys, False)
                        for e in cutlass.range_constexpr(PER_THREAD):
                            i = _index(base, tidx, e, False)
                            if i < n:
                                u = keys[e]
                                if (u & mask) == prefix:
                                    sCand[_smem_add(sPick.iterator + 2, 1)] = u
            cute.arch.sync_threads()
        threshold = prefix
        need = remaining

    # Keep pass in index order: exclusive scan of per-thread (greater, equal) counts packed in 16-bit halves.
    greater_base = Int32(0)
    equal_base = Int32(0)
    for base in cutlass.range(0, n, step):
        _load_keys(mBits, row, sCols, staged, base, tidx, n, keys, True)
        flags = cute.make_rmem_tensor(PER_THREAD, Int32)
        packed = Int32(0)
        for e in cutlass.range_constexpr(PER_THREAD):
            i = _index(base, tidx, e, True)
            flags[e] = Int32(0)
            if i < n:
                u = keys[e]
                if _ugt(u, threshold):
                    flags[e] = Int32(1)
                if u == threshold:
                    flags[e] = Int32(1 << 16)
            packed = packed + flags[e]
        before, total = _block_exclusive_scan(packed, lane, warp, sScan)
        greater = greater_base + (before & 0xFFFF)
        equal = equal_base + (before >> 16)
        for e in cutlass.range_constexpr(PER_THREAD):
            i = _index(base, tidx, e, True)
            slot = greater + cutlass.min(equal, need)
            if flags[e] == 1:
                if slot < k:  # always true for a consistent threshold; never write past the row
                    mOut[row, slot] = i
                greater = greater + 1
            if flags[e] == (1 << 16):
                if equal < need and slot < k:
                    mOut[row, slot] = i
                equal = equal + 1
        greater_base = greater_base + (total & 0xFFFF)
        equal_base = equal_base + (total >> 16)
    for j in cutlass.range(cutlass.min(n, k) + tidx, k, THREADS):
        mOut[row, j] = Int32(-1)


@cute.jit
def topk_launch(mBits: cute.Tensor, mLengths: cute.Tensor, mOut: cute.Tensor, k: Int32, stream):
    smem_bytes = (HIST + CANDIDATES + WARPS + 4) * 4 + 256
    _topk_kernel(mBits, mLengths, mOut, k).launch(grid=[mBits.shape[0], 1, 1], block=[THREADS, 1, 1],
                                                  smem=smem_bytes, stream=stream)
