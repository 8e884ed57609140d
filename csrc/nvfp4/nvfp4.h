// Argument checks and output allocation shared by the CPU and CUDA NVFP4 ops.
// Defined in codec.cpp only: host code must not be compiled both by nvcc and the C++ compiler
// (their C++ dialects can differ, and inline copies would then violate the ODR).
#pragma once

#include <ATen/ATen.h>

#include "codec.h"

namespace kvops {
namespace nvfp4 {

void check_global_scale(const c10::optional<at::Tensor>& g, const at::Tensor& like, const char* what);
void check_quantize_args(const at::Tensor& x, const c10::optional<at::Tensor>& g);
void check_dequantize_args(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& g,
                           at::ScalarType dtype);
std::tuple<at::Tensor, at::Tensor> quantize_outputs(const at::Tensor& x);
at::Tensor dequantize_output(const at::Tensor& packed, at::ScalarType dtype);
void check_cold_pages(const at::Tensor& cold_pages, const char* what);

}  // namespace nvfp4
}  // namespace kvops
