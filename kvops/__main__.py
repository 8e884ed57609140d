"""python -m kvops <command>: `demo` runs the long-decoding workload of kvops/demo.py, `calibrate` writes
TriAttention statistics for a local Hugging Face model (kvops/calibrate.py), `warmup` makes the CuTe kernels of a
model geometry ready (kvops/_cute_build.py), `info` says what runs here."""

import sys


def info(argv=None) -> int:
    """Versions, the GPU and its arch, and which kernel families can run on it."""
    import argparse
    import importlib.metadata as md

    argparse.ArgumentParser(prog="kvops info", description=info.__doc__).parse_args(argv)

    import torch

    import kvops

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "not installed"

    print(f"kvops {kvops.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"triton {version('triton')}, nvidia-cutlass-dsl {version('nvidia-cutlass-dsl')}")
    from kvops import _C, _cute, _triton

    print("built: C++ CPU kernels; CUDA kernels " + ("yes" if _C.CUDA_KERNELS else
                                                     "no (built without nvcc or KVOPS_NO_CUDA=1)")
          + "; CuTe library " + ("yes" if _cute.LIBRARY.is_file() else
                                  "no (KVOPS_NO_CUTE=1: CuTe kernels compile on first use)"))
    prebuilt = _triton.installed()
    print(f"prebuilt Triton kernels: {len(prebuilt)}" + ("" if prebuilt else " (built without CUDA kernels: they "
                                                          "compile with Triton on first use)"))
    for entry in prebuilt:
        print(f"  {entry['symbol']} {entry['arch']} (triton {entry['triton']}, {entry['shared']} B shared memory)")
    if not torch.cuda.is_available():
        print("GPU: none; every op runs on the CPU (C++ kernels and torch)")
        return 0
    from kvops.manager import SUPPORTED_ARCHS

    major, minor = torch.cuda.get_device_capability()
    print(f"GPU: {torch.cuda.get_device_name()} (sm_{major}{minor})")
    supported = (major, minor) in SUPPORTED_ARCHS
    print(f"  NVFP4 codec, compaction (native CUDA): {'yes' if supported else 'no kernel for this arch'} "
          "(a build without nvcc raises a clear error on first use)")
    print(f"  TriAttention mean phase and reduce, short-row top-k (native CUDA), compaction pack (Triton, "
          f"{'prebuilt' if any(e['arch'] == _cute.arch(torch.device('cuda')) for e in prebuilt) else 'JIT'}): "
          f"{'yes' if supported else 'no kernel for this arch'}; scorer, top-k (CuTe DSL): "
          + ("yes" if supported else "not for this arch"))
    return 0


USAGE = ("usage: kvops demo [--preset tiny|gpu] [--device cpu|cuda] [--dtype D] [--json FILE]\n"
         "       kvops calibrate MODEL_DIR --text FILE --out FILE.pt [--max-tokens N] [--window W] [--device D]\n"
         "       kvops warmup [--model DIR | --head-dim D --group G ...] [--page-size T ...] [--dtype D] "
         "[--arch sm_XXa ...]\n"
         "       kvops info\n\n"
         "commands:\n"
         "  demo       a long-decoding workload on the reference paged cache: eviction rounds, then NVFP4 offload\n"
         "  calibrate  TriAttention query statistics of a local Hugging Face model, from a text file\n"
         "  warmup     compile a model geometry's CuTe kernels into the cache (the install built the common ones)\n"
         "  info       versions, what was built, and what runs on this machine\n"
         "(kvops COMMAND --help for each command's options)")
COMMANDS = ("demo", "calibrate", "warmup", "info")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = "a command is required" if not argv else f"unknown command {argv[0]!r}"
        print(f"{USAGE}\nkvops: error: {problem} (choose from {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    if argv[0] == "demo":
        from .demo import main as demo

        return demo(argv[1:])
    if argv[0] == "calibrate":
        from .calibrate import main as calibrate

        return calibrate(argv[1:])
    if argv[0] == "warmup":
        from ._cute_build import warmup

        return warmup(argv[1:])
    return info(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
