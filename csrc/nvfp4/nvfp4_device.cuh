// Device-side NVFP4 block quantize / vector dequantize.
//
// Encode works on one whole 16-element block per thread (2 vectors of 16 bytes for 16-bit dtypes, 1 for fp8,
// 4 for fp32): the block amax, the E4M3 scale and the thresholds are then computed once per block, with no
// shuffles, which matters because the encode is instruction-bound on sm_90.
//
// Two encode paths, bit-identical by construction (and by test):
//  * general: the scalar definition in nvfp4_math.h (fp32 multiply, fp32 divide, thresholds);
//  * fast, for 16-bit and fp8 inputs when g is a power of two in range: |x|*g is exact in the
//    packed type and the thresholds t*s are exact there too, so three packed comparisons of
//    |x|*g against t*s (a binary search whose tie rules line up with round-to-nearest-even)
//    give the same code as rounding the quotient.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "nvfp4_math.h"

namespace kvops {
namespace nvfp4 {

constexpr unsigned kFullMask = 0xffffffffu;

// ---- hot dtype traits -------------------------------------------------------------------------
template <class T>
struct Hot;
template <>
struct Hot<__nv_bfloat16> {
  static constexpr int kEpt = 8;
  static constexpr uint32_t kNaN = 0x7fc0u;
};
template <>
struct Hot<__half> {
  static constexpr int kEpt = 8;
  static constexpr uint32_t kNaN = 0x7e00u;
};
template <>
struct Hot<__nv_fp8_e4m3> {
  static constexpr int kEpt = 16;
  static constexpr uint32_t kNaN = 0x7fu;
};
template <>
struct Hot<float> {
  static constexpr int kEpt = 4;
  static constexpr uint32_t kNaN = 0x7fc00000u;
};

template <class T>
constexpr int vecs_per_block() {  // 16-byte vectors in one 16-element block
  return kBlock / Hot<T>::kEpt;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Exact conversion of a vector to floats.
template <class T>
__device__ __forceinline__ void to_float(const uint4& v, float (&x)[Hot<T>::kEpt]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t w = word(v, i);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      x[2 * i] = __uint_as_float(w << 16);
      x[2 * i + 1] = __uint_as_float(w & 0xffff0000u);
    } else if constexpr (std::is_same_v<T, __half>) {
      float2 f = __half22float2(*reinterpret_cast<__half2*>(&w));
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    } else if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w >> (16 * j)), __NV_E4M3);
        float2 f = __half22float2(*reinterpret_cast<__half2*>(&h));
        x[4 * i + 2 * j] = f.x;
        x[4 * i + 2 * j + 1] = f.y;
      }
    } else {
      x[i] = __uint_as_float(w);
    }
  }
}

// Exact conversion of one block (its vectors) to 16 floats.
template <class T>
__device__ __forceinline__ void block_to_float(const uint4 (&v)[kBlock / Hot<T>::kEpt], float (&x)[kBlock]) {
  constexpr int kEpt = Hot<T>::kEpt;
#pragma unroll
  for (int j = 0; j < kBlock / kEpt; ++j) {
    float xv[kEpt];
    to_float<T>(v[j], xv);
#pragma unroll
    for (int i = 0; i < kEpt; ++i) x[j * kEpt + i] = xv[i];
  }
}

// Round floats to a vector of T (RNE; fp8 saturates to finite).
template <class T>
__device__ __forceinline__ uint4 from_float(const float (&x)[Hot<T>::kEpt]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      __nv_bfloat162 b = __floats2bfloat162_rn(x[2 * i], x[2 * i + 1]);
      w[i] = *reinterpret_cast<uint32_t*>(&b);
    } else if constexpr (std::is_same_v<T, __half>) {
      __half2 h = __floats2half2_rn(x[2 * i], x[2 * i + 1]);
      w[i] = *reinterpret_cast<uint32_t*>(&h);
    } else if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) {
      uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x[4 * i], x[4 * i + 1]), __NV_SATFINITE, __NV_E4M3);
      uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x[4 * i + 2], x[4 * i + 3]), __NV_SATFINITE, __NV_E4M3);
      w[i] = lo | (hi << 16);
    } else {
      w[i] = __float_as_uint(x[i]);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <class T>
__device__ __forceinline__ uint4 nan_vector() {
  constexpr uint32_t n = Hot<T>::kNaN;
  constexpr uint32_t w = sizeof(T) == 1 ? n * 0x01010101u : sizeof(T) == 2 ? n * 0x00010001u : n;
  return make_uint4(w, w, w, w);
}

// E4M3 byte -> float by the hardware convert (exact; same value as e4m3_value).
__device__ __forceinline__ float e4m3_value_dev(uint8_t scale) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(scale), __NV_E4M3)));
}

