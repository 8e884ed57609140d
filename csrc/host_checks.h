// Host-side argument checks shared by the op families (compiled by the host compiler only).
#pragma once

#include <ATen/ATen.h>

namespace kvops {

// Raises ValueError "<what>: <name> has elements that share memory ..." unless every element of `t`, which an op
// writes in place, has memory of its own. A stride-0 dim (an expand) fails; so does a layout whose dims, sorted by
// stride, do not nest (each dim of more than one element stepping past all that the smaller-stride dims span):
// such interleaved strides may overlap, and no pool layout (contiguous, transposed, permuted, padded) has them.
void check_own_memory(const at::Tensor& t, const char* what, const std::string& name);

}  // namespace kvops
