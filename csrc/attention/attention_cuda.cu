// CUDA backend of kvops::attention_decode: flash-decoding over a paged cache, on tensor cores.
//
// One CTA of kWarps warps serves one (request, KV head, block of kM query rows, split of the KV length). The query
// rows of a KV head are its grouped heads x query tokens, padded to the mma's M of 16, so K and V are read once
// per KV head and never repeated. Each warp takes every kWarps-th tile of kTile tokens of the CTA's range through
// its own kStages-deep cp.async pipeline (one page lookup per token, no CTA barrier in the loop), and per tile:
//   scores  S = Q K^T   mma.m16n8k16 with Q in registers (A) and K rows by ldmatrix (B, no transpose);
//   softmax the running max and sum per row in log2 units, on the accumulator fragments (a quad holds a row);
//   output  O += P V    P from S's fragments (A), V rows by ldmatrix.trans (B).
// fp8 tiles are widened to the query's type in shared memory first. At the end the warps' (max, sum, O) are merged
// through shared memory; with several splits each CTA writes its rows' normalised output and log-sum-exp, and a
// second kernel merges the splits. (A CUDA-core version of this kernel plateaued at 47% of the copy bandwidth on
// the H200, bound by its per-token work; see benchmarks/RESULTS.md for this one.)
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

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kM = 16;            // query rows per CTA: the mma's M (more take more row blocks)
constexpr int kTile = 16;         // tokens per warp tile: the mma's K of P V
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

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }

// two floats as the low and high halves of an mma operand register
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// two fp8 e4m3 values (low byte first) as T x 2, exactly
template <typename T> __device__ __forceinline__ uint32_t widen_fp8x2(uint16_t x) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(x, __NV_E4M3);
  if constexpr (std::is_same_v<T, __half>) {
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return pack2<T>(f.x, f.y);
  }
}

