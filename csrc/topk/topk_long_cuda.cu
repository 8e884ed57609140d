// CUDA backend of kvops::topk_long_rows_: several CTAs per row, for rows too few to give every SM one, each of any
// length.
//
// A row is cut into C slices of S keys (whole tiles of 2048), one 512-thread CTA each, chosen so that the batch has
// about two CTAs per SM. The k-th largest key T (order-preserving unsigned patterns, topk.h's ukey) is found by
// three radix passes over digits of 11, 11 and 10 bits, one launch each, whose slice histograms are summed in
// global memory (a shared-memory histogram per CTA, then one atomic per non-empty bin). Each launch first picks
// the previous pass's digit from the summed histogram: every CTA of the row picks the same one, and the row's
// first CTA stores it (with the count still needed) for the launches after. A fourth launch picks T and counts,
// per slice, the keys > T and == T; the fifth writes each slice's kept indices, in index order, from where the
// slices before it end: keys > T, and keys == T while the row still needs them (the lowest indices first, so ties
// go to the lowest index). A row with at most k keys keeps them all and is padded with -1.
//
// The scores are read five times: the first pass from DRAM, the others mostly from L2 while the batch's scores
// fit there. The workspace (histograms, the picks, the slice counts: about 20 KB a row) is zeroed by one memset
// and comes from the caching allocator, so a captured graph replays it.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "../cuda_utils.cuh"
#include "topk.h"

