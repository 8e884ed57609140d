// CPU backends of kvops::compaction_compact_layers_ (the same stream walk as the CUDA kernel, one row at a time) and
// kvops::compaction_fill_lists_ (the same rule as the CUDA kernel, one position at a time).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

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

void fill_lists_cpu(const at::Tensor& kept, const at::Tensor& scored_lengths, const at::Tensor& tail_lengths,
                    const at::Tensor& destination_bases, at::Tensor sources, at::Tensor new_lengths, at::Tensor moves,
                    const std::optional<at::Tensor>& window_offsets) {
  const FillPlan p =
      check_fill_args(kept, scored_lengths, tail_lengths, destination_bases, sources, new_lengths, moves, window_offsets);
  const int64_t C = p.capacity;
  for (int32_t r = 0; r < p.requests; ++r) p.new_lengths[r] = p.row(r, 0).new_length();
  at::parallel_for(0, int64_t(p.requests) * p.list_rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<char> stays;
    for (int64_t item = begin; item < end; ++item) {
      const int32_t r = int32_t(item / p.list_rows), row = int32_t(item % p.list_rows);
      const FillRow f = p.row(r, row);
      int32_t *src = p.sources + item * C, *mv = p.moves + item * C;
      std::fill(src, src + C, -1);
      std::fill(mv, mv + C, -1);
      if (f.refused) continue;
      if (row >= p.rows) {
        for (int32_t m = 0; m < C; ++m) src[m] = f.window_source(m), mv[m] = f.window_move(m);
        continue;
      }
      // U[0..s) lie below the new length and stay on their own slots; the j-th free slot takes U[s + j].
      stays.assign(size_t(f.n), 0);
      int32_t s = 0;
      for (int32_t i = 0; i < f.n; ++i) {
        const int64_t slot = int64_t(f.U(i)) - f.base;
        if (slot < f.n) {
          ++s;
          if (slot >= 0) stays[slot] = 1;
        }
      }
      for (int32_t m = 0, j = 0; m < f.n; ++m) {
        if (stays[m]) {
          src[m] = f.base + m;
        } else {
          src[m] = s + j < f.n ? f.U(s + j) : -1;
          mv[j++] = m;
        }
      }
    }
  });
}

TORCH_LIBRARY_IMPL(kvops, CPU, m) {
  m.impl("compaction_compact_layers_", &compact_layers_cpu);
  m.impl("compaction_fill_lists_", &fill_lists_cpu);
}

}  // namespace compaction
}  // namespace kvops
