// CPU backend of kvops::compaction_compact_layers_: the same stream walk as the CUDA kernel, one row at a time.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "compaction.h"

namespace kvops {
namespace compaction {

void compact_layers_cpu(at::TensorList pools, const at::Tensor& page_table, const at::Tensor& sources,
                        const at::Tensor& new_lengths, const at::Tensor& destination_bases,
                        at::IntArrayRef layer_row_base, at::IntArrayRef head_row_stride,
                        const std::optional<at::Tensor>& moves) {
  const MovePlan plan = check_compact_args(pools, page_table, sources, new_lengths, destination_bases, layer_row_base,
                                           head_row_stride, moves);
  const int64_t L = int64_t(pools.size()), H = plan.pool.heads;
  std::vector<char*> bases(L);
  for (int64_t l = 0; l < L; ++l) bases[l] = static_cast<char*>(pools[l].data_ptr());
  // Streams touch disjoint rows, so they run in parallel; each walks its list in ascending order,
  // which is what makes the move safe in place (a source is read before anything lands on it).
  at::parallel_for(0, int64_t(plan.requests) * L * 2 * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t h = s % H, plane = s / H % 2, l = s / (2 * H) % L, r = s / (2 * H * L);
      const int64_t row = (r * plan.list_rows + layer_row_base[l] + head_row_stride[l] * h) * plan.list_capacity;
      const int32_t *list = plan.sources + row, *walk = plan.moves + (plan.moves ? row : 0);
      const int32_t* pt_row = plan.page_table + r * plan.page_table_stride;
      char* head = bases[l] + plane * plan.pool.stride_plane + h * plan.pool.stride_head;
      const int32_t base = plan.destination_bases[r], n = plan.list_length(int(r));
      for (int32_t j = 0, m; (m = plan.walk_index(walk, j, n)) < n; ++j) {
        const int64_t src = plan.token_offset(pt_row, list[m]), dst = plan.token_offset(pt_row, base + m);
        if (src >= 0 && dst >= 0 && src != dst) std::memmove(head + dst, head + src, plan.pool.row_bytes);
      }
    }
  });
}

TORCH_LIBRARY_IMPL(kvops, CPU, m) { m.impl("compaction_compact_layers_", &compact_layers_cpu); }

}  // namespace compaction
}  // namespace kvops
