// TriAttention's per-round kernels around the CuTe scorer (docs/triattention.md): the mean-phase coefficients
// before it, and the normalize-and-reduce after it. What the CPU and CUDA backends share.
//
// kvops::triattention_mean_phase_: phase[r] = (C, S) [2, F], the means over o in {1, 2, 4, ..., 65536} of
// cos((p + o) w_f) and sin((p + o) w_f), p = round_starts[r], computed in float64 (positions reach 2^24 and beyond,
// where an fp32 angle has lost its phase) and stored as float32.
//
// kvops::triattention_reduce_: from the scorer's raw [R, L, Hq, n] scores and per-chunk partial statistics
// stats [R, L, Hq, ceil(n / kChunk), kStats] = (mean, M2, count) of each chunk's finite scores:
// - each (r, layer, head) plane's mean and population std (floored at 1e-6) over its finite scores, merged from
//   the partials of the chunks that hold decode tokens (Chan et al.);
// - z = (s - mean) / std when normalizing, else s * k_scale[layer, kv head] when a scale is given;
// - the mode's rows: union = max over (layer, head); per_head = mean over layers of the max over the KV head's
//   query heads; per_layer_perhead = the max over the KV head's query heads, row layer * Hkv + kv head;
// - a column with a non-finite score in any (layer, head) its row reduces over, or at or past the request's
//   decode count clamp(cache - prompt, 0, n), is -inf.
// Optionally it also writes the top-k's per-row arguments: row_lengths[r, row] = the decode count and
// row_offsets[r, row] = prompt_lengths[r] (a kept column j is cache position prompt + j).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "../common.h"

namespace kvops {
namespace triattention {

constexpr int kPhaseOffsets = 17;  // o = 2^0 .. 2^16
constexpr int kChunk = 1024;       // decode tokens per partial (kvops/triattention/score.py's CHUNK)
constexpr int kStats = 3;          // mean, M2, count

enum Mode : int { kUnion = 0, kPerHead = 1, kPerLayerPerHead = 2 };  // kvops.compaction.rows.MODES' order

struct ReduceShape {
  int64_t R, L, Hq, Hkv, G, n, nc, rows;
  Mode mode;
  bool normalize, scaled;
};

// The (layer, head) planes decision row `row` of block `block` of `blocks` reduces over: layers [l0, l0 + nl),
// heads [h0, h0 + nh), nh a multiple of G (plane p is layer l0 + p / nh, head h0 + p % nh; each G consecutive
// heads are one KV head's query heads). A union row is split over `blocks` blocks of layers; the other modes have
// one block.
struct Planes {
  int l0, nl, h0, nh;
};

KVOPS_HD Planes planes_of(Mode mode, int row, int block, int blocks, int L, int Hq, int G) {
  if (mode == kUnion) return {block * (L / blocks), L / blocks, 0, Hq};
  if (mode == kPerHead) return {0, L, row * G, G};
  const int kv_heads = Hq / G;
  return {row / kv_heads, 1, (row % kv_heads) * G, G};
}

KVOPS_HD int decode_count(int32_t cache, int32_t prompt, int64_t n) {
  const int64_t c = int64_t(cache) - int64_t(prompt);
  return int(c < 0 ? 0 : (c > n ? n : c));
}

// A plane's (mean, std) over its finite scores, merged from the partials of its chunks holding decode tokens
// (part: the plane's [nc, kStats]); std = max(sqrt(population variance), 1e-6).
KVOPS_HD void plane_moments(const float* part, int nc, int count, float& mean, float& std_) {
  float total = 0.f, weighted = 0.f;
  for (int c = 0; c < nc && c * kChunk < count; ++c) {
    total += part[c * kStats + 2];
    weighted += part[c * kStats] * part[c * kStats + 2];
  }
  total = total > 1.f ? total : 1.f;
  mean = weighted / total;
  float m2 = 0.f;
  for (int c = 0; c < nc && c * kChunk < count; ++c) {
    const float d = part[c * kStats] - mean;
    m2 += part[c * kStats + 1] + part[c * kStats + 2] * d * d;
  }
  const float sd = sqrtf(m2 / total);
  std_ = sd > 1e-6f ? sd : 1e-6f;
}

// A score as the reduction sees it: a non-finite one becomes +inf (it survives every max, sum and normalization,
// so +inf at the end marks the column poisoned), else normalized or scaled.
KVOPS_HD float plane_score(float s, bool normalize, bool scaled, float a, float b) {
  if (!(fabsf(s) < INFINITY)) return INFINITY;
  if (normalize) return (s - a) / b;
  return scaled ? s * a : s;
}

// Host checks (triattention.cpp; the host compiler only). Each raises ValueError naming the argument.
void check_mean_phase(const at::Tensor& round_starts, const at::Tensor& omega, const at::Tensor& phase);
ReduceShape check_reduce(const at::Tensor& raw, const at::Tensor& stats, const at::Tensor& prompt_lengths,
                         const at::Tensor& cache_lengths, const at::Tensor& rows, const std::string& row_mode,
                         int64_t num_kv_heads, bool normalize, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& row_lengths, const std::optional<at::Tensor>& row_offsets);

}  // namespace triattention
}  // namespace kvops
