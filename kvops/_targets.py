"""What the build and the package both need to know, in a file setup.py loads on its own (no torch, no
kvops._C): the package version and the GPU archs the kernels are built for."""

VERSION = "0.1.0"
# Hopper and Blackwell. The 'a' targets unlock the arch-specific instructions (setmaxnreg, wgmma, FP4 converts).
ARCHS = ("sm_90a", "sm_100a")


def capability(arch: str) -> tuple[int, int]:
    """A target's compute capability: "sm_100a" -> (10, 0)."""
    digits = arch.removeprefix("sm_").rstrip("a")
    return int(digits[:-1]), int(digits[-1])


CAPABILITIES = tuple(capability(a) for a in ARCHS)


def install_archs() -> tuple[str, ...]:
    """The archs the install builds the CuTe and Triton kernels for: ARCHS, narrowed by TORCH_CUDA_ARCH_LIST as
    kvops._C is (e.g. "9.0a" for a Hopper-only build: sm_90a; entries below sm_90, where the kernels do not run,
    are left out)."""
    import os

    listed = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not listed:
        return ARCHS
    wanted = {f"sm_{v.split('+')[0].replace('.', '').rstrip('a')}a" for v in listed.replace(";", " ").split()}
    return tuple(a for a in ARCHS if a in wanted)
