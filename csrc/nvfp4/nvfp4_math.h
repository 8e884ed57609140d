// Scalar NVFP4 semantics shared by the CPU kernels and the CUDA kernels.
//
// These functions ARE the definition of the format (docs/nvfp4.md). The CUDA fast paths
// (nvfp4_device.cuh) are bit-identical re-derivations of them and are tested against them.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../common.h"

namespace kvops {
namespace nvfp4 {

constexpr int kBlock = 16;             // elements per block scale
constexpr float kE2M1Max = 6.f;
constexpr float kE4M3Max = 448.f;
constexpr float kPageScaleTarget = kE4M3Max * kE2M1Max;  // per-page g = 2688 / amax
constexpr uint8_t kScaleNaN = 0x7F;    // E4M3 NaN: marks a block that held a NaN

// Scale policies stored in the codec plan.
enum ScaleKind : int { kScaleFixed = 0, kScalePerPage = 1, kScalePerPagePow2 = 2 };

KVOPS_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

KVOPS_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

KVOPS_HD bool is_nan(float f) { return (f32_bits(f) & 0x7fffffffu) > 0x7f800000u; }

// NaN-propagating max (fmaxf drops NaN; a NaN must poison the block or page).
KVOPS_HD float nan_max(float a, float b) { return (a > b || is_nan(a)) ? a : b; }

// E4M3 (fn) from a non-negative float (or +Inf): round to nearest even, saturate to 448.
KVOPS_HD uint8_t e4m3_from_nonneg(float v) {
  if (!(v < kE4M3Max)) return 0x7e;  // >= 448 or +Inf (NaN is handled by callers)
  uint32_t u = f32_bits(v);
  int e = int(u >> 23) - 127;
  if (e < -6) {  // subnormal E4M3: multiples of 2^-9; 8 * 2^-9 rounds up into the first normal
    float q = v * 512.f;  // exact
    uint32_t qi = uint32_t(q);
    float rem = q - float(qi);
    if (rem > 0.5f || (rem == 0.5f && (qi & 1u))) ++qi;
    return uint8_t(qi);  // qi == 8 encodes 2^-6 (exponent 1, mantissa 0)
  }
  uint32_t m = u & 0x7fffffu;
  uint32_t q = m >> 20, rem = m & 0xfffffu;
  if (rem > 0x80000u || (rem == 0x80000u && (q & 1u))) ++q;
  uint32_t code = (uint32_t(e + 7) << 3) + q;  // q == 8 carries into the exponent
  return uint8_t(code > 0x7eu ? 0x7eu : code);
}

// E4M3 (fn) from any float, RNE, saturating finite (NaN -> 0x7f). Used for fp8 outputs.
KVOPS_HD uint8_t e4m3_satfinite(float v) {
  if (is_nan(v)) return 0x7f;
  uint8_t sign = (f32_bits(v) >> 24) & 0x80;
  return sign | e4m3_from_nonneg(std::fabs(v));
}

KVOPS_HD float e4m3_value(uint8_t c) {
  uint32_t sign = uint32_t(c & 0x80) << 24;
  uint32_t e = (c >> 3) & 0xf, m = c & 7;
  if ((c & 0x7f) == 0x7f) return bits_f32(0x7fc00000u | sign);
  if (e == 0) return bits_f32(f32_bits(float(m) * (1.f / 512.f)) | sign);
  return bits_f32(sign | ((e + 120) << 23) | (m << 20));
}

// E2M1 magnitudes, indexed by the low 3 bits of a code.
KVOPS_HD float e2m1_value(uint32_t mag) {
  // {0, .5, 1, 1.5, 2, 3, 4, 6}: exponent bits e = mag>>1, mantissa bit m = mag&1.
  uint32_t e = mag >> 1, m = mag & 1;
  if (e == 0) return m ? 0.5f : 0.f;
  return bits_f32(((e + 126u) << 23) | (m << 22));
}

// Magnitude code of |q| rounded to E2M1: nearest, ties to the even code, saturating at 6.
// The tie rule is > for thresholds below an even code and >= above an odd one.
KVOPS_HD uint32_t e2m1_magnitude(float a) {
  return uint32_t(a > 0.25f) + uint32_t(a >= 0.75f) + uint32_t(a > 1.25f) + uint32_t(a >= 1.75f) +
         uint32_t(a > 2.5f) + uint32_t(a >= 3.5f) + uint32_t(a > 5.f);
}

// Block scale byte from the block's amax (NaN-propagated) and the global scale g.
KVOPS_HD uint8_t block_scale(float amax, float g) {
  if (is_nan(amax)) return kScaleNaN;
  float ymax = amax * g;
  return e4m3_from_nonneg(ymax / 6.f);
}

// One element's 4-bit code given its block scale byte and value s = e4m3_value(scale).
KVOPS_HD uint8_t element_code(float x, float g, uint8_t scale, float s) {
  if (scale == kScaleNaN || s == 0.f) return 0;
  float y = x * g;
  uint32_t sign = (f32_bits(y) >> 28) & 8u;
  return uint8_t(sign | e2m1_magnitude(std::fabs(y) / s));
}

// fp32 value of one code: e2m1(c) * s / g.
KVOPS_HD float decode_value(uint32_t code, float s, float g) {
  float v = e2m1_value(code & 7u) * s;  // exact: 2 x 4 significant bits
  v = v / g;
  return (code & 8u) ? -v : v;
}

// Per-page global scale from the page's amax over one pool plane.
// Zero, NaN or Inf amax gives g = 1; g is clamped to [2^-64, 2^64] so that s / g stays normal.
KVOPS_HD float page_global_scale(float amax, int kind) {
  if (!(amax > 0.f) || !(amax <= FLT_MAX)) return 1.f;
  float g = kPageScaleTarget / amax;
  if (!(g <= 0x1p64f)) g = 0x1p64f;
  if (g < 0x1p-64f) g = 0x1p-64f;
  if (kind == kScalePerPagePow2) g = bits_f32(f32_bits(g) & 0xff800000u);  // round down to 2^k
  return g;
}

// g is a power of two whose scaling is exact for every hot dtype's fast path.
KVOPS_HD bool is_fast_scale(float g) {
  uint32_t u = f32_bits(g);
  int e = int(u >> 23) - 127;
  return (u & 0x807fffffu) == 0 && e >= -64 && e <= 64;
}

}  // namespace nvfp4
}  // namespace kvops