// D += A B on the tensor cores (m16n8k16, fp32 accumulators); A, B of T
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// four 8x8 matrices of 16-bit elements from shared memory; lane l gives the address of row l % 8 of matrix l / 8
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  const unsigned a = unsigned(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  const unsigned a = unsigned(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// cp.async of 16 bytes, zero-filled when !ok (nothing is read then)
__device__ __forceinline__ void copy16(void* dst, const void* src, bool ok) {
  const unsigned d = unsigned(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void wait_groups() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// One warp's shared memory: kStages tiles of K and V rows as stored (KT), a tile widened to T when KT is fp8, and
// a validity mask per stage. Rows in T are stored in 16-byte chunks, chunk c of token t at c ^ (t % 8): ldmatrix's
// eight rows of one chunk then fall in eight different bank groups. The CTA's merge reuses the whole of it.
template <typename T, typename KT, int D>
struct Shape {
  static constexpr bool kWiden = sizeof(KT) == 1;
  static constexpr int kRowBytes = D * int(sizeof(KT));      // a token row as stored
  static constexpr int kChunks = kRowBytes / 16;
  static constexpr int kPlaneBytes = kTile * kRowBytes;
  static constexpr int kStageBytes = 2 * kPlaneBytes;        // K, V
  // about 24 KiB of tiles per warp: two or three CTAs an SM below head_dim 256, 32 KiB of loads in flight each
  static constexpr int kStages = std::clamp(24576 / kStageBytes, 2, 4);
  static constexpr int kWideRowBytes = D * 2;                // a token row in T (ldmatrix's chunks, swizzled)
  static constexpr int kWideBytes = kWiden ? 2 * kTile * kWideRowBytes : 0;
  static constexpr int kMaskOffset = kStages * kStageBytes + kWideBytes;
  static constexpr int kWarpBytes = kMaskOffset + 16;
  // the final merge: every warp's O [kM][D + 8] (padded: a quad's rows fall in different banks), max and sum
  static constexpr int kAccStride = D + 8;
  static constexpr int kMergeBytes = kWarps * kM * (kAccStride + 2) * 4;
  static constexpr int kSmemBytes = std::max(kWarps * kWarpBytes, kMergeBytes);
  static_assert(kWideRowBytes / 16 >= 8 && kStages * kStageBytes % 16 == 0 && kChunks >= 2, "tile shape");
};

__device__ __forceinline__ int swizzle(int token, int chunk) { return chunk ^ (token & 7); }

template <typename T, typename KT, int D>
__global__ void __launch_bounds__(kThreads) decode_kernel(const __grid_constant__ Params p) {
  using S = Shape<T, KT, D>;
  constexpr int KSTEPS = D / 16;  // mma k-steps of Q K^T; also 16-dim column pairs of P V
  extern __shared__ __align__(128) unsigned char smem[];
  const DecodeArgs& a = p.a;
  const int r = blockIdx.z, split = blockIdx.x;
  const int hk = blockIdx.y / p.row_blocks, row0 = (blockIdx.y % p.row_blocks) * kM;
  const int nrows = min(kM, p.rows - row0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane / 4, tig = lane % 4;  // the mma fragments' row group and thread in group
  unsigned char* wsmem = smem + warp * S::kWarpBytes;
  uint32_t* masks = reinterpret_cast<uint32_t*>(wsmem + S::kMaskOffset);

  const int length = min(max(p.lengths[r], 0), a.capacity());
  const int start = a.has_starts ? min(max(p.starts[r], 0), length) : 0;
  const int begin = max(start, split * p.split_tokens);
  const int end = min(length, (split + 1) * p.split_tokens);
  const int tiles = end > begin ? (end - begin + kTile - 1) / kTile : 0;
  const int my_tiles = tiles > warp ? (tiles - warp + kWarps - 1) / kWarps : 0;  // tiles warp, warp + kWarps, ...

  // Stage the warp's tile i into buffer i % kStages. Lane t < kTile looks up token t's page and holds its K and V
  // row offsets; every lane then copies 16-byte chunks of rows, taking each row's offset from its owner.
  const int32_t* trow = p.table + int64_t(r) * a.table_stride;
  const char* kbase = static_cast<const char*>(p.k) + int64_t(hk) * a.k_stride_head * int64_t(sizeof(KT));
  const char* vbase = static_cast<const char*>(p.v) + int64_t(hk) * a.v_stride_head * int64_t(sizeof(KT));
  auto stage = [&](int i) {
    if (i < my_tiles) {
      const int pos = begin + (i * kWarps + warp) * kTile + lane;
      bool ok = lane < kTile && pos < end;
      int64_t koff = 0, voff = 0;
      if (ok) {
        const uint32_t col = a.page_div.div(uint32_t(pos));
        const int page = __ldg(trow + col);
        ok = page >= 0 && page < a.pages;
        const int slot = pos - int(col) * a.page_size;
        koff = (page * a.k_stride_page + slot * a.k_stride_token) * int64_t(sizeof(KT));
        voff = (page * a.v_stride_page + slot * a.v_stride_token) * int64_t(sizeof(KT));
      }
      const uint32_t mask = __ballot_sync(0xffffffffu, ok);
      if (lane == 0) masks[i % S::kStages] = mask;
      unsigned char* buf = wsmem + (i % S::kStages) * S::kStageBytes;
      constexpr int PER_PLANE = kTile * S::kChunks;  // chunks, a multiple of 32
#pragma unroll
      for (int it = 0; it < 2 * PER_PLANE / 32; ++it) {
        const int idx = it * 32 + lane, plane = idx / PER_PLANE, token = idx % PER_PLANE / S::kChunks;
        const int chunk = idx % S::kChunks;
        const int64_t off = __shfl_sync(0xffffffffu, plane == 0 ? koff : voff, token);
        const bool held = (mask >> token) & 1;
        const int at = S::kWiden ? chunk : swizzle(token, chunk);
        copy16(buf + plane * S::kPlaneBytes + token * S::kRowBytes + at * 16,
               (plane == 0 ? kbase : vbase) + (held ? off + chunk * 16 : 0), held);
      }
    }
    commit();  // an empty group past the end keeps the count uniform
  };
#pragma unroll
  for (int t = 0; t < S::kStages - 1; ++t) stage(t);

  // Q as mma A fragments: rows gid and gid + 8, dims 16 kk + 2 tig (+1) and + 8; a padding row is zeros.
  // Row j is (head hk * group + j / q_tokens, query token j % q_tokens); its causal limit is `limit`.
  uint32_t qa[KSTEPS][4];
  int limit[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int j = gid + 8 * h, row = row0 + j;
    const T* qp = static_cast<const T*>(p.query) + r * a.q_stride_request +
                  int64_t(hk * p.group + row / a.q_tokens) * a.q_stride_head +
                  int64_t(row % a.q_tokens) * a.q_stride_token;
    limit[h] = j < nrows ? length - (a.q_tokens - 1 - row % a.q_tokens) : INT_MIN;
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int d = 16 * kk + 8 * half + 2 * tig;
        uint32_t v = 0;
        if (j < nrows) {
          const uint16_t lo = *reinterpret_cast<const uint16_t*>(qp + d);
          const uint16_t hi = *reinterpret_cast<const uint16_t*>(qp + d + 1);
          v = lo | uint32_t(hi) << 16;
        }
        qa[kk][h + 2 * half] = v;
      }
  }
  const float qscale = a.scale * a.k_scale * kLog2e;

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // rows gid, gid + 8; l is this thread's share
  float acc[2 * KSTEPS][4];                                 // O: dims 8 n + 2 tig (+1) of rows gid, gid + 8
#pragma unroll
  for (int n = 0; n < 2 * KSTEPS; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  for (int i = 0; i < my_tiles; ++i) {
    wait_groups<S::kStages - 2>();
    __syncwarp();  // tile i is visible to the warp; every lane is done with tile i - 1's buffer
    stage(i + S::kStages - 1);
    const unsigned char* buf = wsmem + (i % S::kStages) * S::kStageBytes;
    const uint32_t mask = masks[i % S::kStages];
    const unsigned char *ktile = buf, *vtile = buf + S::kPlaneBytes;
    constexpr int ROW = S::kWideRowBytes;
    if constexpr (S::kWiden) {  // fp8 rows to T rows, swizzled
      unsigned char* wide = wsmem + S::kStages * S::kStageBytes;
      constexpr int PER_PLANE = kTile * S::kChunks;
#pragma unroll
      for (int it = 0; it < (2 * PER_PLANE + 31) / 32; ++it) {
        const int idx = it * 32 + lane;
        if (2 * PER_PLANE % 32 == 0 || idx < 2 * PER_PLANE) {
          const int plane = idx / PER_PLANE, token = idx % PER_PLANE / S::kChunks, chunk = idx % S::kChunks;
          const uint4 x = *reinterpret_cast<const uint4*>(buf + plane * S::kPlaneBytes + token * S::kRowBytes +
                                                          chunk * 16);
          const uint32_t w[4] = {x.x, x.y, x.z, x.w};
          uint32_t y[8];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            y[2 * e] = widen_fp8x2<T>(uint16_t(w[e]));
            y[2 * e + 1] = widen_fp8x2<T>(uint16_t(w[e] >> 16));
          }
          unsigned char* row = wide + plane * kTile * ROW + token * ROW;
          *reinterpret_cast<uint4*>(row + swizzle(token, 2 * chunk) * 16) = make_uint4(y[0], y[1], y[2], y[3]);
          *reinterpret_cast<uint4*>(row + swizzle(token, 2 * chunk + 1) * 16) = make_uint4(y[4], y[5], y[6], y[7]);
        }
      }
      __syncwarp();
      ktile = wide;
      vtile = wide + kTile * ROW;
    }

    // S = Q K^T: s[n] holds tokens 8 n + 2 tig (+1) of rows gid (0, 1) and gid + 8 (2, 3)
    float s[2][4] = {};
    {
      // ldmatrix: matrix l / 8 is (tokens 8 (l / 16) .., chunk 2 kk + (l / 8) % 2): B of tokens 0-7, then 8-15
      const int token = (lane / 16) * 8 + lane % 8, sub = (lane / 8) % 2;
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t kb[4];
        ldmatrix_x4(kb, ktile + token * ROW + swizzle(token, 2 * kk + sub) * 16);
        mma<T>(s[0], qa[kk], kb[0], kb[1]);
        mma<T>(s[1], qa[kk], kb[2], kb[3]);
      }
    }
    // online softmax in log2 units; a token not held, past the range or past the row's causal limit is -inf
    const int base = begin + (i * kWarps + warp) * kTile;
    float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int token = 8 * n + 2 * tig + (e & 1), h = e >> 1;
        const bool ok = ((mask >> token) & 1) && base + token < limit[h];
        s[n][e] = ok ? s[n][e] * qscale : -INFINITY;
        tmax[h] = fmaxf(tmax[h], s[n][e]);
      }
    float rescale[2], ref[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 1));
      tmax[h] = fmaxf(tmax[h], __shfl_xor_sync(0xffffffffu, tmax[h], 2));
      const float mn = fmaxf(m[h], tmax[h]);
      ref[h] = mn == -INFINITY ? 0.f : mn;
      rescale[h] = fast_exp2(m[h] - ref[h]);
      m[h] = mn;
      l[h] *= rescale[h];
    }
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = fast_exp2(s[n][e] - ref[e >> 1]);  // 0 for -inf
        l[e >> 1] += s[n][e];
      }
#pragma unroll
    for (int n = 0; n < 2 * KSTEPS; ++n) {
      acc[n][0] *= rescale[0], acc[n][1] *= rescale[0];
      acc[n][2] *= rescale[1], acc[n][3] *= rescale[1];
    }
    // O += P V: P's A fragment is S's two accumulator tiles; V by ldmatrix.trans, matrix l / 8 is (tokens
    // 8 ((l / 8) % 2) .., chunk 2 kk + l / 16): B of dims 16 kk .. + 7, then + 8 .. + 15. A token not held has
    // weight 0 and zero-filled V.
    const uint32_t pa[4] = {pack2<T>(s[0][0], s[0][1]), pack2<T>(s[0][2], s[0][3]), pack2<T>(s[1][0], s[1][1]),
                            pack2<T>(s[1][2], s[1][3])};
    {
      const int token = ((lane / 8) % 2) * 8 + lane % 8, sub = lane / 16;
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, vtile + token * ROW + swizzle(token, 2 * kk + sub) * 16);
        mma<T>(acc[2 * kk], pa, vb[0], vb[1]);
        mma<T>(acc[2 * kk + 1], pa, vb[2], vb[3]);
      }
    }
  }
  wait_groups<0>();
  __syncthreads();  // every warp is done with its tiles: the shared memory is the merge's

  // merge the warps: each writes its O, max and sum (the quad's shares summed) per row
  float* s_acc = reinterpret_cast<float*>(smem);  // [kWarps][kM][kAccStride]
  float* s_m = s_acc + kWarps * kM * S::kAccStride;
  float* s_l = s_m + kWarps * kM;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    float* row = s_acc + (warp * kM + gid + 8 * h) * S::kAccStride;
