"""kvops.topk's CuTe class: radix top-k over rows of ragged lengths, in CuTe DSL (one CTA of 1024 threads per
row).

Keys are the fp32 bit patterns made order-preserving as unsigned ints (NaN lowest, -0 == +0). The k-th largest
key T is found in three radix passes of 11, 11 and 10 bits with shared-memory histograms:
- pass 0 histograms the top digit. A row of up to CANDIDATES keys is copied whole into shared memory by cp.async
  on the way (every copy in flight at once, holding no registers), so later sweeps read shared memory only; a
  longer row is swept from global memory.
- Each thread then lists, in its own slice of shared memory (no atomics), the keys it sees that share the chosen
  top digit: a few percent of a row of scores. Passes 1 and 2 histogram only these lists (a list that overflows
  sends both passes back to the whole row).
- Each digit's bin is picked by the whole CTA (a block scan over the histogram from the top bin down).
A last pass in index order marks, per thread, its keys > T and == T in two bit masks; a block-wide exclusive scan
of their counts places them, so the indices come out ascending, with the first (k - #greater) keys == T kept
(lowest index wins ties). Lengths are read on the device; rows longer than k keep k, shorter rows keep all and
pad with -1.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op

THREADS = 1024
WARPS = THREADS // 32
PER_THREAD = 8          # consecutive elements per thread and keep-pass step (global sweeps: all loaded first)
VEC = 4                 # keys per 16-byte shared-memory access (and cp.async copy, for aligned rows)
HIST = 2048             # bins of the widest digit
DIGITS = ((21, 11), (10, 11), (0, 10))  # (shift, bits) per radix pass, most significant first
CANDIDATES = 32768      # a row up to this length is staged whole in shared memory (128 KiB)
SPILL = 16384           # room for the keys sharing the top digit: beside a staged row, or with CANDIDATES for a
                        # longer row; split evenly into per-thread lists (no atomics); overflow: sweep the row
SIGN = -(2 ** 31)
# What the scans, the bin picks and the staged keep pass rely on: one warp total per lane, at least one bin per
# thread, whole keep-pass steps over a staged row, equal per-thread candidate lists.
assert WARPS <= 32 and min(1 << w for _, w in DIGITS) >= THREADS and CANDIDATES % (THREADS * PER_THREAD) == 0
assert SPILL % THREADS == 0 and (CANDIDATES + SPILL) % THREADS == 0


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
    """Order-preserving key as unsigned bits (held in an Int32): larger float -> larger unsigned key. The one
    rule of kvops/topk/reference.py's sort_keys, written in CuTe DSL (csrc/topk/topk.h's ukey mirrors it; the
    tests check each against it)."""
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed order: negative floats get their magnitude flipped
    if key == -1:  # -0.0 ranks with +0.0
        key = Int32(0)
    if (bits & 0x7FFFFFFF) > 0x7F800000:  # NaN ranks below -inf
        key = Int32(SIGN)
    return key ^ SIGN


@cute.jit
def _ugt(a: Int32, b: Int32) -> cutlass.Boolean:
    return Uint32(a) > Uint32(b)


@cute.jit
def _warp_inclusive_scan(value: Int32, lane: Int32) -> Int32:
    for step in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(value, 1 << step, mask_and_clamp=0)  # shfl.up needs clamp 0
        if lane >= (1 << step):
            value = value + up
    return value


@cute.jit
def _block_exclusive_scan(value: Int32, lane: Int32, warp: Int32, sScan: cute.Tensor) -> tuple:
    """(exclusive prefix of value over the CTA in thread order, CTA total). Ends with a barrier."""
    incl = _warp_inclusive_scan(value, lane)
    if lane == 31:
        sScan[warp] = incl
    cute.arch.sync_threads()
    total = Int32(0)
    if lane < WARPS:
        total = sScan[lane]
    upto = _warp_inclusive_scan(total, lane)  # lane w: the warps 0..w
    before = cute.arch.shuffle_sync(upto, cutlass.max(warp - 1, 0))
    if warp == 0:
        before = Int32(0)
    total = cute.arch.shuffle_sync(upto, WARPS - 1)
    cute.arch.sync_threads()
    return incl - value + before, total


@cute.jit
def _select_bin(sHist: cute.Tensor, bins: cutlass.Constexpr[int], remaining: Int32, tidx: Int32, lane: Int32,
                warp: Int32, sScan: cute.Tensor, sPick: cute.Tensor):
    """The bin holding the remaining-th largest key, found by the whole CTA: thread t owns bins/THREADS bins from
    the top down, so an exclusive scan in thread order counts the keys above each thread's bins. The one thread
    whose bins reach `remaining` walks them and writes (bin, count of keys above it) to sPick. The caller
    synchronizes before reading sPick."""
    per_thread = bins // THREADS
    top = bins - 1 - tidx * per_thread  # descending: top, top - 1, ...
    mine = Int32(0)
    for j in cutlass.range_constexpr(per_thread):
        mine = mine + sHist[top - j]
    above, _ = _block_exclusive_scan(mine, lane, warp, sScan)
    if above < remaining:
        if above + mine >= remaining:
            done = Int32(0)
            for j in cutlass.range_constexpr(per_thread):
                c = sHist[top - j]
                if done == 0:
                    if above + c >= remaining:
                        sPick[0] = top - j
                        sPick[1] = above
                        done = Int32(1)
                    else:
                        above = above + c


@cute.jit
def _copy_chunks(start: Int64, sVec: cute.Tensor, tidx: Int32, lo: Int32, hi: Int32, n: Int32,
                 vector: cutlass.Constexpr[bool]):
    """cp.async this thread's chunks tidx + j * THREADS, j in [lo, hi), of the row at `start` into sVec (key i at
    element i): one 16-byte copy per chunk when the caller vouches for 16-byte aligned rows whose padded length
    stays inside the tensor, else one 4-byte copy per key."""
    if cutlass.const_expr(vector):
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), Int32,
                                   num_bits_per_copy=32 * VEC)
        for j in cutlass.range(lo, hi):
            c = tidx + j * THREADS
            src = cute.make_ptr(Int32, start + Int64(c) * (4 * VEC), cute.AddressSpace.gmem, assumed_align=16)
            cute.copy(atom, cute.make_tensor(src, cute.make_layout(VEC)), sVec[None, c])
    else:
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), Int32,
                                   num_bits_per_copy=32)
        sOne = cute.make_tensor(sVec.iterator, cute.make_layout((1, CANDIDATES)))
        for j in cutlass.range(lo, hi):
            c = tidx + j * THREADS
            for e in cutlass.range_constexpr(VEC):
                i = c * VEC + e
                if i < n:
                    src = cute.make_ptr(Int32, start + Int64(i) * 4, cute.AddressSpace.gmem, assumed_align=4)
                    cute.copy(atom, cute.make_tensor(src, cute.make_layout(1)), sOne[None, i])


@cute.jit
def _count_chunks(sVec: cute.Tensor, sHist: cute.Tensor, tidx: Int32, lo: Int32, hi: Int32, n: Int32):
    """Make this thread's chunks j in [lo, hi) order-preserving in place and histogram their top digit."""
    shift, width = DIGITS[0]
    for j in cutlass.range(lo, hi):
        c = tidx + j * THREADS
        keys = cute.make_rmem_tensor(VEC, Int32)
        keys.store(sVec[None, c].load())
        for e in cutlass.range_constexpr(VEC):
            keys[e] = _ukey(keys[e])
        sVec[None, c].store(keys.load())
        for e in cutlass.range_constexpr(VEC):
            if c * VEC + e < n:
                _smem_add(sHist.iterator + ((keys[e] >> shift) & ((1 << width) - 1)), 1)


