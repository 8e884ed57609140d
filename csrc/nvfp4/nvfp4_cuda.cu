// CUDA kernels for the NVFP4 ops: quantize/dequantize primitives and the cold-page codec.
//
// The codec kernels are shaped like a page copy. One CTA owns one (page, pool, plane) unit and
// walks it in row chunks of up to 64 KiB:
//   encode: 16-byte loads of the chunk's quantized run straight into registers (every thread holds
//           whole 16-element blocks, all its loads in flight at once); the plane's amax and the codes
//           from those registers; codes and scales -> smem staging; 16-byte vector stores of the
//           staging into the blob. Lossless bytes go straight from row to blob.
//   decode: 16-byte loads of the chunk's codes/scales from the blob -> smem; dequantize in registers;
//           16-byte vector stores into the pool rows. Lossless bytes go straight from blob to row.
// The blob may live in pinned host memory: every access to it is a coalesced 16-byte vector, and
// the grid has a CTA per unit so that enough requests are in flight to fill PCIe.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <map>

#include "../cuda_utils.cuh"
#include "codec.h"
#include "nvfp4.h"
#include "nvfp4_device.cuh"

namespace kvops {
namespace nvfp4 {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxPools = 16;               // pools per launch (keeps the parameter block < 4 KB)
constexpr int kMaxSmem = 200 * 1024;

// Block-wide NaN-propagating max; every thread gets the result.
__device__ float block_max(float v, float* red) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = nan_max(v, __shfl_xor_sync(kFullMask, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < int(blockDim.x / 32); ++w) v = nan_max(v, red[w]);
  __syncthreads();  // red is reused
  return v;
}

template <int kBytes>
__device__ __forceinline__ void store_codes(uint8_t* p, uint64_t codes) {
  if constexpr (kBytes == 8) *reinterpret_cast<uint64_t*>(p) = codes;
  else if constexpr (kBytes == 4) *reinterpret_cast<uint32_t*>(p) = uint32_t(codes);
  else *reinterpret_cast<uint16_t*>(p) = uint16_t(codes);
}

template <int kBytes>
__device__ __forceinline__ uint64_t load_codes(const uint8_t* p) {
  if constexpr (kBytes == 8) return *reinterpret_cast<const uint64_t*>(p);
  else if constexpr (kBytes == 4) return *reinterpret_cast<const uint32_t*>(p);
  else return *reinterpret_cast<const uint16_t*>(p);
}

// ---- primitives ---------------------------------------------------------------------------------

template <class T>
__device__ __forceinline__ void load_block(const uint4* p, uint4 (&v)[vecs_per_block<T>()]) {
#pragma unroll
  for (int j = 0; j < vecs_per_block<T>(); ++j) v[j] = p[j];
}

template <class T>
__global__ void __launch_bounds__(kThreads) quantize_kernel(const uint4* __restrict__ x, int64_t nblocks,
                                                            const float* g_dev, float g_host,
                                                            uint8_t* __restrict__ packed, uint8_t* __restrict__ scales) {
  const float g = g_dev ? *g_dev : g_host;
  const bool fast = fast_scale<T>(g);
  for (int64_t b = int64_t(blockIdx.x) * kThreads + threadIdx.x; b < nblocks; b += int64_t(gridDim.x) * kThreads) {
    uint4 v[vecs_per_block<T>()];
    load_block<T>(x + b * vecs_per_block<T>(), v);
    uint8_t sc;
    const uint64_t codes = quantize_block<T>(v, g, fast, sc);
    *reinterpret_cast<uint64_t*>(packed + b * 8) = codes;
    scales[b] = sc;
  }
}

template <class T>
__device__ __forceinline__ uint4 dequantize_vector(uint64_t codes, uint8_t scale, float g, float g_inv, bool fast) {
  if (scale == kScaleNaN) return nan_vector<T>();
  float x[Hot<T>::kEpt];
  dequantize_floats<Hot<T>::kEpt>(codes, scale, g, g_inv, fast, x);
  return from_float<T>(x);
}

template <class T>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const uint8_t* __restrict__ packed,
                                                              const uint8_t* __restrict__ scales, int64_t nvec,
                                                              const float* g_dev, float g_host, uint4* __restrict__ out) {
  constexpr int kEpt = Hot<T>::kEpt, kVecs = vecs_per_block<T>();
  const float g = g_dev ? *g_dev : g_host;
  const bool fast = is_fast_scale(g);
  const float g_inv = fast ? __frcp_rn(g) : 0.f;
  for (int64_t v = int64_t(blockIdx.x) * kThreads + threadIdx.x; v < nvec; v += int64_t(gridDim.x) * kThreads)
    out[v] = dequantize_vector<T>(load_codes<kEpt / 2>(packed + v * (kEpt / 2)), scales[v / kVecs], g, g_inv, fast);
}

template <class F>
void dispatch_dtype(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kFloat8_e4m3fn: f(__nv_fp8_e4m3{}); break;
    case at::kFloat: f(float{}); break;
    default: TORCH_CHECK_VALUE(false, "kvops: unsupported dtype ", t);
  }
}

