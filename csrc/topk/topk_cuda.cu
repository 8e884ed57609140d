// CUDA backend of kvops::topk_short_rows_: one warp per row of at most 4096 keys, four rows per CTA.
//
// The warp stages the row's keys in shared memory (order-preserving unsigned patterns), then finds the k-th
// largest key T one 8-bit digit at a time: a shared-memory histogram of the next digit, a warp scan of its 256
// counts from the top. After the first digit only the keys that share it stay candidates, listed by 16-bit index
// (ballot compaction, in place), so the later digits touch few keys. The keep pass walks the row in index order:
// keys > T, and keys == T while fewer than the needed ones are taken, land at their ballot rank, so the output
// ascends; -1 pads a row shorter than k. No block barrier: every step is warp-synchronous.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../cuda_utils.cuh"
#include "topk.h"

namespace kvops {
namespace topk {

namespace {

constexpr int kWarps = 4;  // rows per CTA

// Per warp: keys[slots] (uint32), hist[256] (uint32, 16-byte aligned), candidates[slots] (uint16); slots is a
// multiple of 8, so every warp's block and its hist start 16-byte aligned.
__host__ __device__ constexpr int warp_words(int slots) { return slots + 256 + slots / 2; }

// The largest digit d with #{digit >= d} >= need among the 256 counts, and #{digit > d}. Where even all of
// them fall short (fewer than `need` keys), digit 0 and the count above it.
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

__global__ void __launch_bounds__(kWarps * 32)
    short_rows_kernel(const int32_t* __restrict__ bits, int64_t stride, const int32_t* __restrict__ lengths,
                      int32_t* __restrict__ out, int rows, int N, int k, int slots) {
  extern __shared__ __align__(16) uint32_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * kWarps + warp;
  if (row >= rows) return;
  uint32_t* keys = smem + size_t(warp) * warp_words(slots);
  uint32_t* hist = keys + slots;
  uint16_t* cand = reinterpret_cast<uint16_t*>(hist + 256);
  const uint32_t below = (1u << lane) - 1;
  const int length = min(max(lengths[row], 0), N);
  const int32_t* src = bits + int64_t(row) * stride;
#pragma unroll 4  // loads in flight
  for (int i = lane; i < length; i += 32) keys[i] = ukey(__ldg(src + i));
  for (int i = lane; i < 256; i += 32) hist[i] = 0;
  __syncwarp();
  for (int i = lane; i < length; i += 32) atomicAdd(&hist[keys[i] >> 24], 1u);
  __syncwarp();
  uint32_t need = uint32_t(k), digit, above;
  pick_digit(hist, need, lane, digit, above);
  need -= above;
  uint32_t threshold = digit << 24;
  int count = 0;  // the candidates: keys with the digits found so far, in index order
  for (int base = 0; base < length; base += 32) {
    const int i = base + lane;
    const bool match = i < length && (keys[i] >> 24) == digit;
    const uint32_t m = __ballot_sync(~0u, match);
    if (match) cand[count + __popc(m & below)] = uint16_t(i);
    count += __popc(m);
  }
  for (int shift = 16; shift >= 0; shift -= 8) {
    __syncwarp();
    for (int i = lane; i < 256; i += 32) hist[i] = 0;
    __syncwarp();
    for (int c = lane; c < count; c += 32) atomicAdd(&hist[(keys[cand[c]] >> shift) & 0xFF], 1u);
    __syncwarp();
    pick_digit(hist, need, lane, digit, above);
    need -= above;
    threshold |= digit << shift;
    if (shift == 0) break;
    int kept = 0;  // in place: a write lands at or before the slot its lane read, all reads done at the ballot
    for (int base = 0; base < count; base += 32) {
      const int c = base + lane;
      const int i = c < count ? cand[c] : 0;
      const bool match = c < count && ((keys[i] >> shift) & 0xFF) == digit;
      const uint32_t m = __ballot_sync(~0u, match);
      if (match) cand[kept + __popc(m & below)] = uint16_t(i);
      kept += __popc(m);
    }
    count = kept;
  }
  // The last histogram counted the keys equal to the threshold: when all of them are kept (no tie to break,
  // the usual case), the keep pass needs one ballot per step instead of two.
  const bool every_tie = hist[digit] == need;
  __syncwarp();
  int32_t* dst = out + int64_t(row) * k;
  int taken = 0;
  uint32_t ties = 0;  // keys == threshold seen so far; the first `need` of them are kept
  for (int base = 0; base < length && taken < k; base += 32) {
    const int i = base + lane;
    const bool valid = i < length;
    const uint32_t key = valid ? keys[i] : 0;
    bool keep = valid && key >= threshold;
    if (!every_tie) {
      const bool equal = valid && key == threshold;
      const uint32_t em = __ballot_sync(~0u, equal);
      keep = (valid && key > threshold) || (equal && ties + __popc(em & below) < need);
      ties += __popc(em);
    }
    const uint32_t km = __ballot_sync(~0u, keep);
    if (keep) dst[taken + __popc(km & below)] = i;
    taken += __popc(km);
  }
  for (int j = taken + lane; j < k; j += 32) dst[j] = -1;
}

void short_rows_cuda(const at::Tensor& scores, const at::Tensor& lengths, int64_t k, at::Tensor out) {
  check_short_rows(scores, lengths, k, out);
  const int rows = int(scores.size(0)), N = int(scores.size(1));
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(scores.device());
  const int slots = (std::max(N, 1) + 7) & ~7;
  const int smem = kWarps * warp_words(slots) * int(sizeof(uint32_t));
  prepare_kernel(short_rows_kernel, "topk_short_rows_", smem);
  short_rows_kernel<<<(rows + kWarps - 1) / kWarps, kWarps * 32, smem, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const int32_t*>(scores.const_data_ptr<float>()), scores.stride(0),
      lengths.const_data_ptr<int32_t>(), out.data_ptr<int32_t>(), rows, N, int(k), slots);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvops, CUDA, m) { m.impl("topk_short_rows_", &short_rows_cuda); }

}  // namespace topk
}  // namespace kvops
