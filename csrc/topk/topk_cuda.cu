// CUDA backend of kvops::topk_short_rows_: one warp per row of at most 4096 keys, up to four rows per CTA (fewer
// when the rows are few, so that they spread over every SM).
//
// The warp holds the row's keys in registers (order-preserving unsigned patterns, key t of a lane at index
// 32 t + lane), ITEMS a lane, a compile-time class of the row width. The k-th largest key T shares every bit
// above the highest bit where the row's smallest and largest keys differ; below that, T is found one digit of up
// to 8 bits at a time: a shared-memory histogram of the next digit over the keys that match T so far, a warp scan
// of its counts from the top. The keep pass walks the row in index order: keys > T, and keys == T while fewer
// than the needed ones are taken, land at their ballot rank (plus the row's offset, when given), so the output
// ascends; -1 pads a row shorter than k.
// A pass over the registers also lists in shared memory, per lane, the keys it counts; once they fit (after the
// first digit or two, on most rows), the next digits read that short list instead of every register. A warp's
// shared memory is its 1 KB histogram and 4 KB list, so occupancy is set by registers. The keep pass stores with
// a predicate, not a branch, per key. No block barrier: every step is warp-synchronous.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../cuda_utils.cuh"
#include "topk.h"

namespace kvops {
namespace topk {

namespace {

constexpr int kWarps = 4;      // rows per CTA, at most
constexpr int kBins = 256;     // 8-bit digits
constexpr int kDummy = kBins;  // where keys that no longer match count
constexpr int kPerLane = 32;   // keys a lane lists in shared memory (4 KB a warp)
// CTAs per SM the register allocation must allow: five (96 registers a thread) up to the steady-state class of
// 72 keys a lane (budget 2048 + beta up to 256), which ptxas otherwise gives 109; wider classes need more.
constexpr int min_ctas(int items) { return items <= 72 ? 5 : 1; }

// The largest digit d with #{digit >= d} >= need among the 256 counts, and #{digit > d}.
__device__ __forceinline__ void pick_digit(const uint32_t* hist, uint32_t need, int lane, uint32_t& digit,
                                           uint32_t& above) {
  // Two 16-byte loads per lane (8 wavefronts for the warp; 8 word loads at a stride of 8 words would be 64).
  const uint4 lo = reinterpret_cast<const uint4*>(hist)[lane * 2], hi = reinterpret_cast<const uint4*>(hist)[lane * 2 + 1];
  const uint32_t c[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
  uint32_t sum = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) sum += c[j];
  uint32_t suffix = sum;  // lanes >= this one
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t v = __shfl_down_sync(~0u, suffix, o);
    if (lane + o < 32) suffix += v;
  }
  const uint32_t hit = __ballot_sync(~0u, suffix >= need);
  const int target = hit ? 31 - __clz(hit) : 0;
  uint32_t d = 0, a = 0;
  if (lane == target) {
    a = suffix - sum;  // the lanes above
    int j = 7;
    for (; j > 0 && a + c[j] < need; --j) a += c[j];
    d = uint32_t(lane * 8 + j);
  }
  digit = __shfl_sync(~0u, d, target);
  above = __shfl_sync(~0u, a, target);
}

// One key into the digit histogram: bin (key >> shift) & mask when it matches the threshold so far, else the dummy
// bin; every lane counts, so there is no branch per key.
__device__ __forceinline__ void count(uint32_t* hist, uint32_t key, bool match, int shift, uint32_t mask) {
  atomicAdd(&hist[match ? key >> shift & mask : kDummy], 1u);
}

// `if (keep) *at = v` without a branch: one predicated store (a branch per key costs a convergence barrier around
// each store, and its address is then recomputed from the row's).
__device__ __forceinline__ void store_if(bool keep, int32_t* at, int32_t v) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p st.global.b32 [%1], %2;\n}"
               :: "r"(int(keep)), "l"(at), "r"(v) : "memory");
}

