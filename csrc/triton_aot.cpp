// Triton kernels built ahead of time (kvops/_triton.py): the install compiles each to a cubin per GPU arch, Python
// registers those of this GPU's arch here once, and each launch goes straight to the CUDA runtime (no Triton launcher,
// no compile): kvops::_triton_register and kvops::_triton_launch.
//
// A kernel's parameters are described by a string, one letter each, in order: 'p' a pointer (a tensor's address,
// or null for an absent one), 'i' an int32, 'l' an int64, 'f' a float32, 's' a scratch pointer Triton appends and
// the kernels built here never use (null). The cubins load with cudaLibraryLoadData, context-independent, so one
// load serves every GPU of the process.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#ifdef KVOPS_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace kvops {
namespace triton_aot {

namespace {

constexpr const char* kParamKinds = "pilfs";

struct Kernel {
  std::string function, params, cubin;
  int num_warps = 4, shared = 0;
#ifdef KVOPS_WITH_CUDA
  cudaLibrary_t library = nullptr;
  cudaKernel_t handle = nullptr;
#endif
};

std::mutex registry_mutex;
std::unordered_map<std::string, std::unique_ptr<Kernel>>& registry() {
  static auto* kernels = new std::unordered_map<std::string, std::unique_ptr<Kernel>>();  // lives for the process
  return *kernels;
}

void register_kernel(const std::string& symbol, const std::string& function, const at::Tensor& cubin,
                     const std::string& params, int64_t num_warps, int64_t shared) {
  constexpr const char* op = "_triton_register";
  TORCH_CHECK_VALUE(!symbol.empty() && !function.empty(), op, ": symbol and function must not be empty");
  TORCH_CHECK_VALUE(cubin.scalar_type() == at::kByte && cubin.dim() == 1 && cubin.is_contiguous() && cubin.is_cpu() &&
                        cubin.numel() > 0,
                    op, ": cubin must be a non-empty contiguous 1-D uint8 CPU tensor");
  TORCH_CHECK_VALUE(params.find_first_not_of(kParamKinds) == std::string::npos, op, ": params may hold only the "
                    "letters '", kParamKinds, "', got '", params, "'");
  TORCH_CHECK_VALUE(num_warps >= 1 && num_warps <= 32, op, ": num_warps must be in [1, 32], got ", num_warps);
  TORCH_CHECK_VALUE(shared >= 0 && shared <= (1 << 20), op, ": shared must be in [0, 2**20], got ", shared);
  auto kernel = std::make_unique<Kernel>();
  kernel->function = function, kernel->params = params;
  kernel->cubin.assign(reinterpret_cast<const char*>(cubin.const_data_ptr<uint8_t>()), size_t(cubin.numel()));
  kernel->num_warps = int(num_warps), kernel->shared = int(shared);
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& slot = registry()[symbol];
  if (slot) {  // registered already (a second import): the same kernel, or a clear error
    TORCH_CHECK_VALUE(slot->cubin == kernel->cubin && slot->params == params && slot->function == function, op,
                      ": ", symbol, " is registered already with another cubin");
    return;
  }
  slot = std::move(kernel);
}

#ifdef KVOPS_WITH_CUDA
// The kernel, its library loaded on first use (never during a CUDA-graph capture: warm up first).
Kernel& loaded(const std::string& symbol, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const auto it = registry().find(symbol);
  TORCH_CHECK_VALUE(it != registry().end(), "_triton_launch: no prebuilt Triton kernel ", symbol,
                    " is registered (kvops/_triton.py registers the installed ones)");
  Kernel& k = *it->second;
  if (k.handle == nullptr) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    TORCH_CHECK(capture == cudaStreamCaptureStatusNone, "_triton_launch: ", symbol, " is first launched during a "
                "CUDA-graph capture; launch it once before capturing (warm-up)");
    C10_CUDA_CHECK(cudaLibraryLoadData(&k.library, k.cubin.data(), nullptr, nullptr, 0, nullptr, nullptr, 0));
    C10_CUDA_CHECK(cudaLibraryGetKernel(&k.handle, k.library, k.function.c_str()));
  }
  if (k.shared > 48 * 1024) {  // the dynamic shared memory opt-in, per device (idempotent)
    int dev = 0;
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    C10_CUDA_CHECK(cudaKernelSetAttributeForDevice(k.handle, cudaFuncAttributeMaxDynamicSharedMemorySize, k.shared,
                                                   dev));
  }
  return k;
}

void launch(const std::string& symbol, at::IntArrayRef grid, const c10::List<std::optional<at::Tensor>>& tensors,
            at::IntArrayRef ints, at::ArrayRef<double> floats) {
  constexpr const char* op = "_triton_launch";
  TORCH_CHECK_VALUE(grid.size() == 3, op, ": grid must have 3 entries, got ", grid.size());
  std::optional<at::Device> device;
  for (const auto& t : tensors) {
    const std::optional<at::Tensor> tensor = t;
    if (!tensor) continue;
    TORCH_CHECK_VALUE(tensor->is_cuda(), op, ": ", symbol, " takes CUDA tensors, got one on ", tensor->device());
    if (!device) device = tensor->device();
    TORCH_CHECK_VALUE(tensor->device() == *device, op, ": ", symbol, "'s tensors are on ", *device, " and ",
                      tensor->device());
  }
  TORCH_CHECK_VALUE(device.has_value(), op, ": ", symbol, " needs at least one tensor");
  const c10::cuda::CUDAGuard guard(*device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Kernel& k = loaded(symbol, stream);
  // Each argument's value lives in one of these (reserved: the addresses taken below must not move).
  const size_t n = k.params.size();
  std::vector<void*> pointers(n);
  std::vector<int32_t> int32s(n);
  std::vector<int64_t> int64s(n);
  std::vector<float> float32s(n);
  std::vector<void*> args(n);
  size_t next_tensor = 0, next_int = 0, next_float = 0;
  for (size_t i = 0; i < n; ++i) {
    switch (k.params[i]) {
      case 'p': {
        TORCH_CHECK_VALUE(next_tensor < tensors.size(), op, ": ", symbol, " takes more tensors than the ",
                          tensors.size(), " given");
        const std::optional<at::Tensor> t = tensors[next_tensor++];
        pointers[i] = t ? t->data_ptr() : nullptr;
        args[i] = &pointers[i];
        break;
      }
      case 'i':
        TORCH_CHECK_VALUE(next_int < ints.size(), op, ": ", symbol, " takes more ints than the ", ints.size(),
                          " given");
        TORCH_CHECK_VALUE(ints[next_int] >= std::numeric_limits<int32_t>::min() &&
                              ints[next_int] <= std::numeric_limits<int32_t>::max(),
                          op, ": ", symbol, "'s int argument ", next_int, " = ", ints[next_int], " exceeds int32");
        int32s[i] = int32_t(ints[next_int++]);
        args[i] = &int32s[i];
        break;
      case 'l':
        TORCH_CHECK_VALUE(next_int < ints.size(), op, ": ", symbol, " takes more ints than the ", ints.size(),
                          " given");
        int64s[i] = ints[next_int++];
        args[i] = &int64s[i];
        break;
      case 'f':
        TORCH_CHECK_VALUE(next_float < floats.size(), op, ": ", symbol, " takes more floats than the ",
                          floats.size(), " given");
        float32s[i] = float(floats[next_float++]);
        args[i] = &float32s[i];
        break;
      default:  // 's': Triton's scratch pointers, unused by the kernels built here
        pointers[i] = nullptr;
        args[i] = &pointers[i];
    }
  }
  TORCH_CHECK_VALUE(next_tensor == tensors.size() && next_int == ints.size() && next_float == floats.size(), op,
                    ": ", symbol, " takes ", next_tensor, " tensors, ", next_int, " ints and ", next_float,
                    " floats; got ", tensors.size(), ", ", ints.size(), " and ", floats.size());
  for (const int64_t g : grid)
    TORCH_CHECK_VALUE(g >= 0 && g <= std::numeric_limits<int32_t>::max(), op, ": grid entries must be in [0, 2**31), "
                      "got ", grid);
  TORCH_CHECK_VALUE(grid[1] <= 65535 && grid[2] <= 65535, op, ": the grid's y and z must be <= 65535, got ", grid);
  if (grid[0] * grid[1] * grid[2] == 0) return;
  C10_CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(k.handle),
                                  dim3(unsigned(grid[0]), unsigned(grid[1]), unsigned(grid[2])),
                                  dim3(unsigned(k.num_warps * 32)), args.data(), size_t(k.shared), stream));
}
#endif

}  // namespace

// Whatever device the cubin tensor claims, the check names it (a CPU-only registration would answer a CUDA tensor
// with a missing-kernel error).
TORCH_LIBRARY_IMPL(kvops, CompositeExplicitAutograd, m) { m.impl("_triton_register", &register_kernel); }

#ifdef KVOPS_WITH_CUDA
TORCH_LIBRARY_IMPL(kvops, CUDA, m) { m.impl("_triton_launch", &launch); }
#endif

}  // namespace triton_aot
}  // namespace kvops