@cute.jit
def _stage_and_count(mBits: cute.Tensor, row: Int32, sVec: cute.Tensor, n: Int32, tidx: Int32,
                     vector: cutlass.Constexpr[bool], sHist: cute.Tensor):
    """First pass over a row that fits in shared memory: copy it in with cp.async and histogram its top digit.
    Thread t copies, then reads back, the chunks t, t + THREADS, ... itself, so it waits for its own copies only
    (in two groups: the first half is counted while the second lands) and no barrier is needed until the pass
    ends. Every copy is in flight at once and holds no registers."""
    start = (mBits.iterator + row * mBits.layout.stride[0]).toint()
    chunks = (n + VEC - 1) // VEC
    mine = Int32(0)
    if tidx < chunks:
        mine = (chunks - 1 - tidx) // THREADS + 1
    half = (mine + 1) // 2
    _copy_chunks(start, sVec, tidx, Int32(0), half, n, vector)
    cute.arch.cp_async_commit_group()
    _copy_chunks(start, sVec, tidx, half, mine, n, vector)
    cute.arch.cp_async_commit_group()
    cute.arch.cp_async_wait_group(1)
    _count_chunks(sVec, sHist, tidx, Int32(0), half, n)
    cute.arch.cp_async_wait_group(0)
    _count_chunks(sVec, sHist, tidx, half, mine, n)


