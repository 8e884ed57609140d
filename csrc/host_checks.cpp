#include "host_checks.h"

#include <ATen/MemoryOverlap.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace kvops {

namespace {
bool nested(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims that step
  for (int64_t k = 0; k < t.dim(); ++k)
    if (t.size(k) > 1) dims.emplace_back(t.stride(k), t.size(k));
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;  // elements the smaller-stride dims reach, plus one
  for (const auto& [stride, size] : dims) {
    if (stride < span) return false;
    span = stride * (size - 1) + span;
  }
  return true;
}
}  // namespace

void check_own_memory(const at::Tensor& t, const char* what, const std::string& name) {
  const at::MemOverlap overlap = at::has_internal_overlap(t);
  TORCH_CHECK_VALUE(overlap == at::MemOverlap::No || (overlap == at::MemOverlap::TooHard && nested(t)), what, ": ",
                    name, " has elements that share memory (shape ", t.sizes(), ", strides ", t.strides(),
                    ": e.g. an expand()); it is written in place, so every element needs its own memory");
}

namespace {
bool share_memory(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.has_storage() || !b.has_storage() ||
      !a.storage().is_alias_of(b.storage()))
    return false;
  switch (at::get_overlap_status(a, b)) {
    case at::MemOverlapStatus::Full:
    case at::MemOverlapStatus::Partial:
      return true;
    case at::MemOverlapStatus::No:
      return false;
    default:  // too hard to tell (padded strides): the same first element is the same tensor passed twice
      return a.data_ptr() == b.data_ptr();
  }
}
}  // namespace

void check_disjoint(at::TensorList tensors, const char* what, const char* name,
                    std::initializer_list<std::pair<const at::Tensor*, const char*>> others) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    for (size_t j = i + 1; j < tensors.size(); ++j)
      TORCH_CHECK_VALUE(!share_memory(tensors[i], tensors[j]), what, ": ", name, "[", i, "] and ", name, "[", j,
                        "] share memory; each must be its own tensor (the same pool passed twice would be changed "
                        "twice)");
    for (const auto& [t, other] : others)
      TORCH_CHECK_VALUE(!share_memory(tensors[i], *t), what, ": ", other, " shares memory with ", name, "[", i, "]");
  }
}

namespace {
// kvops::_same_layout_addresses: the per-layer pools of a round, checked in one call (a Python loop over 36
// layers' shapes and strides costs more than the round's other host work): every tensor has tensors[0]'s sizes,
// strides, dtype and device (a ValueError names `name`[i] otherwise); returns their addresses.
std::vector<int64_t> same_layout_addresses(const std::vector<at::Tensor>& tensors, const std::string& name) {
  std::vector<int64_t> addresses;
  addresses.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_VALUE(i == 0 || (t.sizes() == tensors[0].sizes() && t.strides() == tensors[0].strides() &&
                                 t.scalar_type() == tensors[0].scalar_type() && t.device() == tensors[0].device()),
                      name, "[", i, "] differs from ", name, "[0] in shape, strides, dtype or device (", t.sizes(),
                      " ", t.strides(), " ", t.scalar_type(), " on ", t.device(), " against ", tensors[0].sizes(),
                      " ", tensors[0].strides(), " ", tensors[0].scalar_type(), " on ", tensors[0].device(), ")");
    addresses.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
  }
  return addresses;
}
}  // namespace

TORCH_LIBRARY_IMPL(kvops, CompositeExplicitAutograd, m) { m.impl("_same_layout_addresses", &same_layout_addresses); }

}  // namespace kvops
