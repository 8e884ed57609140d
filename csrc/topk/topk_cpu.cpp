// CPU backend of kvops::topk_short_rows_ and kvops::topk_long_rows_: per row, a partial sort by (key descending,
// index ascending).
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "topk.h"

namespace kvops {
namespace topk {

void rows_cpu(const at::Tensor& scores, const at::Tensor& lengths, const std::optional<at::Tensor>& offsets,
              int64_t k, at::Tensor& out) {
  const int64_t rows = scores.size(0), N = scores.size(1);
  const auto* bits = reinterpret_cast<const int32_t*>(scores.const_data_ptr<float>());
  const auto* length = lengths.const_data_ptr<int32_t>();
  const int32_t* offset = offsets ? offsets->const_data_ptr<int32_t>() : nullptr;
  auto* dst = out.data_ptr<int32_t>();
  std::vector<std::pair<uint32_t, int32_t>> keys;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = std::min<int64_t>(std::max<int32_t>(length[r], 0), N);
    keys.clear();
    for (int64_t i = 0; i < n; ++i) keys.emplace_back(ukey(bits[r * scores.stride(0) + i]), int32_t(i));
    const int64_t kept = std::min(k, n);
    std::partial_sort(keys.begin(), keys.begin() + kept, keys.end(),
                      [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
    std::vector<int32_t> picked(kept);
    for (int64_t j = 0; j < kept; ++j) picked[j] = keys[j].second;
    std::sort(picked.begin(), picked.end());
    const int32_t base = offset ? offset[r] : 0;
    for (int64_t j = 0; j < k; ++j) dst[r * k + j] = j < kept ? picked[j] + base : -1;
  }
}

namespace {

void short_rows_cpu(const at::Tensor& scores, const at::Tensor& lengths, const std::optional<at::Tensor>& offsets,
                    int64_t k, at::Tensor out) {
  check_rows("kvops::topk_short_rows_", scores, lengths, offsets, k, out, kShortRow);
  rows_cpu(scores, lengths, offsets, k, out);
}

void long_rows_cpu(const at::Tensor& scores, const at::Tensor& lengths, const std::optional<at::Tensor>& offsets,
                   int64_t k, at::Tensor out) {
  check_rows("kvops::topk_long_rows_", scores, lengths, offsets, k, out, kLongRow);
  rows_cpu(scores, lengths, offsets, k, out);
}

}  // namespace

TORCH_LIBRARY_IMPL(kvops, CPU, m) {
  m.impl("topk_short_rows_", &short_rows_cpu);
  m.impl("topk_long_rows_", &long_rows_cpu);
}

}  // namespace topk
}  // namespace kvops
