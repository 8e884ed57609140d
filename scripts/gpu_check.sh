#!/usr/bin/env bash
# One command on the GPU machine (device tool): build in place, run the tests, run the benchmarks.
#   carry: [".whl"]   (an nvidia-cutlass-dsl archive and an apache-tvm-ffi wheel, when the machine lacks them)
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
# The host compilers: KVOPS_CXX and KVOPS_CC when set, else the first g++ (or c++) on the PATH whose shared
# libraries link libstdc++ dynamically, with its C compiler. A toolchain that links libstdc++ statically (one GPU
# machine's /opt/gcc does) makes every C++ exception thrown from kvops crash the process (docs/DESIGN.md).
shared_libstdcxx() {  # $1: a C++ compiler; true when a shared library it builds loads libstdc++.so
  local dir ok
  dir=$(mktemp -d)
  printf '#include <stdexcept>\nvoid kvops_probe(int x) { if (x) throw std::runtime_error("probe"); }\n' > "$dir/p.cpp"
  "$1" -shared -fPIC -o "$dir/p.so" "$dir/p.cpp" 2>/dev/null && ldd "$dir/p.so" | grep -q 'libstdc++'
  ok=$?
  rm -rf "$dir"
  return $ok
}
if [ -z "${KVOPS_CXX:-}" ]; then
  for cxx in $(type -ap g++ c++); do
    if shared_libstdcxx "$cxx"; then KVOPS_CXX=$cxx; break; fi
  done
  [ -n "${KVOPS_CXX:-}" ] || { echo "no C++ compiler whose shared libraries load libstdc++.so: set KVOPS_CXX and KVOPS_CC"; exit 1; }
fi
KVOPS_CC=${KVOPS_CC:-$(dirname "$KVOPS_CXX")/$(basename "$KVOPS_CXX" | sed 's/g++/gcc/; s/^c++$/cc/')}
echo "compilers: $KVOPS_CXX, $KVOPS_CC"
CXX=$KVOPS_CXX CC=$KVOPS_CC TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16} \
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
