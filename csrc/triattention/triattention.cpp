// Host-side checks of kvops::triattention_mean_phase_ and kvops::triattention_reduce_, shared by the CPU and CUDA
// backends.
#include "triattention.h"

#include <ATen/MemoryOverlap.h>

#include <limits>
#include <utility>

#include "../host_checks.h"

namespace kvops {
namespace triattention {

namespace {

void check_tensor(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype,
                  at::IntArrayRef shape, const at::Device& device) {
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), ", expected ", device);
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// Every output against every other argument: the kernels read the inputs while they write the outputs.
void check_no_overlap(const char* op, std::initializer_list<std::pair<const at::Tensor*, const char*>> outputs,
                      std::initializer_list<std::pair<const at::Tensor*, const char*>> inputs) {
  // (an undefined tensor is an absent optional argument)
  const auto empty = [](const at::Tensor* t) { return !t->defined() || t->numel() == 0; };
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    if (empty(out->first)) continue;
    check_own_memory(*out->first, op, out->second);
    for (auto other = out + 1; other != outputs.end(); ++other)
      TORCH_CHECK_VALUE(empty(other->first) ||
                            at::get_overlap_status(*out->first, *other->first) == at::MemOverlapStatus::No,
                        op, ": ", out->second, " and ", other->second, " share memory");
    for (const auto& in : inputs)
      TORCH_CHECK_VALUE(empty(in.first) ||
                            at::get_overlap_status(*out->first, *in.first) == at::MemOverlapStatus::No,
                        op, ": ", out->second, " shares memory with ", in.second);
  }
}

}  // namespace

void check_mean_phase(const at::Tensor& round_starts, const at::Tensor& omega, const at::Tensor& phase) {
  constexpr const char* op = "triattention_mean_phase_";
  const at::Device device = omega.device();
  TORCH_CHECK_VALUE(round_starts.scalar_type() == at::kInt || round_starts.scalar_type() == at::kLong, op,
                    ": round_starts must be int32 or int64, got ", round_starts.scalar_type());
  TORCH_CHECK_VALUE(round_starts.dim() == 1 && round_starts.is_contiguous(), op,
                    ": round_starts must be a contiguous 1-D tensor, got shape ", round_starts.sizes());
  TORCH_CHECK_VALUE(round_starts.device() == device, op, ": round_starts is on ", round_starts.device(),
                    ", omega on ", device);
  TORCH_CHECK_VALUE(omega.dim() == 1, op, ": omega must be 1-D, got shape ", omega.sizes());
  check_tensor(omega, op, "omega", at::kFloat, {omega.size(0)}, device);
  check_tensor(phase, op, "phase", at::kFloat, {round_starts.size(0), 2, omega.size(0)}, device);
  check_no_overlap(op, {{&phase, "phase"}}, {{&round_starts, "round_starts"}, {&omega, "omega"}});
}

ReduceShape check_reduce(const at::Tensor& raw, const at::Tensor& stats, const at::Tensor& prompt_lengths,
                         const at::Tensor& cache_lengths, const at::Tensor& rows, const std::string& row_mode,
                         int64_t num_kv_heads, bool normalize, const std::optional<at::Tensor>& k_scale,
                         const std::optional<at::Tensor>& row_lengths, const std::optional<at::Tensor>& row_offsets) {
  constexpr const char* op = "triattention_reduce_";
  const at::Device device = raw.device();
  ReduceShape s{};
  if (row_mode == "union") s.mode = kUnion;
  else if (row_mode == "per_head") s.mode = kPerHead;
  else if (row_mode == "per_layer_perhead") s.mode = kPerLayerPerHead;
  else TORCH_CHECK_VALUE(false, op, ": row_mode must be union, per_head or per_layer_perhead, got '", row_mode, "'");
  TORCH_CHECK_VALUE(raw.dim() == 4, op, ": raw must be 4-D [R, L, Hq, n], got shape ", raw.sizes());
  s.R = raw.size(0), s.L = raw.size(1), s.Hq = raw.size(2), s.n = raw.size(3);
  TORCH_CHECK_VALUE(num_kv_heads >= 1 && s.Hq % num_kv_heads == 0, op, ": num_kv_heads must divide the ", s.Hq,
                    " query heads, got ", num_kv_heads);
  s.Hkv = num_kv_heads, s.G = s.Hq / num_kv_heads, s.nc = (s.n + kChunk - 1) / kChunk;
  s.rows = s.mode == kUnion ? 1 : (s.mode == kPerHead ? s.Hkv : s.L * s.Hkv);
  s.normalize = normalize, s.scaled = k_scale.has_value() && !normalize;
  TORCH_CHECK_VALUE(s.L >= 1 && s.Hq >= 1, op, ": raw needs at least one layer and head, got shape ", raw.sizes());
  TORCH_CHECK_VALUE(s.R * s.L * s.Hq * s.n < std::numeric_limits<int64_t>::max() / 8 &&
                        s.R <= 65535 && s.rows <= 65535 && s.n < std::numeric_limits<int32_t>::max() / 2,
                    op, ": raw of shape ", raw.sizes(), " is too large");
  check_tensor(raw, op, "raw", at::kFloat, raw.sizes(), device);
  check_tensor(stats, op, "stats", at::kFloat, {s.R, s.L, s.Hq, s.nc, kStats}, device);
  check_tensor(prompt_lengths, op, "prompt_lengths", at::kInt, {s.R}, device);
  check_tensor(cache_lengths, op, "cache_lengths", at::kInt, {s.R}, device);
  check_tensor(rows, op, "rows", at::kFloat, {s.R, s.rows, s.n}, device);
  if (k_scale) check_tensor(*k_scale, op, "k_scale", at::kFloat, {s.L, s.Hkv}, device);
  TORCH_CHECK_VALUE(row_lengths.has_value() == row_offsets.has_value(), op,
                    ": row_lengths and row_offsets go together");
  const at::Tensor none;
  const at::Tensor& lengths_out = row_lengths ? *row_lengths : none;
  const at::Tensor& offsets_out = row_offsets ? *row_offsets : none;
  if (row_lengths) {
    check_tensor(lengths_out, op, "row_lengths", at::kInt, {s.R, s.rows}, device);
    check_tensor(offsets_out, op, "row_offsets", at::kInt, {s.R, s.rows}, device);
  }
  const at::Tensor& scale = k_scale ? *k_scale : none;
  check_no_overlap(op, {{&rows, "rows"}, {&lengths_out, "row_lengths"}, {&offsets_out, "row_offsets"}},
                   {{&raw, "raw"}, {&stats, "stats"}, {&prompt_lengths, "prompt_lengths"},
                    {&cache_lengths, "cache_lengths"}, {&scale, "k_scale"}});
  return s;
}

}  // namespace triattention
}  // namespace kvops