template <int ITEMS>
__global__ void __launch_bounds__(kWarps * 32, min_ctas(ITEMS))
    short_rows_kernel(const int32_t* __restrict__ bits, int64_t stride, const int32_t* __restrict__ lengths,
                      const int32_t* __restrict__ offsets, int32_t* __restrict__ out, int rows, int N, int k) {
  __shared__ __align__(16) uint32_t hists[kWarps][kBins + 4];  // + the dummy bin, rows kept 16-byte aligned
  __shared__ uint32_t lists[kWarps][kPerLane * 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * int(blockDim.x >> 5) + warp;
  if (row >= rows) return;
  uint32_t *hist = hists[warp], *list = lists[warp];
  const uint32_t below = (1u << lane) - 1;
  const int length = min(max(lengths[row], 0), N);
  const int32_t* src = bits + int64_t(row) * stride + lane;
  const int held = (length - lane + 31) / 32;  // this lane's keys: t < held
  uint32_t key[ITEMS];
  uint32_t lo = ~0u, hi = 0;
#pragma unroll
  for (int t = 0; t < ITEMS; ++t) {
    key[t] = t < held ? ukey(__ldg(src + 32 * t)) : 0;
    if (t < held) lo = min(lo, key[t]), hi = max(hi, key[t]);
  }
  uint32_t threshold = 0, need = uint32_t(k);
  bool every_tie = true;  // every key == threshold is kept (then one ballot per keep step)
  if (length > k) {       // else the row keeps all it has: threshold 0
    lo = __reduce_min_sync(~0u, lo);
    hi = __reduce_max_sync(~0u, hi);
    int top = lo == hi ? 0 : 32 - __clz(lo ^ hi);  // the low bits that vary; T shares hi's bits above them
    threshold = top == 32 ? 0u : hi >> top << top;
    uint32_t equal = uint32_t(length);             // keys == threshold, when no digit is searched
    // A pass over the registers also lists, per lane, the keys it counts (up to kPerLane a lane); when no lane
    // overflowed, the next pass reads that list instead of every register.
    int listed = -1;
    while (top > 0) {
      const int width = min(8, top), shift = top - width;
      const uint32_t himask = top == 32 ? 0u : ~0u << top, mask = (1u << width) - 1;
#pragma unroll
      for (int j = 0; j < 8; ++j) hist[lane * 8 + j] = 0;
      __syncwarp();
      if (listed < 0) {
        int mine = 0;
#pragma unroll
        for (int t = 0; t < ITEMS; ++t) {
          const bool match = t < held && (key[t] & himask) == threshold;
          count(hist, key[t], match, shift, mask);
          if (match && mine < kPerLane) list[mine * 32 + lane] = key[t];
          mine += match;
        }
        listed = __any_sync(~0u, mine > kPerLane) ? -1 : mine;
      } else {
        for (int i = 0; i < listed; ++i) {
          const uint32_t listed_key = list[i * 32 + lane];
          count(hist, listed_key, (listed_key & himask) == threshold, shift, mask);
        }
      }
      __syncwarp();
      uint32_t digit, above;
      pick_digit(hist, need, lane, digit, above);
      need -= above;
      threshold |= digit << shift;
      equal = hist[digit];
      top = shift;
      __syncwarp();
    }
    every_tie = equal == need;
  }
  int32_t* const row_out = out + int64_t(row) * k;
  uint32_t taken = 0;
  const int32_t index = (offsets ? offsets[row] : 0) + lane;  // what key 0 of this lane writes
  if (every_tie) {
#pragma unroll
    for (int t = 0; t < ITEMS; ++t) {
      const bool keep = t < held && key[t] >= threshold;
      const uint32_t km = __ballot_sync(~0u, keep);
      store_if(keep, row_out + (taken + __popc(km & below)), index + 32 * t);
      taken += __popc(km);
    }
  } else {
    uint32_t ties = 0;  // keys == threshold seen so far; the first `need` of them are kept
#pragma unroll
    for (int t = 0; t < ITEMS; ++t) {
      const bool valid = t < held, equal = valid && key[t] == threshold;
      const uint32_t em = __ballot_sync(~0u, equal);
      const bool keep = (valid && key[t] > threshold) || (equal && ties + __popc(em & below) < need);
      ties += __popc(em);
      const uint32_t km = __ballot_sync(~0u, keep);
      store_if(keep, row_out + (taken + __popc(km & below)), index + 32 * t);
      taken += __popc(km);
    }
  }
  for (int j = int(taken) + lane; j < k; j += 32) row_out[j] = -1;
}

template <int ITEMS>
void launch(const at::Tensor& scores, const at::Tensor& lengths, const std::optional<at::Tensor>& offsets, int64_t k,
            at::Tensor& out) {
  const int rows = int(scores.size(0));
  // rows a CTA: kWarps once there are that many per SM; fewer rows get fewer a CTA, one CTA per SM at least
  const int warps = std::max(1, std::min(kWarps, rows / sm_count()));
  prepare_kernel(short_rows_kernel<ITEMS>, "topk_short_rows_");
  short_rows_kernel<ITEMS><<<(rows + warps - 1) / warps, warps * 32, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const int32_t*>(scores.const_data_ptr<float>()), scores.stride(0),
      lengths.const_data_ptr<int32_t>(), offsets ? offsets->const_data_ptr<int32_t>() : nullptr,
      out.data_ptr<int32_t>(), rows, int(scores.size(1)), int(k));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void short_rows_cuda(const at::Tensor& scores, const at::Tensor& lengths, const std::optional<at::Tensor>& offsets,
                     int64_t k, at::Tensor out) {
  check_rows("kvops::topk_short_rows_", scores, lengths, offsets, k, out, kShortRow);
  if (scores.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(scores.device());
  const int64_t items = (scores.size(1) + 31) / 32;  // keys per lane; the class: the fewest registers that hold them
  if (items <= 8) return launch<8>(scores, lengths, offsets, k, out);
  if (items <= 16) return launch<16>(scores, lengths, offsets, k, out);
  if (items <= 32) return launch<32>(scores, lengths, offsets, k, out);
  if (items <= 48) return launch<48>(scores, lengths, offsets, k, out);
  if (items <= 64) return launch<64>(scores, lengths, offsets, k, out);
  if (items <= 72) return launch<72>(scores, lengths, offsets, k, out);  // budget 2048 + beta <= 256
  if (items <= 96) return launch<96>(scores, lengths, offsets, k, out);
  static_assert(kShortRow == 128 * 32, "the widest class holds kShortRow keys");
  launch<128>(scores, lengths, offsets, k, out);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvops, CUDA, m) { m.impl("topk_short_rows_", &short_rows_cuda); }

}  // namespace topk
}  // namespace kvops
