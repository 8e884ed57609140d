"""Triton kernels built ahead of time, launched from C++ (csrc/triton_aot.cpp).

Each Triton kernel on a round's path is declared as a ``Kernel``: its ``@triton.jit`` function, the Triton types of
its runtime arguments, and the constexpr variants the install compiles. ``python -m kvops._triton`` (run by setup.py
at install; no GPU needed) compiles every variant with ``triton.compile`` for each target arch (kvops/_targets.py's,
narrowed by TORCH_CUDA_ARCH_LIST like kvops._C) and writes the cubins to ``kvops/_triton_kernels.json``. At the first
launch on a GPU the cubins of its arch are registered with kvops._C; every launch then goes to the CUDA runtime
through ``kvops::_triton_launch``, on the current stream, with no Triton launcher and no compile. A kernel whose
source changed since the install, or a GPU arch nothing was built for, falls back to Triton's JIT, and says so once.
On CPU tensors (the tests, under TRITON_INTERPRET=1) the kernel runs in Triton's interpreter.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Mapping, Sequence

import torch

from ._cute import arch
from ._targets import install_archs

ARTIFACT = Path(__file__).with_name("_triton_kernels.json")
# A param's letter in kvops::_triton_launch's params string, by its Triton type.
_PARAM = {"i32": "i", "i64": "l", "fp32": "f"}

KERNELS: dict[str, "Kernel"] = {}  # every declared kernel, by name (what the install builds)
_prebuilt: dict[str, dict] = {}    # arch -> {symbol: entry}, the artifact's entries loaded so far
_registered: set[tuple[str, str]] = set()  # (arch, symbol) registered with kvops._C
_warned: set[str] = set()


class Kernel:
    """A Triton kernel built ahead of time.

    Parameters
    ----------
    name : str
        Unique among kvops' Triton kernels; with the constexpr values it names each compiled variant.
    fn : triton.runtime.JITFunction
        The ``@triton.jit`` function.
    signature : mapping of str to str
        Every runtime (non-constexpr) argument of `fn`, in order, with its Triton type: ``"*i32"``-like pointers
        (a tensor, or None for a pointer the variant never reads), ``"i32"``, ``"i64"`` or ``"fp32"``.
    variants : sequence of mapping
        The constexpr values each variant compiled at install takes (every constexpr of `fn`).
    num_warps : int
        Warps per program, for every variant.
    """

    def __init__(self, name: str, fn, signature: Mapping[str, str], variants: Sequence[Mapping[str, object]],
                 num_warps: int = 4):
        if name in KERNELS:
            raise ValueError(f"kvops Triton kernel {name!r} is declared twice")
        constexprs = [a for a in fn.arg_names if a not in signature]
        for v in variants:
            if sorted(v) != sorted(constexprs):
                raise ValueError(f"{name}: a variant must give the constexprs {constexprs}, got {sorted(v)}")
        self.name, self.fn, self.num_warps = name, fn, num_warps
        self.signature = dict(signature)
        self.variants = [dict(v) for v in variants]
        self.params = "".join("p" if t.startswith("*") else _PARAM[t] for t in self.signature.values())
        self._symbols: dict[tuple, str] = {}
        KERNELS[name] = self

    def symbol(self, constexprs: Mapping[str, object]) -> str:
        """The variant's name: the kernel's and its constexpr values."""
        return "_".join([self.name, *(f"{k}{int(v) if isinstance(v, bool) else v}"
                                      for k, v in sorted(constexprs.items()))])

    def __getitem__(self, grid: tuple[int, ...]):
        """``kernel[grid](*args, **constexprs)``, like a Triton kernel: a prebuilt cubin when there is one."""
        grid = tuple(grid) + (1,) * (3 - len(grid))
        return lambda *args, **constexprs: self.launch(grid, args, constexprs)

    def launch(self, grid: tuple[int, int, int], args: Sequence, constexprs: Mapping[str, object]) -> None:
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} runtime arguments, got {len(args)}")
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        if device.type == "cuda":
            key = tuple(constexprs.items())
            symbol = self._symbols.get(key) or self._symbols.setdefault(key, self.symbol(constexprs))
            if _prebuilt_ready(self, symbol, device):
                tensors, ints, floats = [], [], []
                for a, kind in zip(args, self.params):
                    (tensors if kind == "p" else ints if kind in "il" else floats).append(a)
                torch.ops.kvops._triton_launch(symbol, grid, tensors, ints, floats)
                return
        self.fn[grid](*args, **constexprs, num_warps=self.num_warps)


def _prebuilt_ready(kernel: Kernel, symbol: str, device: torch.device) -> bool:
    """Whether `symbol` runs from its prebuilt cubin on `device` (registering it with kvops._C on first use); if not,
    warns once that the kernel compiles with Triton's JIT instead."""
    target = arch(device)  # the arch-specific target, e.g. sm_90a
    if (target, symbol) in _registered:
        return True
    entry = _entries(target).get(symbol)
    if entry is not None and entry["source"] == kernel.fn.cache_key:
        torch.ops.kvops._triton_register(symbol, entry["function"], torch.frombuffer(
            bytearray(base64.b64decode(entry["cubin"])), dtype=torch.uint8), entry["params"], entry["num_warps"],
            entry["shared"])
        _registered.add((target, symbol))
        return True
    if symbol not in _warned:
        _warned.add(symbol)
        why = ("its source changed since the install" if entry is not None else
               f"the install built none for {target}" if ARTIFACT.exists() else "kvops was installed without them")
        warnings.warn(f"kvops: Triton kernel {symbol} has no prebuilt cubin ({why}): compiling it with Triton "
                      f"(JIT); reinstall kvops to build it ahead of time", stacklevel=4)
    return False


