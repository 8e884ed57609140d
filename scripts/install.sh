#!/usr/bin/env bash
# Installs kvops and what it needs on a fresh machine, then builds kvops._C in place (idempotent).
# CUDA kernels are built when nvcc is found (CUDA_HOME, default /usr/local/cuda); otherwise CPU only.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda  # without it torch looks in /usr/local and the link fails
fi
python -m pip install -q "torch==2.14.1" numpy ninja pytest hypothesis nvidia-cutlass-dsl "transformers>=5.0"
MAX_JOBS=${MAX_JOBS:-$(nproc)} python -m pip install -q --no-build-isolation -e .
