// CPU backend of kvops::triattention_mean_phase_ and kvops::triattention_reduce_ (triattention.h states them): the
// CUDA kernels' arithmetic, one row at a time.
#include <torch/library.h>

#include <vector>

#include "triattention.h"

namespace kvops {
namespace triattention {

namespace {

void mean_phase_cpu(const at::Tensor& round_starts, const at::Tensor& omega, at::Tensor phase) {
  check_mean_phase(round_starts, omega, phase);
  const at::Tensor starts = round_starts.to(at::kLong);
  const int64_t R = starts.size(0), F = omega.size(0);
  const int64_t* p = starts.const_data_ptr<int64_t>();
  const float* w = omega.const_data_ptr<float>();
  float* out = phase.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t f = 0; f < F; ++f) {
      double c = 0, s = 0, o = 1;
      for (int i = 0; i < kPhaseOffsets; ++i, o *= 2) {
        const double angle = (double(p[r]) + o) * double(w[f]);
        c += std::cos(angle);
        s += std::sin(angle);
      }
      out[(r * 2) * F + f] = float(c / kPhaseOffsets);
      out[(r * 2 + 1) * F + f] = float(s / kPhaseOffsets);
    }
  }
}

void reduce_cpu(const at::Tensor& raw, const at::Tensor& stats, const at::Tensor& prompt_lengths,
                const at::Tensor& cache_lengths, at::Tensor rows, const std::string& row_mode, int64_t num_kv_heads,
                bool normalize, const std::optional<at::Tensor>& k_scale,
                const std::optional<at::Tensor>& row_lengths, const std::optional<at::Tensor>& row_offsets) {
  const ReduceShape s = check_reduce(raw, stats, prompt_lengths, cache_lengths, rows, row_mode, num_kv_heads,
                                     normalize, k_scale, row_lengths, row_offsets);
  const float* in = raw.const_data_ptr<float>();
  const float* part = stats.const_data_ptr<float>();
  const float* scale = s.scaled ? k_scale->const_data_ptr<float>() : nullptr;
  const int32_t* prompt = prompt_lengths.const_data_ptr<int32_t>();
  const int32_t* cache = cache_lengths.const_data_ptr<int32_t>();
  float* out = rows.data_ptr<float>();
  const int L = int(s.L), Hq = int(s.Hq), G = int(s.G);
  std::vector<float> a(size_t(s.L * s.Hq)), b(size_t(s.L * s.Hq)), acc(size_t(s.n));
  for (int64_t r = 0; r < s.R; ++r) {
    const int count = decode_count(cache[r], prompt[r], s.n);
    for (int64_t plane = 0; plane < s.L * s.Hq; ++plane) {  // (layer, head) of request r
      if (s.normalize) plane_moments(part + ((r * s.L * s.Hq + plane) * s.nc) * kStats, int(s.nc), count,
                                     a[plane], b[plane]);
      else if (scale) a[plane] = scale[(plane / Hq) * s.Hkv + (plane % Hq) / G];
    }
    for (int64_t row = 0; row < s.rows; ++row) {
      const Planes set = planes_of(s.mode, int(row), 0, 1, L, Hq, G);
      std::fill(acc.begin(), acc.end(), s.mode == kPerHead ? 0.f : -INFINITY);
      for (int dl = 0; dl < set.nl; ++dl) {
        for (int h = set.h0; h < set.h0 + set.nh; h += G) {  // one KV head's query heads
          const int64_t plane = int64_t(set.l0 + dl) * Hq + h;
          for (int64_t j = 0; j < count; ++j) {
            float best = -INFINITY;
            for (int dh = 0; dh < G; ++dh)
              best = std::max(best, plane_score(in[(r * s.L * s.Hq + plane + dh) * s.n + j], s.normalize,
                                                scale != nullptr, a[plane + dh], b[plane + dh]));
            acc[j] = s.mode == kPerHead ? acc[j] + best : std::max(acc[j], best);
          }
        }
      }
      float* dst = out + (r * s.rows + row) * s.n;
      for (int64_t j = 0; j < s.n; ++j) {
        const float v = s.mode == kPerHead ? acc[j] / float(L) : acc[j];
        dst[j] = j < count && v < INFINITY ? v : -INFINITY;
      }
      if (row_lengths) {
        row_lengths->data_ptr<int32_t>()[r * s.rows + row] = count;
        row_offsets->data_ptr<int32_t>()[r * s.rows + row] = prompt[r];
      }
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(kvops, CPU, m) {
  m.impl("triattention_mean_phase_", &mean_phase_cpu);
  m.impl("triattention_reduce_", &reduce_cpu);
}

}  // namespace triattention
}  // namespace kvops
