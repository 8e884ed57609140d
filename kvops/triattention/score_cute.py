"""TriAttention raw scores straight from the paged K pools, in CuTe DSL (one CTA per chunk of decode tokens).

CTA (chunk, layer * Hkv + g, r) scores CHUNK consecutive decode tokens of request r against the G query heads
of KV head g. A token's key is split over LANES lanes, each holding FPL frequencies (one 8- or 16-byte load from
each rotary half); K is read exactly once. The per-(head, frequency) coefficients and the chunk's page ids are
staged in shared memory; the main loop runs frequency by frequency (one frequency's fp32 values live at a time),
and each coefficient read serves UNROLL tokens, whose successors' loads are in flight in registers meanwhile. A
reduce-scatter butterfly over the token's lanes finishes the G dot products. Scores are staged in shared memory,
then written coalesced with the (mean, M2, count) of the chunk's finite scores per head,
from which the reduce merges each (r, l, h)'s statistics. A token whose page is absent (-1 or outside the pool,
or past the page table) scores NaN.
Coefficients fold the mean phase in: a = qr C - qi S, b = qr S + qi C (qr, qi, e already times freq_scale_sq).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .score import lane_split

@dsl_user_op
def sqrt_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """One MUFU.SQRT, pinned as inline PTX so that the main loop's instruction count does not depend on how a DSL
    release lowers cute.math.sqrt(fastmath=True) (an IEEE sequence with a slow-path branch costs about 8 more
    instructions per call, a third of the scorer's main loop)."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "sqrt.approx.ftz.f32 $0, $1;",
                                   "=f,f", has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def _block_sum2(a: Float32, b: Float32, lane: Int32, warp: Int32, sRed: cute.Tensor,
                warps: cutlass.Constexpr[int]):
    """The CTA-wide sums of two values (sRed holds 2 * warps floats)."""
    for step in cutlass.range_constexpr(5):
        a = a + cute.arch.shuffle_sync_bfly(a, 1 << step)
        b = b + cute.arch.shuffle_sync_bfly(b, 1 << step)
    if lane == 0:
        sRed[warp] = a
        sRed[warps + warp] = b
    cute.arch.sync_threads()
    total_a, total_b = Float32(0.0), Float32(0.0)
    for w in cutlass.range_constexpr(warps):
        total_a, total_b = total_a + sRed[w], total_b + sRed[warps + w]
    cute.arch.sync_threads()
    return total_a, total_b


class Scorer:
    """One compiled shape class. Its constants are attributes, read as self.X where used: an attribute is a
    compile-time constant wherever the kernel reads it (inside dynamic loops too), so each class is fully
    specialized and its constants are part of the compile key."""

    def __init__(self, kv_type, num_freqs: int, group: int, page_size: int, chunk: int, *, threads: int = 64,
                 unroll: int = 4, freqs_per_lane: int | None = None):
        # The shape class (KV dtype, F, G, page size), the layout of the statistics (chunk: decode tokens per CTA
        # and per partial), and the launch knobs (threads per CTA; unroll: tokens per lane group per pipeline
        # stage, whose successors' loads fly while these are scored; frequencies per lane), all part of the
        # compile key. The defaults are the sweep's choice (docs/triattention.md, "Speed").
        self.dtype = kv_type  # the keys' cutlass type (score.py's KV_DTYPES)
        self.F, self.G, self.T, self.CHUNK = num_freqs, group, page_size, chunk
        self.FPL, self.LANES = lane_split(num_freqs, group, freqs_per_lane)
        self.THREADS, self.WARPS, self.UNROLL = threads, threads // 32, unroll
        self.TOKENS = threads // self.LANES  # tokens per CTA step
        self.SPANS = tuple(1 << i for i in range(self.LANES.bit_length() - 1))  # butterfly over a token's lanes
        self.G2 = 1 << (group - 1).bit_length()  # heads padded to a power of two for the reduce-scatter
        self.HALVINGS = min(len(self.SPANS), (self.G2 - 1).bit_length())
        self.BYTES = self.dtype.width // 8
        self.PAGES = (chunk + page_size - 2) // page_size + 1  # pages a chunk can touch
        self.HG = (group + 3) // 4  # groups of 4 heads: one 16-byte coefficient load each

    @cute.jit
    def __call__(self, mLayerK: cute.Tensor, mTable: cute.Tensor, mPrompt: cute.Tensor, mCache: cute.Tensor,
                 mPhase: cute.Tensor, mQr: cute.Tensor, mQi: cute.Tensor, mE: cute.Tensor, mRaw: cute.Tensor,
                 mStats: cute.Tensor, page_stride: Int64, head_stride: Int64, token_stride: Int64, num_pages: Int32,
                 stream):
        smem_bytes = (self.G * self.CHUNK + 2 * self.WARPS + self.PAGES + 12 * self.HG * self.F) * 4 + 64
        grid = [mStats.shape[3], mQr.shape[0] * (mQr.shape[1] // self.G), mRaw.shape[0]]
        self.kernel(mLayerK, mTable, mPrompt, mCache, mPhase, mQr, mQi, mE, mRaw, mStats, page_stride, head_stride,
                    token_stride, num_pages).launch(grid=grid, block=[self.THREADS, 1, 1], smem=smem_bytes,
                                                    stream=stream)

    def coef_column(self, which, hg, fi, q):
        """sCoef column of coefficient `which` (a, b, e) of heads 4hg..4hg+3, frequency fi of lane slice q."""
        return ((fi * 3 + which) * self.HG + hg) * self.LANES + q

    def load_keys(self, dst_r, dst_i, step, sPage, page0, start, todo, slot_in_step, base, page_stride,
                  token_stride):
        """Issue the 2 x UNROLL vector loads of this lane's slices of tokens step + u * TOKENS + slot (plain
        Python, traced inline: no branches). Tokens past the chunk reload its last one (cached, not stored)."""
        for u in range(self.UNROLL):
            tok = cutlass.min(step + u * self.TOKENS + slot_in_step, todo - 1)
            pos = start + tok
            page = Int64(cutlass.max(sPage[pos // self.T - page0], Int32(0)))  # an absent page (-1) reads page 0
            addr = base + (page * page_stride + Int64(pos % self.T) * token_stride) * self.BYTES
            for half, dst in ((0, dst_r[u]), (self.F, dst_i[u])):
                src = cute.make_ptr(self.dtype, addr + half * self.BYTES, cute.AddressSpace.gmem,
                                    assumed_align=self.FPL * self.BYTES)
                cute.autovec_copy(cute.make_tensor(src, cute.make_layout(self.FPL)), dst)

    @cute.kernel
    def kernel(self, mLayerK: cute.Tensor, mTable: cute.Tensor, mPrompt: cute.Tensor, mCache: cute.Tensor,
               mPhase: cute.Tensor, mQr: cute.Tensor, mQi: cute.Tensor, mE: cute.Tensor, mRaw: cute.Tensor,
               mStats: cute.Tensor, page_stride: Int64, head_stride: Int64, token_stride: Int64, num_pages: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        chunk, lg, r = cute.arch.block_idx()
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        smem = cutlass.utils.SmemAllocator()
        sScore = smem.allocate_tensor(Float32, cute.make_layout((self.G, self.CHUNK), stride=(self.CHUNK, 1)),
                                      byte_alignment=16)
        sRed = smem.allocate_tensor(Float32, cute.make_layout(2 * self.WARPS), byte_alignment=16)
        sPage = smem.allocate_tensor(Int32, cute.make_layout(self.PAGES), byte_alignment=16)
        # [4 heads, (frequency in the lane's slice, coef, head group, lane)]: a frequency's coefficient for 4 heads is
        # one 16-byte load, and the 8 lanes of a token read 128 contiguous bytes (no bank conflict).
        sCoef = smem.allocate_tensor(Float32, cute.make_layout((4, 3 * self.HG * self.F)), byte_alignment=16)
        num_kv = mQr.shape[1] // self.G
        layer = lg // num_kv
        g = lg - layer * num_kv

        prompt = mPrompt[r]
        count = mCache[r] - prompt
        if count > mRaw.shape[3]:
            count = Int32(mRaw.shape[3])
        first = chunk * self.CHUNK
        todo = count - first
        if todo > self.CHUNK:
            todo = Int32(self.CHUNK)
        if todo > 0:
            q = tidx % self.LANES       # this lane's frequency slice within the token
            slot_in_step = tidx // self.LANES
            f0 = q * self.FPL
            # The G x F coefficients of this (request, layer, KV head), once per CTA into shared memory: in registers
            # they would cost the occupancy that hides the FMA latency.
            for at in cutlass.range(tidx, 4 * self.HG * self.F, self.THREADS):
                h, f = at // self.F, at % self.F
                ca, cb, ce = Float32(0.0), Float32(0.0), Float32(0.0)  # padding heads of the last group score 0
                if h < self.G:
                    c, s = mPhase[r, 0, f], mPhase[r, 1, f]
                    qr, qi = mQr[layer, g * self.G + h, f], mQi[layer, g * self.G + h, f]
                    ca, cb, ce = qr * c - qi * s, qr * s + qi * c, mE[layer, g * self.G + h, f]
                for which, value in enumerate((ca, cb, ce)):
                    sCoef[h % 4, self.coef_column(which, h // 4, f % self.FPL, f // self.FPL)] = value

            # The chunk's page ids, staged once: K addresses then need no dependent global load per token. A column
            # past the table or an entry outside the pool is absent (-1): its tokens score NaN.
            page0 = (prompt + first) // self.T
            for t in cutlass.range(tidx, self.PAGES, self.THREADS):
                page = Int32(-1)
                if page0 + t < mTable.shape[1]:
                    page = mTable[r, page0 + t]
                    if page >= num_pages:
                        page = Int32(-1)
                sPage[t] = page
            cute.arch.sync_threads()
            base = mLayerK[layer] + (g * head_stride + f0) * self.BYTES
            # after the reduce-scatter: the heads this lane holds start at first_head; one lane per group stores
            first_head = Int32(0)
            for k in cutlass.range_constexpr(self.HALVINGS):
                if (q & (self.LANES >> (k + 1))) != 0:
                    first_head = first_head + (self.G2 >> (k + 1))
            owner = (q & ((self.LANES >> self.HALVINGS) - 1)) == 0
            # Software pipeline: the next UNROLL tokens' loads are in flight while these are scored.
            kr = [cute.make_rmem_tensor(self.FPL, self.dtype) for _ in range(self.UNROLL)]
            ki = [cute.make_rmem_tensor(self.FPL, self.dtype) for _ in range(self.UNROLL)]
            nr = [cute.make_rmem_tensor(self.FPL, self.dtype) for _ in range(self.UNROLL)]
            ni = [cute.make_rmem_tensor(self.FPL, self.dtype) for _ in range(self.UNROLL)]
            where = (sPage, page0, prompt + first, todo, slot_in_step, base, page_stride, token_stride)
            self.load_keys(kr, ki, Int32(0), *where)
            for step in cutlass.range(0, todo, self.TOKENS * self.UNROLL):
                self.load_keys(nr, ni, step + self.TOKENS * self.UNROLL, *where)
                acc = cute.make_rmem_tensor(self.UNROLL * self.G, Float32)
                wr, wi = kr, ki
                if cutlass.const_expr(self.BYTES == 1):
                    # fp8 keys widen to fp16 a whole lane slice at once (one cvt per pair of keys), then to fp32
                    # frequency by frequency as bf16 keys do
                    wr = [cute.make_rmem_tensor(self.FPL, cutlass.Float16) for _ in range(self.UNROLL)]
                    wi = [cute.make_rmem_tensor(self.FPL, cutlass.Float16) for _ in range(self.UNROLL)]
                    for u in cutlass.range_constexpr(self.UNROLL):
                        wr[u].store(kr[u].load().to(cutlass.Float16))
                        wi[u].store(ki[u].load().to(cutlass.Float16))
                for i in cutlass.range_constexpr(self.UNROLL * self.G):
                    acc[i] = Float32(0.0)
                # Frequency by frequency, so only one frequency's fp32 values are live (the registers go to more
                # CTAs per SM instead); each coefficient is read once from shared memory and used for UNROLL tokens.
                for f in cutlass.range_constexpr(self.FPL):
                    xr = [Float32(wr[u][f]) for u in range(self.UNROLL)]
                    xi = [Float32(wi[u][f]) for u in range(self.UNROLL)]
                    mg = [sqrt_approx(xr[u] * xr[u] + xi[u] * xi[u]) for u in range(self.UNROLL)]
                    for hg in cutlass.range_constexpr(self.HG):
                        a4, b4, e4 = (sCoef[None, self.coef_column(w, hg, f, q)].load() for w in range(3))
                        for h4 in cutlass.range_constexpr(min(4, self.G - 4 * hg)):
                            h = 4 * hg + h4
                            for u in cutlass.range_constexpr(self.UNROLL):
                                acc[u * self.G + h] = (acc[u * self.G + h] + a4[h4] * xr[u] + b4[h4] * xi[u]
                                                       + e4[h4] * mg[u])
                for u in cutlass.range_constexpr(self.UNROLL):
                    # Reduce-scatter over the token's lanes: each exchange halves the heads a lane holds, so G
                    # sums cost about G shuffles instead of G * log2(LANES).
                    held = [acc[u * self.G + h] for h in range(self.G)] + [Float32(0.0)] * (self.G2 - self.G)
                    for span in self.SPANS[::-1]:
                        if cutlass.const_expr(len(held) > 1):
                            half = len(held) // 2
                            kept = []
                            for j in cutlass.range_constexpr(half):
                                send = held[half + j]
                                keep = held[j]
                                if (q & span) != 0:  # the upper lane of the pair keeps the upper half
                                    send = held[j]
                                    keep = held[half + j]
                                kept.append(keep + cute.arch.shuffle_sync_bfly(send, span))
                            held = kept
                        else:
                            held = [held[0] + cute.arch.shuffle_sync_bfly(held[0], span)]
                    mine = step + u * self.TOKENS + slot_in_step
                    if owner and mine < todo:
                        for j in cutlass.range_constexpr(len(held)):
                            if first_head + j < self.G:
                                sScore[first_head + j, mine] = held[j]
                for u in cutlass.range_constexpr(self.UNROLL):
                    kr[u].store(nr[u].load())
                    ki[u].store(ni[u].load())
            cute.arch.sync_threads()

            # Tokens of absent pages score NaN (marked here, off the main loop; each thread then reads back only
            # the tokens it marked).
            for t in cutlass.range(tidx, todo, self.THREADS):
                if sPage[(prompt + first + t) // self.T - page0] < 0:
                    for h in cutlass.range_constexpr(self.G):
                        sScore[h, t] = Float32(float("nan"))
            # Chunk statistics per head over the finite scores (count, mean, then M2 about it: no cancellation;
            # x * 0 == 0 is false for NaN and Inf), and the coalesced write-out.
            for h in cutlass.range_constexpr(self.G):
                part, finite = Float32(0.0), Float32(0.0)
                for t in cutlass.range(tidx, todo, self.THREADS):
                    v = sScore[h, t]
                    if v * Float32(0.0) == Float32(0.0):
                        part, finite = part + v, finite + Float32(1.0)
                part, finite = _block_sum2(part, finite, lane, warp, sRed, self.WARPS)
                mean = part / cutlass.max(finite, Float32(1.0))
                part = Float32(0.0)
                for t in cutlass.range(tidx, todo, self.THREADS):
                    v = sScore[h, t]
                    if v * Float32(0.0) == Float32(0.0):
                        part = part + (v - mean) * (v - mean)
                    mRaw[r, layer, g * self.G + h, first + t] = v
                m2, _ = _block_sum2(part, Float32(0.0), lane, warp, sRed, self.WARPS)
                if tidx == 0:
                    mStats[r, layer, g * self.G + h, chunk, 0] = mean
                    mStats[r, layer, g * self.G + h, chunk, 1] = m2
                    mStats[r, layer, g * self.G + h, chunk, 2] = finite
