// kvops::topk_short_rows_ and kvops::topk_long_rows_: what the CPU and CUDA backends share.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "../common.h"

namespace kvops {
namespace topk {

constexpr int64_t kShortRow = 4096;  // topk_short_rows_'s widest row: 128 keys a lane of a warp
constexpr int64_t kLongRow = (int64_t(1) << 31) - 4096;  // topk_long_rows_'s: an index a tile past it fits int32

// A float's bits as an order-preserving unsigned key: NaN lowest (0), -0.0 == +0.0. One rule, written once per
// language: kvops/topk/reference.py's sort_keys states it (tests check every copy against it).
KVOPS_HD uint32_t ukey(int32_t b) {
  int32_t key = b ^ ((b >> 31) & 0x7FFFFFFF);
  if (key == -1) key = 0;
  if ((b & 0x7FFFFFFF) > 0x7F800000) key = INT32_MIN;
  return uint32_t(key) ^ 0x80000000u;
}

// The host checks of kvops::topk_short_rows_ and topk_long_rows_ (topk.cpp; the host compiler only): dtypes,
// shapes (rows of at most `max_width` keys), devices, k, and that out overlaps no input.
void check_rows(const char* op, const at::Tensor& scores, const at::Tensor& lengths,
                const std::optional<at::Tensor>& offsets, int64_t k, const at::Tensor& out, int64_t max_width);

// Both ops' CPU backend (topk_cpu.cpp): per row, a partial sort by (key descending, index ascending).
void rows_cpu(const at::Tensor& scores, const at::Tensor& lengths, const std::optional<at::Tensor>& offsets, int64_t k,
              at::Tensor& out);

}  // namespace topk
}  // namespace kvops
