// Tiny helpers shared by every kvops family, on the host and in kernels.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVOPS_HD __host__ __device__ __forceinline__
#else
#define KVOPS_HD inline
#endif

namespace kvops {

struct FastDiv {  // n / d for 0 <= n < 2^31, d >= 1, by multiply-high (Granlund-Montgomery)
  uint32_t d = 1, mul = 0, shift = 0;
  FastDiv() = default;
  explicit FastDiv(uint32_t divisor) : d(divisor) {
    while ((1u << shift) < d) ++shift;
    mul = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  KVOPS_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    uint32_t t = __umulhi(n, mul);
#else
    uint32_t t = uint32_t((uint64_t(n) * mul) >> 32);
#endif
    return (t + n) >> shift;
  }
};

}  // namespace kvops
