// CUDA backend of kvops::triattention_mean_phase_ and kvops::triattention_reduce_ (triattention.h states them).
//
// The reduce is one pass over the raw scores: a CTA owns 1024 columns (4 a thread, 16-byte loads when the rows
// allow them) of one decision row, or of one block of layers of a union row, and walks the (layer, head) planes
// that row reduces over. The planes' statistics are merged from the scorer's chunk partials by the CTA itself, into
// shared memory, before its columns are read: no launch of their own, and their bytes are a few per cent of the
// columns' (a CTA takes more columns when the rows are long, so that this stays true). A union row of few requests
// is split over blocks of layers so that the GPU fills; a second small kernel takes the max over the blocks.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "../cuda_utils.cuh"
#include "triattention.h"

namespace kvops {
namespace triattention {

namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;                       // columns a thread
constexpr int kColumns = kThreads * kVec;     // columns a CTA covers per pass
constexpr int kStagedPlanes = 2048;           // planes whose statistics a CTA holds at once (16 KB)

__global__ void mean_phase_kernel(const int32_t* __restrict__ starts32, const int64_t* __restrict__ starts64,
                                  const float* __restrict__ omega, float* __restrict__ phase, int F) {
  const int r = blockIdx.x;
  const double p = starts64 ? double(starts64[r]) : double(starts32[r]);
  for (int f = threadIdx.x; f < F; f += blockDim.x) {
    const double w = omega[f];
    double c = 0, s = 0, o = 1;
#pragma unroll
    for (int i = 0; i < kPhaseOffsets; ++i, o *= 2) {
      double sv, cv;
      sincos((p + o) * w, &sv, &cv);
      c += cv;
      s += sv;
    }
    phase[(int64_t(r) * 2) * F + f] = float(c / kPhaseOffsets);
    phase[(int64_t(r) * 2 + 1) * F + f] = float(s / kPhaseOffsets);
  }
}

struct ReduceArgs {
  const float* raw;
  const float* stats;
  const float* k_scale;  // [L, Hkv] when scaled
  const int32_t* prompt;
  const int32_t* cache;
  float* out;            // rows [R, rows, n], or a split union's partial maxima [R, blocks, n]
  int32_t* row_lengths;  // [R, rows] or nullptr
  int32_t* row_offsets;
  int L, Hq, G, n, nc, out_rows, blocks;
  int passes;            // column passes a CTA makes (kColumns each)
  bool vec;              // 16-byte loads: n % 4 == 0 and raw 16-byte aligned
};

__device__ __forceinline__ void load4(const float* p, int j, int count, bool vec, float (&v)[kVec]) {
  if (vec && j + kVec <= count) {
    const float4 x = __ldg(reinterpret_cast<const float4*>(p + j));
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = j + i < count ? __ldg(p + j + i) : 0.f;
  }
}

// grid (column groups, rows or union blocks, R). MODE, NORMALIZE, SCALED: what the row reduces and how a score is
// transformed (plane_score); FINAL: this kernel writes the row itself (-inf where poisoned or past the count),
// else a union block's partial maxima (+inf still marking a poisoned column).
template <int MODE, bool NORMALIZE, bool SCALED, bool FINAL>
__global__ void __launch_bounds__(kThreads) reduce_kernel(const ReduceArgs a) {
  __shared__ float2 staged[kStagedPlanes];  // (mean, std), or (scale, -) of each plane of the current chunk
  const int r = blockIdx.z, row = blockIdx.y;
  const int count = decode_count(a.cache[r], a.prompt[r], a.n);
  const Planes set = planes_of(Mode(MODE), row, row, a.blocks, a.L, a.Hq, a.G);
  const int planes = set.nl * set.nh;
  const int chunk = (kStagedPlanes / a.G) * a.G;  // whole KV heads per staged chunk
  const int64_t request = int64_t(r) * a.L * a.Hq;
  if (FINAL && a.row_lengths && blockIdx.x == 0 && threadIdx.x == 0) {
    a.row_lengths[int64_t(r) * a.out_rows + row] = count;
    a.row_offsets[int64_t(r) * a.out_rows + row] = a.prompt[r];
  }
  // plane p of the set: (layer l0 + p / nh, head h0 + p % nh)
  auto plane_index = [&](int p) { return request + int64_t(set.l0 + p / set.nh) * a.Hq + set.h0 + p % set.nh; };
  auto stage = [&](int p0, int np) {
    if (!NORMALIZE && !SCALED) return;
    __syncthreads();  // the previous chunk's readers are done
    for (int i = threadIdx.x; i < np; i += kThreads) {
      float2 v = make_float2(1.f, 1.f);
      const int64_t plane = plane_index(p0 + i);
      if (NORMALIZE) {
        plane_moments(a.stats + plane * a.nc * kStats, a.nc, count, v.x, v.y);
      } else {
        const int layer = set.l0 + (p0 + i) / set.nh, head = set.h0 + (p0 + i) % set.nh;
        v.x = a.k_scale[layer * (a.Hq / a.G) + head / a.G];
      }
      staged[i] = v;
    }
    __syncthreads();
  };
  if (planes <= chunk) stage(0, planes);
  for (int pass = 0; pass < a.passes; ++pass) {
    const int j = (blockIdx.x * a.passes + pass) * kColumns + threadIdx.x * kVec;
    if (__syncthreads_or(j < a.n) == 0) break;  // (uniform: every thread stages the next chunk)
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = MODE == kPerHead ? 0.f : -INFINITY;
    for (int p0 = 0; p0 < planes; p0 += chunk) {
      const int np = min(chunk, planes - p0);
      if (planes > chunk) stage(p0, np);
      for (int g = 0; g < np; g += a.G) {  // one KV head's query heads
        float best[kVec];
#pragma unroll
        for (int i = 0; i < kVec; ++i) best[i] = -INFINITY;
#pragma unroll 4
        for (int dh = 0; dh < a.G; ++dh) {
          float v[kVec];
          load4(a.raw + plane_index(p0 + g + dh) * a.n, j, count, a.vec, v);
          const float2 t = staged[g + dh];
#pragma unroll
          for (int i = 0; i < kVec; ++i) best[i] = fmaxf(best[i], plane_score(v[i], NORMALIZE, SCALED, t.x, t.y));
        }
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = MODE == kPerHead ? acc[i] + best[i] : fmaxf(acc[i], best[i]);
      }
    }
    float* dst = a.out + (int64_t(r) * a.out_rows + row) * a.n;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      if (j + i >= a.n) break;
      float v = MODE == kPerHead ? acc[i] / float(a.L) : acc[i];
      if (FINAL) v = j + i < count && v < INFINITY ? v : -INFINITY;
      dst[j + i] = v;
    }
  }
}

// rows[r, 0] = the max over a split union's blocks, -inf where poisoned or past the decode count; grid (column
// groups, R).
__global__ void __launch_bounds__(kThreads) union_max_kernel(const float* __restrict__ partial, int blocks,
                                                             const int32_t* prompt, const int32_t* cache,
                                                             float* __restrict__ rows, int32_t* row_lengths,
                                                             int32_t* row_offsets, int n) {
  const int r = blockIdx.y;
  const int count = decode_count(cache[r], prompt[r], n);
  if (row_lengths && blockIdx.x == 0 && threadIdx.x == 0) row_lengths[r] = count, row_offsets[r] = prompt[r];
  for (int j = blockIdx.x * kThreads + threadIdx.x; j < n; j += gridDim.x * kThreads) {
    float acc = -INFINITY;
    for (int b = 0; b < blocks; ++b) acc = fmaxf(acc, partial[(int64_t(r) * blocks + b) * n + j]);
    rows[int64_t(r) * n + j] = j < count && acc < INFINITY ? acc : -INFINITY;
  }
}

void mean_phase_cuda(const at::Tensor& round_starts, const at::Tensor& omega, at::Tensor phase) {
  check_mean_phase(round_starts, omega, phase);
  const int64_t R = round_starts.size(0), F = omega.size(0);
  if (R == 0 || F == 0) return;
  TORCH_CHECK_VALUE(R <= std::numeric_limits<int32_t>::max(), "triattention_mean_phase_: too many requests");
  const c10::cuda::CUDAGuard guard(omega.device());
  prepare_kernel(mean_phase_kernel, "triattention_mean_phase_");
  const bool wide = round_starts.scalar_type() == at::kLong;
  mean_phase_kernel<<<unsigned(R), int(std::min<int64_t>(128, (F + 31) / 32 * 32)), 0,
                      c10::cuda::getCurrentCUDAStream()>>>(
      wide ? nullptr : round_starts.const_data_ptr<int32_t>(), wide ? round_starts.const_data_ptr<int64_t>() : nullptr,
      omega.const_data_ptr<float>(), phase.data_ptr<float>(), int(F));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Layer blocks for a union row: the fewest that divide the layers and give at least one CTA per SM, so that a
// round of few requests is not a few CTAs each walking every plane; 1 when the requests alone fill the GPU. The max
// over blocks is exact, so the rows do not depend on it.
int union_blocks(int64_t requests, int64_t column_groups, int64_t layers, int sms) {
  for (int64_t b = 1; b <= layers; ++b)
    if (layers % b == 0 && requests * column_groups * b >= sms) return int(b);
  return int(layers);
}

template <int MODE, bool NORMALIZE, bool SCALED, bool FINAL>
void launch_reduce(const ReduceArgs& a, dim3 grid) {
  auto kernel = reduce_kernel<MODE, NORMALIZE, SCALED, FINAL>;
  prepare_kernel(kernel, "triattention_reduce_");
  kernel<<<grid, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int MODE, bool FINAL>
void launch_reduce(const ReduceArgs& a, dim3 grid, bool normalize, bool scaled) {
  if (normalize) return launch_reduce<MODE, true, false, FINAL>(a, grid);
  if (scaled) return launch_reduce<MODE, false, true, FINAL>(a, grid);
  launch_reduce<MODE, false, false, FINAL>(a, grid);
}

void reduce_cuda(const at::Tensor& raw, const at::Tensor& stats, const at::Tensor& prompt_lengths,
                 const at::Tensor& cache_lengths, at::Tensor rows, const std::string& row_mode, int64_t num_kv_heads,
                 bool normalize, const std::optional<at::Tensor>& k_scale,
                 const std::optional<at::Tensor>& row_lengths, const std::optional<at::Tensor>& row_offsets) {
  const ReduceShape s = check_reduce(raw, stats, prompt_lengths, cache_lengths, rows, row_mode, num_kv_heads,
                                     normalize, k_scale, row_lengths, row_offsets);
  if (s.R == 0) return;
  const c10::cuda::CUDAGuard guard(raw.device());
  ReduceArgs a{};
  a.raw = raw.const_data_ptr<float>();
  a.stats = stats.const_data_ptr<float>();
  a.k_scale = s.scaled ? k_scale->const_data_ptr<float>() : nullptr;
  a.prompt = prompt_lengths.const_data_ptr<int32_t>();
  a.cache = cache_lengths.const_data_ptr<int32_t>();
  a.row_lengths = row_lengths ? row_lengths->data_ptr<int32_t>() : nullptr;
  a.row_offsets = row_offsets ? row_offsets->data_ptr<int32_t>() : nullptr;
  a.L = int(s.L), a.Hq = int(s.Hq), a.G = int(s.G), a.n = int(s.n), a.nc = int(s.nc);
  a.vec = s.n % kVec == 0 && reinterpret_cast<uintptr_t>(a.raw) % 16 == 0;
  // Long rows: more columns a CTA, so that merging a plane's nc partials stays a small part of reading its columns.
  a.passes = int(std::max<int64_t>(1, s.nc / 16));
  const int64_t groups = std::max<int64_t>(1, (s.n + int64_t(kColumns) * a.passes - 1) / (int64_t(kColumns) * a.passes));
  TORCH_CHECK_VALUE(groups <= std::numeric_limits<int32_t>::max(), "triattention_reduce_: rows too long");
  a.blocks = s.mode == kUnion ? union_blocks(s.R, groups, s.L, sm_count()) : 1;
  if (s.mode == kUnion && a.blocks > 1) {
    const at::Tensor partial = at::empty({s.R, a.blocks, std::max<int64_t>(s.n, 1)}, raw.options());
    a.out = partial.data_ptr<float>(), a.out_rows = a.blocks;
    launch_reduce<kUnion, false>(a, dim3(unsigned(groups), unsigned(a.blocks), unsigned(s.R)), s.normalize,
                                 s.scaled);
    const int64_t max_groups = std::min<int64_t>((s.n + kThreads - 1) / kThreads, 4096);
    union_max_kernel<<<dim3(unsigned(std::max<int64_t>(1, max_groups)), unsigned(s.R)), kThreads, 0,
                       c10::cuda::getCurrentCUDAStream()>>>(partial.const_data_ptr<float>(), a.blocks, a.prompt,
                                                            a.cache, rows.data_ptr<float>(), a.row_lengths,
                                                            a.row_offsets, a.n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  a.out = rows.data_ptr<float>(), a.out_rows = int(s.rows);
  const dim3 grid(unsigned(groups), unsigned(s.mode == kUnion ? 1 : s.rows), unsigned(s.R));
  if (s.mode == kUnion) launch_reduce<kUnion, true>(a, grid, s.normalize, s.scaled);
  else if (s.mode == kPerHead) launch_reduce<kPerHead, true>(a, grid, s.normalize, s.scaled);
  else launch_reduce<kPerLayerPerHead, true>(a, grid, s.normalize, s.scaled);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvops, CUDA, m) {
  m.impl("triattention_mean_phase_", &mean_phase_cuda);
  m.impl("triattention_reduce_", &reduce_cuda);
}

}  // namespace triattention
}  // namespace kvops
