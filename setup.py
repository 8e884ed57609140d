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
import subprocess
import sys

from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
TARGETS = runpy.run_path(os.path.join(ROOT, "kvops", "_targets.py"))  # the version and archs, without importing kvops


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", "**", pattern), recursive=True))


def _cuda_arch_flags():
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if archs:
        return []  # torch's cpp_extension turns TORCH_CUDA_ARCH_LIST into -gencode flags
    return [f"-gencode=arch=compute_{arch[3:]},code={arch}" for arch in TARGETS["ARCHS"]]


WITH_CUDA = torch.version.cuda is not None and CUDA_HOME is not None and os.environ.get("KVOPS_NO_CUDA") != "1"


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
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
