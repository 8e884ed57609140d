// Host-side checks and descriptors for the cold-page codec (CPU and CUDA share them).
#include "codec.h"
#include "nvfp4.h"

#include "../host_checks.h"

#include <cstring>
#include <unordered_set>

namespace kvops {
namespace nvfp4 {

void check_global_scale(const c10::optional<at::Tensor>& g, const at::Tensor& like, const char* what) {
  if (!g) return;
  TORCH_CHECK_VALUE(g->scalar_type() == at::kFloat && g->numel() == 1, what,
                    ": global_scale must be a one-element float32 tensor, got ", g->scalar_type(), " ", g->sizes());
  TORCH_CHECK_VALUE(g->is_cpu() || g->device() == like.device(), what, ": global_scale is on ", g->device(),
                    ", the data on ", like.device());
}

void check_quantize_args(const at::Tensor& x, const c10::optional<at::Tensor>& g) {
  const char* what = "nvfp4_quantize";
  TORCH_CHECK_VALUE(is_hot_dtype(x.scalar_type()) || x.scalar_type() == at::kFloat, what,
                    ": x dtype must be bfloat16, float16, float32 or float8_e4m3fn, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) % kBlock == 0, what, ": x last dim must be a multiple of 16, got shape ",
                    x.sizes());
  check_global_scale(g, x, what);
}

void check_dequantize_args(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& g,
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

std::tuple<at::Tensor, at::Tensor> quantize_outputs(const at::Tensor& x) {
  auto shape = x.sizes().vec();
  const int64_t n = shape.back();
  shape.back() = n / 2;
  at::Tensor packed = at::empty(shape, x.options().dtype(at::kByte));
  shape.back() = n / kBlock;
  at::Tensor scales = at::empty(shape, x.options().dtype(at::kFloat8_e4m3fn));
  return {packed, scales};
}

at::Tensor dequantize_output(const at::Tensor& packed, at::ScalarType dtype) {
  auto shape = packed.sizes().vec();
  shape.back() *= 2;
  return at::empty(shape, packed.options().dtype(dtype));
}

void check_cold_pages(const at::Tensor& cold_pages, const char* what) {
  TORCH_CHECK_VALUE(cold_pages.scalar_type() == at::kByte && cold_pages.dim() == 2, what,
                    ": cold_pages must be uint8 [num_slots, cold_page_bytes], got ", cold_pages.scalar_type(), " ",
                    cold_pages.sizes());
  TORCH_CHECK_VALUE(cold_pages.stride(1) == 1 && (cold_pages.stride(0) % 16 == 0 || cold_pages.size(0) <= 1) &&
                        reinterpret_cast<uintptr_t>(cold_pages.data_ptr()) % 16 == 0,
                    what, ": cold_pages rows must be contiguous and 16-byte aligned");
}

bool is_hot_dtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat8_e4m3fn;
}

std::vector<PoolDesc> make_pool_descs(const std::vector<at::Tensor>& pools, at::IntArrayRef plan,
                                      int64_t cold_page_bytes, const char* what) {
  TORCH_CHECK_VALUE(!pools.empty(), what, ": pools is empty");
  TORCH_CHECK_VALUE(int64_t(plan.size()) == int64_t(pools.size()) * kPlanFields, what, ": plan has ",
                    plan.size(), " entries, expected ", kPlanFields, " per pool for ", pools.size(), " pools");
  TORCH_CHECK_VALUE(cold_page_bytes % 16 == 0, what, ": cold_pages row size ", cold_page_bytes,
                    " is not a multiple of 16");
  std::vector<PoolDesc> descs;
  for (size_t p = 0; p < pools.size(); ++p) {
    const at::Tensor& t = pools[p];
    const int64_t* f = plan.data() + p * kPlanFields;
    TORCH_CHECK_VALUE(t.device() == pools[0].device(), what, ": pools[", p, "] is on ", t.device(),
                      ", pools[0] on ", pools[0].device());
    TORCH_CHECK_VALUE(t.dim() >= 2, what, ": pools[", p, "] must have a page dim and a row dim, got shape ",
                      t.sizes());
    const int nd = int(t.dim());
    for (int k = 1; k < nd; ++k)  // the row walk divides by these sizes
      TORCH_CHECK_VALUE(t.size(k) > 0, what, ": pools[", p, "] dim ", k, " is empty (shape ", t.sizes(),
                        "); every dim but the page dim needs at least one element");
    TORCH_CHECK_VALUE(t.stride(nd - 1) == 1, what, ": pools[", p, "] rows (last dim) must be contiguous");
    PoolDesc d{};
    d.esize = int32_t(t.element_size());
    d.base = static_cast<char*>(t.data_ptr());
    d.row_bytes = int32_t(t.size(nd - 1) * d.esize);
    TORCH_CHECK_VALUE(d.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(d.base) % 16 == 0, what,
                      ": pools[", p, "] rows must be 16-byte aligned and a multiple of 16 bytes");
    for (int k = 0; k < nd - 1; ++k)
      TORCH_CHECK_VALUE((t.stride(k) * d.esize) % 16 == 0 || t.size(k) == 1, what, ": pools[", p,
                        "] stride of dim ", k, " is not a multiple of 16 bytes");
    d.num_pages = int32_t(t.size(0));
    d.page_stride = t.stride(0) * d.esize;
    d.q_start = int32_t(f[kQStart]);
    d.q_len = int32_t(f[kQLen]);
    d.r_start = int32_t(f[kRStart]);
    d.r_len = int32_t(f[kRLen]);
    const int64_t row = t.size(nd - 1);
    TORCH_CHECK_VALUE(f[kQStart] >= 0 && f[kQLen] >= 0 && f[kQStart] % 16 == 0 && f[kQLen] % 16 == 0 &&
                          f[kQStart] + f[kQLen] <= row,
                      what, ": pools[", p, "] quantized range (", f[kQStart], ", ", f[kQLen],
                      ") must be multiples of 16 inside a row of ", row);
    TORCH_CHECK_VALUE(f[kRLen] == 0 || (f[kRStart] % 16 == 0 && f[kRLen] % 16 == 0 && f[kRStart] >= f[kQStart] &&
                                        f[kRStart] + f[kRLen] <= f[kQStart] + f[kQLen]),
                      what, ": pools[", p, "] residual range (", f[kRStart], ", ", f[kRLen],
                      ") must be multiples of 16 inside the quantized range");
    TORCH_CHECK_VALUE(f[kQLen] == 0 || is_hot_dtype(t.scalar_type()), what, ": pools[", p, "] dtype ",
                      t.scalar_type(), " cannot be quantized (bf16, fp16, float8_e4m3fn)");
    const int plane_dim = int(f[kPlaneDim]);
    TORCH_CHECK_VALUE(plane_dim == 0 || (plane_dim >= 1 && plane_dim <= nd - 2), what, ": pools[", p,
                      "] plane_dim ", plane_dim, " is not a middle dim of shape ", t.sizes());
    d.planes = plane_dim ? int32_t(t.size(plane_dim)) : 1;
    d.plane_stride = plane_dim ? t.stride(plane_dim) * d.esize : 0;
    int other = 0;
    int64_t rows = 1;
    for (int k = 1; k < nd - 1; ++k) {
      if (k == plane_dim) continue;
      TORCH_CHECK_VALUE(other < kMaxOtherDims, what, ": pools[", p, "] has more than ", kMaxOtherDims,
                        " dims between page and row besides the plane dim");
      d.dim_size[other] = FastDiv(uint32_t(t.size(k)));
      d.dim_stride[other] = t.stride(k) * d.esize;
      rows *= t.size(k);
      ++other;
    }
    for (; other < kMaxOtherDims; ++other) {
      // Pad at the outer end: dims are consumed innermost first.
      for (int k = kMaxOtherDims - 1; k > 0; --k) {
        d.dim_size[k] = d.dim_size[k - 1];
        d.dim_stride[k] = d.dim_stride[k - 1];
      }
      d.dim_size[0] = FastDiv(1);
      d.dim_stride[0] = 0;
    }
    TORCH_CHECK_VALUE(rows < (int64_t(1) << 30), what, ": pools[", p, "] has too many rows per page");
    // Evenly spaced rows: each non-trivial dim's stride is the next inner one's stride times its size.
    d.uniform_rows = true;
    d.row_stride = d.row_bytes;
    int64_t expect = -1;
    for (int k = kMaxOtherDims - 1; k >= 0; --k) {
      if (d.dim_size[k].d == 1) continue;
      if (expect < 0) d.row_stride = d.dim_stride[k];
      else if (d.dim_stride[k] != expect) d.uniform_rows = false;
      expect = d.dim_stride[k] * d.dim_size[k].d;
    }
    d.plane_rows = int32_t(rows);
    d.scale_kind = int32_t(f[kScaleKind]);
    TORCH_CHECK_VALUE(d.scale_kind >= kScaleFixed && d.scale_kind <= kScalePerPagePow2, what, ": pools[", p,
                      "] unknown scale kind ", d.scale_kind);
    d.fixed_scale = bits_f32(uint32_t(f[kFixedScaleBits]));
    TORCH_CHECK_VALUE(d.scale_kind != kScaleFixed || (d.fixed_scale > 0.f && d.fixed_scale <= FLT_MAX), what,
                      ": pools[", p, "] fixed global scale must be positive and finite");
    d.section_offset = f[kSectionOffset];
    d.plane_offset = f[kPlaneOffset];
    d.plane_bytes = f[kPlaneBytes];
    d.off_codes = int32_t(f[kOffCodes]);
    d.off_rcodes = int32_t(f[kOffRCodes]);
    d.off_scales = int32_t(f[kOffScales]);
    d.off_rscales = int32_t(f[kOffRScales]);
    d.off_lossless = int32_t(f[kOffLossless]);
    d.tag = uint32_t(f[kLayoutTag]);
    TORCH_CHECK_VALUE(d.tag != 0, what, ": pools[", p, "] plan has no layout tag");
    // Regions come in a fixed order; each must fit before the next, the last inside the plane.
    const int64_t ends[5][2] = {
        {d.off_codes, rows * d.q_len / 2},      {d.off_rcodes, rows * d.r_len / 2},
        {d.off_scales, rows * d.q_len / 16},    {d.off_rscales, rows * d.r_len / 16},
        {d.off_lossless, rows * d.lossless_bytes()}};
    int64_t prev = 0;
    for (auto& r : ends) {
      TORCH_CHECK_VALUE(r[0] >= prev && r[0] % 16 == 0, what, ": pools[", p, "] plan regions overlap or are unaligned");
      prev = r[0] + r[1];
    }
    TORCH_CHECK_VALUE(prev <= d.plane_bytes && d.plane_bytes % 16 == 0 && d.plane_offset >= PoolDesc::g_offset(d.planes) &&
                          d.plane_offset % 16 == 0 && d.section_offset % 16 == 0 && d.section_offset >= 0 &&
                          d.section_offset + d.plane_offset + d.planes * d.plane_bytes <= cold_page_bytes,
                      what, ": pools[", p, "] plan does not fit a cold page of ", cold_page_bytes, " bytes");
    d.qvecs = FastDiv(uint32_t(std::max<int64_t>(1, d.q_len * d.esize / 16)));
    d.lvecs = FastDiv(uint32_t(std::max<int64_t>(1, d.lossless_bytes() / 16)));
    descs.push_back(d);
  }
  return descs;
}

void check_page_pairs(const at::Tensor& page_pairs, int64_t dst_limit, int64_t src_limit, const char* dst_name,
                      const char* src_name, bool validate, const char* what) {
  TORCH_CHECK_VALUE(page_pairs.scalar_type() == at::kInt && page_pairs.dim() == 2 && page_pairs.size(1) == 2, what,
                    ": page_pairs must be int32 [n, 2], got ", page_pairs.scalar_type(), " ", page_pairs.sizes());
  TORCH_CHECK_VALUE(page_pairs.is_contiguous(), what, ": page_pairs must be contiguous");
  if (page_pairs.size(0) == 0 || !(page_pairs.is_cpu() || validate)) return;
  at::Tensor host = page_pairs.is_cpu() ? page_pairs : page_pairs.cpu();  // validate: syncs by design
  const int32_t* pp = host.data_ptr<int32_t>();
  std::unordered_set<int32_t> seen;
  for (int64_t i = 0; i < host.size(0); ++i) {
    int32_t dst = pp[2 * i], src = pp[2 * i + 1];
    TORCH_CHECK_VALUE(dst >= 0 && dst < dst_limit, what, ": page_pairs[", i, "] ", dst_name, " ", dst,
                      " is out of range [0, ", dst_limit, ")");
    TORCH_CHECK_VALUE(src >= 0 && src < src_limit, what, ": page_pairs[", i, "] ", src_name, " ", src,
                      " is out of range [0, ", src_limit, ")");
    TORCH_CHECK_VALUE(seen.insert(dst).second, what, ": page_pairs[", i, "] ", dst_name, " ", dst,
                      " is written twice");
  }
}

namespace {
// Decode with validate: every pair's blob must carry each section's layout tag and positive, finite global scales
// (encode writes nothing else).
void check_global_scales(const std::vector<PoolDesc>& descs, const at::Tensor& cold_pages, const at::Tensor& page_pairs,
                         const char* what) {
  if (page_pairs.size(0) == 0) return;
  const at::Tensor host_pairs = page_pairs.cpu();  // validate: syncs by design
  const int32_t* pairs = host_pairs.data_ptr<int32_t>();
  // Only each section's g table (its tag, then the 4-byte global scales) of each listed slot reaches the host,
  // never whole blobs: one gather of slot * row stride + offset over the rows' bytes (contiguous rows,
  // check_cold_pages).
  std::vector<int64_t> offsets;
  for (const PoolDesc& d : descs)
    for (int word = 0; word <= d.planes; ++word)
      for (int b = 0; b < 4; ++b) offsets.push_back(d.section_offset + 4 * word + b);
  const int64_t n = page_pairs.size(0), per_slot = int64_t(offsets.size());
  std::vector<int64_t> index(n * per_slot);
  const int64_t row = cold_pages.stride(0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < per_slot; ++j) index[i * per_slot + j] = pairs[2 * i + 1] * row + offsets[j];
  const at::Tensor flat = cold_pages.as_strided({(cold_pages.size(0) - 1) * row + cold_pages.size(1)}, {1});
  const at::Tensor bytes =
      flat.index_select(0, at::tensor(index, at::kLong).to(cold_pages.device())).cpu().contiguous();
  const uint8_t* b = bytes.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    int64_t j = 0;
    for (size_t p = 0; p < descs.size(); ++p) {
      uint32_t tag;
      std::memcpy(&tag, b + i * per_slot + j, 4);
      j += 4;
      TORCH_CHECK_VALUE(tag == descs[p].tag, what, ": page_pairs[", i, "] slot ", pairs[2 * i + 1], "'s section of pools[",
                        p, "] carries layout tag ", tag, ", this codec's is ", descs[p].tag, ": the slot was written "
                        "under another layout (other row specs, shapes or dtypes), never encoded, or is corrupt");
      for (int plane = 0; plane < descs[p].planes; ++plane, j += 4) {
        float g;
        std::memcpy(&g, b + i * per_slot + j, 4);
        TORCH_CHECK_VALUE(valid_global_scale(g), what, ": page_pairs[", i, "] slot ", pairs[2 * i + 1],
                          " holds global scale ", g, " for pools[", p, "] plane ", plane,
                          "; encode writes only positive finite scales, so the slot was never encoded or is corrupt");
      }
    }
  }
}
}  // namespace

std::vector<PoolDesc> check_codec_call(at::TensorList pools, const at::Tensor& cold_pages, const at::Tensor& page_pairs,
                                       at::IntArrayRef plan, bool validate, bool encode,
                                       const c10::optional<at::Tensor>& refused) {
  const char* what = encode ? "nvfp4_encode_pages_" : "nvfp4_decode_pages_";
  check_cold_pages(cold_pages, what);
  std::vector<at::Tensor> pv(pools.begin(), pools.end());
  auto descs = make_pool_descs(pv, plan, cold_pages.size(1), what);
  // What the kernel writes must not hold one element twice (an expand()); torch refuses such in-place writes too.
  if (encode) {
    check_own_memory(cold_pages, what, "cold_pages");
  } else {
    for (size_t p = 0; p < pv.size(); ++p) check_own_memory(pv[p], what, "pools[" + std::to_string(p) + "]");
  }
  int64_t pages = descs[0].num_pages;  // a page index must exist in every pool
  for (auto& d : descs) pages = std::min<int64_t>(pages, d.num_pages);
  if (refused)
    TORCH_CHECK_VALUE(refused->scalar_type() == at::kInt && refused->numel() == 1 && refused->is_contiguous() &&
                          refused->device() == pools[0].device(),
                      what, ": refused must be a one-element int32 tensor on ", pools[0].device(), ", got ",
                      refused->scalar_type(), " ", refused->sizes(), " on ", refused->device());
  if (encode) check_page_pairs(page_pairs, cold_pages.size(0), pages, "slot", "page", validate, what);
  else check_page_pairs(page_pairs, pages, cold_pages.size(0), "page", "slot", validate, what);
  if (!encode && validate) check_global_scales(descs, cold_pages, page_pairs, what);
  return descs;
}

}  // namespace nvfp4
}  // namespace kvops
