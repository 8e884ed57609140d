// CPU backend of kvops::attention_decode: per request, gather the positions it sees through the page table and
// attend in fp32 with ATen ops (the same semantics as the CUDA kernel, without its splitting).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "attention.h"

namespace kvops {
namespace attention {

namespace {

at::Tensor decode_cpu(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& page_table, const at::Tensor& lengths, const std::optional<at::Tensor>& starts,
                      double scale, double k_scale, double v_scale, int64_t num_splits) {
  const DecodeArgs a = check_decode_args(query, k_cache, v_cache, page_table, lengths, starts, scale, k_scale,
                                         v_scale, num_splits);
  const int64_t R = a.requests, Hq = a.q_heads, Hkv = a.kv_heads, q = a.q_tokens, D = a.head_dim, G = a.group();
  at::Tensor out = at::zeros({R, q, Hq, D}, query.options());
  const at::Tensor table = page_table.contiguous();
  const int32_t* pt = table.data_ptr<int32_t>();
  const int32_t* len = lengths.data_ptr<int32_t>();
  const int32_t* st = starts.has_value() ? starts->data_ptr<int32_t>() : nullptr;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  for (int64_t r = 0; r < R; ++r) {
    // positions [start, length) clamped to the table's, through pages that exist
    const int32_t length = std::clamp(len[r], 0, a.capacity());
    const int32_t start = st == nullptr ? 0 : std::clamp(st[r], 0, length);
    std::vector<int64_t> pages, slots, positions;
    for (int32_t p = start; p < length; ++p) {
      const int32_t page = pt[r * a.max_pages + p / a.page_size];
      if (page < 0 || page >= a.pages) continue;
      pages.push_back(page);
      slots.push_back(p % a.page_size);
      positions.push_back(p);
    }
    if (pages.empty()) continue;
    const int64_t n = int64_t(pages.size());
    const at::Tensor page_idx = at::from_blob(pages.data(), {n}, i64).clone();
    const at::Tensor slot_idx = at::from_blob(slots.data(), {n}, i64).clone();
    const at::Tensor pos = at::from_blob(positions.data(), {n}, i64).clone();
    // [n, Hkv, D] -> [Hkv, n, D], fp32
    using at::indexing::Slice;
    const at::Tensor K = k_cache.index({page_idx, Slice(), slot_idx}).to(f32).mul_(k_scale).permute({1, 0, 2});
    const at::Tensor V = v_cache.index({page_idx, Slice(), slot_idx}).to(f32).mul_(v_scale).permute({1, 0, 2});
    // query rows of KV head h: its G heads x q tokens, [Hkv, G * q, D]
    const at::Tensor Q = query[r].to(f32).reshape({Hkv, G * q, D});
    at::Tensor S = at::bmm(Q, K.transpose(1, 2)).mul_(scale);  // [Hkv, G * q, n]
    // token i sees positions before length - (q - 1 - i)
    const at::Tensor limit = at::arange(length - q + 1, length + 1, i64).repeat({G});  // [G * q]
    const at::Tensor hidden = pos.unsqueeze(0).ge(limit.unsqueeze(1));                   // [G * q, n]
    S.masked_fill_(hidden.unsqueeze(0), -std::numeric_limits<float>::infinity());
    const at::Tensor seen = hidden.logical_not().any(1);  // rows that see a position
    // a row that sees nothing is zeros (its softmax is 0/0); NaN or inf in the data propagates, as in sdpa
    at::Tensor P = at::softmax(S, -1).masked_fill_(seen.logical_not().view({1, G * q, 1}), 0.0);
    const at::Tensor O = at::bmm(P, V).view({Hkv, G, q, D}).permute({2, 0, 1, 3}).reshape({q, Hq, D});
    out[r].copy_(O);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(kvops, CPU, m) { m.impl("attention_decode", &decode_cpu); }

}  // namespace attention
}  // namespace kvops
