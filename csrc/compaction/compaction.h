// In-place KV compaction (docs/compaction.md): the move plan shared by the CPU and CUDA kernels.
//
// A stream is one (request, layer, plane, head). Its move list is row
// `layer_row_base[l] + head_row_stride[l] * h` of the request's lists in `sources`
// [R, list_rows, capacity]; position destination_bases[r] + m receives source m, for
// m < new_lengths[r] - destination_bases[r]. Lists come from kvops/compaction/pack.py. With `moves` (the
// shape of sources), a stream walks only the indices m its row of moves lists (ascending, -1 ends it):
// fill order lists just the tokens that move.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "../common.h"

namespace kvops {
namespace compaction {

constexpr int kMaxRowBytes = 4096;  // one token row of one head: head_dim * element size

// Geometry of the per-layer 5-D pool views [page, plane, head, token, dim]; strides in bytes.
struct PoolGeometry {
  int64_t stride_page, stride_plane, stride_head, stride_token;
  int32_t pages, heads, page_size, row_bytes;
  FastDiv page_div;  // by page_size
};

struct MovePlan {
  PoolGeometry pool;
  const int32_t* page_table;
  int64_t page_table_stride;  // elements between requests
  int32_t max_pages;          // page-table columns
  const int32_t* sources;
  const int32_t* new_lengths;
  const int32_t* destination_bases;
  const int32_t* moves;  // nullptr: walk every m of the list
  int32_t requests, list_rows, list_capacity;

  // Byte offset of cache position `pos` of request r within a (plane, head) of a layer, or -1 when
  // the position or its page is out of range (a bad list never reaches another request's pages).
  KVOPS_HD int64_t token_offset(const int32_t* pt_row, int32_t pos) const {
    if (pos < 0 || pos >= int64_t(max_pages) * pool.page_size) return -1;  // < 2^31 (checked on the host)
    const uint32_t col = pool.page_div.div(uint32_t(pos));
    const int32_t page = pt_row[col];
    if (page < 0 || page >= pool.pages) return -1;
    return page * pool.stride_page + int64_t(uint32_t(pos) - col * pool.page_size) * pool.stride_token;
  }
  KVOPS_HD int32_t list_length(int r) const {  // clamped: the kernels never read past a list
    const int32_t n = new_lengths[r] - destination_bases[r];
    return n < 0 ? 0 : (n > list_capacity ? list_capacity : n);
  }
  // The list index of step j of a stream's walk (`walk` = its row of moves, at the row's offset), or n when the
  // walk has ended.
  KVOPS_HD int32_t walk_index(const int32_t* walk, int32_t j, int32_t n) const {
    if (j >= n) return n;
    if (moves == nullptr) return j;
    const int32_t m = walk[j];
    return m < 0 || m >= n ? n : m;
  }
};

// Fill-order move lists (kvops::compaction_fill_lists_; kvops/compaction/pack.py states the lists): the
// arguments, and one list row of one request.
struct FillRow {
  const int32_t* kept;  // the decision row; unused for the window row
  int32_t K, scored, tail, base, n;  // n = K + tail: the list's length
  // The window row's ring offset (window_offsets[r]), or -1 when the window keeps its tokens in order.
  int32_t ring;
  // Lists of -1 and the length before the round (scored + tail, saturated to [0, INT32_MAX]) for a tail the
  // lists cannot hold, a base outside [0, scored - K] (no decision fits there; base + n could overflow), a
  // length before the round past int32, or a ring offset outside [0, K).
  bool refused;

  // U: the kept positions, then the tail's (ascending when the decision keeps the contract).
  KVOPS_HD int32_t U(int32_t i) const { return i < K ? kept[i] : scored + (i - K); }
  KVOPS_HD int32_t new_length() const {
    if (!refused) return base + n;  // <= scored + tail <= INT32_MAX
    const int64_t before = int64_t(scored) + (tail > 0 ? tail : 0);
    return int32_t(before < 0 ? 0 : before > INT32_MAX ? INT32_MAX : before);
  }
  // The window row (kvops/compaction/pack.py states both layouts). In order: the latest K scored tokens, every
  // one moving once any is evicted. As a ring: slot base + (ring + i) % K holds the i-th oldest of the K, and the
  // scored tokens past base + K follow in order; the e = scored - base - K oldest are evicted, the newest K take
  // ring offset (ring + e) % K, so only the evicted slots and the tail move.
  KVOPS_HD int32_t window_source(int32_t m) const {
    if (m >= n) return -1;
    if (ring < 0 || m >= K) return scored - K + m;
    const int64_t e = int64_t(scored) - base - K, j = e + (m - ring - e % K + 2 * int64_t(K)) % K;
    return int32_t(base + (j < K ? (ring + j) % K : j));
  }
  // Step j of the window row's walk: the list index it moves, -1 past the last.
  KVOPS_HD int32_t window_move(int32_t j) const {
    if (j >= n || scored - K == base) return -1;  // nothing evicted: nothing moves
    if (ring < 0) return j;
    const int64_t e = int64_t(scored) - base - K, c = e < K ? e : K, wrapped = int64_t(ring) + c - K;
    if (j < wrapped) return j;                                      // evicted slots past the ring's end, wrapped
    if (j < c) return int32_t(ring + j - (wrapped > 0 ? wrapped : 0));  // evicted slots from the ring offset
    return j < c + tail ? int32_t(K + j - c) : -1;                  // the tail, down by e
  }
};

struct FillPlan {
  const int32_t* kept;
  int64_t kept_stride_request, kept_stride_row;
  const int32_t *scored_lengths, *tail_lengths, *destination_bases;
  const int32_t* window_offsets;  // nullptr: the window row in order
  int32_t *sources, *moves, *new_lengths;
  int32_t requests, rows, list_rows, K, capacity;

  KVOPS_HD FillRow row(int32_t r, int32_t list_row) const {
    FillRow f;
    f.kept = kept + r * kept_stride_request + (list_row < rows ? list_row : 0) * kept_stride_row;
    f.K = K;
    f.scored = scored_lengths[r];
    f.tail = tail_lengths[r];
    f.base = destination_bases[r];
    f.n = int32_t(int64_t(K) + f.tail);  // wraps only for a refused tail, whose n is never read
    f.ring = window_offsets == nullptr ? -1 : window_offsets[r];
    f.refused = f.tail < 0 || f.tail > capacity - K || f.base < 0 || int64_t(f.base) + K > f.scored ||
                int64_t(f.scored) + f.tail > INT32_MAX ||
                (window_offsets != nullptr && (f.ring < 0 || f.ring > (K > 0 ? K - 1 : 0)));
    return f;
  }
};

// Checks every argument of kvops::compaction_fill_lists_ and fills the plan; raises before anything is written.
FillPlan check_fill_args(const at::Tensor& kept, const at::Tensor& scored_lengths, const at::Tensor& tail_lengths,
                         const at::Tensor& destination_bases, const at::Tensor& sources,
                         const at::Tensor& new_lengths, const at::Tensor& moves,
                         const std::optional<at::Tensor>& window_offsets);

// Checks every argument of kvops::compaction_compact_layers_ (shapes, dtypes, devices, strides, alignment,
// list-row ranges) and fills the plan; raises before anything is touched.
MovePlan check_compact_args(at::TensorList pools, const at::Tensor& page_table, const at::Tensor& sources,
                            const at::Tensor& new_lengths, const at::Tensor& destination_bases,
                            at::IntArrayRef layer_row_base, at::IntArrayRef head_row_stride,
                            const std::optional<at::Tensor>& moves);

}  // namespace compaction
}  // namespace kvops
