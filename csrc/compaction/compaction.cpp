// Host-side checks of kvops::compaction_compact_layers_ and kvops::compaction_fill_lists_, shared by the CPU and
// CUDA backends.
#include "compaction.h"
#include "../host_checks.h"

#include <ATen/MemoryOverlap.h>

#include <iterator>
#include <limits>

namespace kvops {
namespace compaction {

namespace {
constexpr const char* kOp = "compaction_compact_layers_";

bool movable_dtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

void check_index(const at::Tensor& t, const char* name, int64_t dim, const at::Device& device, const char* op = kOp,
                 const char* anchor = "the pools") {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt, op, ": ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), ", ", anchor, " on ", device);
}
}  // namespace

FillPlan check_fill_args(const at::Tensor& kept, const at::Tensor& scored_lengths, const at::Tensor& tail_lengths,
                         const at::Tensor& destination_bases, const at::Tensor& sources,
                         const at::Tensor& new_lengths, const at::Tensor& moves,
                         const std::optional<at::Tensor>& window_offsets) {
  constexpr const char* op = "compaction_fill_lists_";
  const at::Device device = kept.device();
  // The outputs first: every pair that includes one must not overlap.
  const std::pair<const at::Tensor*, const char*> args[] = {
      {&sources, "sources"}, {&moves, "moves"}, {&new_lengths, "new_lengths"}, {&kept, "kept"},
      {&scored_lengths, "scored_lengths"}, {&tail_lengths, "tail_lengths"}, {&destination_bases, "destination_bases"}};
  constexpr size_t kOutputs = 3;
  check_index(kept, "kept", 3, device, op, "kept");
  check_index(sources, "sources", 3, device, op, "kept");
  check_index(moves, "moves", 3, device, op, "kept");
  const int64_t R = kept.size(0), rows = kept.size(1), K = kept.size(2);
  const std::pair<const at::Tensor*, const char*> per_request[] = {
      {&scored_lengths, "scored_lengths"}, {&tail_lengths, "tail_lengths"},
      {&destination_bases, "destination_bases"}, {&new_lengths, "new_lengths"}};
  for (const auto& [t, name] : per_request) {
    check_index(*t, name, 1, device, op, "kept");
    TORCH_CHECK_VALUE(t->size(0) == R && t->is_contiguous(), op, ": ", name, " must be contiguous with one entry per "
                      "request of kept (", R, "), got shape ", t->sizes());
  }
  TORCH_CHECK_VALUE(kept.stride(2) == 1 || K <= 1, op, ": kept needs a contiguous last dim, got strides ",
                    kept.strides());
  TORCH_CHECK_VALUE(sources.size(0) == R && (sources.size(1) == rows || sources.size(1) == rows + 1) &&
                        sources.size(2) >= K && sources.is_contiguous(),
                    op, ": sources must be contiguous [", R, ", ", rows, " or ", rows + 1, ", >= ", K,
                    "] for kept of shape ", kept.sizes(), ", got ", sources.sizes());
  TORCH_CHECK_VALUE(sources.size(1) >= 1, op, ": sources needs at least one list row per request");
  TORCH_CHECK_VALUE(moves.sizes() == sources.sizes() && moves.is_contiguous(), op,
                    ": moves must be contiguous with the shape of sources ", sources.sizes(), ", got ", moves.sizes());
  TORCH_CHECK_VALUE(sources.numel() < std::numeric_limits<int32_t>::max() / 2 &&
                        kept.numel() < std::numeric_limits<int32_t>::max() / 2,
                    op, ": too many list entries for int32 indexing");
  for (size_t a = 0; a < kOutputs; ++a)
    for (size_t b = a + 1; b < std::size(args); ++b)
      TORCH_CHECK_VALUE(at::get_overlap_status(*args[a].first, *args[b].first) == at::MemOverlapStatus::No, op, ": ",
                        args[a].second, " overlaps ", args[b].second);
  FillPlan plan{};
  if (window_offsets.has_value()) {
    check_index(*window_offsets, "window_offsets", 1, device, op, "kept");
    TORCH_CHECK_VALUE(window_offsets->size(0) == R && window_offsets->is_contiguous(), op,
                      ": window_offsets must be contiguous with one entry per request of kept (", R, "), got shape ",
                      window_offsets->sizes());
    TORCH_CHECK_VALUE(sources.size(1) == rows + 1, op, ": window_offsets needs the window row (sources with ", rows + 1,
                      " list rows), got ", sources.size(1));
    for (size_t a = 0; a < kOutputs; ++a)
      TORCH_CHECK_VALUE(at::get_overlap_status(*args[a].first, *window_offsets) == at::MemOverlapStatus::No, op, ": ",
                        args[a].second, " overlaps window_offsets");
    plan.window_offsets = window_offsets->data_ptr<int32_t>();
  }
  plan.kept = kept.data_ptr<int32_t>();
  plan.kept_stride_request = kept.stride(0);
  plan.kept_stride_row = kept.stride(1);
  plan.scored_lengths = scored_lengths.data_ptr<int32_t>();
  plan.tail_lengths = tail_lengths.data_ptr<int32_t>();
  plan.destination_bases = destination_bases.data_ptr<int32_t>();
  plan.sources = sources.data_ptr<int32_t>();
  plan.moves = moves.data_ptr<int32_t>();
  plan.new_lengths = new_lengths.data_ptr<int32_t>();
  plan.requests = int32_t(R);
  plan.rows = int32_t(rows);
  plan.list_rows = int32_t(sources.size(1));
  plan.K = int32_t(K);
  plan.capacity = int32_t(sources.size(2));
  return plan;
}

MovePlan check_compact_args(at::TensorList pools, const at::Tensor& page_table, const at::Tensor& sources,
                            const at::Tensor& new_lengths, const at::Tensor& destination_bases,
                            at::IntArrayRef layer_row_base, at::IntArrayRef head_row_stride,
                            const std::optional<at::Tensor>& moves) {
  TORCH_CHECK_VALUE(!pools.empty(), kOp, ": pools is empty");
  const at::Tensor& p0 = pools[0];
  TORCH_CHECK_VALUE(p0.dim() == 5 && p0.size(1) == 2, kOp,
                    ": pools must be 5-D views [page, plane (K, V), head, token, dim], got shape ", p0.sizes());
  TORCH_CHECK_VALUE(movable_dtype(p0.scalar_type()), kOp,
                    ": pool dtype must be bfloat16, float16 or float8 (e4m3fn, e5m2), got ", p0.scalar_type());
  const int64_t esize = p0.element_size();
  TORCH_CHECK_VALUE(p0.stride(4) == 1, kOp, ": pools need a contiguous dim (stride 1), got strides ", p0.strides());
  const int64_t row_bytes = p0.size(4) * esize;
  TORCH_CHECK_VALUE(row_bytes % 16 == 0 && row_bytes <= kMaxRowBytes, kOp,
                    ": a token row (head_dim * element size) must be a multiple of 16 bytes and at most ",
                    kMaxRowBytes, ", got ", row_bytes);
  for (int d = 0; d < 4; ++d)
    TORCH_CHECK_VALUE((p0.stride(d) * esize) % 16 == 0 || p0.size(d) == 1, kOp,
                      ": pool rows must be 16-byte aligned; stride of dim ", d, " is ", p0.stride(d) * esize,
                      " bytes");
  TORCH_CHECK_VALUE(p0.size(0) < std::numeric_limits<int32_t>::max(), kOp, ": too many pages");
  for (size_t l = 0; l < pools.size(); ++l) {
    const at::Tensor& p = pools[l];
    TORCH_CHECK_VALUE(p.sizes() == p0.sizes() && p.strides() == p0.strides() && p.scalar_type() == p0.scalar_type() &&
                          p.device() == p0.device(),
                      kOp, ": pools[", l, "] (", p.scalar_type(), " ", p.sizes(), " strides ", p.strides(), " on ",
                      p.device(), ") differs from pools[0] (", p0.scalar_type(), " ", p0.sizes(), " strides ",
                      p0.strides(), " on ", p0.device(), "); every layer must share one geometry");
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(p.data_ptr()) % 16 == 0, kOp, ": pools[", l,
                      "] data is not 16-byte aligned");
    check_own_memory(p, kOp, "pools[" + std::to_string(l) + "]");
  }
  const at::Device device = p0.device();
  check_index(page_table, "page_table", 2, device);
  check_index(sources, "sources", 3, device);
  check_index(new_lengths, "new_lengths", 1, device);
  check_index(destination_bases, "destination_bases", 1, device);
  const int64_t R = sources.size(0);
  TORCH_CHECK_VALUE(page_table.size(0) == R && new_lengths.size(0) == R && destination_bases.size(0) == R, kOp,
                    ": page_table, new_lengths and destination_bases need one row per request of sources (", R,
                    "), got ", page_table.size(0), ", ", new_lengths.size(0), ", ", destination_bases.size(0));
  TORCH_CHECK_VALUE(page_table.stride(1) == 1 || page_table.size(1) <= 1, kOp,
                    ": page_table columns must be contiguous, got strides ", page_table.strides());
  TORCH_CHECK_VALUE(sources.is_contiguous() && new_lengths.is_contiguous() && destination_bases.is_contiguous(), kOp,
                    ": sources, new_lengths and destination_bases must be contiguous");
  TORCH_CHECK_VALUE(page_table.size(1) * p0.size(3) < std::numeric_limits<int32_t>::max(), kOp,
                    ": page_table columns * page size must fit in int32");
  const int64_t L = int64_t(pools.size()), H = p0.size(2), list_rows = sources.size(1);
  TORCH_CHECK_VALUE(int64_t(layer_row_base.size()) == L && int64_t(head_row_stride.size()) == L, kOp,
                    ": layer_row_base and head_row_stride need one entry per layer (", L, "), got ",
                    layer_row_base.size(), " and ", head_row_stride.size());
  for (int64_t l = 0; l < L; ++l) {
    const int64_t first = layer_row_base[l], last = first + head_row_stride[l] * (H - 1);
    TORCH_CHECK_VALUE(first >= 0 && head_row_stride[l] >= 0 && last < list_rows, kOp, ": layer ", l,
                      " reads list rows ", first, "..", last, " but sources has ", list_rows, " rows per request");
  }
  // the indices too: a move that wrote over its page table or lists would steer the later moves
  check_disjoint(pools, kOp, "pools",
                 {{&page_table, "page_table"}, {&sources, "sources"}, {&new_lengths, "new_lengths"},
                  {&destination_bases, "destination_bases"}});
  if (moves.has_value()) check_disjoint(pools, kOp, "pools", {{&*moves, "moves"}});
  MovePlan plan{};
  plan.pool = PoolGeometry{p0.stride(0) * esize, p0.stride(1) * esize, p0.stride(2) * esize, p0.stride(3) * esize,
                           int32_t(p0.size(0)),  int32_t(H),           int32_t(p0.size(3)),   int32_t(row_bytes),
                           FastDiv(uint32_t(std::max<int64_t>(1, p0.size(3))))};
  plan.page_table = page_table.data_ptr<int32_t>();
  plan.page_table_stride = page_table.stride(0);
  plan.max_pages = int32_t(page_table.size(1));
  plan.sources = sources.data_ptr<int32_t>();
  plan.new_lengths = new_lengths.data_ptr<int32_t>();
  plan.destination_bases = destination_bases.data_ptr<int32_t>();
  if (moves.has_value()) {
    check_index(*moves, "moves", 3, device);
    TORCH_CHECK_VALUE(moves->sizes() == sources.sizes() && moves->is_contiguous(), kOp,
                      ": moves must be contiguous with the shape of sources ", sources.sizes(), ", got ",
                      moves->sizes());
    plan.moves = moves->data_ptr<int32_t>();
  }
  plan.requests = int32_t(R);
  plan.list_rows = int32_t(list_rows);
  plan.list_capacity = int32_t(sources.size(2));
  return plan;
}

}  // namespace compaction
}  // namespace kvops
