// Host-side argument checks shared by the op families (compiled by the host compiler only).
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <string>
#include <utility>

namespace kvops {

// Raises ValueError "<what>: <name> has elements that share memory ..." unless every element of `t`, which an op
// writes in place, has memory of its own. A stride-0 dim (an expand) fails; so does a layout whose dims, sorted by
// stride, do not nest (each dim of more than one element stepping past all that the smaller-stride dims span):
// such interleaved strides may overlap, and no pool layout (contiguous, transposed, permuted, padded) has them.
void check_own_memory(const at::Tensor& t, const char* what, const std::string& name);

// Raises ValueError "<what>: <name>[i] and <name>[j] share memory" (or "<other> shares memory with <name>[i]")
// unless no two of `tensors`, and none of them with a tensor of `others`, share memory. Exact for dense tensors
// (at::get_overlap_status); of two padded ones whose byte spans meet, only the same start counts as shared. The
// ops that move pools in place run it themselves, so a compiled call (whose traced tensors have no addresses for
// the Python checks) refuses what an eager one does.
void check_disjoint(at::TensorList tensors, const char* what, const char* name,
                    std::initializer_list<std::pair<const at::Tensor*, const char*>> others = {});

}  // namespace kvops
