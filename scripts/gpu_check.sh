#!/usr/bin/env bash
# One command on the GPU machine (device tool): build in place, run the tests, run the benchmarks.
#   carry: [".whl"]   (nvidia-cutlass-dsl 4.8.1 archive + apache-tvm-ffi wheel from ../shared/device/fetch-wheels.sh)
# Results land in $OUT (pytest.log, bench.csv, bench.md, build.log).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
if ls .whl/cutlass-dsl-*.tar.xz >/dev/null 2>&1; then  # the same DSL as pip and CI (../shared/device.md)
  [ -d /tmp/site/nvidia_cutlass_dsl ] || { mkdir -p /tmp/site && tar -xJf .whl/cutlass-dsl-*.tar.xz -C /tmp/site; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade .whl/apache_tvm_ffi-*.whl
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD  # --target skips .pth files
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
# /opt/gcc there links libstdc++ statically: C++ exceptions thrown from kvops then crash. Use the system one.
CXX=${KVOPS_CXX:-/usr/bin/g++} CC=${KVOPS_CC:-/usr/bin/gcc} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16} \
  python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 ))s"
rc=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -25
  rc=${PIPESTATUS[0]}
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m benchmarks ${BENCH_ARGS:-} --csv "$OUT/bench.csv" --md "$OUT/bench.md" 2>&1 | tee "$OUT/bench.log"
fi
exit $rc
