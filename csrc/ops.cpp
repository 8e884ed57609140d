// Every kvops schema, in one place. Backend impls live with their family
// (csrc/<family>/*_cpu.cpp, *_cuda.cu); fake impls live beside the Python wrappers.
#include <Python.h>
#include <torch/library.h>

#include <string>

extern "C" {
// A plain module: importing kvops._C runs the static registrations below and in each family. CUDA_KERNELS says
// whether this build holds the CUDA kernels (`kvops info` reports it).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
#ifdef KVOPS_WITH_CUDA
  const long cuda_kernels = 1;
#else
  const long cuda_kernels = 0;
#endif
  if (module != nullptr && PyModule_AddIntConstant(module, "CUDA_KERNELS", cuda_kernels) != 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}

namespace {
// Every schema, in one list: TORCH_LIBRARY below defines them, and a build without CUDA kernels answers each
// one's CUDA calls (its name is the schema up to the '(').
constexpr const char* kSchemas[] = {
    // NVFP4 primitives: 16-element blocks, E4M3 block scales, one fp32 global scale.
    "nvfp4_quantize(Tensor x, Tensor? global_scale=None) -> (Tensor packed, Tensor scales)",
    "nvfp4_dequantize(Tensor packed, Tensor scales, Tensor? global_scale, ScalarType dtype) -> Tensor",
    // Cold-page codec: pools -> one fixed-size blob per page (plan from kvops/nvfp4/layout.py).
    // staging (GPU only): uint8 [rows, cold page bytes] on the pools' device; with cold_pages in pinned host memory
    // and host page_pairs, the kernels work on it chunk by chunk and the copy engine moves each chunk (csrc/nvfp4,
    // docs/nvfp4.md "Staged transfers").
    "nvfp4_encode_pages_(Tensor[] pools, Tensor(a!) cold_pages, Tensor page_pairs, int[] plan, "
        "bool validate=False, Tensor(c!)? staging=None) -> ()",
    // refused: int32 [1] on the pools' device, += 1 per (page, pool, plane) left untouched because its blob's
    // global scale is not positive and finite (a slot never encoded, or corrupt).
    "nvfp4_decode_pages_(Tensor cold_pages, Tensor(a!)[] pools, Tensor page_pairs, int[] plan, "
        "bool validate=False, Tensor(b!)? refused=None, Tensor(c!)? staging=None) -> ()",
    // Compaction: position destination_bases[r] + m of each (layer, plane, head) stream receives source m of the
    // stream's move list, list row layer_row_base[l] + head_row_stride[l] * head (lists from kvops/compaction/pack.py);
    // with moves (the shape of sources), only the list indices the row of moves names (ascending, -1 ends it).
    "compaction_compact_layers_(Tensor(a!)[] pools, Tensor page_table, Tensor sources, Tensor new_lengths, "
        "Tensor destination_bases, int[] layer_row_base, int[] head_row_stride, Tensor? moves=None) -> ()",
    // Fill-order move lists (kvops/compaction/pack.py): sources, moves and new_lengths from the decisions, every
    // list row of every request; with window_offsets, the window row as a ring.
    "compaction_fill_lists_(Tensor kept, Tensor scored_lengths, Tensor tail_lengths, Tensor destination_bases, "
        "Tensor(a!) sources, Tensor(b!) new_lengths, Tensor(c!) moves, Tensor? window_offsets=None) -> ()",
    // TriAttention around the CuTe scorer (csrc/triattention/triattention.h states both): a round's mean-phase
    // coefficients, and the scorer's raw scores and chunk partials reduced to the mode's decision rows (with the
    // top-k's per-row lengths and offsets when asked).
    "triattention_mean_phase_(Tensor round_starts, Tensor omega, Tensor(a!) phase) -> ()",
    "triattention_reduce_(Tensor raw, Tensor stats, Tensor prompt_lengths, Tensor cache_lengths, Tensor(a!) rows, "
        "str row_mode, int num_kv_heads, bool normalize, Tensor? k_scale=None, Tensor(b!)? row_lengths=None, "
        "Tensor(c!)? row_offsets=None) -> ()",
    // Triton kernels built ahead of time (csrc/triton_aot.cpp, kvops/_triton.py): a cubin registered once, then
    // launched with its arguments in order (pointers from tensors, then ints and floats by its params string).
    "_triton_register(str symbol, str function, Tensor cubin, str params, int num_warps, int shared) -> ()",
    "_triton_launch(str symbol, int[] grid, Tensor(a!)?[] tensors, int[] ints, float[] floats) -> ()",
    // Host check of a round's per-layer pools (csrc/host_checks.cpp): one layout, their addresses.
    "_same_layout_addresses(Tensor[] tensors, str name) -> int[]",
    // Top-k over rows of at most 4096 keys (kvops.topk's semantics, docs/topk.md): one warp per row on the GPU.
    "topk_short_rows_(Tensor scores, Tensor lengths, Tensor? offsets, int k, Tensor(a!) out) -> ()",
    // The same over rows of any width, several CTAs a row on the GPU (a few long rows).
    "topk_long_rows_(Tensor scores, Tensor lengths, Tensor? offsets, int k, Tensor(a!) out) -> ()",
    // Decode attention over a paged cache (csrc/attention/attention.h states it): query [R, Hq, q, D] -> [R, q, Hq, D].
    "attention_decode(Tensor query, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor lengths, "
        "Tensor? starts, float scale, float k_scale=1.0, float v_scale=1.0, int num_splits=0) -> Tensor",
};
}  // namespace

TORCH_LIBRARY(kvops, m) {
  for (const char* schema : kSchemas) m.def(schema);
}

#ifndef KVOPS_WITH_CUDA
// A build without nvcc still answers CUDA calls, with a clear error instead of a missing kernel.
namespace {
void not_built(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(false, op.schema().name(),
              ": kvops was built without CUDA kernels (no nvcc or a CPU-only torch at build time); "
              "reinstall with CUDA_HOME set to the CUDA toolkit");
}
}  // namespace

TORCH_LIBRARY_IMPL(kvops, CUDA, m) {
  for (const char* schema : kSchemas) {
    const std::string name(schema);
    m.impl(name.substr(0, name.find('(')).c_str(), torch::CppFunction::makeFromBoxedFunction<&not_built>());
  }
}
#endif
