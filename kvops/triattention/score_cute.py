"""TriAttention raw scores straight from the paged K pools, in CuTe DSL (one CTA per chunk of decode tokens).

CTA (chunk, layer * Hkv + g, r) scores CHUNK consecutive decode tokens of request r against the G query heads
of KV head g. A token's key is split over LANES lanes, each holding FPL frequencies (one 8- or 16-byte load from
each rotary half), so the per-(head, frequency) coefficients stay in registers and K is read exactly once; a
butterfly over the token's lanes finishes the dot products. Scores are staged in shared memory, then written
coalesced with the chunk's (mean, M2) per head, from which the reduce merges each (r, l, h)'s statistics.
Coefficients fold the mean phase in: a = qr C - qi S, b = qr S + qi C (qr, qi, e already times freq_scale_sq).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from .score import CHUNK  # decode tokens per CTA, and per statistics partial

THREADS = 128
WARPS = THREADS // 32
UNROLL = 4   # tokens per lane group whose loads are in flight together
KV_TYPES = (cutlass.BFloat16, cutlass.Float16)  # passed by index: DSL 4.3.5 takes no type as a compile argument


def lane_split(num_freqs: int, group: int) -> tuple[int, int]:
    """(frequencies per lane, lanes per token): 8 frequencies (16-byte bf16 loads) while the group's coefficients
    fit in registers (G <= 4), else 4."""
    fpl = 8 if group <= 4 else 4
    return fpl, num_freqs // fpl


def _spans(num_freqs: int, group: int) -> tuple[int, ...]:
    return tuple(1 << i for i in range(lane_split(num_freqs, group)[1].bit_length() - 1))


@cute.jit
def _block_sum(value: Float32, lane: Int32, warp: Int32, sRed: cute.Tensor) -> Float32:
    for step in cutlass.range_constexpr(5):
        value = value + cute.arch.shuffle_sync_bfly(value, 1 << step)
    if lane == 0:
        sRed[warp] = value
    cute.arch.sync_threads()
    total = Float32(0.0)
    for w in cutlass.range_constexpr(WARPS):
        total = total + sRed[w]
    cute.arch.sync_threads()
    return total


@cute.kernel
def _score_kernel(mLayerK: cute.Tensor, mTable: cute.Tensor, mPrompt: cute.Tensor, mCache: cute.Tensor,
                  mPhase: cute.Tensor, mQr: cute.Tensor, mQi: cute.Tensor, mE: cute.Tensor, mRaw: cute.Tensor,
                  mStats: cute.Tensor, page_stride: Int64, head_stride: Int64, token_stride: Int64,
                  kv_code: cutlass.Constexpr[int], F: cutlass.Constexpr[int], G: cutlass.Constexpr[int],
                  T: cutlass.Constexpr[int]):
    dtype = KV_TYPES[kv_code]
    tidx, _, _ = cute.arch.thread_idx()
    chunk, lg, r = cute.arch.block_idx()
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    FPL, LANES = lane_split(F, G)
    TOKENS = THREADS // LANES  # tokens per CTA step
    smem = cutlass.utils.SmemAllocator()
    sScore = smem.allocate_tensor(Float32, cute.make_layout((G, CHUNK), stride=(CHUNK, 1)), byte_alignment=16)
    sRed = smem.allocate_tensor(Float32, cute.make_layout(WARPS), byte_alignment=16)
    num_kv = mQr.shape[1] // G
    layer = lg // num_kv
    g = lg - layer * num_kv

    prompt = mPrompt[r]
    count = mCache[r] - prompt
    if count > mRaw.shape[3]:
        count = Int32(mRaw.shape[3])
    first = chunk * CHUNK
    todo = count - first
    if todo > CHUNK:
        todo = Int32(CHUNK)
    if todo > 0:
        q = tidx % LANES       # this lane's frequency slice within the token
        slot_in_step = tidx // LANES
        f0 = q * FPL
        ca = cute.make_rmem_tensor(G * FPL, Float32)
        cb = cute.make_rmem_tensor(G * FPL, Float32)
        ce = cute.make_rmem_tensor(G * FPL, Float32)
        for i in cutlass.range_constexpr(FPL):
            c = mPhase[r, 0, f0 + i]
            s = mPhase[r, 1, f0 + i]
            for h in cutlass.range_constexpr(G):
                qr = mQr[layer, g * G + h, f0 + i]
                qi = mQi[layer, g * G + h, f0 + i]
                ca[h * FPL + i] = qr * c - qi * s
                cb[h * FPL + i] = qr * s + qi * c
                ce[h * FPL + i] = mE[layer, g * G + h, f0 + i]

        base = mLayerK[layer] + (g * head_stride + f0) * (dtype.width // 8)
        for step in cutlass.range(0, todo, TOKENS * UNROLL):
            kr = [cute.make_rmem_tensor(FPL, dtype) for _ in range(UNROLL)]
            ki = [cute.make_rmem_tensor(FPL, dtype) for _ in range(UNROLL)]
            for u in cutlass.range_constexpr(UNROLL):
                i = step + u * TOKENS + slot_in_step
                if i >= todo:
                    i = Int32(0)  # past the chunk: reload its first token (cached), the score is not stored
                pos = prompt + first + i
                page = Int64(mTable[r, pos // T])
                addr = base + (page * page_stride + Int64(pos % T) * token_stride) * (dtype.width // 8)
                for half, dst in ((0, kr[u]), (F, ki[u])):
                    src = cute.make_ptr(dtype, addr + half * (dtype.width // 8), cute.AddressSpace.gmem,
                                        assumed_align=FPL * dtype.width // 8)
                    cute.autovec_copy(cute.make_tensor(src, cute.make_layout(FPL)), dst)
            for u in cutlass.range_constexpr(UNROLL):
                xr = cute.make_rmem_tensor(FPL, Float32)
                xi = cute.make_rmem_tensor(FPL, Float32)
                xr.store(kr[u].load().to(Float32))
                xi.store(ki[u].load().to(Float32))
                acc = cute.make_rmem_tensor(G, Float32)
                for h in cutlass.range_constexpr(G):
                    acc[h] = Float32(0.0)
                for f in cutlass.range_constexpr(FPL):
                    a, b = xr[f], xi[f]
                    mag = cute.math.sqrt(a * a + b * b, fastmath=True)
                    for h in cutlass.range_constexpr(G):
                        acc[h] = acc[h] + ca[h * FPL + f] * a + cb[h * FPL + f] * b + ce[h * FPL + f] * mag
                for h in cutlass.range_constexpr(G):
                    for span in _spans(F, G):  # butterfly over the token's lanes
                        acc[h] = acc[h] + cute.arch.shuffle_sync_bfly(acc[h], span)
                i = step + u * TOKENS + slot_in_step
                for h in cutlass.range_constexpr(G):
                    if q == h % lane_split(F, G)[1]:  # (a Python int: names read in the loop become Int32)
                        if i < todo:
                            sScore[h, i] = acc[h]
        cute.arch.sync_threads()

        # Chunk statistics per head (mean, then M2 about it: no cancellation), and the coalesced write-out.
        inv = Float32(1.0) / Float32(todo)
        for h in cutlass.range_constexpr(G):
            part = Float32(0.0)
            for i in cutlass.range(tidx, todo, THREADS):
                part = part + sScore[h, i]
            mean = _block_sum(part, lane, warp, sRed) * inv
            part = Float32(0.0)
            for i in cutlass.range(tidx, todo, THREADS):
                d = sScore[h, i] - mean
                part = part + d * d
                mRaw[r, layer, g * G + h, first + i] = sScore[h, i]
            m2 = _block_sum(part, lane, warp, sRed)
            if tidx == 0:
                mStats[r, layer, g * G + h, chunk, 0] = mean
                mStats[r, layer, g * G + h, chunk, 1] = m2


@cute.jit
def score_launch(mLayerK: cute.Tensor, mTable: cute.Tensor, mPrompt: cute.Tensor, mCache: cute.Tensor,
                 mPhase: cute.Tensor, mQr: cute.Tensor, mQi: cute.Tensor, mE: cute.Tensor, mRaw: cute.Tensor,
                 mStats: cute.Tensor, page_stride: Int64, head_stride: Int64, token_stride: Int64,
                 kv_code: cutlass.Constexpr[int], F: cutlass.Constexpr[int], G: cutlass.Constexpr[int],
                 T: cutlass.Constexpr[int], stream):
    smem_bytes = (G * CHUNK + WARPS) * 4 + 64
    grid = [mStats.shape[3], mQr.shape[0] * (mQr.shape[1] // G), mRaw.shape[0]]
    _score_kernel(mLayerK, mTable, mPrompt, mCache, mPhase, mQr, mQi, mE, mRaw, mStats, page_stride, head_stride,
                  token_stride, kv_code, F, G, T).launch(grid=grid, block=[THREADS, 1, 1], smem=smem_bytes,
                                                       stream=stream)