__device__ __forceinline__ uint8_t block_scale_dev(float amax, float g) {
  if (is_nan(amax)) return kScaleNaN;
  float q = __fdiv_rn(__fmul_rn(amax, g), 6.f);
  return __nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);  // RNE, +Inf -> 448
}

// ---- general path: the scalar definition ------------------------------------------------------
#if defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM103_ALL) || \
    (defined(__CUDA_ARCH_FAMILY_SPECIFIC__) && __CUDA_ARCH_FAMILY_SPECIFIC__ >= 1000)
#define KVOPS_HW_E2M1 1  // Blackwell: the hardware E2M1 convert
#endif

// x's codes given its NaN-propagated amax.
template <int kEpt>
__device__ __forceinline__ uint64_t quantize_floats(const float (&x)[kEpt], float amax, float g, uint8_t& scale) {
  scale = block_scale_dev(amax, g);
  float s = e4m3_value_dev(scale);
  uint64_t codes = 0;
#if defined(KVOPS_HW_E2M1)
  if (scale == kScaleNaN || s == 0.f) return 0;
#pragma unroll
  for (int i = 0; i < kEpt; i += 2) {
    // Correctly rounded quotient, then RNE-satfinite in hardware: the same codes as the thresholds.
    float lo = __fdiv_rn(__fmul_rn(x[i], g), s), hi = __fdiv_rn(__fmul_rn(x[i + 1], g), s);
    uint32_t b;
    asm("{\n .reg .b8 t;\n cvt.rn.satfinite.e2m1x2.f32 t, %1, %2;\n cvt.u32.u8 %0, t;\n}" : "=r"(b) : "f"(hi), "f"(lo));
    codes |= uint64_t(b & 0xffu) << (4 * i);
  }
#else
#pragma unroll
  for (int i = 0; i < kEpt; ++i) codes |= uint64_t(element_code(x[i], g, scale, s)) << (4 * i);
#endif
  return codes;
}

template <int kEpt>
__device__ __forceinline__ uint64_t quantize_floats(const float (&x)[kEpt], float g, uint8_t& scale) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kEpt; ++i) amax = nan_max(amax, fabsf(x[i]));
  return quantize_floats<kEpt>(x, amax, g, scale);
}

// ---- fast path: packed 16-bit comparisons -----------------------------------------------------
template <class H>
struct Packed;
template <>
struct Packed<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ __forceinline__ T2 as(uint32_t u) { return *reinterpret_cast<T2*>(&u); }
  static __device__ __forceinline__ uint32_t bits(T2 v) { return *reinterpret_cast<uint32_t*>(&v); }
  static __device__ __forceinline__ uint32_t splat(float f) { return bits(__float2bfloat162_rn(f)); }
  static __device__ __forceinline__ float lo(uint32_t u) { return __uint_as_float(u << 16); }
  static __device__ __forceinline__ float hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
  static __device__ __forceinline__ bool scale_ok(float g) { return is_fast_scale(g); }
  // {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5} in both halves
  static constexpr uint32_t kT[7] = {0x3e803e80u, 0x3f403f40u, 0x3fa03fa0u, 0x3fe03fe0u,
                                     0x40204020u, 0x40604060u, 0x40a040a0u};
};
template <>
struct Packed<__half> {
  using T2 = __half2;
  static __device__ __forceinline__ T2 as(uint32_t u) { return *reinterpret_cast<T2*>(&u); }
  static __device__ __forceinline__ uint32_t bits(T2 v) { return *reinterpret_cast<uint32_t*>(&v); }
  static __device__ __forceinline__ uint32_t splat(float f) { return bits(__float2half2_rn(f)); }
  static __device__ __forceinline__ float lo(uint32_t u) { return __low2float(as(u)); }
  static __device__ __forceinline__ float hi(uint32_t u) { return __high2float(as(u)); }
  // g itself must be a normal half for the packed multiply to be a pure exponent shift.
  static __device__ __forceinline__ bool scale_ok(float g) { return is_fast_scale(g) && g >= 0x1p-14f && g <= 0x1p15f; }
  static constexpr uint32_t kT[7] = {0x34003400u, 0x3a003a00u, 0x3d003d00u, 0x3f003f00u,
                                     0x41004100u, 0x43004300u, 0x45004500u};
};