#pragma unroll
    for (int n = 0; n < 2 * KSTEPS; ++n)
      *reinterpret_cast<float2*>(row + 8 * n + 2 * tig) = make_float2(acc[n][2 * h], acc[n][2 * h + 1]);
    if (tig == 0) {
      s_m[warp * kM + gid + 8 * h] = m[h];
      s_l[warp * kM + gid + 8 * h] = l[h];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < nrows * D; idx += kThreads) {
    const int j = idx / D, d = idx % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, s_m[w * kM + j]);
    const float ref = M == -INFINITY ? 0.f : M;
    float x = 0.f, sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float f = fast_exp2(s_m[w * kM + j] - ref);
      x = fmaf(f, s_acc[(w * kM + j) * S::kAccStride + d], x);
      sum = fmaf(f, s_l[w * kM + j], sum);
    }
    x *= sum > 0.f ? a.v_scale / sum : 0.f;
    const int row = row0 + j, head = hk * p.group + row / a.q_tokens, t = row % a.q_tokens;
    if (p.splits == 1) {
      static_cast<T*>(p.out)[((int64_t(r) * a.q_tokens + t) * a.q_heads + head) * D + d] = from_float<T>(x);
    } else {
      const int64_t at = ((int64_t(r) * a.q_heads + head) * a.q_tokens + t) * p.splits + split;
      p.part_out[at * D + d] = x;
      if (d == 0) p.part_lse[at] = sum > 0.f ? M + log2f(sum) : -INFINITY;
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

template <typename QT, typename KT, int D>
void launch_d(Params& p, const at::Tensor& query) {
  auto kernel = decode_kernel<QT, KT, D>;
  constexpr int smem = Shape<QT, KT, D>::kSmemBytes;
  prepare_kernel(kernel, "attention_decode", smem);
  const DecodeArgs& a = p.a;
  p.row_blocks = (p.rows + kM - 1) / kM;
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
