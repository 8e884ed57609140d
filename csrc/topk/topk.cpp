// Host-side checks of kvops::topk_short_rows_ and topk_long_rows_, shared by the CPU and CUDA backends (compiled by
// the host compiler only).
#include "topk.h"

#include <utility>

namespace kvops {
namespace topk {

namespace {

// Whether two tensors' byte spans, first element to last, intersect: exact for the contiguous ones, conservative
// for a scores view with padded rows (at::get_overlap_status calls that too hard to tell).
bool spans_meet(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const auto span = [](const at::Tensor& t) {
    int64_t last = 0;
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const auto* first = static_cast<const char*>(t.data_ptr());
    return std::make_pair(first, first + (last + 1) * t.element_size());
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

}  // namespace

void check_rows(const char* op, const at::Tensor& scores, const at::Tensor& lengths,
                const std::optional<at::Tensor>& offsets, int64_t k, const at::Tensor& out, int64_t max_width) {
  TORCH_CHECK_TYPE(scores.scalar_type() == at::kFloat, op, ": scores must be float32, got ", scores.scalar_type());
  TORCH_CHECK_TYPE(lengths.scalar_type() == at::kInt && out.scalar_type() == at::kInt, op,
                   ": lengths and out must be int32, got ", lengths.scalar_type(), " and ", out.scalar_type());
  TORCH_CHECK_VALUE(scores.dim() == 2 && (scores.stride(1) == 1 || scores.size(1) <= 1), op,
                    ": scores must be 2-D with contiguous rows, got shape ", scores.sizes(), " strides ",
                    scores.strides());
  TORCH_CHECK_VALUE(scores.size(1) <= max_width, op, ": scores rows hold at most ", max_width, " keys, got ",
                    scores.size(1));
  TORCH_CHECK_VALUE(lengths.dim() == 1 && lengths.is_contiguous() && lengths.size(0) == scores.size(0), op,
                    ": lengths must be contiguous [", scores.size(0), "], got shape ", lengths.sizes());
  if (offsets) {
    TORCH_CHECK_TYPE(offsets->scalar_type() == at::kInt, op, ": offsets must be int32, got ", offsets->scalar_type());
    TORCH_CHECK_VALUE(offsets->dim() == 1 && offsets->is_contiguous() && offsets->size(0) == scores.size(0), op,
                      ": offsets must be contiguous [", scores.size(0), "], got shape ", offsets->sizes());
    TORCH_CHECK_VALUE(offsets->device() == scores.device(), op, ": offsets must be on ", scores.device(), ", got ",
                      offsets->device());
    TORCH_CHECK_VALUE(!spans_meet(out, *offsets), op, ": out overlaps offsets");
  }
  TORCH_CHECK_VALUE(k >= 1 && k < (int64_t(1) << 31), op, ": k must be in [1, 2^31), got ", k);
  TORCH_CHECK_VALUE(out.dim() == 2 && out.is_contiguous() && out.size(0) == scores.size(0) && out.size(1) == k, op,
                    ": out must be contiguous [", scores.size(0), ", ", k, "], got shape ", out.sizes());
  TORCH_CHECK_VALUE(scores.device() == lengths.device() && scores.device() == out.device(), op,
                    ": scores, lengths and out must be on one device, got ", scores.device(), ", ",
                    lengths.device(), ", ", out.device());
  TORCH_CHECK_VALUE(!spans_meet(out, scores) && !spans_meet(out, lengths), op, ": out overlaps scores or lengths");
}

}  // namespace topk
}  // namespace kvops
