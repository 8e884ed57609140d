// CPU kernels for the NVFP4 ops: the scalar definition, applied block by block.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <atomic>

#include "codec.h"
#include "nvfp4.h"

namespace kvops {
namespace nvfp4 {
namespace {

float load(const char* p, at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return float(*reinterpret_cast<const c10::BFloat16*>(p));
    case at::kHalf: return float(*reinterpret_cast<const c10::Half*>(p));
    case at::kFloat8_e4m3fn: return float(*reinterpret_cast<const c10::Float8_e4m3fn*>(p));
    default: return *reinterpret_cast<const float*>(p);
  }
}

void store(char* p, at::ScalarType t, float v) {
  switch (t) {
    case at::kBFloat16: *reinterpret_cast<c10::BFloat16*>(p) = c10::BFloat16(v); break;
    case at::kHalf: *reinterpret_cast<c10::Half*>(p) = c10::Half(v); break;
    case at::kFloat8_e4m3fn: *reinterpret_cast<uint8_t*>(p) = e4m3_satfinite(v); break;
    default: *reinterpret_cast<float*>(p) = v;
  }
}

void store_nan(char* p, at::ScalarType t) {  // the canonical NaN of each dtype (CPU == CUDA bytes)
  switch (t) {
    case at::kBFloat16: *reinterpret_cast<uint16_t*>(p) = 0x7fc0; break;
    case at::kHalf: *reinterpret_cast<uint16_t*>(p) = 0x7e00; break;
    case at::kFloat8_e4m3fn: *reinterpret_cast<uint8_t*>(p) = 0x7f; break;
    default: *reinterpret_cast<uint32_t*>(p) = 0x7fc00000u;
  }
}

// Quantizes one block of 16 floats: 8 code bytes, 1 scale byte. Returns the fp32 decoded values
// in `dec` when asked (the residual component needs them).
void quantize_block(const float* x, float g, uint8_t* codes, uint8_t* scale, float* dec = nullptr) {
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = nan_max(amax, std::fabs(x[i]));
  uint8_t sc = block_scale(amax, g);
  float s = e4m3_value(sc);
  for (int i = 0; i < kBlock; i += 2) {
    uint8_t lo = element_code(x[i], g, sc, s), hi = element_code(x[i + 1], g, sc, s);
    codes[i / 2] = uint8_t(lo | (hi << 4));
    if (dec) {
      dec[i] = decode_value(lo, s, g);
      dec[i + 1] = decode_value(hi, s, g);
    }
  }
  *scale = sc;
}

// Decodes one block of 16 codes into floats (NaN-flagged blocks give NaN; callers store canonical NaN).
bool dequantize_block(const uint8_t* codes, uint8_t scale, float g, float* out) {
  if (scale == kScaleNaN) return false;
  float s = e4m3_value(scale);
  for (int i = 0; i < kBlock; ++i) out[i] = decode_value((codes[i / 2] >> (4 * (i & 1))) & 0xf, s, g);
  return true;
}

float global_scale_value(const c10::optional<at::Tensor>& global_scale) {
  return global_scale ? global_scale->item<float>() : 1.f;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& global_scale) {
  check_quantize_args(x, global_scale);
  const float g = global_scale_value(global_scale);
  TORCH_CHECK_VALUE(g > 0.f && g <= FLT_MAX, "nvfp4_quantize: global_scale must be positive and finite, got ", g);
  at::Tensor xc = x.contiguous();
  auto [packed, scales] = quantize_outputs(x);
  const int64_t blocks = xc.numel() / kBlock;
  const auto t = xc.scalar_type();
  const char* src = static_cast<const char*>(xc.data_ptr());
  uint8_t* pk = packed.data_ptr<uint8_t>();
  uint8_t* sc = reinterpret_cast<uint8_t*>(scales.data_ptr());
  const int64_t es = xc.element_size();
  at::parallel_for(0, blocks, 1024, [&](int64_t b0, int64_t b1) {
    float buf[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      for (int i = 0; i < kBlock; ++i) buf[i] = load(src + (b * kBlock + i) * es, t);
      quantize_block(buf, g, pk + b * kBlock / 2, sc + b);
    }
  });
  return {packed, scales};
}

at::Tensor dequantize_cpu(const at::Tensor& packed, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& global_scale, at::ScalarType dtype) {
  check_dequantize_args(packed, scales, global_scale, dtype);
  const float g = global_scale_value(global_scale);
  TORCH_CHECK_VALUE(g > 0.f && g <= FLT_MAX, "nvfp4_dequantize: global_scale must be positive and finite, got ", g);
  at::Tensor pc = packed.contiguous(), sc = scales.contiguous();
  at::Tensor out = dequantize_output(packed, dtype);
  const int64_t blocks = sc.numel(), es = out.element_size();
  const uint8_t* pk = pc.data_ptr<uint8_t>();
  const uint8_t* sp = reinterpret_cast<const uint8_t*>(sc.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, blocks, 1024, [&](int64_t b0, int64_t b1) {
    float buf[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      bool ok = dequantize_block(pk + b * kBlock / 2, sp[b], g, buf);
      for (int i = 0; i < kBlock; ++i) {
        char* p = dst + (b * kBlock + i) * es;
        ok ? store(p, dtype, buf[i]) : store_nan(p, dtype);
      }
    }
  });
  return out;
}

namespace {

// Per-page global scale of one (page, pool, plane): max |x| over the quantized run of each row.
float plane_scale(const PoolDesc& d, at::ScalarType t, int64_t page, int plane) {
  if (d.scale_kind == kScaleFixed) return d.fixed_scale;
  float amax = 0.f;
  for (int32_t r = 0; r < d.plane_rows; ++r) {
    const char* row = d.base + d.row_offset(page, plane, r);
    for (int32_t i = 0; i < d.q_len; ++i) amax = nan_max(amax, std::fabs(load(row + (d.q_start + i) * d.esize, t)));
  }
  return page_global_scale(amax, d.scale_kind);
}

void encode_page(const PoolDesc& d, at::ScalarType t, int64_t page, uint8_t* blob) {
  uint8_t* section = blob + d.section_offset;
  std::memset(section, 0, d.plane_offset);  // the g table and its padding
  std::memcpy(section, &d.tag, 4);
  for (int plane = 0; plane < d.planes; ++plane) {
    const float g = plane_scale(d, t, page, plane);
    std::memcpy(section + PoolDesc::g_offset(plane), &g, 4);
    uint8_t* pb = section + d.plane_offset + plane * d.plane_bytes;
    std::memset(pb, 0, d.plane_bytes);  // padding is zero so blobs are deterministic
    const int32_t qb = d.q_len / kBlock, rb = d.r_len / kBlock, lb = d.lossless_bytes();
    float x[kBlock], dec[kBlock], res[kBlock];
    for (int32_t r = 0; r < d.plane_rows; ++r) {
      const char* row = d.base + d.row_offset(page, plane, r);
      for (int32_t b = 0; b < qb; ++b) {
        const int32_t e0 = d.q_start + b * kBlock;
        for (int i = 0; i < kBlock; ++i) x[i] = load(row + (e0 + i) * d.esize, t);
        quantize_block(x, g, pb + d.off_codes + (int64_t(r) * qb + b) * 8, pb + d.off_scales + int64_t(r) * qb + b, dec);
        const int32_t rb_i = (e0 - d.r_start) / kBlock;
        if (d.r_len && e0 >= d.r_start && rb_i < rb) {  // 2FP4: quantize the first component's error
          for (int i = 0; i < kBlock; ++i) res[i] = x[i] - dec[i];
          quantize_block(res, g, pb + d.off_rcodes + (int64_t(r) * rb + rb_i) * 8, pb + d.off_rscales + int64_t(r) * rb + rb_i);
        }
      }
      for (int32_t j = 0; j < lb; ++j) pb[d.off_lossless + int64_t(r) * lb + j] = uint8_t(row[d.lossless_col(j)]);
    }
  }
}

// Returns the planes left untouched because their section's tag or their global scale is not one encode writes.
int decode_page(const PoolDesc& d, at::ScalarType t, const uint8_t* blob, int64_t page) {
  const uint8_t* section = blob + d.section_offset;
  int refused = 0;
  for (int plane = 0; plane < d.planes; ++plane) {
    float g;
    std::memcpy(&g, section + PoolDesc::g_offset(plane), 4);
    if (!decodable(d, section, g)) {
      ++refused;
      continue;
    }
    const uint8_t* pb = section + d.plane_offset + plane * d.plane_bytes;
    const int32_t qb = d.q_len / kBlock, rb = d.r_len / kBlock, lb = d.lossless_bytes();
    float x[kBlock], res[kBlock];
    for (int32_t r = 0; r < d.plane_rows; ++r) {
      char* row = d.base + d.row_offset(page, plane, r);
      for (int32_t b = 0; b < qb; ++b) {
        const int32_t e0 = d.q_start + b * kBlock;
        bool ok = dequantize_block(pb + d.off_codes + (int64_t(r) * qb + b) * 8, pb[d.off_scales + int64_t(r) * qb + b], g, x);
        const int32_t rb_i = (e0 - d.r_start) / kBlock;
        if (ok && d.r_len && e0 >= d.r_start && rb_i < rb) {
          ok = dequantize_block(pb + d.off_rcodes + (int64_t(r) * rb + rb_i) * 8, pb[d.off_rscales + int64_t(r) * rb + rb_i], g, res);
          for (int i = 0; i < kBlock; ++i) x[i] += res[i];
        }
        for (int i = 0; i < kBlock; ++i) {
          char* p = row + (e0 + i) * d.esize;
          ok ? store(p, t, x[i]) : store_nan(p, t);
        }
      }
      for (int32_t j = 0; j < lb; ++j) row[d.lossless_col(j)] = char(pb[d.off_lossless + int64_t(r) * lb + j]);
    }
  }
  return refused;
}

}  // namespace

// Both directions: pools and pairs must be on the CPU; one pair per task.
void run_codec_cpu(at::TensorList pools, const at::Tensor& cold_pages, const at::Tensor& page_pairs, at::IntArrayRef plan,
                   bool validate, bool encode, const c10::optional<at::Tensor>& refused = c10::nullopt) {
  const char* what = encode ? "nvfp4_encode_pages_" : "nvfp4_decode_pages_";
  TORCH_CHECK_VALUE(page_pairs.is_cpu(), what, ": page_pairs must be on the CPU for CPU pools");
  for (size_t p = 0; p < pools.size(); ++p) TORCH_CHECK_VALUE(pools[p].is_cpu(), what, ": pools[", p, "] is not on the CPU");
  const auto descs = check_codec_call(pools, cold_pages, page_pairs, plan, validate, encode, refused);
  const int32_t* pp = page_pairs.data_ptr<int32_t>();
  uint8_t* blobs = cold_pages.data_ptr<uint8_t>();
  const int64_t stride = cold_pages.stride(0);
  std::atomic<int32_t> refusals{0};
  at::parallel_for(0, page_pairs.size(0), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (size_t p = 0; p < descs.size(); ++p) {
        if (encode) encode_page(descs[p], pools[p].scalar_type(), pp[2 * i + 1], blobs + pp[2 * i] * stride);
        else refusals += decode_page(descs[p], pools[p].scalar_type(), blobs + pp[2 * i + 1] * stride, pp[2 * i]);
      }
  });
  if (refused) *refused->data_ptr<int32_t>() += refusals.load();
}

void encode_pages_cpu(at::TensorList pools, const at::Tensor& cold_pages, const at::Tensor& page_pairs,
                      at::IntArrayRef plan, bool validate, const c10::optional<at::Tensor>& staging) {
  TORCH_CHECK_VALUE(!staging, "nvfp4_encode_pages_: staging serves pools on the GPU only");
  run_codec_cpu(pools, cold_pages, page_pairs, plan, validate, true);
}

void decode_pages_cpu(const at::Tensor& cold_pages, at::TensorList pools, const at::Tensor& page_pairs,
                      at::IntArrayRef plan, bool validate, const c10::optional<at::Tensor>& refused,
                      const c10::optional<at::Tensor>& staging) {
  TORCH_CHECK_VALUE(!staging, "nvfp4_decode_pages_: staging serves pools on the GPU only");
  run_codec_cpu(pools, cold_pages, page_pairs, plan, validate, false, refused);
}

TORCH_LIBRARY_IMPL(kvops, CPU, m) {
  m.impl("nvfp4_quantize", &quantize_cpu);
  m.impl("nvfp4_dequantize", &dequantize_cpu);
  m.impl("nvfp4_encode_pages_", &encode_pages_cpu);
  m.impl("nvfp4_decode_pages_", &decode_pages_cpu);
}

}  // namespace nvfp4
}  // namespace kvops
