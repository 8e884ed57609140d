// Small host helpers shared by every kvops CUDA family.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

namespace kvops {

// Raises a clear error when this build has no kernel image for the current GPU
// (cudaFuncGetAttributes fails with cudaErrorInvalidDeviceFunction). Also opts the kernel in to
// `smem_bytes` of dynamic shared memory. The opt-in only ever grows: a later call with less must not lower the
// limit below what an earlier launch size needs. Done before any capture, once per (kernel, device) and size.
template <class Kernel>
void prepare_kernel(Kernel kernel, const char* op, int smem_bytes = 0) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> opted;  // (kernel, device) -> dynamic shared memory allowed
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), dev);
  std::lock_guard<std::mutex> lock(mu);
  const auto it = opted.find(key);
  if (it != opted.end() && it->second >= smem_bytes) return;
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    cudaDeviceProp prop;
    C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    TORCH_CHECK(false, "kvops::", op, ": this kvops build has no kernel for sm_", prop.major, prop.minor,
                " (", cudaGetErrorString(err), "); rebuild with TORCH_CUDA_ARCH_LIST including ", prop.major, ".",
                prop.minor);
  }
  if (smem_bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  opted[key] = std::max(smem_bytes, 48 * 1024);
}

// How many CTAs of `kernel` (`threads` a CTA, no dynamic shared memory) the current GPU holds at once: its
// occupancy times the SMs, cached per (kernel, device). A kernel whose CTAs wait for each other must launch no more.
template <class Kernel>
int resident_ctas(Kernel kernel, int threads) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> known;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), dev);
  std::lock_guard<std::mutex> lock(mu);
  const auto it = known.find(key);
  if (it != known.end()) return it->second;
  int per_sm = 0, sms = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return known[key] = std::max(per_sm, 1) * sms;
}

inline int sm_count() {
  int dev = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

// Device-visible address of a tensor that lives on `device` or in pinned host memory.
// Pinned host memory is read and written by the kernels in place (no staging copy).
inline void* device_address(const at::Tensor& t, const at::Device& device, const char* name, const char* op) {
  if (t.is_cuda()) {
    TORCH_CHECK_VALUE(t.device() == device, op, ": ", name, " is on ", t.device(), ", expected ", device);
    return t.data_ptr();
  }
  TORCH_CHECK_VALUE(t.is_cpu(), op, ": ", name, " must be on ", device, " or in pinned host memory");
  cudaPointerAttributes attr;
  cudaError_t err = cudaPointerGetAttributes(&attr, t.data_ptr());
  if (err != cudaSuccess) (void)cudaGetLastError();
  TORCH_CHECK_VALUE(err == cudaSuccess && attr.type == cudaMemoryTypeHost && attr.devicePointer != nullptr, op, ": ",
                    name, " is in pageable host memory; it must be pinned (tensor.pin_memory()) or on ", device);
  return attr.devicePointer;
}

}  // namespace kvops
