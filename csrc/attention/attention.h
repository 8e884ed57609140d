// Decode attention over a paged KV cache (docs/attention.md): the arguments, checked once on the host and shared
// by the CPU and CUDA backends of kvops::attention_decode.
//
// Request r has q query tokens (the last q of its sequence: one for decode, a few for a speculative step) and holds
// its tokens at cache positions [starts[r], lengths[r]); position p lives in page page_table[r, p / page_size],
// slot p % page_size. Query token i of head h attends, causally, to the positions before lengths[r] - (q - 1 - i),
// reading the KV head h / (Hq / Hkv) of each (grouped-query heads share it, nothing is repeated). A row that sees
// no position outputs zeros.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "../common.h"

namespace kvops {
namespace attention {

constexpr int kMaxSplits = 256;  // KV-length splits of one (request, KV head) on the GPU

struct DecodeArgs {
  // query [R, Hq, q, D] (element strides; D contiguous), out [R, q, Hq, D] contiguous
  int64_t q_stride_request, q_stride_head, q_stride_token;
  // k_cache / v_cache [pages, Hkv, page_size, D] (element strides; D contiguous)
  int64_t k_stride_page, k_stride_head, k_stride_token;
  int64_t v_stride_page, v_stride_head, v_stride_token;
  int64_t table_stride;  // page_table [R, max_pages], elements between requests (columns contiguous)
  int32_t requests, q_heads, kv_heads, q_tokens, head_dim, pages, page_size, max_pages;
  FastDiv page_div;      // by page_size
  float scale, k_scale, v_scale;
  bool has_starts;
  int32_t num_splits;    // KV-length splits asked for; 0: the backend chooses

  KVOPS_HD int32_t group() const { return q_heads / kv_heads; }
  KVOPS_HD int32_t capacity() const { return max_pages * page_size; }  // < 2^31 (checked)
};

// Checks every argument of kvops::attention_decode (shapes, dtypes, devices, strides, alignment, ranges) and fills
// the geometry; raises ValueError/TypeError naming the argument before anything runs.
DecodeArgs check_decode_args(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& page_table, const at::Tensor& lengths,
                             const std::optional<at::Tensor>& starts, double scale, double k_scale, double v_scale,
                             int64_t num_splits);

}  // namespace attention
}  // namespace kvops
