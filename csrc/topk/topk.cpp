// Host-side checks of kvops::topk_short_rows_, shared by the CPU and CUDA backends (compiled by the host compiler
// only).
#include "topk.h"

#include <ATen/MemoryOverlap.h>

namespace kvops {
namespace topk {

void check_short_rows(const at::Tensor& scores, const at::Tensor& lengths,
                      const std::optional<at::Tensor>& offsets, int64_t k, const at::Tensor& out) {
  constexpr const char* op = "kvops::topk_short_rows_";
  TORCH_CHECK_TYPE(scores.scalar_type() == at::kFloat, op, ": scores must be float32, got ", scores.scalar_type());
  TORCH_CHECK_TYPE(lengths.scalar_type() == at::kInt && out.scalar_type() == at::kInt, op,
                   ": lengths and out must be int32, got ", lengths.scalar_type(), " and ", out.scalar_type());
  TORCH_CHECK_VALUE(scores.dim() == 2 && (scores.stride(1) == 1 || scores.size(1) <= 1), op,
                    ": scores must be 2-D with contiguous rows, got shape ", scores.sizes(), " strides ",
                    scores.strides());
  TORCH_CHECK_VALUE(scores.size(1) <= kShortRow, op, ": scores rows hold at most ", kShortRow, " keys, got ",
                    scores.size(1));
  TORCH_CHECK_VALUE(lengths.dim() == 1 && lengths.is_contiguous() && lengths.size(0) == scores.size(0), op,
                    ": lengths must be contiguous [", scores.size(0), "], got shape ", lengths.sizes());
  if (offsets) {
    TORCH_CHECK_TYPE(offsets->scalar_type() == at::kInt, op, ": offsets must be int32, got ", offsets->scalar_type());
    TORCH_CHECK_VALUE(offsets->dim() == 1 && offsets->is_contiguous() && offsets->size(0) == scores.size(0), op,
                      ": offsets must be contiguous [", scores.size(0), "], got shape ", offsets->sizes());
    TORCH_CHECK_VALUE(offsets->device() == scores.device(), op, ": offsets must be on ", scores.device(), ", got ",
                      offsets->device());
    TORCH_CHECK_VALUE(at::get_overlap_status(out, *offsets) == at::MemOverlapStatus::No, op,
                      ": out overlaps offsets");
  }
  TORCH_CHECK_VALUE(k >= 1 && k < (int64_t(1) << 31), op, ": k must be in [1, 2^31), got ", k);
  TORCH_CHECK_VALUE(out.dim() == 2 && out.is_contiguous() && out.size(0) == scores.size(0) && out.size(1) == k, op,
                    ": out must be contiguous [", scores.size(0), ", ", k, "], got shape ", out.sizes());
  TORCH_CHECK_VALUE(scores.device() == lengths.device() && scores.device() == out.device(), op,
                    ": scores, lengths and out must be on one device, got ", scores.device(), ", ",
                    lengths.device(), ", ", out.device());
  TORCH_CHECK_VALUE(at::get_overlap_status(out, scores) == at::MemOverlapStatus::No &&
                        at::get_overlap_status(out, lengths) == at::MemOverlapStatus::No,
                    op, ": out overlaps scores or lengths");
}

}  // namespace topk
}  // namespace kvops