int grid_for(int64_t nvec) {
  const int sms = sm_count();
  return int(std::max<int64_t>(1, std::min<int64_t>((nvec + kThreads - 1) / kThreads, int64_t(sms) * 8)));
}

// g on the device is read by the kernel (no sync); on the host it is passed by value.
std::pair<const float*, float> scale_arg(const c10::optional<at::Tensor>& g, const char* what) {
  if (!g) return {nullptr, 1.f};
  if (g->is_cuda()) return {g->data_ptr<float>(), 1.f};
  const float v = g->item<float>();
  TORCH_CHECK_VALUE(v > 0.f && v <= FLT_MAX, what, ": global_scale must be positive and finite, got ", v);
  return {nullptr, v};
}

at::Tensor aligned_contiguous(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 ? c.clone() : c;
}

std::tuple<at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& global_scale) {
  check_quantize_args(x, global_scale);
  c10::cuda::CUDAGuard guard(x.device());
  auto [g_dev, g_host] = scale_arg(global_scale, "nvfp4_quantize");
  at::Tensor xc = aligned_contiguous(x);
  auto [packed, scales] = quantize_outputs(x);
  const int64_t nblocks = xc.numel() / kBlock;
  if (nblocks == 0) return {packed, scales};
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_dtype(xc.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    prepare_kernel(quantize_kernel<T>, "nvfp4_quantize");
    quantize_kernel<T><<<grid_for(nblocks), kThreads, 0, stream>>>(
        static_cast<const uint4*>(xc.data_ptr()), nblocks, g_dev, g_host, packed.data_ptr<uint8_t>(),
        reinterpret_cast<uint8_t*>(scales.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {packed, scales};
}

at::Tensor dequantize_cuda(const at::Tensor& packed, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& global_scale, at::ScalarType dtype) {
  check_dequantize_args(packed, scales, global_scale, dtype);
  c10::cuda::CUDAGuard guard(packed.device());
  auto [g_dev, g_host] = scale_arg(global_scale, "nvfp4_dequantize");
  at::Tensor pc = packed.contiguous(), sc = scales.contiguous();
  at::Tensor out = dequantize_output(packed, dtype);
  const int64_t nvec = out.numel() * out.element_size() / 16;
  if (nvec == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    prepare_kernel(dequantize_kernel<T>, "nvfp4_dequantize");
    dequantize_kernel<T><<<grid_for(nvec), kThreads, 0, stream>>>(pc.data_ptr<uint8_t>(),
                                                                  reinterpret_cast<const uint8_t*>(sc.data_ptr()), nvec,
                                                                  g_dev, g_host, static_cast<uint4*>(out.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

// ---- cold-page codec ----------------------------------------------------------------------------

constexpr int kEncodeThreads = 256;  // 2 CTAs per SM: the held vectors take about half the registers
constexpr int kEncodeVecs = 16;      // 16-byte vectors of a chunk each encode thread holds in registers
constexpr int kDecodeThreads = 256;

struct CodecParams {
  PoolDesc pools[kMaxPools];
  int32_t unit_begin[kMaxPools + 1];  // units (planes) of pools before each pool, within one page
  int32_t chunk_rows[kMaxPools];
  int32_t num_pools, units_per_page;
  const int32_t* pairs;  // [n, 2] (dst, src)
  int32_t* refused;      // decode: planes left untouched for a bad global scale (may be null)
  uint8_t* blobs;
  int64_t blob_stride, num_slots;
  int32_t staged;        // the blob of pair i is row i of `blobs` (a staging chunk), not the pair's slot
};

// Staging layout of one chunk's quantized output (each region padded to 16 bytes).
struct ChunkStaging {
  int32_t codes, rcodes, scales, rscales, total;
  __host__ __device__ ChunkStaging(const PoolDesc& d, int32_t rows) {
    auto p16 = [](int64_t n) { return int32_t((n + 15) & ~int64_t(15)); };
    codes = 0;
    rcodes = codes + p16(int64_t(rows) * d.q_len / 2);
    scales = rcodes + p16(int64_t(rows) * d.r_len / 2);
    rscales = scales + p16(int64_t(rows) * d.q_len / kBlock);
    total = rscales + p16(int64_t(rows) * d.r_len / kBlock);
  }
};

struct Unit {
  int pool, plane;
  int64_t page, slot;
};

// Which (pool, plane) and pair this CTA owns; false when the pair is out of range (skipped).
__device__ __forceinline__ bool locate_unit(const CodecParams& P, bool encode, Unit& u) {
  const int64_t pair = blockIdx.x / P.units_per_page;
  int unit = blockIdx.x % P.units_per_page;
  u.pool = 0;
  while (unit >= P.unit_begin[u.pool + 1]) ++u.pool;
  u.plane = unit - P.unit_begin[u.pool];
  const int32_t dst = P.pairs[2 * pair], src = P.pairs[2 * pair + 1];
  u.page = encode ? src : dst;
  u.slot = P.staged ? pair : encode ? dst : src;
  return u.slot >= 0 && u.slot < P.num_slots && u.page >= 0 && u.page < P.pools[u.pool].num_pages;
}

// Lossless bytes of a plane: row <-> blob region, 16-byte vectors, no smem.
__device__ __forceinline__ void copy_lossless(const PoolDesc& d, int64_t page, int plane, uint8_t* region, bool to_blob) {
  const int32_t lb = d.lossless_bytes();
  if (lb == 0) return;
  const int32_t n = d.plane_rows * int32_t(d.lvecs.d);
  for (int32_t v = threadIdx.x; v < n; v += blockDim.x) {
    const uint32_t row = d.lvecs.div(uint32_t(v));
    const int32_t j = (v - int32_t(row * d.lvecs.d)) * 16;
    char* rp = d.base + d.row_offset(page, plane, row) + d.lossless_col(j);
    uint4* bp = reinterpret_cast<uint4*>(region + int64_t(row) * lb + j);
    if (to_blob) *bp = *reinterpret_cast<const uint4*>(rp);
    else *reinterpret_cast<uint4*>(rp) = *bp;
  }
}

// 16-byte vector copy of n bytes rounded up to 16 (both sides 16-byte aligned).
__device__ __forceinline__ void copy_out(uint8_t* dst, const uint8_t* src, int64_t n) {
  for (int64_t i = threadIdx.x * 16; i < n; i += blockDim.x * 16)
    *reinterpret_cast<uint4*>(dst + i) = *reinterpret_cast<const uint4*>(src + i);
}

// Global (device or mapped host) -> smem with plain 16-byte loads, four in flight per thread.
__device__ __forceinline__ void load_to_smem(uint8_t* smem, const uint8_t* src, int64_t n) {
  const int64_t nv = (n + 15) / 16, step = blockDim.x;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  uint4* d = reinterpret_cast<uint4*>(smem);
  for (int64_t i = threadIdx.x; i < nv; i += 4 * step) {
    uint4 r[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (i + j * step < nv) r[j] = s[i + j * step];
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (i + j * step < nv) d[i + j * step] = r[j];
  }
}

// Zero a staging region's padding (the blob's padding bytes come from here).
__device__ __forceinline__ void zero_tail(uint8_t* stage, int64_t n) {
  for (int64_t i = n; i & 15; ++i) stage[i] = 0;
}

template <class T>
__global__ void __launch_bounds__(kEncodeThreads, 2) encode_pages_kernel(const __grid_constant__ CodecParams P) {
  constexpr int kVecs = vecs_per_block<T>(), kHeld = kEncodeVecs / kVecs;  // blocks a thread holds
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float red[32];
  Unit u;
  if (!locate_unit(P, true, u)) return;
  const PoolDesc& d = P.pools[u.pool];
  uint8_t* section = P.blobs + u.slot * P.blob_stride + d.section_offset;
  uint8_t* pb = section + d.plane_offset + u.plane * d.plane_bytes;

  const int32_t qb = d.q_len / kBlock, rb = d.r_len / kBlock;  // blocks per row
  const int32_t cr = P.chunk_rows[u.pool];
  const int32_t nchunks = d.q_len ? (d.plane_rows + cr - 1) / cr : 0;
  // Block b of the rows from r0 on (row-major), as vectors in the pool.
  auto block_at = [&](int32_t r0, int32_t b) {
    const uint32_t row = d.qvecs.div(uint32_t(b * kVecs));
    const int32_t k = b - int32_t(row) * qb;
    return reinterpret_cast<const uint4*>(d.base + d.row_offset(u.page, u.plane, r0 + row) +
                                          (d.q_start + k * kBlock) * d.esize);
  };
  // A pool with nothing to quantize still records g (1 for per-page policies, as on the CPU).
  float g = d.scale_kind == kScaleFixed ? d.fixed_scale : 1.f;
  if (d.scale_kind != kScaleFixed && nchunks > 1) {  // plane larger than a tile: amax pass first
    float m = 0.f;
    for (int32_t b = threadIdx.x; b < d.plane_rows * qb; b += blockDim.x) {
      uint4 v[kVecs];
      load_block<T>(block_at(0, b), v);
      m = nan_max(m, block_amax<T>(v));
    }
    g = page_global_scale(block_max(m, red), d.scale_kind);
  }

  const ChunkStaging st(d, cr);
  uint8_t* stage = smem;
  for (int32_t c = 0; c < nchunks; ++c) {
    const int32_t r0 = c * cr, rows = min(cr, d.plane_rows - r0), nblk = rows * qb;
    // The chunk goes straight into registers, block b = i * kEncodeThreads + threadIdx.x in thread slot i: every
    // load is in flight before the first is used, and the amax and the codes come from the same registers.
    uint4 v[kHeld][kVecs];
    float amax[kHeld];
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      const int32_t b = i * kEncodeThreads + threadIdx.x;
      if (b < nblk) load_block<T>(block_at(r0, b), v[i]);
    }
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < kHeld; ++i) {
      amax[i] = i * kEncodeThreads + int32_t(threadIdx.x) < nblk ? block_amax<T>(v[i]) : 0.f;
      m = nan_max(m, amax[i]);
    }
    if (d.scale_kind != kScaleFixed && nchunks == 1) g = page_global_scale(block_max(m, red), d.scale_kind);
    if (c > 0) __syncthreads();  // the previous chunk's staging is out
    if (threadIdx.x == 0) {
      zero_tail(stage + st.codes, int64_t(nblk) * 8);
      zero_tail(stage + st.scales, nblk);
      zero_tail(stage + st.rcodes, int64_t(rows) * rb * 8);
      zero_tail(stage + st.rscales, int64_t(rows) * rb);
    }
    // Only the fast path runs from the held registers, unrolled. The general path (a g that is not a power of two)
    // and the 2FP4 residual reload their blocks (from L2) in rolled loops, which keeps the kernel's code small
    // enough for the instruction cache.
    if (fast_scale<T>(g)) {
#pragma unroll
      for (int i = 0; i < kHeld; ++i) {
        const int32_t b = i * kEncodeThreads + threadIdx.x;
        if (b >= nblk) continue;
        uint8_t sc;
        *reinterpret_cast<uint64_t*>(stage + st.codes + int64_t(b) * 8) = quantize_block_fast<T>(v[i], amax[i], g, sc);
        stage[st.scales + b] = sc;
      }
    } else {
#pragma unroll 1
      for (int32_t b = threadIdx.x; b < nblk; b += kEncodeThreads) {
        uint4 w[kVecs];
        load_block<T>(block_at(r0, b), w);
        uint8_t sc;
        *reinterpret_cast<uint64_t*>(stage + st.codes + int64_t(b) * 8) =
            quantize_block_general<T>(w, block_amax<T>(w), g, sc);
        stage[st.scales + b] = sc;
      }
    }
    if (d.r_len) {  // 2FP4: quantize the first component's rounding error (general path); this thread's blocks
      const bool fast_dec = is_fast_scale(g);
      const float g_inv = fast_dec ? __frcp_rn(g) : 0.f;
#pragma unroll 1
      for (int32_t b = threadIdx.x; b < nblk; b += kEncodeThreads) {
        const int32_t row = int32_t(d.qvecs.div(uint32_t(b * kVecs))), col = d.q_start + (b - row * qb) * kBlock;
        if (col < d.r_start || col >= d.r_start + d.r_len) continue;
        uint4 w[kVecs];
        load_block<T>(block_at(r0, b), w);
        float x[kBlock], dec[kBlock];
        block_to_float<T>(w, x);
        dequantize_floats<kBlock>(*reinterpret_cast<const uint64_t*>(stage + st.codes + int64_t(b) * 8),
                                  stage[st.scales + b], g, g_inv, fast_dec, dec);
#pragma unroll
        for (int e = 0; e < kBlock; ++e) x[e] = x[e] - dec[e];
        uint8_t rsc;
        const uint64_t rcodes = quantize_floats<kBlock>(x, g, rsc);
        const int32_t rbi = row * rb + (col - d.r_start) / kBlock;
        *reinterpret_cast<uint64_t*>(stage + st.rcodes + int64_t(rbi) * 8) = rcodes;
        stage[st.rscales + rbi] = rsc;
      }
    }
    __syncthreads();
    copy_out(pb + d.off_codes + int64_t(r0) * qb * 8, stage + st.codes, int64_t(nblk) * 8);
    copy_out(pb + d.off_scales + int64_t(r0) * qb, stage + st.scales, nblk);
    if (d.r_len) {
      copy_out(pb + d.off_rcodes + int64_t(r0) * rb * 8, stage + st.rcodes, int64_t(rows) * rb * 8);
      copy_out(pb + d.off_rscales + int64_t(r0) * rb, stage + st.rscales, int64_t(rows) * rb);
    }
  }
  copy_lossless(d, u.page, u.plane, pb + d.off_lossless, true);
  if (threadIdx.x == 0) {
    *reinterpret_cast<float*>(section + PoolDesc::g_offset(u.plane)) = g;
    if (u.plane == 0) {  // the layout tag, and zeros in the g table's padding
      *reinterpret_cast<uint32_t*>(section) = d.tag;
      for (int64_t i = PoolDesc::g_offset(d.planes); i < d.plane_offset; i += 4)
        *reinterpret_cast<uint32_t*>(section + i) = 0;
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kDecodeThreads, 4) decode_pages_kernel(const __grid_constant__ CodecParams P) {
  constexpr int kEpt = Hot<T>::kEpt, kVecs = vecs_per_block<T>();
  extern __shared__ __align__(16) uint8_t smem[];
  Unit u;
  if (!locate_unit(P, false, u)) return;
  const PoolDesc& d = P.pools[u.pool];
  const uint8_t* section = P.blobs + u.slot * P.blob_stride + d.section_offset;
  uint8_t* pb = const_cast<uint8_t*>(section) + d.plane_offset + u.plane * d.plane_bytes;

  const int32_t qvpr = int32_t(d.qvecs.d);
  const int32_t rvpr = d.r_len * d.esize / 16;
  const int32_t cr = P.chunk_rows[u.pool];
  const ChunkStaging st(d, cr);
  const int32_t qb = d.q_len / kBlock, rb = d.r_len / kBlock;
  const float* g_at = reinterpret_cast<const float*>(section + PoolDesc::g_offset(u.plane));
  // A global scale encode never writes (a slot never encoded: 0) leaves the plane untouched. Every thread reads
  // the same g, so all leave together, before anything is written.
  bool refused = d.q_len == 0 && !decodable(d, section, *g_at);
  for (int32_t r0 = 0; r0 < d.plane_rows && d.q_len; r0 += cr) {
    const int32_t rows = min(cr, d.plane_rows - r0);
    load_to_smem(smem + st.codes, pb + d.off_codes + int64_t(r0) * d.q_len / 2, int64_t(rows) * d.q_len / 2);
    load_to_smem(smem + st.scales, pb + d.off_scales + int64_t(r0) * qb, int64_t(rows) * qb);
    if (d.r_len) {
      load_to_smem(smem + st.rcodes, pb + d.off_rcodes + int64_t(r0) * d.r_len / 2, int64_t(rows) * d.r_len / 2);
      load_to_smem(smem + st.rscales, pb + d.off_rscales + int64_t(r0) * rb, int64_t(rows) * rb);
    }
    const float g = *g_at;  // after the loads are in flight
    refused = !decodable(d, section, g);
    if (refused) break;
    const bool fast = is_fast_scale(g);
    const float g_inv = fast ? __frcp_rn(g) : 0.f;
    __syncthreads();
    const int32_t nvec = rows * qvpr;
    for (int32_t v = threadIdx.x; v < nvec; v += blockDim.x) {
      const uint32_t row = d.qvecs.div(uint32_t(v));
      const int32_t k = v - int32_t(row) * qvpr;
      const int32_t col = d.q_start + k * kEpt;
      const uint8_t sc = smem[st.scales + v / kVecs];
      bool nan = sc == kScaleNaN;
      float x[kEpt];
      dequantize_floats<kEpt>(load_codes<kEpt / 2>(smem + st.codes + int64_t(v) * (kEpt / 2)), sc, g, g_inv, fast, x);
      if (d.r_len && col >= d.r_start && col < d.r_start + d.r_len) {
        const int32_t rv = int32_t(row) * rvpr + (col - d.r_start) / kEpt;
        const uint8_t rsc = smem[st.rscales + rv / kVecs];
        nan |= rsc == kScaleNaN;
        float r[kEpt];
        dequantize_floats<kEpt>(load_codes<kEpt / 2>(smem + st.rcodes + int64_t(rv) * (kEpt / 2)), rsc, g, g_inv, fast, r);
#pragma unroll
        for (int i = 0; i < kEpt; ++i) x[i] = x[i] + r[i];
      }
      const uint4 out = nan ? nan_vector<T>() : from_float<T>(x);
      *reinterpret_cast<uint4*>(d.base + d.row_offset(u.page, u.plane, r0 + row) + col * d.esize) = out;
    }
    if (r0 + cr < d.plane_rows) __syncthreads();
  }
  if (refused) {
    if (threadIdx.x == 0 && P.refused != nullptr) atomicAdd(P.refused, 1);
    return;
  }
  copy_lossless(d, u.page, u.plane, pb + d.off_lossless, false);
}

// The encode's chunk: what its threads hold (64 KiB, a whole Qwen3-8B bf16 plane). Decode chunks match.
constexpr int64_t kTileBytes = int64_t(kEncodeThreads) * kEncodeVecs * 16;

int64_t chunk_rows_for(const PoolDesc& d) {
  const int64_t qbytes = int64_t(d.q_len) * d.esize;
  if (qbytes == 0 || d.plane_rows * qbytes <= kTileBytes) return std::max<int64_t>(d.plane_rows, 1);
  const int64_t rows = std::max<int64_t>(16, (kTileBytes / qbytes) & ~int64_t(15));
  TORCH_CHECK_VALUE(rows * qbytes <= kTileBytes, "nvfp4 codec: rows of ", d.q_len,
                    " quantized elements are too long for the encode tile");
  return rows;
}

// Where one launch's blobs are: `blobs` rows `blob_stride` bytes apart, `num_slots` of them; `staged`: pair i's
// blob is row i.
struct Blobs {
  uint8_t* base;
  int64_t stride, slots;
  bool staged;
};

template <class Kernel>
void launch_codec(Kernel kernel, const char* what, bool encode, const std::vector<PoolDesc>& descs,
                  const std::vector<size_t>& members, const int32_t* pairs, int32_t* refused, int64_t num_pairs,
                  const Blobs& blobs, cudaStream_t stream) {
  prepare_kernel(kernel, what, kMaxSmem);
  for (size_t b = 0; b < members.size(); b += kMaxPools) {
    CodecParams P{};
    P.num_pools = int32_t(std::min<size_t>(kMaxPools, members.size() - b));
    int64_t smem = 0;
    for (int i = 0; i < P.num_pools; ++i) {
      const PoolDesc& d = descs[members[b + i]];
      P.pools[i] = d;
      P.chunk_rows[i] = int32_t(chunk_rows_for(d));
      P.unit_begin[i + 1] = P.unit_begin[i] + d.planes;
      const int64_t stage = ChunkStaging(d, P.chunk_rows[i]).total;
      smem = std::max<int64_t>(smem, stage);
    }
    TORCH_CHECK(smem <= kMaxSmem, what, ": a chunk needs ", smem, " bytes of shared memory");
    P.units_per_page = P.unit_begin[P.num_pools];
    P.pairs = pairs;
    P.refused = refused;
    P.blobs = blobs.base;
    P.blob_stride = blobs.stride;
    P.num_slots = blobs.slots;
    P.staged = blobs.staged;
    const int64_t grid = num_pairs * P.units_per_page;
    TORCH_CHECK(grid < (int64_t(1) << 31), what, ": too many pages in one call");
    kernel<<<dim3(uint32_t(grid)), encode ? kEncodeThreads : kDecodeThreads, smem, stream>>>(P);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// A staged transfer (docs/nvfp4.md, "Staged transfers"): the pairs go in chunks of half the staging rows, the two
// halves in turn. Offload: the kernels encode a chunk into its half on the current stream, and a side stream's
// copy engine moves each run of consecutive slots to the host; the kernels wait for a half's copies before they
// encode into it again. Onboard mirrors it: the side stream copies a chunk's slots into a half, the kernels decode
// it. The side stream first waits for the current stream's earlier work, and the current stream ends after the
// side stream's copies, so the call is stream-ordered like the direct one; events (no host sync) order the rest,
// so it can be captured (the copies' slots are read from the host pairs then: a replay copies the same slots).
// An event that orders one stream after another (no timing); destroyed with its scope (CUDA releases it once it
// completes). ATen's CUDAEvent would pull in the CUDA libraries' headers, which a toolkit without cuSPARSE lacks.
class Event {
 public:
  Event() { C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~Event() { cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  void record(cudaStream_t stream) {
    C10_CUDA_CHECK(cudaEventRecord(event_, stream));
    recorded_ = true;
  }
  void block(cudaStream_t stream) const {  // a no-op before the first record
    if (recorded_) C10_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
  }

 private:
  cudaEvent_t event_ = nullptr;
  bool recorded_ = false;
};

template <class Launch>
void run_staged(bool encode, const at::Tensor& cold_pages, const at::Tensor& page_pairs, const at::Tensor& staging,
                const int32_t* pairs_dev, const Launch& launch, const at::Device& device) {
  const cudaStream_t main = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  const cudaStream_t side = c10::cuda::getStreamFromPool(false, device.index()).stream();
  Event before, after, filled[2], drained[2];  // per half: the kernels' work, the copies' work
  before.record(main);
  before.block(side);
  const int64_t n = page_pairs.size(0), half = staging.size(0) / 2, row = staging.stride(0);
  const int64_t host_row = cold_pages.stride(0), bytes = cold_pages.size(1);
  const int32_t* host_pairs = page_pairs.const_data_ptr<int32_t>();
  auto* host = static_cast<uint8_t*>(cold_pages.data_ptr());
  auto* stage = static_cast<uint8_t*>(staging.data_ptr());
  const int slot_field = encode ? 0 : 1;
  for (int64_t c0 = 0, chunk = 0; c0 < n; c0 += half, ++chunk) {
    const int h = int(chunk & 1);
    const int64_t m = std::min(half, n - c0);
    uint8_t* rows = stage + h * half * row;
    // each run of consecutive slots is one copy (2-D: the host rows may be padded)
    auto copy_runs = [&](cudaMemcpyKind kind) {
      for (int64_t i = 0; i < m;) {
        const int64_t slot = host_pairs[2 * (c0 + i) + slot_field];
        int64_t len = 1;
        while (i + len < m && host_pairs[2 * (c0 + i + len) + slot_field] == slot + len) ++len;
        uint8_t* h_row = host + slot * host_row;
        uint8_t* s_row = rows + i * row;
        if (kind == cudaMemcpyDeviceToHost)
          C10_CUDA_CHECK(cudaMemcpy2DAsync(h_row, host_row, s_row, row, bytes, len, kind, side));
        else
          C10_CUDA_CHECK(cudaMemcpy2DAsync(s_row, row, h_row, host_row, bytes, len, kind, side));
        i += len;
      }
    };
    if (encode) {
      if (chunk >= 2) drained[h].block(main);  // this half's previous chunk is on the host
      launch(pairs_dev + 2 * c0, m, Blobs{rows, row, m, true}, main);
      filled[h].record(main);
      filled[h].block(side);
      copy_runs(cudaMemcpyDeviceToHost);
      drained[h].record(side);
    } else {
      if (chunk >= 2) filled[h].block(side);  // the kernels have decoded this half's previous chunk
      copy_runs(cudaMemcpyHostToDevice);
      drained[h].record(side);
      drained[h].block(main);
      launch(pairs_dev + 2 * c0, m, Blobs{rows, row, m, true}, main);
      filled[h].record(main);
    }
  }
  after.record(side);
  after.block(main);
}

void check_staging(const at::Tensor& staging, at::TensorList pools, const at::Tensor& cold_pages,
                   const at::Tensor& page_pairs, const at::Device& device, const char* what) {
  TORCH_CHECK_VALUE(staging.scalar_type() == at::kByte && staging.dim() == 2 && staging.size(0) >= 2 &&
                        staging.size(1) == cold_pages.size(1) && staging.stride(1) == 1 && staging.stride(0) % 16 == 0,
                    what, ": staging must be uint8 [rows >= 2, ", cold_pages.size(1),
                    "] with 16-byte aligned contiguous rows, got ", staging.scalar_type(), " ", staging.sizes(),
                    " strides ", staging.strides());
  TORCH_CHECK_VALUE(staging.device() == device, what, ": staging is on ", staging.device(), ", expected ", device);
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(staging.data_ptr()) % 16 == 0, what,
                    ": staging must start 16-byte aligned");
  // the kernels write staging while they read (encode) or write (decode) the pools
  for (size_t p = 0; p < pools.size(); ++p)
    TORCH_CHECK_VALUE(!staging.storage().is_alias_of(pools[p].storage()), what, ": staging shares memory with pools[",
                      p, "]");
  TORCH_CHECK_VALUE(cold_pages.is_cpu() && page_pairs.is_cpu(), what,
                    ": staging serves cold_pages in pinned host memory with page_pairs on the host; got cold_pages on ",
                    cold_pages.device(), " and page_pairs on ", page_pairs.device());
}

void run_codec(at::TensorList pools, const at::Tensor& cold_pages, const at::Tensor& page_pairs, at::IntArrayRef plan,
               bool validate, bool encode, const c10::optional<at::Tensor>& refused,
               const c10::optional<at::Tensor>& staging) {
  const char* what = encode ? "nvfp4_encode_pages_" : "nvfp4_decode_pages_";
  TORCH_CHECK_VALUE(!pools.empty(), what, ": pools is empty");
  const at::Device device = pools[0].device();
  for (size_t p = 0; p < pools.size(); ++p)
    TORCH_CHECK_VALUE(pools[p].is_cuda(), what, ": pools[", p, "] is on ", pools[p].device(),
                      "; pools must be on the GPU when cold_pages or page_pairs are");
  c10::cuda::CUDAGuard guard(device);
  const auto descs = check_codec_call(pools, cold_pages, page_pairs, plan, validate, encode, refused);
  if (staging) check_staging(*staging, pools, cold_pages, page_pairs, device, what);
  int32_t* refusals = refused ? refused->data_ptr<int32_t>() : nullptr;
  uint8_t* blobs = static_cast<uint8_t*>(device_address(cold_pages, device, "cold_pages", what));
  const int32_t* pairs = static_cast<const int32_t*>(device_address(page_pairs, device, "page_pairs", what));
  const int64_t n = page_pairs.size(0);
  if (n == 0) return;
  // One launch per dtype (lossless-only pools of other dtypes ride with bf16: bytes are bytes).
  std::map<at::ScalarType, std::vector<size_t>> groups;
  for (size_t p = 0; p < pools.size(); ++p) {
    at::ScalarType t = pools[p].scalar_type();
    groups[is_hot_dtype(t) ? t : at::kBFloat16].push_back(p);
  }
  auto launch = [&](const int32_t* chunk_pairs, int64_t count, const Blobs& where, cudaStream_t stream) {
    for (auto& [t, members] : groups) {
      dispatch_dtype(t, [&](auto tag) {
        using T = decltype(tag);
        if constexpr (!std::is_same_v<T, float>) {
          if (encode)
            launch_codec(encode_pages_kernel<T>, what, true, descs, members, chunk_pairs, nullptr, count, where,
                         stream);
          else
            launch_codec(decode_pages_kernel<T>, what, false, descs, members, chunk_pairs, refusals, count, where,
                         stream);
        }
      });
    }
  };
  if (staging)
    run_staged(encode, cold_pages, page_pairs, *staging, pairs, launch, device);
  else
    launch(pairs, n, Blobs{blobs, cold_pages.stride(0), cold_pages.size(0), false}, c10::cuda::getCurrentCUDAStream());
}

void encode_pages_cuda(at::TensorList pools, const at::Tensor& cold_pages, const at::Tensor& page_pairs,
                       at::IntArrayRef plan, bool validate, const c10::optional<at::Tensor>& staging) {
  run_codec(pools, cold_pages, page_pairs, plan, validate, true, c10::nullopt, staging);
}

void decode_pages_cuda(const at::Tensor& cold_pages, at::TensorList pools, const at::Tensor& page_pairs,
                       at::IntArrayRef plan, bool validate, const c10::optional<at::Tensor>& refused,
                       const c10::optional<at::Tensor>& staging) {
  run_codec(pools, cold_pages, page_pairs, plan, validate, false, refused, staging);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvops, CUDA, m) {
  m.impl("nvfp4_quantize", &quantize_cuda);
  m.impl("nvfp4_dequantize", &dequantize_cuda);
  m.impl("nvfp4_encode_pages_", &encode_pages_cuda);
  m.impl("nvfp4_decode_pages_", &decode_pages_cuda);
}

}  // namespace nvfp4
}  // namespace kvops