namespace kvops {
namespace topk {

namespace {

constexpr int kThreads = 512, kPer = 4, kTile = kThreads * kPer;  // a thread's 4 consecutive keys of a tile
// The workspace of a row, in 32-bit words: the three passes' histograms, then the pick of each launch (the
// threshold's bits so far and how many keys equal to them the row still needs), then (> T, == T) per slice.
constexpr int kHist0 = 0, kHist1 = 2048, kHist2 = 4096, kPicks = 5120, kCounts = 5128;
// pass p's digit: key >> shift(p) & (bins(p) - 1), counted at hist(p)
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

// The slice [begin, end) of this CTA's row, and the row's length (0 when the CTA has no keys).
struct Slice {
  int row, c, length, begin, end;
  __device__ Slice(const Args& a) {
    row = blockIdx.x / a.C;
    c = blockIdx.x % a.C;
    length = min(max(a.lengths[row], 0), a.N);
    begin = c * a.S;
    end = min(begin + a.S, length);
  }
};

// Keys i .. i + 3 (i a multiple of 4) of a row, those at or past `end` invalid. VEC: the row is 16-byte aligned.
template <bool VEC>
__device__ __forceinline__ void load(const int32_t* row, int i, int end, uint32_t (&key)[kPer], bool (&valid)[kPer]) {
  if (VEC && i + kPer <= end) {
    const int4 v = __ldg(reinterpret_cast<const int4*>(row + i));
    key[0] = ukey(v.x), key[1] = ukey(v.y), key[2] = ukey(v.z), key[3] = ukey(v.w);
#pragma unroll
    for (int j = 0; j < kPer; ++j) valid[j] = true;
    return;
  }
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    valid[j] = i + j < end;
    key[j] = valid[j] ? ukey(__ldg(row + i + j)) : 0u;
  }
}

// The digit d of a summed histogram with #{digit >= d} >= need > #{digit > d}, and #{digit > d}, in every thread.
// Thread t owns the PER bins from the top down at BINS - 1 - PER t, so an exclusive scan counts the bins above.
template <int BINS>
__device__ void pick(const uint32_t* hist, uint32_t need, uint32_t& digit, uint32_t& above,
                     Scan::TempStorage& scan, uint32_t (&picked)[2]) {
  constexpr int PER = BINS / kThreads;
  const int top = BINS - 1 - PER * int(threadIdx.x);
  uint32_t c[PER], sum = 0;
#pragma unroll
  for (int j = 0; j < PER; ++j) sum += c[j] = hist[top - j];
  if (threadIdx.x == 0) picked[0] = picked[1] = 0;  // (only read if the counts lack `need` keys: never)
  uint32_t before;
  Scan(scan).ExclusiveSum(sum, before);
  if (before < need && before + sum >= need) {  // exactly one thread
    uint32_t a = before;
    int j = 0;
    while (j < PER - 1 && a + c[j] < need) a += c[j++];
    picked[0] = uint32_t(top - j);
    picked[1] = a;
  }
  __syncthreads();
  digit = picked[0];
  above = picked[1];
}

// One key into a shared-memory histogram; the lanes adding to one bin at once add once.
__device__ __forceinline__ void add(uint32_t* hist, uint32_t bin) {
  const uint32_t peers = __match_any_sync(__activemask(), bin);
  if (int(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
}

// Pass P: the digit of pass P - 1 (stored by the row's first CTA as pick P), then the histogram of digit P over
// the keys that match the threshold so far.
template <bool VEC, int P>
__global__ void __launch_bounds__(kThreads) hist_kernel(Args a) {
  const Slice s(a);
  if (s.length <= a.k || s.begin >= s.end) return;  // (the first CTA of a row with more than k keys never returns)
  constexpr int BINS = bins(P);
  __shared__ uint32_t hist[BINS];
  __shared__ Scan::TempStorage scan;
  __shared__ uint32_t picked[2];
  uint32_t* ws = a.ws + int64_t(s.row) * a.words;
  uint32_t prefix = 0, mask = 0;
  if constexpr (P > 0) {
    const uint32_t need = P == 1 ? uint32_t(a.k) : ws[kPicks + 2 * (P - 1) + 1];
    uint32_t digit, above;
    prefix = P == 1 ? 0u : ws[kPicks + 2 * (P - 1)];
    pick<bins(P - 1)>(ws + hist_at(P - 1), need, digit, above, scan, picked);
    prefix |= digit << shift(P - 1);
    mask = ~0u << shift(P - 1);
    if (s.c == 0 && threadIdx.x == 0) ws[kPicks + 2 * P] = prefix, ws[kPicks + 2 * P + 1] = need - above;
  }
  for (int i = threadIdx.x; i < BINS; i += kThreads) hist[i] = 0;
  __syncthreads();
  const int32_t* row = a.bits + int64_t(s.row) * a.stride;
  for (int i = s.begin + int(threadIdx.x) * kPer; i < s.end; i += kTile) {
    uint32_t key[kPer];
    bool valid[kPer];
    load<VEC>(row, i, s.end, key, valid);
#pragma unroll
    for (int j = 0; j < kPer; ++j)
      if (valid[j] && (key[j] & mask) == prefix) add(hist, key[j] >> shift(P) & (BINS - 1));
  }
  __syncthreads();
  for (int i = threadIdx.x; i < BINS; i += kThreads)
    if (hist[i]) atomicAdd(ws + hist_at(P) + i, hist[i]);
}

// T from the last histogram (the row's first CTA stores it as pick 3, with the keys == T the row keeps), then this
// slice's keys > T and == T.
template <bool VEC>
__global__ void __launch_bounds__(kThreads) count_kernel(Args a) {
  const Slice s(a);
  if (s.length <= a.k || s.begin >= s.end) return;
  __shared__ union {
    Scan::TempStorage scan;
    Reduce::TempStorage reduce;
  } tmp;
  __shared__ uint32_t picked[2];
  uint32_t* ws = a.ws + int64_t(s.row) * a.words;
  uint32_t digit, above;
  const uint32_t need = ws[kPicks + 5];
  pick<bins(2)>(ws + kHist2, need, digit, above, tmp.scan, picked);
  const uint32_t threshold = ws[kPicks + 4] | digit;
  if (s.c == 0 && threadIdx.x == 0) ws[kPicks + 6] = threshold, ws[kPicks + 7] = need - above;
  __syncthreads();  // tmp is reused
  const int32_t* row = a.bits + int64_t(s.row) * a.stride;
  uint32_t greater = 0, equal = 0;
  for (int i = s.begin + int(threadIdx.x) * kPer; i < s.end; i += kTile) {
    uint32_t key[kPer];
    bool valid[kPer];
    load<VEC>(row, i, s.end, key, valid);
#pragma unroll
    for (int j = 0; j < kPer; ++j) greater += valid[j] && key[j] > threshold, equal += valid[j] && key[j] == threshold;
  }
  const unsigned long long both = Reduce(tmp.reduce).Sum(greater | (static_cast<unsigned long long>(equal) << 32));
  if (threadIdx.x == 0) ws[kCounts + 2 * s.c] = uint32_t(both), ws[kCounts + 2 * s.c + 1] = uint32_t(both >> 32);
}

// The kept indices of this slice, in index order, from where the slices before it end.
template <bool VEC>
__global__ void __launch_bounds__(kThreads) write_kernel(Args a) {
  const Slice s(a);
  int32_t* out = a.out + int64_t(s.row) * a.k;
  const int32_t offset = a.offsets ? a.offsets[s.row] : 0;
  if (s.length <= a.k) {  // every key is kept, index i at slot i; the row's CTAs share the padding
    for (int i = s.begin + threadIdx.x; i < s.end; i += kThreads) out[i] = i + offset;
    for (int64_t j = s.length + int64_t(s.c) * kThreads + threadIdx.x; j < a.k; j += int64_t(a.C) * kThreads)
      out[j] = -1;
    return;
  }
  if (s.begin >= s.end) return;
  __shared__ union {
    Scan::TempStorage scan;
    Reduce::TempStorage reduce;
  } tmp;
  __shared__ unsigned long long before_all;
  const uint32_t* ws = a.ws + int64_t(s.row) * a.words;
  const uint32_t threshold = ws[kPicks + 6], need = ws[kPicks + 7];  // the keys == T the row keeps
  unsigned long long mine = 0;  // (> T, == T) of the slices before this one
  for (int c = threadIdx.x; c < s.c; c += kThreads)
    mine += ws[kCounts + 2 * c] | (static_cast<unsigned long long>(ws[kCounts + 2 * c + 1]) << 32);
  mine = Reduce(tmp.reduce).Sum(mine);
  if (threadIdx.x == 0) before_all = mine;
  __syncthreads();
  const uint32_t ties_before = min(uint32_t(before_all >> 32), need);
  uint32_t slot = uint32_t(before_all) + ties_before;  // this slice's first output slot
  const uint32_t quota = need - ties_before;            // keys == T this slice and the later ones may keep
  uint32_t seen = 0;                                    // keys == T in this slice's earlier tiles
  const int32_t* row = a.bits + int64_t(s.row) * a.stride;
  for (int base = s.begin; base < s.end; base += kTile) {  // the same trip count in every thread
    const int i = base + int(threadIdx.x) * kPer;
    uint32_t key[kPer];
    bool valid[kPer];
    load<VEC>(row, i, s.end, key, valid);
    uint32_t greater = 0, equal = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) greater += valid[j] && key[j] > threshold, equal += valid[j] && key[j] == threshold;
    // a tile holds 2048 keys: both counts fit 16 bits
    uint32_t pre, total;
    Scan(tmp.scan).ExclusiveSum(greater | equal << 16, pre, total);
    const uint32_t room = quota > seen ? quota - seen : 0u;  // keys == T this tile may keep
    uint32_t tie = pre >> 16, at = slot + (pre & 0xFFFF) + min(tie, room);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const bool equal_j = valid[j] && key[j] == threshold;
      if ((valid[j] && key[j] > threshold) || (equal_j && tie < room)) out[at++] = i + j + offset;
      tie += equal_j;
    }
    slot += (total & 0xFFFF) + min(total >> 16, room);
    seen += total >> 16;
    __syncthreads();  // tmp.scan is reused
  }
}

template <bool VEC>
void launch(const Args& a, int blocks, cudaStream_t stream) {
  prepare_kernel(hist_kernel<VEC, 0>, "topk_long_rows_");
  hist_kernel<VEC, 0><<<blocks, kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  hist_kernel<VEC, 1><<<blocks, kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  hist_kernel<VEC, 2><<<blocks, kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  count_kernel<VEC><<<blocks, kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  write_kernel<VEC><<<blocks, kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void long_rows_cuda(const at::Tensor& scores, const at::Tensor& lengths, const std::optional<at::Tensor>& offsets,
                    int64_t k, at::Tensor out) {
  check_rows("kvops::topk_long_rows_", scores, lengths, offsets, k, out, kLongRow);
  const int64_t rows = scores.size(0), N = scores.size(1);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(scores.device());
  // C slices a row: about two CTAs per SM over the batch, whole tiles each
  const int64_t tiles = std::max<int64_t>(1, (N + kTile - 1) / kTile);
  int64_t C = std::min<int64_t>(tiles, std::max<int64_t>(1, (2 * sm_count() + rows - 1) / rows));
  const int64_t S = (tiles + C - 1) / C * kTile;
  C = std::max<int64_t>(1, (N + S - 1) / S);
  TORCH_CHECK_VALUE(rows * C < (int64_t(1) << 31) && S < (int64_t(1) << 31), "kvops::topk_long_rows_: ", rows,
                    " rows of ", N, " keys exceed one launch");
  const int64_t words = kCounts + 2 * C;
  const at::Tensor ws = at::zeros({rows, words}, scores.options().dtype(at::kInt));
  const Args a{reinterpret_cast<const int32_t*>(scores.const_data_ptr<float>()), scores.stride(0),
               lengths.const_data_ptr<int32_t>(), offsets ? offsets->const_data_ptr<int32_t>() : nullptr,
               out.data_ptr<int32_t>(), reinterpret_cast<uint32_t*>(ws.data_ptr<int32_t>()), int(N), int(k), int(C),
               int(S), int(words)};
  const bool vec = reinterpret_cast<uintptr_t>(a.bits) % 16 == 0 && (rows == 1 || a.stride % 4 == 0);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (vec)
    launch<true>(a, int(rows * C), stream);
  else
    launch<false>(a, int(rows * C), stream);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvops, CUDA, m) { m.impl("topk_long_rows_", &long_rows_cuda); }

}  // namespace topk
}  // namespace kvops
