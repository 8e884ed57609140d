// Argument checks and output allocation shared by the CPU and CUDA NVFP4 ops.
#pragma once

#include <ATen/ATen.h>

#include "codec.h"

namespace kvops {
namespace nvfp4 {

inline void check_global_scale(const c10::optional<at::Tensor>& g, const at::Tensor& like, const char* what) {
  if (!g) return;
  TORCH_CHECK_VALUE(g->scalar_type() == at::kFloat && g->numel() == 1, what,
                    ": global_scale must be a one-element float32 tensor, got ", g->scalar_type(), " ", g->sizes());
  TORCH_CHECK_VALUE(g->is_cpu() || g->device() == like.device(), what, ": global_scale is on ", g->device(),
                    ", the data on ", like.device());
}

inline void check_quantize_args(const at::Tensor& x, const c10::optional<at::Tensor>& g) {
  const char* what = "nvfp4_quantize";
  TORCH_CHECK_VALUE(is_hot_dtype(x.scalar_type()) || x.scalar_type() == at::kFloat, what,
                    ": x dtype must be bfloat16, float16, float32 or float8_e4m3fn, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) % kBlock == 0, what, ": x last dim must be a multiple of 16, got shape ",
                    x.sizes());
  check_global_scale(g, x, what);
}

inline void check_dequantize_args(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& g,
                                  at::ScalarType dtype) {
  const char* what = "nvfp4_dequantize";
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kByte, what, ": packed must be uint8, got ", packed.scalar_type());
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat8_e4m3fn, what, ": scales must be float8_e4m3fn, got ",
                    scales.scalar_type());
  TORCH_CHECK_VALUE(packed.dim() >= 1 && packed.size(-1) % 8 == 0, what,
                    ": packed last dim must be a multiple of 8 (16 codes per block), got shape ", packed.sizes());
  auto expect = packed.sizes().vec();
  expect.back() /= 8;
  TORCH_CHECK_VALUE(scales.sizes() == at::IntArrayRef(expect), what, ": scales shape ", scales.sizes(),
                    " does not match packed shape ", packed.sizes(), " (expected ", at::IntArrayRef(expect), ")");
  TORCH_CHECK_VALUE(scales.device() == packed.device(), what, ": scales is on ", scales.device(), ", packed on ",
                    packed.device());
  TORCH_CHECK_VALUE(is_hot_dtype(dtype) || dtype == at::kFloat, what,
                    ": dtype must be bfloat16, float16, float32 or float8_e4m3fn, got ", dtype);
  check_global_scale(g, packed, what);
}

inline std::tuple<at::Tensor, at::Tensor> quantize_outputs(const at::Tensor& x) {
  auto shape = x.sizes().vec();
  const int64_t n = shape.back();
  shape.back() = n / 2;
  at::Tensor packed = at::empty(shape, x.options().dtype(at::kByte));
  shape.back() = n / kBlock;
  at::Tensor scales = at::empty(shape, x.options().dtype(at::kFloat8_e4m3fn));
  return {packed, scales};
}

inline at::Tensor dequantize_output(const at::Tensor& packed, at::ScalarType dtype) {
  auto shape = packed.sizes().vec();
  shape.back() *= 2;
  return at::empty(shape, packed.options().dtype(dtype));
}

inline void check_cold_pages(const at::Tensor& cold_pages, const char* what) {
  TORCH_CHECK_VALUE(cold_pages.scalar_type() == at::kByte && cold_pages.dim() == 2, what,
                    ": cold_pages must be uint8 [num_slots, cold_page_bytes], got ", cold_pages.scalar_type(), " ",
                    cold_pages.sizes());
  TORCH_CHECK_VALUE(cold_pages.stride(1) == 1 && (cold_pages.stride(0) % 16 == 0 || cold_pages.size(0) <= 1) &&
                        reinterpret_cast<uintptr_t>(cold_pages.data_ptr()) % 16 == 0,
                    what, ": cold_pages rows must be contiguous and 16-byte aligned");
}

}  // namespace nvfp4
}  // namespace kvops
