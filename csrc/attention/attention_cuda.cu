// CUDA backend of kvops::attention_decode: flash-decoding over a paged cache.
//
// One CTA serves one (request, KV head, block of up to kRows query rows, split of the KV length); the query rows
// of a KV head are its grouped heads x query tokens, so K and V are read once per KV head and never repeated. The
// CTA streams its range in tiles (Shape) through a kStages-deep cp.async pipeline in shared memory, one page
// lookup per token row. Per tile: scores (a few threads per token, each a slice of its K row against the query rows
// held in shared memory), softmax (a warp per query row: the tile's max, the running max and sum, in log2 units) and
// output (a thread per two dims and token subset adds weights x V). With several splits each CTA writes its rows'
// normalised output and log-sum-exp, and a second kernel merges the splits. It reaches about 47% of the copy
// bandwidth on the H200 (benchmarks/RESULTS.md): the per-token work on CUDA cores is the limit, not the loads.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "../cuda_utils.cuh"
#include "attention.h"

namespace kvops {
namespace attention {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 8;          // query rows one CTA serves at most (more take more row blocks)
constexpr int kStages = 3;        // tiles in flight per CTA
constexpr int kMinSplitTokens = 64;
constexpr float kLog2e = 1.4426950408889634f;

struct Params {
  DecodeArgs a;
  const void *query, *k, *v;
  const int32_t *table, *lengths, *starts;
  void* out;           // [R, q, Hq, D]
  float* part_out;     // [R, Hq, q, splits, D]: each split's normalised output
  float* part_lse;     // [R, Hq, q, splits]: its log2-sum-exp2 of the scaled scores, -inf when it saw nothing
  int32_t group, rows, row_blocks, splits, split_tokens;
};

// 2^x by the SFU (ex2.approx: 2 ulp; 2^-inf = 0)
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T> __device__ __forceinline__ float load_float(const T* p) { return float(*p); }
template <> __device__ __forceinline__ float load_float(const __nv_bfloat16* p) { return __bfloat162float(*p); }
template <> __device__ __forceinline__ float load_float(const __half* p) { return __half2float(*p); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }

// cp.async of 16 bytes, zero-filled when !ok (nothing is read then)
__device__ __forceinline__ void copy16(void* dst, const void* src, bool ok) {
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void wait_groups() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// The shape of a CTA's work: kTokens-token tiles of K and V staged in shared memory, kStages of them in flight.
// Rows are stored in 16-byte chunks, chunk c of token t at c ^ (t % kSwizzle): the score phase (a thread per
// token reads down a row) and the output phase (a warp reads across a row) are then both free of bank conflicts.
template <typename KT, int D, int ROWS>
struct Shape {
  static constexpr int kRowBytes = D * int(sizeof(KT));
  static constexpr int kChunks = kRowBytes / 16;
  static constexpr int kSwizzle = kChunks < 8 ? kChunks : 8;
  static constexpr int kTokens = 16384 / kRowBytes < 64 ? 16384 / kRowBytes : 64;  // K tile <= 16 KiB
  static constexpr int kParts = kThreads / kTokens;   // score phase: threads per token, each a slice of its chunks
  static constexpr int kPartChunks = kChunks / kParts;
  static constexpr int kPairs = D / 2;                // output phase: a thread per 2 dims and token subset
  static constexpr int kSubsets = kThreads / kPairs;
  static constexpr int kTileBytes = kTokens * kRowBytes;
  static constexpr int kStageBytes = 2 * kTileBytes + kTokens;  // K, V, a byte per token: whether it is held
  static constexpr int kStageStride = (kStageBytes + 15) / 16 * 16;
  // shared memory after the stages: the query [D][ROWS] fp32, partial scores [kParts][kTokens][ROWS], weights
  // [kTokens][ROWS], per-row rescale factors; the final merge reuses the stages
  static constexpr int kQueryOffset = kStages * kStageStride;
  static constexpr int kScoreOffset = kQueryOffset + D * ROWS * 4;
  static constexpr int kWeightOffset = kScoreOffset + kParts * kTokens * ROWS * 4;
  static constexpr int kRescaleOffset = kWeightOffset + kTokens * ROWS * 4;
  static constexpr int kSmemBytes = kRescaleOffset + ROWS * 4;
  static_assert(kThreads % kTokens == 0 && kChunks % kParts == 0 && kThreads % kPairs == 0, "tile shape");
  static_assert(kSubsets * kPairs * ROWS * 2 * 4 <= kStages * kStageStride, "merge buffer");
};

template <typename KT> __device__ __forceinline__ float2 pair_to_float(const unsigned char* p) {
  if constexpr (std::is_same_v<KT, __nv_bfloat16>) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else if constexpr (std::is_same_v<KT, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(p));
  } else {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(*reinterpret_cast<const __nv_fp8x2_storage_t*>(p), __NV_E4M3);
    return __half22float2(*reinterpret_cast<const __half2*>(&h));
  }
}

// ROWS consecutive floats of shared memory (16-byte aligned when ROWS % 4 == 0) into registers
template <int ROWS>
__device__ __forceinline__ void load_rows(const float* p, float (&x)[ROWS]) {
  if constexpr (ROWS % 4 == 0) {
#pragma unroll
    for (int j = 0; j < ROWS; j += 4) {
      const float4 v = *reinterpret_cast<const float4*>(p + j);
      x[j] = v.x, x[j + 1] = v.y, x[j + 2] = v.z, x[j + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < ROWS; ++j) x[j] = p[j];
  }
}

template <typename QT, typename KT, int D, int ROWS>
__global__ void __launch_bounds__(kThreads) decode_kernel(const __grid_constant__ Params p) {
  using S = Shape<KT, D, ROWS>;
  constexpr int TOKENS = S::kTokens;
  extern __shared__ __align__(16) unsigned char smem[];
  float* s_query = reinterpret_cast<float*>(smem + S::kQueryOffset);     // [D][ROWS], log2 units
  float* s_score = reinterpret_cast<float*>(smem + S::kScoreOffset);     // [parts][TOKENS][ROWS]
  float* s_weight = reinterpret_cast<float*>(smem + S::kWeightOffset);   // [TOKENS][ROWS]
  float* s_rescale = reinterpret_cast<float*>(smem + S::kRescaleOffset); // [ROWS]
  const DecodeArgs& a = p.a;
  const int r = blockIdx.z, split = blockIdx.x;
  const int hk = blockIdx.y / p.row_blocks, row0 = (blockIdx.y % p.row_blocks) * ROWS;
  const int nrows = min(ROWS, p.rows - row0);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  const int capacity = a.capacity();
  const int length = min(max(p.lengths[r], 0), capacity);
  const int start = a.has_starts ? min(max(p.starts[r], 0), length) : 0;
  const int begin = max(start, split * p.split_tokens);
  const int end = min(length, (split + 1) * p.split_tokens);
  const int tiles = end > begin ? (end - begin + TOKENS - 1) / TOKENS : 0;

  // Stage tile `tile` of this CTA's range into buffer tile % kStages: 16-byte copies of K and V rows; the thread of
  // a K row's first chunks also records whether the token is held (in range, on a page that exists).
  const int32_t* trow = p.table + int64_t(r) * a.table_stride;
  const char* kbase = static_cast<const char*>(p.k) + int64_t(hk) * a.k_stride_head * int64_t(sizeof(KT));
  const char* vbase = static_cast<const char*>(p.v) + int64_t(hk) * a.v_stride_head * int64_t(sizeof(KT));
  // thread tid copies chunks [part * n, (part + 1) * n) of one row: (plane, token) = (tid / TOKENS, tid % TOKENS) of
  // the tile's 2 * TOKENS rows, part = tid / (2 * TOKENS); its page is looked up once per tile
  constexpr int ROW_THREADS = kThreads / (2 * TOKENS), ROW_CHUNKS = S::kChunks / ROW_THREADS;
  static_assert(kThreads % (2 * TOKENS) == 0 && S::kChunks % ROW_THREADS == 0, "staging shape");
  const int cp_row = tid % (2 * TOKENS), cp_plane = cp_row / TOKENS, cp_token = cp_row % TOKENS;
  const int cp_chunk0 = tid / (2 * TOKENS) * ROW_CHUNKS;
  const char* cp_base = cp_plane == 0 ? kbase : vbase;
  const int64_t cp_stride_page = cp_plane == 0 ? a.k_stride_page : a.v_stride_page;
  const int64_t cp_stride_token = cp_plane == 0 ? a.k_stride_token : a.v_stride_token;
  auto stage = [&](int tile) {
    if (tile < tiles) {
      unsigned char* buf = smem + (tile % kStages) * S::kStageStride;
      const int pos = begin + tile * TOKENS + cp_token;
      bool ok = pos < end;
      const char* src = cp_base;
      if (ok) {
        const uint32_t col = a.page_div.div(uint32_t(pos));
        const int page = __ldg(trow + col);
        ok = page >= 0 && page < a.pages;
        const int slot = pos - int(col) * a.page_size;
        if (ok) src += (page * cp_stride_page + slot * cp_stride_token) * int64_t(sizeof(KT));
      }
      unsigned char* dst = buf + cp_plane * S::kTileBytes + cp_token * S::kRowBytes;
#pragma unroll
      for (int c = 0; c < ROW_CHUNKS; ++c) {
        const int chunk = cp_chunk0 + c;
        copy16(dst + (chunk ^ (cp_token % S::kSwizzle)) * 16, src + (ok ? chunk * 16 : 0), ok);
      }
      if (cp_plane == 0 && cp_chunk0 == 0) buf[2 * S::kTileBytes + cp_token] = ok;
    }
    commit();  // an empty group past the end keeps the count uniform
  };
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) stage(t);

  // query row j = (head hk * group + j / q_tokens, token j % q_tokens), scaled to log2 units; a missing row is 0
  const float qscale = a.scale * a.k_scale * kLog2e;
  for (int i = tid; i < D * ROWS; i += kThreads) {
    const int d = i / ROWS, j = i % ROWS, row = row0 + j;
    const QT* qp = static_cast<const QT*>(p.query) + r * a.q_stride_request +
                   int64_t(hk * p.group + row / a.q_tokens) * a.q_stride_head + int64_t(row % a.q_tokens) *
                   a.q_stride_token;
    s_query[i] = j < nrows ? load_float(qp + d) * qscale : 0.f;
  }

  // score phase: thread (part, token) dots its slice of the token's K row with every query row
  const int st_token = tid % TOKENS, st_part = tid / TOKENS;
  // softmax phase: warp w owns rows w, w + kWarps, ...; lanes take tokens
  constexpr int WROWS = (ROWS + kWarps - 1) / kWarps;  // rows per warp
  float m[WROWS], l[WROWS];
#pragma unroll
  for (int k = 0; k < WROWS; ++k) m[k] = -INFINITY, l[k] = 0.f;
  // output phase: thread (subset, pair) accumulates dims 2 * pair, 2 * pair + 1 of every row over its tokens
  const int o_pair = tid % S::kPairs, o_subset = tid / S::kPairs;
  float acc[ROWS][2];
#pragma unroll
  for (int j = 0; j < ROWS; ++j) acc[j][0] = acc[j][1] = 0.f;

  for (int tile = 0; tile < tiles; ++tile) {
    wait_groups<kStages - 2>();
    __syncthreads();  // this tile is visible (and the query); every thread is done with tile - 1's buffer
    stage(tile + kStages - 1);
    const unsigned char* buf = smem + (tile % kStages) * S::kStageStride;
    {
      float x[ROWS];
#pragma unroll
      for (int j = 0; j < ROWS; ++j) x[j] = 0.f;
      const unsigned char* krow = buf + st_token * S::kRowBytes;
#pragma unroll
      for (int cc = 0; cc < S::kPartChunks; ++cc) {
        const int chunk = st_part * S::kPartChunks + cc;
        const unsigned char* kp = krow + (chunk ^ (st_token % S::kSwizzle)) * 16;
        constexpr int PAIRS = 8 / int(sizeof(KT));  // element pairs per 16 bytes
#pragma unroll
        for (int e = 0; e < PAIRS; ++e) {
          const float2 kf = pair_to_float<KT>(kp + e * 2 * sizeof(KT));
          const int d = (chunk * 16 / int(sizeof(KT))) + 2 * e;
          float q0[ROWS], q1[ROWS];
          load_rows<ROWS>(s_query + d * ROWS, q0);
          load_rows<ROWS>(s_query + (d + 1) * ROWS, q1);
#pragma unroll
          for (int j = 0; j < ROWS; ++j) x[j] = fmaf(q0[j], kf.x, fmaf(q1[j], kf.y, x[j]));
        }
      }
#pragma unroll
      for (int j = 0; j < ROWS; ++j) s_score[(st_part * TOKENS + st_token) * ROWS + j] = x[j];
    }
    __syncthreads();
    // softmax: the tile's max per row, the new running max, the weights and their sum
    const int base = begin + tile * TOKENS;
#pragma unroll
    for (int k = 0; k < WROWS; ++k) {
      const int j = warp + kWarps * k;
      if (j < ROWS) {
        const int row = row0 + j, limit = j < nrows ? length - (a.q_tokens - 1 - row % a.q_tokens) : INT_MIN;
        constexpr int PER_LANE = (TOKENS + 31) / 32;
        float sc[PER_LANE], tmax = -INFINITY;
#pragma unroll
        for (int u = 0; u < PER_LANE; ++u) {
          const int token = lane + 32 * u;
          float x = -INFINITY;
          if (token < TOKENS && buf[2 * S::kTileBytes + token] && base + token < limit) {
            x = 0.f;
#pragma unroll
            for (int part = 0; part < S::kParts; ++part) x += s_score[(part * TOKENS + token) * ROWS + j];
          }
          sc[u] = x;
          tmax = fmaxf(tmax, x);
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, off));
        const float mn = fmaxf(m[k], tmax), ref = mn == -INFINITY ? 0.f : mn;
        const float rescale = fast_exp2(m[k] - ref);
        float sum = 0.f;
#pragma unroll
        for (int u = 0; u < PER_LANE; ++u) {
          const int token = lane + 32 * u;
          const float w = fast_exp2(sc[u] - ref);  // 0 for a masked token
          sum += w;
          if (token < TOKENS) s_weight[token * ROWS + j] = w;
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        m[k] = mn;
        l[k] = l[k] * rescale + sum;
        if (lane == 0) s_rescale[j] = rescale;
      }
    }
    __syncthreads();
    // output: acc = acc * rescale + weights x V (a token not held has weight 0 and zero-filled V)
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      const float f = s_rescale[j];
      acc[j][0] *= f;
      acc[j][1] *= f;
    }
    const unsigned char* vtile = buf + S::kTileBytes;
    const int byte = o_pair * 2 * int(sizeof(KT)), chunk = byte / 16, within = byte % 16;
#pragma unroll 4
    for (int token = o_subset; token < TOKENS; token += S::kSubsets) {
      const float2 vf = pair_to_float<KT>(vtile + token * S::kRowBytes + (chunk ^ (token % S::kSwizzle)) * 16 +
                                          within);
      float w[ROWS];
      load_rows<ROWS>(s_weight + token * ROWS, w);
#pragma unroll
      for (int j = 0; j < ROWS; ++j) {
        acc[j][0] = fmaf(w[j], vf.x, acc[j][0]);
        acc[j][1] = fmaf(w[j], vf.y, acc[j][1]);
      }
    }
  }
  wait_groups<0>();
  __syncthreads();  // the stages are free for the merge

