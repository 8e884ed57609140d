#!/usr/bin/env bash
# Installs kvops and what it needs on a fresh machine, then builds kvops._C and the CuTe library in place.
# CUDA kernels are built when nvcc is found (CUDA_HOME, default /usr/local/cuda); otherwise CPU only.
# A second run is a no-op while the dependencies import and the build inputs (csrc/, kvops/*.py, setup.py, torch,
# the DSL, the build environment) are unchanged: their hash is kept in build/kvops-build.sha256.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda  # without it torch looks in /usr/local and the link fails
fi
if ! python -c "import torch, ninja, pytest, hypothesis, cutlass, tvm_ffi, transformers, ruff
assert torch.__version__.startswith('2.14.1'), torch.__version__" 2>/dev/null; then
  python -m pip install -q "torch==2.14.1" ninja pytest hypothesis "nvidia-cutlass-dsl>=4.8.1" apache-tvm-ffi \
    "transformers>=5.0" ruff
fi
inputs=$( { python -c "import torch, cutlass, tvm_ffi; print(torch.__version__, torch.version.cuda, cutlass.__version__,
tvm_ffi.__version__)"
            echo "${CUDA_HOME:-} ${TORCH_CUDA_ARCH_LIST:-} ${KVOPS_NO_CUDA:-} ${KVOPS_NO_CUTE:-}"
            cat setup.py; find csrc kvops -type f \( -path 'csrc/*' -o -name '*.py' \) | LC_ALL=C sort | xargs cat
          } | sha256sum | cut -d' ' -f1)
stamp=build/kvops-build.sha256
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$inputs" ] && python -c "import kvops" 2>/dev/null; then
  echo "kvops._C is current (build inputs unchanged); nothing to build"
  exit 0
fi
MAX_JOBS=${MAX_JOBS:-$(nproc)} python -m pip install -q --no-build-isolation -e .
mkdir -p build && echo "$inputs" > "$stamp"
