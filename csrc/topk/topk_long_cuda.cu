// CUDA backend of kvops::topk_long_rows_: one launch, several CTAs per row when the rows are too few to give every
// SM one, for rows of any length.
//
// A row is cut into C slices of S keys (whole tiles of 2048), one 512-thread CTA each, with C chosen so that the
// batch fills the GPU's resident CTAs (occupancy x SMs) and no more: the CTAs of a row meet at barriers in global
// memory, so all of them must be resident at once (C = 1 needs no other CTA). A slice's first kHeld tiles stay in
// registers from one load (every load of a thread in flight together); the tiles after them, if any, are read
// again on each pass (from L2 while the batch's scores fit there).
//
// The k-th largest key T (order-preserving unsigned patterns, topk.h's ukey) is found by three radix passes over
// digits of 11, 11 and 10 bits: each CTA counts its slice's digits in shared memory, adds the non-empty bins to the
// row's histogram in global memory, and after the row's barrier every CTA picks the same digit from the sum. A
// fourth pass counts, per slice, the keys > T and == T; after the last barrier each slice writes its kept indices,
// in index order, from where the slices before it end: keys > T, and keys == T while the row still needs them
// (the lowest indices first, so ties go to the lowest index). A row with at most k keys keeps them all and is
// padded with -1.
//
// The workspace (three histograms, the barrier's counter, the slice counts: about 20 KB a row) is zeroed by one
// memset and comes from the caching allocator, so a captured graph replays it.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/atomic>

#include "../cuda_utils.cuh"
#include "topk.h"