  // merge the token subsets' accumulators, normalise, write
  float* s_acc = reinterpret_cast<float*>(smem);  // [subsets][ROWS][D]
  float* s_m = s_weight;  // [ROWS] running max and sum per row (the weights are read no more)
  float* s_l = s_weight + ROWS;
#pragma unroll
  for (int j = 0; j < ROWS; ++j) {
    s_acc[(o_subset * ROWS + j) * D + 2 * o_pair] = acc[j][0];
    s_acc[(o_subset * ROWS + j) * D + 2 * o_pair + 1] = acc[j][1];
  }
  if (lane == 0)
#pragma unroll
    for (int k = 0; k < WROWS; ++k)
      if (warp + kWarps * k < ROWS) {
        s_m[warp + kWarps * k] = m[k];
        s_l[warp + kWarps * k] = l[k];
      }
  __syncthreads();
  const float out_scale = a.v_scale;
  for (int i = tid; i < nrows * D; i += kThreads) {
    const int j = i / D, d = i % D;
    float x = 0.f;
#pragma unroll
    for (int h = 0; h < S::kSubsets; ++h) x += s_acc[(h * ROWS + j) * D + d];
    const float sum = s_l[j];
    x *= sum > 0.f ? out_scale / sum : 0.f;
    const int row = row0 + j, head = hk * p.group + row / a.q_tokens, t = row % a.q_tokens;
    if (p.splits == 1) {
      static_cast<QT*>(p.out)[((int64_t(r) * a.q_tokens + t) * a.q_heads + head) * D + d] = from_float<QT>(x);
    } else {
      const int64_t at = ((int64_t(r) * a.q_heads + head) * a.q_tokens + t) * p.splits + split;
      p.part_out[at * D + d] = x;
      if (d == 0) p.part_lse[at] = sum > 0.f ? s_m[j] + log2f(sum) : -INFINITY;
    }
  }
}

// One CTA per (request, head, query token): the splits' outputs weighted by their share of the softmax sum.
template <typename QT>
__global__ void merge_kernel(const __grid_constant__ Params p) {
  const DecodeArgs& a = p.a;
  const int64_t at = blockIdx.x;  // ((r * Hq + head) * q + t)
  const int t = int(at % a.q_tokens), head = int(at / a.q_tokens % a.q_heads);
  const int64_t r = at / (int64_t(a.q_tokens) * a.q_heads);
  __shared__ float w[kMaxSplits];
  __shared__ float total;
  const float* lse = p.part_lse + at * p.splits;
  if (threadIdx.x < 32) {
    float M = -INFINITY;
    for (int s = threadIdx.x; s < p.splits; s += 32) M = fmaxf(M, lse[s]);
    for (int off = 16; off > 0; off /= 2) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    float sum = 0.f;
    for (int s = threadIdx.x; s < p.splits; s += 32) {
      w[s] = lse[s] == -INFINITY ? 0.f : fast_exp2(lse[s] - M);
      sum += w[s];
    }
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (threadIdx.x == 0) total = sum;
  }
  __syncthreads();
  const int D = a.head_dim;
  const float inv = total > 0.f ? 1.f / total : 0.f;
  const float* po = p.part_out + at * p.splits * D;
  QT* o = static_cast<QT*>(p.out) + ((r * a.q_tokens + t) * a.q_heads + head) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float x = 0.f;
    for (int s = 0; s < p.splits; ++s) x = fmaf(w[s], po[int64_t(s) * D + d], x);
    o[d] = from_float<QT>(x * inv);
  }
}

