#include "host_checks.h"

#include <ATen/MemoryOverlap.h>

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

}  // namespace kvops