def _entries(target: str) -> dict:
    if target not in _prebuilt:
        kernels = json.loads(ARTIFACT.read_text())["kernels"] if ARTIFACT.exists() else []
        _prebuilt[target] = {k["symbol"]: k for k in kernels if k["arch"] == target}
    return _prebuilt[target]


def installed() -> list[dict]:
    """The prebuilt variants of the install (symbol, arch, params, shared memory; not the cubins)."""
    if not ARTIFACT.exists():
        return []
    return [{k: v for k, v in e.items() if k != "cubin"} for e in json.loads(ARTIFACT.read_text())["kernels"]]


def compile_variant(kernel: Kernel, constexprs: Mapping[str, object], target: str) -> dict:
    """One variant's cubin for one arch (``sm_90a``-like), as an artifact entry. No GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ._targets import capability

    major, minor = capability(target)
    signature = {**kernel.signature, **{k: "constexpr" for k in constexprs}}
    signature = {a: signature[a] for a in kernel.fn.arg_names}  # in the function's order
    # constexprs keyed by argument index paths: what Triton 3.3 and later take
    src = ASTSource(fn=kernel.fn, signature=signature,
                    constexprs={(kernel.fn.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", major * 10 + minor, 32),
                              options={"num_warps": kernel.num_warps})
    md = compiled.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise RuntimeError(f"{kernel.name}: a kernel that needs Triton's scratch memory cannot be launched from C++")
    # Triton appends scratch pointers to the kernel's parameters (how many depends on its version): count the
    # entry's parameters in the PTX and mark the extra ones.
    ptx = compiled.asm["ptx"]
    entry = ptx[ptx.index(".entry"):]
    extra = entry[:entry.index(")")].count(".param") - len(kernel.params)
    if extra < 0:
        raise RuntimeError(f"{kernel.name}: the PTX entry has fewer parameters than the signature")
    return {"symbol": kernel.symbol(constexprs), "arch": target, "function": md.name,
            "params": kernel.params + "s" * extra, "num_warps": md.num_warps, "shared": md.shared,
            "source": kernel.fn.cache_key, "triton": triton.__version__,
            "cubin": base64.b64encode(compiled.asm["cubin"]).decode()}


def _compile(job: tuple[str, int, str]) -> dict:
    import kvops  # noqa: F401  (declares every kernel; in a spawned worker too)

    name, variant, target = job
    kernel = KERNELS[name]
    return compile_variant(kernel, kernel.variants[variant], target)


def build(out: Path, archs: Sequence[str] | None = None, jobs: int | None = None) -> None:
    """Compile every declared kernel's variants for every arch into the artifact at `out` (written whole)."""
    import kvops  # noqa: F401

    archs = install_archs() if archs is None else tuple(archs)
    todo = [(name, i, target) for target in archs for name, k in sorted(KERNELS.items())
            for i in range(len(k.variants))]
    start = time.time()
    jobs = max(1, min(len(todo), jobs or int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)))
    if jobs == 1:
        entries = [_compile(job) for job in todo]
    else:  # spawned: a forked child would inherit the parent's torch state
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        from kvops import _triton  # this module by its name, also when run as __main__, so that it pickles

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            entries = list(pool.map(_triton._compile, todo))
    from ._files import write_whole

    out.parent.mkdir(parents=True, exist_ok=True)
    write_whole(str(out), lambda f: f.write(json.dumps({"kernels": entries}, indent=1).encode()))
    print(f"{out}: {len(entries)} Triton kernels for {', '.join(archs) or 'no arch'} in {time.time() - start:.0f} s")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvops._triton", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ARTIFACT)
    parser.add_argument("--arch", action="append", help="a target such as sm_90a (default: the install's)")
    args = parser.parse_args(argv)
    from kvops import _triton  # the module the kernels declared themselves in (not __main__)

    _triton.build(args.out, args.arch)


if __name__ == "__main__":
    main(sys.argv[1:])