__device__ __forceinline__ uint32_t select(uint32_t mask, uint32_t a, uint32_t b) { return (a & mask) | (b & ~mask); }

// NaN-propagated amax of one block of T, given as its vectors. 16-bit types take packed maxima; fp8 magnitudes
// order as the integers of their low 7 bits, with NaN (0x7f) above every finite value.
template <class T>
__device__ __forceinline__ float block_amax(const uint4 (&v)[vecs_per_block<T>()]) {
  if constexpr (std::is_same_v<T, float>) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kBlock; ++i) amax = nan_max(amax, fabsf(__uint_as_float(word(v[i / 4], i % 4))));
    return amax;
  } else if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) m = __vmaxu4(m, word(v[0], i) & 0x7f7f7f7fu);
    m = __vmaxu4(m, m >> 8);  // bytes 0 and 2: the maxima of bytes {0, 1} and {2, 3}
    return e4m3_value_dev(uint8_t(max(m & 0xffu, (m >> 16) & 0xffu)));
  } else {
    using P = Packed<T>;
    typename P::T2 amax2 = P::as(0u);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax2 = __hmax2_nan(amax2, P::as(word(v[i / 4], i % 4) & 0x7fff7fffu));
    const uint32_t am = P::bits(amax2);
    return nan_max(P::lo(am), P::hi(am));
  }
}

// Codes of one block held as 8 packed words (2 elements each), given its amax.
template <class H>
__device__ __forceinline__ uint64_t quantize_packed(const uint32_t (&w)[8], float amax, float g, uint8_t& scale) {
  constexpr int kWords = 8;
  using P = Packed<H>;
  uint32_t a[kWords];
#pragma unroll
  for (int i = 0; i < kWords; ++i) a[i] = w[i] & 0x7fff7fffu;
  scale = block_scale_dev(amax, g);
  float s = e4m3_value_dev(scale);
  if (scale == kScaleNaN || s == 0.f) return 0;
  // Thresholds between E2M1 magnitudes, times s: packed products, exact in either 16-bit type.
  const typename P::T2 s2 = P::as(P::splat(s));
  auto times_s = [&](uint32_t t) { return P::bits(__hmul2(s2, P::as(t))); };
  const uint32_t t0 = times_s(P::kT[0]), t1 = times_s(P::kT[1]), t2 = times_s(P::kT[2]), t3 = times_s(P::kT[3]),
                 t4 = times_s(P::kT[4]), t5 = times_s(P::kT[5]), t6 = times_s(P::kT[6]), gg = P::splat(g);
  uint64_t codes = 0;
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    typename P::T2 m = __hmul2(P::as(a[i]), P::as(gg));
    // Level thresholds 1.75 and {0.75, 3.5} sit below odd codes (>=), {0.25,1.25,2.5,5} below even (>).
    uint32_t b2 = __hge2_mask(m, P::as(t3));
    uint32_t b1 = __hge2_mask(m, P::as(select(b2, t5, t1)));
    uint32_t b0 = __hgt2_mask(m, P::as(select(b2, select(b1, t6, t4), select(b1, t2, t0))));
    uint32_t c = (b2 & 0x40004u) | (b1 & 0x20002u) | (b0 & 0x10001u) | ((w[i] >> 12) & 0x80008u);
    codes |= uint64_t((c | (c >> 12)) & 0xffu) << (8 * i);
  }
  return codes;
}

// Is the packed path exact for this hot dtype and g?
template <class T>
__device__ __forceinline__ bool fast_scale(float g) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return Packed<__nv_bfloat16>::scale_ok(g);
  else if constexpr (std::is_same_v<T, float>) return false;
  else return Packed<__half>::scale_ok(g);  // fp16, and fp8 widened to fp16
}