@cute.jit
def _visit(u: Int32, valid: cutlass.Boolean, mask: Int32, prefix: Int32, shift: cutlass.Constexpr[int],
           bins: cutlass.Constexpr[int], sHist: cute.Tensor, collect: cutlass.Constexpr[bool], sBuf: cute.Tensor,
           at: Int32, got: Int32, cap: Int32) -> Int32:
    """A key u that matches `prefix` under `mask`: histogram digit `shift`, or (collect) append it to this
    thread's candidate list sBuf[at:at + cap]. Returns the list's new length (counting past cap: overflow)."""
    if valid:
        if (u & mask) == prefix:
            if cutlass.const_expr(collect):
                if got < cap:
                    sBuf[at + got] = u
                got = got + 1
            else:
                _smem_add(sHist.iterator + ((u >> shift) & (bins - 1)), 1)
    return got


@cute.jit
def _sweep_shared(sVec: cute.Tensor, n: Int32, tidx: Int32, mask: Int32, prefix: Int32,
                  shift: cutlass.Constexpr[int], bins: cutlass.Constexpr[int], sHist: cute.Tensor,
                  collect: cutlass.Constexpr[bool], sBuf: cute.Tensor, at: Int32, cap: Int32) -> Int32:
    """_visit every key of a staged row, VEC at a time in any order (neither a histogram nor a list of candidates
    cares)."""
    got = Int32(0)
    for c in cutlass.range(tidx, (n + VEC - 1) // VEC, THREADS):
        keys = cute.make_rmem_tensor(VEC, Int32)
        keys.store(sVec[None, c].load())
        for e in cutlass.range_constexpr(VEC):
            got = _visit(keys[e], c * VEC + e < n, mask, prefix, shift, bins, sHist, collect, sBuf, at, got, cap)
    return got


@cute.jit
def _index(base: Int32, tidx: Int32, e: int, consecutive: cutlass.Constexpr[bool]) -> Int32:
    """Element e of this thread in the sweep step at base: consecutive per thread (index order follows thread
    order, which the keep pass's scan needs) or strided by THREADS (each load instruction coalesced)."""
    if cutlass.const_expr(consecutive):
        return base + tidx * PER_THREAD + e
    else:
        return base + e * THREADS + tidx


@cute.jit
def _load_global(mBits: cute.Tensor, row: Int32, base: Int32, tidx: Int32, n: Int32, keys: cute.Tensor,
                 consecutive: cutlass.Constexpr[bool]):
    """This thread's PER_THREAD keys of the sweep step at base, from global memory. Every load is issued before any
    key is used (indices past the row read its last key, so no load is conditional); the caller masks by index."""
    for e in cutlass.range_constexpr(PER_THREAD):
        keys[e] = mBits[row, cutlass.min(_index(base, tidx, e, consecutive), n - 1)]
    for e in cutlass.range_constexpr(PER_THREAD):
        keys[e] = _ukey(keys[e])


@cute.jit
def _sweep_global(mBits: cute.Tensor, row: Int32, n: Int32, tidx: Int32, keys: cute.Tensor, mask: Int32,
                  prefix: Int32, shift: cutlass.Constexpr[int], bins: cutlass.Constexpr[int], sHist: cute.Tensor,
                  collect: cutlass.Constexpr[bool], sBuf: cute.Tensor, at: Int32, cap: Int32) -> Int32:
    """_visit every key of a row that is not staged, read from global memory in coalesced order."""
    got = Int32(0)
    for base in cutlass.range(0, n, THREADS * PER_THREAD):
        _load_global(mBits, row, base, tidx, n, keys, False)
        for e in cutlass.range_constexpr(PER_THREAD):
            got = _visit(keys[e], _index(base, tidx, e, False) < n, mask, prefix, shift, bins, sHist, collect, sBuf,
                         at, got, cap)
    return got


class TopK:
    """The kernel for one staging-copy width. vector: 16-byte copies; the caller vouches that every row starts
    16-byte aligned and that the row length rounded up to 4 stays inside the tensor. (A class attribute, not a
    kernel argument: an attribute is a compile-time constant, so each width is its own specialized kernel.)"""

    def __init__(self, vector: bool):
        self.vector = vector

    @cute.jit
    def __call__(self, mBits: cute.Tensor, mLengths: cute.Tensor, mOffsets: cute.Tensor, with_offsets: Int32,
                 mOut: cute.Tensor, k: Int32, stream):
        smem_bytes = (HIST + CANDIDATES + SPILL + WARPS + 4) * 4 + 256
        self.kernel(mBits, mLengths, mOffsets, with_offsets, mOut, k).launch(
            grid=[mBits.shape[0], 1, 1], block=[THREADS, 1, 1], smem=smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, mBits: cute.Tensor, mLengths: cute.Tensor, mOffsets: cute.Tensor, with_offsets: Int32,
               mOut: cute.Tensor, k: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        smem = cutlass.utils.SmemAllocator()
        sHist = smem.allocate_tensor(Int32, cute.make_layout(HIST), byte_alignment=16)
        # A staged row in [0, CANDIDATES) and the candidate lists after it; a longer row's candidate lists from 0.
        sBuf = smem.allocate_tensor(Int32, cute.make_layout(CANDIDATES + SPILL), byte_alignment=16)
        sVec = cute.make_tensor(sBuf.iterator, cute.make_layout((VEC, CANDIDATES // VEC)))
        sCols = cute.make_tensor(sBuf.iterator, cute.make_layout((PER_THREAD, CANDIDATES // PER_THREAD)))
        sScan = smem.allocate_tensor(Int32, cute.make_layout(WARPS), byte_alignment=16)
        sPick = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)  # bin, above, overflow

        n = mLengths[row]
        if n > mBits.shape[1]:
            n = Int32(mBits.shape[1])
        if n < 0:
            n = Int32(0)
        keys = cute.make_rmem_tensor(PER_THREAD, Int32)
        staged = n > k and n <= CANDIDATES  # the whole row lives in sBuf (as keys after the first pass)

        threshold = Int32(0)  # unsigned-order key of the k-th largest
        need = n              # keys equal to the threshold to keep (lowest index first)
        if n > k:
            cap = Int32((CANDIDATES + SPILL) // THREADS)  # this thread's candidate list: sBuf[at:at + cap]
            at = tidx * cap
            if staged:
                cap = Int32(SPILL // THREADS)
                at = CANDIDATES + tidx * cap
            prefix = Int32(0)
            mask = Int32(0)
            remaining = k
            overflow = Int32(0)
            got = Int32(0)
            for p in cutlass.range_constexpr(len(DIGITS)):
                shift, width = DIGITS[p]
                bins = 1 << width
                for b in cutlass.range(tidx, bins, THREADS):
                    sHist[b] = Int32(0)
                if tidx == 0:
                    sPick[0] = Int32(0)
                    sPick[1] = Int32(0)
                    if cutlass.const_expr(p == 0):
                        sPick[2] = Int32(0)
                cute.arch.sync_threads()
                if cutlass.const_expr(p == 0):
                    if staged:
                        _stage_and_count(mBits, row, sVec, n, tidx, self.vector, sHist)
                    else:
                        _sweep_global(mBits, row, n, tidx, keys, mask, prefix, shift, bins, sHist, False, sBuf, at,
                                      cap)
                else:
                    if overflow == 0:  # the thread's own candidates
                        for j in cutlass.range(0, got):
                            _visit(sBuf[at + j], True, mask, prefix, shift, bins, sHist, False, sBuf, at, got, cap)
                    elif staged:
                        _sweep_shared(sVec, n, tidx, mask, prefix, shift, bins, sHist, False, sBuf, at, cap)
                    else:
                        _sweep_global(mBits, row, n, tidx, keys, mask, prefix, shift, bins, sHist, False, sBuf, at,
                                      cap)
                cute.arch.sync_threads()
                _select_bin(sHist, bins, remaining, tidx, lane, warp, sScan, sPick)
                cute.arch.sync_threads()
                remaining = remaining - sPick[1]
                prefix = prefix | (sPick[0] << shift)
                mask = mask | _i32((bins - 1) << shift)
                if cutlass.const_expr(p == 0):
                    # Each thread lists the keys sharing the top digit that it sees (a few percent of a row of
                    # scores), without atomics; the next two passes read only these lists unless one overflowed.
                    if staged:
                        got = _sweep_shared(sVec, n, tidx, mask, prefix, shift, bins, sHist, True, sBuf, at, cap)
                    else:
                        got = _sweep_global(mBits, row, n, tidx, keys, mask, prefix, shift, bins, sHist, True, sBuf,
                                            at, cap)
                    if got > cap:
                        sPick[2] = Int32(1)
                cute.arch.sync_threads()
                if cutlass.const_expr(p == 0):
                    overflow = sPick[2]
            threshold = prefix
            need = remaining

        # Keep pass in index order: per thread, bit masks of its keys > T and == T; an exclusive scan of their
        # counts (packed in 16-bit halves) places them; only set bits are visited. A kept index is written plus the
        # row's offset (mOffsets[row], when with_offsets is set).
        offset = Int32(0)
        if with_offsets != 0:
            offset = mOffsets[row]
        greater_base = Int32(0)
        equal_base = Int32(0)
        for base in cutlass.range(0, n, THREADS * PER_THREAD):
            if staged:
                keys.store(sCols[None, base // PER_THREAD + tidx].load())
            else:
                _load_global(mBits, row, base, tidx, n, keys, True)
            gmask = Int32(0)
            emask = Int32(0)
            for e in cutlass.range_constexpr(PER_THREAD):
                if _index(base, tidx, e, True) < n:
                    if _ugt(keys[e], threshold):
                        gmask = gmask | (1 << e)
                    if keys[e] == threshold:
                        emask = emask | (1 << e)
            before, total = _block_exclusive_scan(cute.arch.popc(gmask) | (cute.arch.popc(emask) << 16), lane,
                                                  warp, sScan)
            greater = greater_base + (before & 0xFFFF)
            equal = equal_base + (before >> 16)
            todo = gmask | emask
            while todo != 0:
                bit = todo & (0 - todo)
                below = bit - 1
                ties = equal + cute.arch.popc(emask & below)  # keys == T before this one
                slot = greater + cute.arch.popc(gmask & below) + cutlass.min(ties, need)
                if (gmask & bit) != 0 or ties < need:
                    if slot < k:  # always true for a consistent threshold; never write past the row
                        mOut[row, slot] = base + tidx * PER_THREAD + cute.arch.popc(below) + offset
                todo = todo ^ bit
            greater_base = greater_base + (total & 0xFFFF)
            equal_base = equal_base + (total >> 16)
        for j in cutlass.range(cutlass.min(n, k) + tidx, k, THREADS):
            mOut[row, j] = Int32(-1)
