// CUDA backend of kvops::triattention_mean_phase_ and kvops::triattention_reduce_ (triattention.h states them).
//
// The reduce is two kernels when normalizing: one thread per (request, layer, head) plane merges the plane's chunk
// partials into its mean and std (once, not once per column block), then the reduce proper reads the raw scores
// once: a CTA owns 1024 columns (8 a thread, 16-byte loads and stores when the rows allow them) of one decision
// row, or of one block of layers of a union row. It copies the statistics of the planes that row reduces over into
// shared memory, then walks those planes with four planes' loads (eight 16-byte loads) in flight before any is
// used: a row walks up to L x Hq planes, so a loop that waited on each load would be bound by latency. A union row
// of few requests is split over blocks of layers so that the GPU fills; a third small kernel then takes the max
// over the blocks.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>

#include "../cuda_utils.cuh"
#include "triattention.h"

namespace kvops {
namespace triattention {

namespace {

constexpr int kThreads = 128;
constexpr int kVec = 8;                       // columns a thread: two 16-byte loads a plane
constexpr int kColumns = kThreads * kVec;     // columns a CTA covers
constexpr int kUnroll = 4;                    // planes whose loads a thread issues before using any
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
  const float2* moments;  // [R, L, Hq]: each plane's (mean, std), when normalizing
  const float* k_scale;   // [L, Hkv], when scaled
  const int32_t* prompt;
  const int32_t* cache;
  float* out;             // rows [R, rows, n], or a split union's partial maxima [R, blocks, n]
  int32_t* row_lengths;   // [R, rows] or nullptr
  int32_t* row_offsets;
  int L, Hq, G, n, out_rows, blocks;
  bool vec, vec_out;      // 16-byte loads (stores): n % 4 == 0 and raw (out) 16-byte aligned
};

// Each plane's (mean, std) over its finite scores, from the scorer's chunk partials: a thread per plane.
__global__ void __launch_bounds__(kThreads) moments_kernel(const float* __restrict__ stats,
                                                           const int32_t* __restrict__ prompt,
                                                           const int32_t* __restrict__ cache,
                                                           float2* __restrict__ moments, int64_t planes,
                                                           int planes_per_request, int nc, int n) {
  const int64_t plane = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (plane >= planes) return;
  const int r = int(plane / planes_per_request);
  float2 m;
  plane_moments(stats + plane * nc * kStats, nc, decode_count(cache[r], prompt[r], n), m.x, m.y);
  moments[plane] = m;
}

// A thread's kVec columns j.. of one plane's row `p`: two 16-byte loads when the row allows them, else scalar ones;
// 0 at or past the decode count.
__device__ __forceinline__ void load_columns(const float* p, int j, int count, bool vec, float (&v)[kVec]) {
  if (vec && j + kVec <= count) {
#pragma unroll
    for (int h = 0; h < kVec; h += 4) {
      const float4 x = __ldg(reinterpret_cast<const float4*>(p + j + h));
      v[h] = x.x, v[h + 1] = x.y, v[h + 2] = x.z, v[h + 3] = x.w;
    }
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
  __shared__ float2 staged[kStagedPlanes];  // each plane's (mean, std) or (scale, -), a chunk of planes at a time
  const int r = blockIdx.z, row = blockIdx.y;
  const int count = decode_count(a.cache[r], a.prompt[r], a.n);
  const Planes set = planes_of(Mode(MODE), row, row, a.blocks, a.L, a.Hq, a.G);
  const int planes = set.nl * set.nh;
  const int64_t request = int64_t(r) * a.L * a.Hq;
  if (FINAL && a.row_lengths && blockIdx.x == 0 && threadIdx.x == 0) {
    a.row_lengths[int64_t(r) * a.out_rows + row] = count;
    a.row_offsets[int64_t(r) * a.out_rows + row] = a.prompt[r];
  }
  const int j = blockIdx.x * kColumns + threadIdx.x * kVec;  // (past n: the thread still stages)
  float acc[kVec], best[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) acc[i] = MODE == kPerHead ? 0.f : -INFINITY, best[i] = -INFINITY;
  const int chunk = (kStagedPlanes / a.G) * a.G;  // whole KV heads a chunk
  int layer = set.l0, head = 0, in_group = 0;     // the next plane: (layer, set.h0 + head)
  for (int c0 = 0; c0 < planes; c0 += chunk) {
    const int np = min(chunk, planes - c0);
    if (NORMALIZE || SCALED) {
      if (c0 > 0) __syncthreads();  // the previous chunk's readers are done
      for (int i = threadIdx.x; i < np; i += kThreads) {
        const int p = c0 + i, l = set.l0 + p / set.nh, h = set.h0 + p % set.nh;
        staged[i] = NORMALIZE ? __ldg(a.moments + request + int64_t(l) * a.Hq + h)
                              : make_float2(__ldg(a.k_scale + l * (a.Hq / a.G) + h / a.G), 1.f);
      }
      __syncthreads();
    }
    if (j >= a.n) continue;
    for (int p0 = 0; p0 < np; p0 += kUnroll) {
      float v[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {  // every load of the step first
        if (p0 + u >= np) break;
        load_columns(a.raw + (request + int64_t(layer) * a.Hq + set.h0 + head) * a.n, j, count, a.vec, v[u]);
        if (++head == set.nh) head = 0, ++layer;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (p0 + u >= np) break;
        const float2 t = NORMALIZE || SCALED ? staged[p0 + u] : make_float2(1.f, 1.f);
#pragma unroll
        for (int i = 0; i < kVec; ++i)
          best[i] = fmaxf(best[i], plane_score(v[u][i], NORMALIZE, SCALED, t.x, t.y));
        if (++in_group == a.G) {  // the KV head's max joins the row
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            acc[i] = MODE == kPerHead ? acc[i] + best[i] : fmaxf(acc[i], best[i]);
            best[i] = -INFINITY;
          }
          in_group = 0;
        }
      }
    }
  }
  if (j >= a.n) return;
  float out[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    out[i] = MODE == kPerHead ? acc[i] / float(a.L) : acc[i];
    if (FINAL) out[i] = j + i < count && out[i] < INFINITY ? out[i] : -INFINITY;
  }
  float* dst = a.out + (int64_t(r) * a.out_rows + row) * a.n + j;
  if (a.vec_out && j + kVec <= a.n) {
#pragma unroll
    for (int h = 0; h < kVec; h += 4)
      reinterpret_cast<float4*>(dst + h)[0] = make_float4(out[h], out[h + 1], out[h + 2], out[h + 3]);
  } else {
    for (int i = 0; i < kVec && j + i < a.n; ++i) dst[i] = out[i];
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

// Layer blocks for a union row: the fewest that divide the layers and give at least kUnionCtasPerSm CTAs per SM,
// so that a round of few requests is not a few CTAs each walking every plane (a walk is bound by latency, so the
// SMs need several at once); 1 when the requests alone fill the GPU so. The max over blocks is exact, so the rows
// do not depend on it.
constexpr int kUnionCtasPerSm = 4;
int union_blocks(int64_t requests, int64_t column_groups, int64_t layers, int sms) {
  for (int64_t b = 1; b <= layers; ++b)
    if (layers % b == 0 && requests * column_groups * b >= int64_t(sms) * kUnionCtasPerSm) return int(b);
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
  a.k_scale = s.scaled ? k_scale->const_data_ptr<float>() : nullptr;
  a.prompt = prompt_lengths.const_data_ptr<int32_t>();
  a.cache = cache_lengths.const_data_ptr<int32_t>();
  a.row_lengths = row_lengths ? row_lengths->data_ptr<int32_t>() : nullptr;
  a.row_offsets = row_offsets ? row_offsets->data_ptr<int32_t>() : nullptr;
  a.L = int(s.L), a.Hq = int(s.Hq), a.G = int(s.G), a.n = int(s.n);
  a.vec = s.n % 4 == 0 && reinterpret_cast<uintptr_t>(a.raw) % 16 == 0;
  const int64_t groups = std::max<int64_t>(1, (s.n + kColumns - 1) / kColumns);
  TORCH_CHECK_VALUE(groups <= std::numeric_limits<int32_t>::max(), "triattention_reduce_: rows too long");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor moments;
  if (s.normalize) {
    const int64_t planes = s.R * s.L * s.Hq;
    moments = at::empty({planes, 2}, raw.options());
    prepare_kernel(moments_kernel, "triattention_reduce_");
    moments_kernel<<<unsigned((planes + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        stats.const_data_ptr<float>(), a.prompt, a.cache, reinterpret_cast<float2*>(moments.data_ptr<float>()), planes,
        int(s.L * s.Hq), int(s.nc), int(s.n));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    a.moments = reinterpret_cast<const float2*>(moments.const_data_ptr<float>());
  }
  a.blocks = s.mode == kUnion ? union_blocks(s.R, groups, s.L, sm_count()) : 1;
  if (s.mode == kUnion && a.blocks > 1) {
    const at::Tensor partial = at::empty({s.R, a.blocks, std::max<int64_t>(s.n, 1)}, raw.options());
    a.out = partial.data_ptr<float>(), a.out_rows = a.blocks, a.vec_out = s.n % 4 == 0;
    launch_reduce<kUnion, false>(a, dim3(unsigned(groups), unsigned(a.blocks), unsigned(s.R)), s.normalize,
                                 s.scaled);
    const int64_t max_groups = std::min<int64_t>((s.n + kThreads - 1) / kThreads, 4096);
    union_max_kernel<<<dim3(unsigned(std::max<int64_t>(1, max_groups)), unsigned(s.R)), kThreads, 0, stream>>>(
        partial.const_data_ptr<float>(), a.blocks, a.prompt, a.cache, rows.data_ptr<float>(), a.row_lengths,
        a.row_offsets, a.n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  a.out = rows.data_ptr<float>(), a.out_rows = int(s.rows);
  a.vec_out = s.n % 4 == 0 && reinterpret_cast<uintptr_t>(a.out) % 16 == 0;
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