template <typename QT, typename KT, int D, int ROWS>
void launch_rows(Params& p, const at::Tensor& query) {
  auto kernel = decode_kernel<QT, KT, D, ROWS>;
  constexpr int smem = Shape<KT, D, ROWS>::kSmemBytes;
  prepare_kernel(kernel, "attention_decode", smem);
  const DecodeArgs& a = p.a;
  p.row_blocks = (p.rows + ROWS - 1) / ROWS;
  const int capacity = a.capacity();
  if (a.num_splits > 0) {
    p.splits = a.num_splits;
  } else {
    // The fewest splits that fill the resident CTA slots of every SM in whole waves (>= 90% of the last wave
    // busy), no split shorter than kMinSplitTokens; else the best-filled count.
    static thread_local std::map<std::pair<const void*, int>, int> resident;
    int dev = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    int& per_sm = resident[{reinterpret_cast<const void*>(kernel), dev}];
    if (per_sm == 0) C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
    const int64_t items = int64_t(a.requests) * a.kv_heads * p.row_blocks;
    const int64_t slots = int64_t(sm_count()) * std::max(per_sm, 1);
    const int64_t most = std::clamp<int64_t>(capacity / kMinSplitTokens, 1, kMaxSplits);
    double best = 0;
    p.splits = 1;
    for (int64_t s = 1; s <= std::min<int64_t>(most, 4 * ((slots + items - 1) / items)); ++s) {
      const int64_t ctas = items * s, waves = (ctas + slots - 1) / slots;
      const double filled = double(ctas) / double(waves * slots);
      if (filled > best + 1e-9) {
        best = filled;
        p.splits = int32_t(s);
      }
      if (filled >= 0.9) break;
    }
  }
  p.split_tokens = std::max(1, (capacity + p.splits - 1) / p.splits);
  p.splits = std::max(1, (capacity + p.split_tokens - 1) / p.split_tokens);  // no split past the capacity
  at::Tensor part_out, part_lse;
  if (p.splits > 1) {
    const auto f32 = query.options().dtype(at::kFloat);
    part_lse = at::empty({int64_t(a.requests) * a.q_heads * a.q_tokens * p.splits}, f32);
    part_out = at::empty({part_lse.numel() * D}, f32);
    p.part_out = part_out.data_ptr<float>();
    p.part_lse = part_lse.data_ptr<float>();
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  kernel<<<dim3(p.splits, a.kv_heads * p.row_blocks, a.requests), kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.splits > 1) {
    prepare_kernel(merge_kernel<QT>, "attention_decode");
    merge_kernel<QT><<<int64_t(a.requests) * a.q_heads * a.q_tokens, std::min(D, 128), 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Query rows per CTA: 1 (no grouping), 4 (up to 4 grouped rows) or kRows (more take several row blocks).
template <typename QT, typename KT, int D>
void launch_d(Params& p, const at::Tensor& query) {
  if (p.rows == 1) return launch_rows<QT, KT, D, 1>(p, query);
  if (p.rows <= 4) return launch_rows<QT, KT, D, 4>(p, query);
  launch_rows<QT, KT, D, kRows>(p, query);
}

template <typename QT, typename KT>
void launch(Params& p, const at::Tensor& query) {
  switch (p.a.head_dim) {
    case 64: return launch_d<QT, KT, 64>(p, query);
    case 128: return launch_d<QT, KT, 128>(p, query);
    default: return launch_d<QT, KT, 256>(p, query);
  }
}

at::Tensor decode_cuda(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& page_table, const at::Tensor& lengths,
                       const std::optional<at::Tensor>& starts, double scale, double k_scale, double v_scale,
                       int64_t num_splits) {
  Params p{};
  p.a = check_decode_args(query, k_cache, v_cache, page_table, lengths, starts, scale, k_scale, v_scale, num_splits);
  const DecodeArgs& a = p.a;
  at::Tensor out = at::empty({a.requests, a.q_tokens, a.q_heads, a.head_dim}, query.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard guard(query.device());
  p.query = query.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.table = page_table.data_ptr<int32_t>();
  p.lengths = lengths.data_ptr<int32_t>();
  p.starts = starts.has_value() ? starts->data_ptr<int32_t>() : nullptr;
  p.out = out.data_ptr();
  p.group = a.group();
  p.rows = p.group * a.q_tokens;
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  if (query.scalar_type() == at::kBFloat16) {
    fp8 ? launch<__nv_bfloat16, __nv_fp8_e4m3>(p, query) : launch<__nv_bfloat16, __nv_bfloat16>(p, query);
  } else {
    fp8 ? launch<__half, __nv_fp8_e4m3>(p, query) : launch<__half, __half>(p, query);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvops, CUDA, m) { m.impl("attention_decode", &decode_cuda); }

}  // namespace attention
}  // namespace kvops
