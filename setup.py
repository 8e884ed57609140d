"""Builds kvops ahead of time: kvops._C (C++ CPU kernels always, CUDA kernels when torch has CUDA and nvcc exists),
then, with the CUDA kernels, the Triton kernels (kvops/_triton_kernels.json, by `python -m kvops._triton`) and the
CuTe DSL kernels (kvops/_cute_kernels.so, by `python -m kvops._cute_build`); no GPU needed.

The package's metadata is in pyproject.toml. The default CUDA archs are kvops/_targets.py's (sm_90a Hopper, sm_100a
Blackwell); TORCH_CUDA_ARCH_LIST overrides them (e.g. "9.0a" for a quick Hopper-only build) for kvops._C and the
CuTe library. Build with --no-build-isolation so the extension links against the torch you run with. KVOPS_NO_CUTE=1 skips the CuTe library (the kernels then
compile into the user cache at first use).
"""
import glob
import os
import runpy
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
TARGETS = runpy.run_path(os.path.join(ROOT, "kvops", "_targets.py"))  # the version and archs, without importing kvops


def _toolkit(root):
    return root and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h"))


def _find_cuda_home():
    """The CUDA toolkit root for torch's cpp_extension, which reads CUDA_HOME when it is imported: CUDA_HOME or
    CUDA_PATH when set (refused at once if it is no toolkit), else where nvcc really lives, else /usr/local/cuda.
    torch alone would take the parent of the first nvcc on the PATH, a wrapper's /usr/local for /usr/local/bin/nvcc,
    and fail on cuda_runtime.h after minutes of compiling."""
    if torch.version.cuda is None or os.environ.get("KVOPS_NO_CUDA") == "1":
        return None
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            if not _toolkit(os.environ[var]):
                sys.exit(f"kvops setup: {var}={os.environ[var]} is not a CUDA toolkit (no include/cuda_runtime.h); "
                         "point it at the toolkit's root, or set KVOPS_NO_CUDA=1 for a CPU-only build")
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc:  # a wrapper script: ask it where the compiler is
        for root in (os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), _nvcc_root(nvcc)):
            if _toolkit(root):
                return root
    if _toolkit("/usr/local/cuda"):
        return "/usr/local/cuda"
    if nvcc:
        sys.exit(f"kvops setup: {nvcc} has no CUDA toolkit (include/cuda_runtime.h) beside it, nor is one at "
                 "/usr/local/cuda: set CUDA_HOME to the toolkit's root, or KVOPS_NO_CUDA=1 for a CPU-only build")
    return None


def _nvcc_root(nvcc):
    """The toolkit of the nvcc a wrapper runs: a dry run prints its TOP= directory (and compiles nothing)."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (out.stdout + out.stderr).splitlines():
        if "TOP=" in line:
            return os.path.normpath(line.split("TOP=", 1)[1].strip())
    return None


_cuda_home = _find_cuda_home()
if _cuda_home:
    os.environ["CUDA_HOME"] = _cuda_home
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "**", pattern), recursive=True))


def _cuda_arch_flags():
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs:
        return []  # torch's cpp_extension turns TORCH_CUDA_ARCH_LIST into -gencode flags
    return [f"-gencode=arch=compute_{arch[3:]},code={arch}" for arch in TARGETS["ARCHS"]]


WITH_CUDA = _cuda_home is not None and CUDA_HOME is not None
if not WITH_CUDA:
    print("kvops setup: building the CPU kernels only (" + ("KVOPS_NO_CUDA=1" if os.environ.get("KVOPS_NO_CUDA") == "1"
          else "a CPU build of torch" if torch.version.cuda is None else "no CUDA toolkit found") + ")", file=sys.stderr)
# kvops._C loads only into the torch it was built against: the wheel requires that release. Triton defines kernels
# at import (every build); the CUDA build's CuTe DSL kernels need the DSL at run time (other shape classes compile
# then).
TORCH_RELEASE = torch.__version__.split("+")[0]
REQUIRES = [f"torch=={TORCH_RELEASE}", "triton"] + (["nvidia-cutlass-dsl>=4.8.1", "apache-tvm-ffi"] if WITH_CUDA
                                                    else [])


def _extension():
    with_cuda = WITH_CUDA
    cxx = ["-O3", "-ffp-contract=off"]
    sources = _sources("*.cpp")
    if not with_cuda:
        return CppExtension("kvops._C", sources, extra_compile_args={"cxx": cxx}, py_limited_api=True)
    nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo", "-DKVOPS_WITH_CUDA",
            "-Xcompiler=-ffp-contract=off"] + _cuda_arch_flags()
    return CUDAExtension("kvops._C", sources + _sources("*.cu"),
                         extra_compile_args={"cxx": cxx + ["-DKVOPS_WITH_CUDA"], "nvcc": nvcc}, py_limited_api=True)


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    """build_ext, then the Triton kernels (with the CUDA kernels: they launch from kvops._C) and the CuTe library
    beside kvops._C (a failed compile or export fails the build)."""

    def run(self):
        super().run()
        package = os.path.dirname(os.path.abspath(self.get_ext_fullpath("kvops._C")))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(package),
                                                                         os.environ.get("PYTHONPATH")]))}
        if WITH_CUDA:
            subprocess.run([sys.executable, "-m", "kvops._triton", "--out",
                            os.path.join(package, "_triton_kernels.json")], check=True, env=env)
        if os.environ.get("KVOPS_NO_CUTE") != "1":
            subprocess.run([sys.executable, "-m", "kvops._cute_build", "--out",
                            os.path.join(package, "_cute_kernels.so")], check=True, env=env)


setup(
    version=TARGETS["VERSION"],
    packages=find_packages(include=["kvops", "kvops.*"]),
    # shipped TriAttention calibrations (Apache-2.0, see NOTICE.md there)
    package_data={"kvops": ["data/triattention/*.pt", "data/triattention/NOTICE.md", "_triton_kernels.json"]},
    install_requires=REQUIRES,
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},  # the stable ABI of Python >= 3.10 (requires-python)
)
