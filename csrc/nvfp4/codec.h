// The cold-page codec's per-pool descriptor, shared by the CPU and CUDA kernels.
//
// kvops/nvfp4/layout.py computes the blob layout once (it is the only place that does) and
// passes it as a flat int list, the "plan", PLAN_FIELDS entries per pool. The host side here
// checks the plan against the pools and the blob before anything runs.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "nvfp4_math.h"

namespace kvops {
namespace nvfp4 {

// Plan fields, in order (keep in sync with kvops/nvfp4/layout.py: PLAN_FIELDS).
enum PlanField : int {
  kQStart, kQLen, kRStart, kRLen,  // element ranges within the row
  kPlaneDim,                       // pool dim of the K/V plane, 0 = none
  kScaleKind, kFixedScaleBits,     // ScaleKind, fp32 bits of the fixed g
  kSectionOffset,                  // byte offset of this pool's section in a blob (g table first)
  kPlaneOffset, kPlaneBytes,       // first plane's byte offset within the section, bytes per plane
  kOffCodes, kOffRCodes, kOffScales, kOffRScales, kOffLossless,  // region offsets in a plane
  kLayoutTag,                      // u32 the section's g table starts with (layout.py: PoolLayout.tag)
  kPlanFields
};

constexpr int kMaxOtherDims = 3;  // pool dims between page and row, besides the plane dim

// Rows are addressed by mixed radix over the pool's middle dims (plane dim excluded).
struct PoolDesc {
  char* base;                       // pool data
  int64_t page_stride;              // bytes
  int64_t plane_stride;             // bytes
  int64_t dim_stride[kMaxOtherDims];  // bytes, outermost first
  FastDiv dim_size[kMaxOtherDims];
  int32_t num_pages, planes, plane_rows, row_bytes;
  int32_t esize;                    // bytes per element
  int32_t q_start, q_len, r_start, r_len;  // elements
  int32_t scale_kind;
  float fixed_scale;
  int64_t section_offset, plane_offset, plane_bytes;
  int32_t off_codes, off_rcodes, off_scales, off_rscales, off_lossless;
  uint32_t tag;                     // the layout tag: the g table's first word
  int64_t row_stride;               // bytes between rows of a plane when they are evenly spaced
  bool uniform_rows;                // (HND, MLA: one multiply instead of the mixed-radix walk)
  FastDiv qvecs, lvecs;             // 16-byte vectors per row in the quantized run / lossless part

  KVOPS_HD int32_t lossless_bytes() const { return row_bytes - q_len * esize; }
  // Byte offset of a plane's global scale in the section (after the tag).
  KVOPS_HD static constexpr int64_t g_offset(int plane) { return 4 + 4 * int64_t(plane); }
  KVOPS_HD int64_t row_offset(int64_t page, int plane, uint32_t row) const {
    int64_t off = page * page_stride + plane * plane_stride;
    if (uniform_rows) return off + int64_t(row) * row_stride;
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (int k = kMaxOtherDims - 1; k >= 0; --k) {
      uint32_t q = dim_size[k].div(row);
      off += int64_t(row - q * dim_size[k].d) * dim_stride[k];
      row = q;
    }
    return off;
  }
  // Lossless byte j of a row (0 <= j < lossless_bytes) sits before or after the quantized run.
  KVOPS_HD int32_t lossless_col(int32_t j) const { return j < q_start * esize ? j : j + q_len * esize; }
};

// Checks the plan against the pools and the blob size; returns one descriptor per pool.
// `what` names the op in messages. Throws (TORCH_CHECK -> RuntimeError, value errors as ValueError).
std::vector<PoolDesc> make_pool_descs(const std::vector<at::Tensor>& pools, at::IntArrayRef plan,
                                      int64_t cold_page_bytes, const char* what);

// Checks the page_pairs tensor's shape/dtype; when its contents are readable on the host
// (or validate is set), checks every index against [0, dst_limit) x [0, src_limit), and that
// no destination repeats. Never reads device memory unless validate is true.
void check_page_pairs(const at::Tensor& page_pairs, int64_t dst_limit, int64_t src_limit,
                      const char* dst_name, const char* src_name, bool validate, const char* what);

// Every host-side check of an encode/decode call (blob, plan, pools, pairs, the decode's refusal counter);
// returns the descriptors. With validate, a decode also reads every pair's global scales (a sync) and raises
// on one that is not positive and finite. Device placement is checked by each backend before this.
std::vector<PoolDesc> check_codec_call(at::TensorList pools, const at::Tensor& cold_pages, const at::Tensor& page_pairs,
                                       at::IntArrayRef plan, bool validate, bool encode,
                                       const c10::optional<at::Tensor>& refused = c10::nullopt);

// What encode writes as a plane's global scale, and decode accepts.
KVOPS_HD bool valid_global_scale(float g) { return g > 0.f && g <= 3.402823466e+38f; }

// Whether a plane of a section decodes: the section carries this layout's tag and the plane a scale encode writes.
KVOPS_HD bool decodable(const PoolDesc& d, const uint8_t* section, float g) {
  uint32_t tag;
  memcpy(&tag, section, 4);
  return tag == d.tag && valid_global_scale(g);
}

// True for dtypes whose values can be quantized (the hot dtypes).
bool is_hot_dtype(at::ScalarType t);

}  // namespace nvfp4
}  // namespace kvops