// Quantize one 16-element block of T, given as its vecs_per_block<T>() vectors and its block_amax.
// Returns the 16 codes (element i at bits [4i, 4i+4)) and the scale byte.
// The general path: the scalar definition (the hardware E2M1 convert on Blackwell).
template <class T>
__device__ __forceinline__ uint64_t quantize_block_general(const uint4 (&v)[vecs_per_block<T>()], float amax, float g,
                                                           uint8_t& scale) {
  float x[kBlock];
  block_to_float<T>(v, x);
  return quantize_floats<kBlock>(x, amax, g, scale);
}

// The fast path, for g with fast_scale<T>(g): packed comparisons on sm_90, the general path where the hardware
// converts (and for fp32, which has no packed path).
template <class T>
__device__ __forceinline__ uint64_t quantize_block_fast(const uint4 (&v)[vecs_per_block<T>()], float amax, float g,
                                                        uint8_t& scale) {
#if !defined(KVOPS_HW_E2M1)
  if constexpr (!std::is_same_v<T, float>) {
    uint32_t w[8];
    if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) {  // widen to fp16 (exact)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t u = word(v[0], i);
        __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(u), __NV_E4M3);
        __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(u >> 16), __NV_E4M3);
        w[2 * i] = *reinterpret_cast<uint32_t*>(&lo);
        w[2 * i + 1] = *reinterpret_cast<uint32_t*>(&hi);
      }
      return quantize_packed<__half>(w, amax, g, scale);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) w[i] = word(v[i / 4], i % 4);
      return quantize_packed<T>(w, amax, g, scale);
    }
  }
#endif
  return quantize_block_general<T>(v, amax, g, scale);
}

template <class T>
__device__ __forceinline__ uint64_t quantize_block(const uint4 (&v)[vecs_per_block<T>()], float g, bool fast,
                                                   uint8_t& scale) {
  const float amax = block_amax<T>(v);
  return fast ? quantize_block_fast<T>(v, amax, g, scale) : quantize_block_general<T>(v, amax, g, scale);
}

// fp32 magnitudes of four codes (low 16 bits of c4) via byte-permute lookups.
__device__ __forceinline__ void e2m1_lookup4(uint32_t c4, float (&f)[4]) {
  uint32_t sel = c4 & 0x7777u;
  uint32_t hb = __byte_perm(0x3f3f3f00u, 0x40404040u, sel);  // bf16 high bytes of {0,.5,1,1.5,2,3,4,6}
  uint32_t lb = __byte_perm(0xc0800000u, 0xc0804000u, sel);  // bf16 low bytes
  uint32_t p01 = __byte_perm(lb, hb, 0x5140), p23 = __byte_perm(lb, hb, 0x7362);
  f[0] = __uint_as_float(p01 << 16);
  f[1] = __uint_as_float(p01 & 0xffff0000u);
  f[2] = __uint_as_float(p23 << 16);
  f[3] = __uint_as_float(p23 & 0xffff0000u);
}

// Decode kEpt codes to fp32 values (sign applied). fast: g is a power of two, so e2m1 * (s * (1/g)) is exact;
// g_inv = 1/g then (exact too), precomputed once by the caller.
template <int kEpt>
__device__ __forceinline__ void dequantize_floats(uint64_t codes, uint8_t scale, float g, float g_inv, bool fast,
                                                  float (&x)[kEpt]) {
  const float s = e4m3_value_dev(scale);
  const float sg = __fmul_rn(s, g_inv);
#pragma unroll
  for (int q = 0; q < kEpt; q += 4) {
    float m[4];
    e2m1_lookup4(uint32_t(codes >> (4 * q)), m);
#pragma unroll
    for (int j = 0; j < 4 && q + j < kEpt; ++j) {
      float v = fast ? __fmul_rn(m[j], sg) : __fdiv_rn(__fmul_rn(m[j], s), g);
      uint32_t sign = uint32_t(codes >> (4 * (q + j) + 3)) & 1u;
      x[q + j] = __uint_as_float(__float_as_uint(v) | (sign << 31));
    }
  }
}

}  // namespace nvfp4
}  // namespace kvops