namespace kvops {
namespace topk {

namespace {

constexpr int kThreads = 512, kPer = 4, kTile = kThreads * kPer;  // a thread's 4 consecutive keys of a tile
constexpr int kHeld = 4;                                          // tiles a CTA keeps in registers
constexpr int kMinCtas = 2;                                       // CTAs per SM the registers must allow
// The workspace of a row, in 32-bit words: the three passes' histograms, the barrier's arrivals, then
// (> T, == T) per slice.
constexpr int kHist0 = 0, kHist1 = 2048, kHist2 = 4096, kArrived = 5120, kCounts = 5124;
// pass p's digit: key >> shift(p) & (bins(p) - 1), summed at hist(p)
__host__ __device__ constexpr int shift(int p) { return p == 0 ? 21 : p == 1 ? 10 : 0; }
__host__ __device__ constexpr int bins(int p) { return p == 2 ? 1024 : 2048; }
__host__ __device__ constexpr int hist_at(int p) { return p == 0 ? kHist0 : p == 1 ? kHist1 : kHist2; }

using Scan = cub::BlockScan<uint32_t, kThreads>;
using Reduce = cub::BlockReduce<unsigned long long, kThreads>;

struct Args {
  const int32_t* bits;
  int64_t stride;
  const int32_t* lengths;
  const int32_t* offsets;
  int32_t* out;
  uint32_t* ws;
  int N, k, C, S, words;
};

// Keys i .. i + 3 (i a multiple of 4) of a row, those at or past `end` invalid (key 0, which no count reads).
// VEC: the row is 16-byte aligned.
template <bool VEC>
__device__ __forceinline__ void load(const int32_t* row, int i, int end, uint32_t (&key)[kPer]) {
  if (VEC && i + kPer <= end) {
    const int4 v = __ldg(reinterpret_cast<const int4*>(row + i));
    key[0] = ukey(v.x), key[1] = ukey(v.y), key[2] = ukey(v.z), key[3] = ukey(v.w);
    return;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) key[j] = i + j < end ? ukey(__ldg(row + i + j)) : 0u;
}

// Every CTA of the row has arrived here `phase` times (the row's C CTAs are resident together). The release
// orders this CTA's global atomics before the arrival; the acquire orders the reads after it.
__device__ __forceinline__ void row_barrier(uint32_t* arrived, uint32_t target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    cuda::atomic_ref<uint32_t, cuda::thread_scope_device> count(*arrived);
    count.fetch_add(1, cuda::memory_order_release);
    while (count.load(cuda::memory_order_acquire) < target) {
    }
  }
  __syncthreads();
}

// The digit d of a summed histogram (global memory, read past L1) with #{digit >= d} >= need > #{digit > d},
// and #{digit > d}, in every thread. Thread t owns the PER bins from the top down at BINS - 1 - PER t, so an
// exclusive scan counts the bins above.
template <int BINS>
__device__ void pick(const uint32_t* hist, uint32_t need, uint32_t& digit, uint32_t& above,
                     Scan::TempStorage& scan, uint32_t (&picked)[2]) {
  constexpr int PER = BINS / kThreads;
  const int top = BINS - 1 - PER * int(threadIdx.x);
  uint32_t c[PER], sum = 0;
#pragma unroll
  for (int j = 0; j < PER; ++j) sum += c[j] = __ldcg(hist + top - j);
  uint32_t before;
  Scan(scan).ExclusiveSum(sum, before);
  if (before < need && before + sum >= need) {  // exactly one thread: the row has more than `need` keys left
    uint32_t a = before;
    int j = 0;
    while (j < PER - 1 && a + c[j] < need) a += c[j++];
    picked[0] = uint32_t(top - j);
    picked[1] = a;
  }
  __syncthreads();
  digit = picked[0];
  above = picked[1];
  __syncthreads();  // picked and scan are reused
}

// One key into a shared-memory histogram; the lanes adding to one bin at once add once.
__device__ __forceinline__ void add(uint32_t* hist, uint32_t bin) {
  const uint32_t peers = __match_any_sync(__activemask(), bin);
  if (int(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
}

template <bool VEC>
__global__ void __launch_bounds__(kThreads, kMinCtas) long_rows_kernel(Args a) {
  const int row = blockIdx.x / a.C, c = blockIdx.x % a.C;
  const int length = min(max(a.lengths[row], 0), a.N);
  const int begin = c * a.S, end = min(begin + a.S, length);  // this CTA's keys (none when begin >= end)
  const int tiles = end > begin ? (end - begin + kTile - 1) / kTile : 0;
  int32_t* out = a.out + int64_t(row) * a.k;
  const int32_t offset = a.offsets ? a.offsets[row] : 0;
  if (length <= a.k) {  // every key is kept, index i at slot i; the row's CTAs share the padding
    for (int i = begin + threadIdx.x; i < end; i += kThreads) out[i] = i + offset;
    for (int64_t j = length + int64_t(c) * kThreads + threadIdx.x; j < a.k; j += int64_t(a.C) * kThreads) out[j] = -1;
    return;  // (every CTA of the row: no barrier waits for this one)
  }
  const int32_t* src = a.bits + int64_t(row) * a.stride;
  const int first = begin + int(threadIdx.x) * kPer;  // this thread's first key of every tile
  uint32_t held[kHeld][kPer];
#pragma unroll
  for (int t = 0; t < kHeld; ++t) load<VEC>(src, first + t * kTile, t < tiles ? end : 0, held[t]);
  // f(tile, keys, i): the slice's tiles in order, keys i .. i + 3 of this thread (past `end`: key 0, not valid)
  auto each_tile = [&](auto&& f) {
#pragma unroll
    for (int t = 0; t < kHeld; ++t)
      if (t < tiles) f(held[t], first + t * kTile);
    for (int t = kHeld; t < tiles; ++t) {
      uint32_t key[kPer];
      load<VEC>(src, first + t * kTile, end, key);
      f(key, first + t * kTile);
    }
  };

  __shared__ uint32_t hist[2048];
  __shared__ union {
    Scan::TempStorage scan;
    Reduce::TempStorage reduce;
  } tmp;
  __shared__ uint32_t picked[2];
  __shared__ unsigned long long before_all;
  uint32_t* ws = a.ws + int64_t(row) * a.words;
  uint32_t prefix = 0, need = uint32_t(a.k);  // T's bits so far; the keys matching them the row still needs
#pragma unroll
  for (int p = 0; p < 3; ++p) {
    constexpr int kBinsMax = 2048;
    const int nbins = bins(p);
    const uint32_t mask = p == 0 ? 0u : ~0u << shift(p - 1);
    for (int i = threadIdx.x; i < kBinsMax; i += kThreads) hist[i] = 0;
    __syncthreads();
    each_tile([&](const uint32_t(&key)[kPer], int i) {
#pragma unroll
      for (int j = 0; j < kPer; ++j)
        if (i + j < end && (key[j] & mask) == prefix) add(hist, key[j] >> shift(p) & (nbins - 1));
    });
    __syncthreads();
    for (int i = threadIdx.x; i < nbins; i += kThreads)
      if (hist[i]) atomicAdd(ws + hist_at(p) + i, hist[i]);
    row_barrier(ws + kArrived, uint32_t(p + 1) * a.C);
    uint32_t digit, above;
    if (p < 2)
      pick<2048>(ws + hist_at(p), need, digit, above, tmp.scan, picked);
    else
      pick<1024>(ws + hist_at(p), need, digit, above, tmp.scan, picked);
    prefix |= digit << shift(p);
    need -= above;
  }
  const uint32_t threshold = prefix;  // T; the row keeps `need` of its keys == T
  uint32_t greater = 0, equal = 0;
  each_tile([&](const uint32_t(&key)[kPer], int i) {
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      greater += i + j < end && key[j] > threshold, equal += i + j < end && key[j] == threshold;
  });
  const unsigned long long both = Reduce(tmp.reduce).Sum(greater | (static_cast<unsigned long long>(equal) << 32));
  if (threadIdx.x == 0) ws[kCounts + 2 * c] = uint32_t(both), ws[kCounts + 2 * c + 1] = uint32_t(both >> 32);
  row_barrier(ws + kArrived, 4u * a.C);
  if (begin >= end) return;
  unsigned long long mine = 0;  // (> T, == T) of the slices before this one
  for (int s = threadIdx.x; s < c; s += kThreads)
    mine += __ldcg(ws + kCounts + 2 * s) | (static_cast<unsigned long long>(__ldcg(ws + kCounts + 2 * s + 1)) << 32);
  mine = Reduce(tmp.reduce).Sum(mine);
  if (threadIdx.x == 0) before_all = mine;
  __syncthreads();
  const uint32_t ties_before = min(uint32_t(before_all >> 32), need);
  uint32_t slot = uint32_t(before_all) + ties_before;  // this slice's first output slot
  const uint32_t quota = need - ties_before;            // keys == T this slice and the later ones may keep
  uint32_t seen = 0;                                    // keys == T in this slice's earlier tiles
  each_tile([&](const uint32_t(&key)[kPer], int i) {    // the same tiles in every thread
    uint32_t gt = 0, eq = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) gt += i + j < end && key[j] > threshold, eq += i + j < end && key[j] == threshold;
    // a tile holds 2048 keys: both counts fit 16 bits
    uint32_t pre, total;
    Scan(tmp.scan).ExclusiveSum(gt | eq << 16, pre, total);
    const uint32_t room = quota > seen ? quota - seen : 0u;  // keys == T this tile may keep
    uint32_t tie = pre >> 16, at = slot + (pre & 0xFFFF) + min(tie, room);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const bool valid = i + j < end, equal_j = valid && key[j] == threshold;
      if ((valid && key[j] > threshold) || (equal_j && tie < room)) out[at++] = i + j + offset;
      tie += equal_j;
    }
    slot += (total & 0xFFFF) + min(total >> 16, room);
    seen += total >> 16;
    __syncthreads();  // tmp.scan is reused
  });
}

void long_rows_cuda(const at::Tensor& scores, const at::Tensor& lengths, const std::optional<at::Tensor>& offsets,
                    int64_t k, at::Tensor out) {
  check_rows("kvops::topk_long_rows_", scores, lengths, offsets, k, out, kLongRow);
  const int64_t rows = scores.size(0), N = scores.size(1);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(scores.device());
  const bool vec = reinterpret_cast<uintptr_t>(scores.const_data_ptr()) % 16 == 0 && (rows == 1 || scores.stride(0) % 4 == 0);
  const auto kernel = vec ? long_rows_kernel<true> : long_rows_kernel<false>;
  prepare_kernel(kernel, "topk_long_rows_");
  // C slices a row, as many as the resident CTAs allow (a row's CTAs wait for each other), no more than it takes
  // to hold the row in registers
  const int64_t resident = resident_ctas(kernel, kThreads);
  const int64_t tiles = std::max<int64_t>(1, (N + kTile - 1) / kTile);
  int64_t C = std::clamp<int64_t>(resident / rows, 1, (tiles + kHeld - 1) / kHeld);
  const int64_t S = (tiles + C - 1) / C * kTile;
  C = std::max<int64_t>(1, (N + S - 1) / S);
  TORCH_CHECK_VALUE(rows * C < (int64_t(1) << 31), "kvops::topk_long_rows_: ", rows,
                    " rows of ", N, " keys exceed one launch");
  const int64_t words = kCounts + 2 * C;
  const at::Tensor ws = at::zeros({rows, words}, scores.options().dtype(at::kInt));
  const Args a{reinterpret_cast<const int32_t*>(scores.const_data_ptr<float>()), scores.stride(0),
               lengths.const_data_ptr<int32_t>(), offsets ? offsets->const_data_ptr<int32_t>() : nullptr,
               out.data_ptr<int32_t>(), reinterpret_cast<uint32_t*>(ws.data_ptr<int32_t>()), int(N), int(k), int(C),
               int(S), int(words)};
  kernel<<<int(rows * C), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(kvops, CUDA, m) { m.impl("topk_long_rows_", &long_rows_cuda); }

}  // namespace topk
}  // namespace kvops
