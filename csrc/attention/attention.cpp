// Host-side checks of kvops::attention_decode, shared by the CPU and CUDA backends.
#include "attention.h"

#include <cmath>
#include <limits>

namespace kvops {
namespace attention {

namespace {
constexpr const char* kOp = "attention_decode";

void check_index(const at::Tensor& t, const char* name, int64_t R, const at::Device& device) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, kOp, ": ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == R && t.is_contiguous(), kOp, ": ", name,
                    " must be contiguous [", R, "] (one entry per request of query), got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == device, kOp, ": ", name, " is on ", t.device(), ", query on ", device);
}

void check_cache(const at::Tensor& c, const char* name, const at::Tensor& query) {
  TORCH_CHECK_VALUE(c.dim() == 4, kOp, ": ", name, " must be 4-D [pages, kv_heads, page_size, head_dim], got shape ",
                    c.sizes());
  TORCH_CHECK_TYPE(c.scalar_type() == query.scalar_type() || c.scalar_type() == at::kFloat8_e4m3fn, kOp, ": ", name,
                   " must be ", query.scalar_type(), " (query's dtype) or float8_e4m3fn, got ", c.scalar_type());
  TORCH_CHECK_VALUE(c.device() == query.device(), kOp, ": ", name, " is on ", c.device(), ", query on ",
                    query.device());
  TORCH_CHECK_VALUE(c.size(3) == query.size(3), kOp, ": ", name, " has head_dim ", c.size(3), ", query ",
                    query.size(3));
  TORCH_CHECK_VALUE(c.stride(3) == 1, kOp, ": ", name, " needs a contiguous head_dim (stride 1), got strides ",
                    c.strides());
  // 16-byte vector loads of whole token rows
  const int64_t esize = c.element_size();
  for (int d = 0; d < 3; ++d)
    TORCH_CHECK_VALUE((c.stride(d) * esize) % 16 == 0 || c.size(d) == 1, kOp, ": ", name,
                      " rows must be 16-byte aligned; the stride of dim ", d, " is ", c.stride(d) * esize, " bytes");
  TORCH_CHECK_VALUE(c.numel() == 0 || reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0, kOp, ": ", name,
                    " data is not 16-byte aligned");
}
}  // namespace

DecodeArgs check_decode_args(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& page_table, const at::Tensor& lengths,
                             const std::optional<at::Tensor>& starts, double scale, double k_scale, double v_scale,
                             int64_t num_splits) {
  TORCH_CHECK_TYPE(query.scalar_type() == at::kBFloat16 || query.scalar_type() == at::kHalf, kOp,
                   ": query must be bfloat16 or float16, got ", query.scalar_type());
  TORCH_CHECK_VALUE(query.dim() == 4, kOp, ": query must be 4-D [requests, q_heads, q_tokens, head_dim], got shape ",
                    query.sizes());
  const int64_t R = query.size(0), Hq = query.size(1), q = query.size(2), D = query.size(3);
  TORCH_CHECK_VALUE(D == 64 || D == 128 || D == 256, kOp, ": head_dim must be 64, 128 or 256, got ", D);
  TORCH_CHECK_VALUE(q >= 1 && Hq >= 1, kOp, ": query needs at least one head and one token, got shape ",
                    query.sizes());
  TORCH_CHECK_VALUE(query.stride(3) == 1, kOp, ": query needs a contiguous head_dim (stride 1), got strides ",
                    query.strides());
  check_cache(k_cache, "k_cache", query);
  check_cache(v_cache, "v_cache", query);
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(), kOp,
                    ": v_cache (", v_cache.scalar_type(), " ", v_cache.sizes(), ") must match k_cache (",
                    k_cache.scalar_type(), " ", k_cache.sizes(), ")");
  const int64_t P = k_cache.size(0), Hkv = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK_VALUE(Hkv >= 1 && Hq % Hkv == 0, kOp, ": query's ", Hq, " heads must be a multiple of the caches' ",
                    Hkv, " KV heads");
  TORCH_CHECK_VALUE(S >= 1, kOp, ": the caches need a page size of at least one token, got shape ", k_cache.sizes());
  const at::Device device = query.device();
  TORCH_CHECK_TYPE(page_table.scalar_type() == at::kInt, kOp, ": page_table must be int32, got ",
                   page_table.scalar_type());
  TORCH_CHECK_VALUE(page_table.dim() == 2 && page_table.size(0) == R, kOp, ": page_table must be 2-D [", R,
                    ", max_pages] (one row per request of query), got shape ", page_table.sizes());
  TORCH_CHECK_VALUE(page_table.stride(1) == 1 || page_table.size(1) <= 1, kOp,
                    ": page_table columns must be contiguous, got strides ", page_table.strides());
  TORCH_CHECK_VALUE(page_table.device() == device, kOp, ": page_table is on ", page_table.device(), ", query on ",
                    device);
  check_index(lengths, "lengths", R, device);
  if (starts.has_value()) check_index(*starts, "starts", R, device);
  const int64_t max_pages = page_table.size(1);
  // positions and pages are int32 in the kernels; requests and heads x query tokens bound the grid's y and z
  TORCH_CHECK_VALUE(max_pages * S < std::numeric_limits<int32_t>::max() &&
                        P < std::numeric_limits<int32_t>::max() && R < 65536 && Hq * q < 65536,
                    kOp, ": too large: positions (max_pages * page_size = ", max_pages * S, ") and pages (", P,
                    ") must fit int32, requests (", R, ") and q_heads x q_tokens (", Hq * q, ") at most 65535");
  for (const auto& [value, name] : {std::pair{scale, "scale"}, {k_scale, "k_scale"}, {v_scale, "v_scale"}})
    TORCH_CHECK_VALUE(std::isfinite(float(value)) && value > 0, kOp, ": ", name, " must be finite and positive, got ",
                      value);
  TORCH_CHECK_VALUE(num_splits >= 0 && num_splits <= kMaxSplits, kOp, ": num_splits must be in [0, ", kMaxSplits,
                    "] (0: chosen from the shapes), got ", num_splits);
  DecodeArgs a{};
  a.q_stride_request = query.stride(0);
  a.q_stride_head = query.stride(1);
  a.q_stride_token = query.stride(2);
  a.k_stride_page = k_cache.stride(0);
  a.k_stride_head = k_cache.stride(1);
  a.k_stride_token = k_cache.stride(2);
  a.v_stride_page = v_cache.stride(0);
  a.v_stride_head = v_cache.stride(1);
  a.v_stride_token = v_cache.stride(2);
  a.table_stride = page_table.stride(0);
  a.requests = int32_t(R);
  a.q_heads = int32_t(Hq);
  a.kv_heads = int32_t(Hkv);
  a.q_tokens = int32_t(q);
  a.head_dim = int32_t(D);
  a.pages = int32_t(P);
  a.page_size = int32_t(S);
  a.max_pages = int32_t(max_pages);
  a.page_div = FastDiv(uint32_t(S));
  a.scale = float(scale);
  a.k_scale = float(k_scale);
  a.v_scale = float(v_scale);
  a.has_starts = starts.has_value();
  a.num_splits = int32_t(num_splits);
  return a;
}

}  // namespace attention
}  // namespace kvops
