"""What every kvops CuTe DSL op shares: kernels built ahead of time and called through TVM-FFI.

Each kernel class is a ``Spec`` whose ``build(arch)`` compiles it with ``--enable-tvm-ffi`` for one GPU arch against
fake tensors of symbolic shape (no GPU needed), so the result takes torch tensors directly and runs on the caller's
current stream. ``python -m kvops._cute_build`` (run by setup.py at install) exports every shipped spec for sm_90a
and sm_100a and links them into one library, ``kvops/_cute_kernels.so``; symbols carry a hash of the kernel sources
(``kernel_sources``: found from what imports cutlass, not listed), so a library built from other sources is not
used. A spec that library lacks (another arch, another shape class, an install without it, edited sources) is
compiled once into a persistent cache (``KVOPS_CACHE_DIR``, default ``~/.cache/kvops``), keyed by the DSL and
TVM-FFI versions and a hash of the kernel sources, written atomically under a file lock so that concurrent
processes compile it once; later processes load it in milliseconds. ``python -m kvops warmup`` fills it. Nothing
compiles inside a CUDA-graph capture.
"""

from __future__ import annotations

import fcntl
import functools
import ast
import hashlib
import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch

from ._targets import ARCHS  # noqa: F401  (kvops._cute.ARCHS: what the install builds)

MIN_DSL = (4, 8, 1)  # compiles without a GPU (--gpu-arch) and exports TVM-FFI objects
LIBRARY = Path(__file__).with_name("_cute_kernels.so")

_functions: dict[tuple[str, str], object] = {}
_library: list = []  # [the loaded prebuilt library, or None]
_lock = threading.Lock()
compile_count = 0  # kernels this process compiled (the tests count cache hits with it)


class Spec(NamedTuple):
    """One compiled kernel class: a name unique per shape class (it becomes the exported symbol, with the arch) and
    ``build(arch)``, which compiles it for TVM-FFI with ``ffi_compile``."""

    name: str
    build: Callable[[str], object]


def require_dsl():
    """Import the CuTe DSL, refusing versions older than MIN_DSL with a clear message."""
    import cutlass

    version = tuple(int(p) for p in cutlass.__version__.split(".")[:3] if p.isdigit())
    if version < MIN_DSL:
        raise ImportError(f"kvops needs nvidia-cutlass-dsl >= {'.'.join(map(str, MIN_DSL))} (found "
                          f"{cutlass.__version__}): pip install -U nvidia-cutlass-dsl apache-tvm-ffi")
    return cutlass


def _refuse_in_capture(what: str, key) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}: the CuTe kernel for {key} is not compiled yet and a CUDA graph is being "
                           f"captured; call it once with the same shapes before capturing (warm-up)")


def arch(device: torch.device) -> str:
    """The arch-specific target of a CUDA device, e.g. "sm_90a" for an H100/H200."""
    return _arch(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}a"


def fake(dtype, ndim: int, align: int = 16, divisibility: int = 1):
    """A fake tensor for an ahead-of-time compile: every extent and stride symbolic but a unit last stride; `divisibility`: a known divisor of the last extent and of the next-to-last stride."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    shape = [cute.sym_int() for _ in range(ndim)]
    strides = [cute.sym_int64() for _ in range(ndim - 1)]
    if divisibility > 1:
        shape[-1] = cute.sym_int(divisibility=divisibility)
        if ndim > 1:
            strides[-1] = cute.sym_int64(divisibility=divisibility)
    return make_fake_tensor(dtype, tuple(shape), stride=(*strides, 1), assumed_align=align)


def ffi_compile(kernel, args: Sequence, target: str):
    """``cute.compile`` of `kernel` for TVM-FFI calls on the caller's current stream, for GPU arch `target`. `args`
    are fakes and scalars, without the stream (appended here)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    global compile_count
    require_dsl()
    compile_count += 1
    return cute.compile(kernel, *args, make_fake_stream(use_tvm_ffi_env_stream=True),
                        options=f"--enable-tvm-ffi --gpu-arch {target}")


def _walk(nodes, in_function: bool = False):
    """(node, whether it lies inside a function) for every node under `nodes`."""
    for node in nodes:
        yield node, in_function
        yield from _walk(ast.iter_child_nodes(node), in_function or isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))


def _imports(path: Path, module: str, modules: dict[str, Path]) -> tuple[bool, set[str]]:
    """(whether the module `module` at `path` imports cutlass anywhere, the modules of `modules` it imports outside
    functions). ``from X import name`` imports the module X.name when there is one, else X (which holds name)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    cutlass, named = False, set()
    for node, in_function in _walk(ast.parse(path.read_bytes()).body):
        if isinstance(node, ast.Import):
            cutlass |= any(a.name.split(".")[0] == "cutlass" for a in node.names)
            found = {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            cutlass |= base.split(".")[0] == "cutlass"
            found = {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        else:
            continue
        if not in_function:
            named |= found & modules.keys()
    return cutlass, named


def kernel_sources() -> list[Path]:
    """The files whose text decides what a spec compiles to, found rather than listed (a list kept by hand could
    miss one): this file and every module of the package that imports cutlass (the CuTe kernels, which need it,
    and the modules that define specs, whose builders make their fake arguments from its types), with the kvops
    modules they import outside functions, transitively (what their code reads when it is imported)."""
    root = Path(__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        modules[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    imports = functools.cache(lambda name: _imports(modules[name], name, modules))
    todo = [__name__, *(name for name, path in modules.items()
                        if b"cutlass" in path.read_bytes() and imports(name)[0])]
    found: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo.extend(imports(name)[1])
    return sorted(modules[name] for name in found)


SOURCES = LIBRARY.with_name("_cute_kernels.sources.json")  # the build's sources_hash and the files it saw


def _package_files() -> dict[str, list[int]]:
    """Every module of the package with its size and modification time: what a saved sources_hash is valid for."""
    root = Path(__file__).parent
    return {p.relative_to(root).as_posix(): [(st := p.stat()).st_size, st.st_mtime_ns]
            for p in sorted(root.rglob("*.py"))}


@functools.cache
def sources_hash() -> str:
    """A short hash of kernel_sources() (their paths in the package and their bytes): in every exported symbol, so
    a library or cache entry built from other kernel sources (an editable install edited since) is never used.
    Finding those sources parses the package (tens of milliseconds of a first round), so the build saves the hash
    with the size and modification time of every module (``save_sources_hash``); while none has changed, that
    saved hash is used."""
    files = _package_files()
    try:
        saved = json.loads(SOURCES.read_text())
        if saved["files"] == files:
            return saved["hash"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return _hash_sources()


def _hash_sources() -> str:
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in kernel_sources():
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def save_sources_hash(path: Path = SOURCES) -> None:
    """Save sources_hash() with the package's modules' sizes and modification times at `path`, beside the library
    (the build calls it); written whole or not at all."""
    from ._files import write_whole

    data = {"hash": _hash_sources(), "files": _package_files()}
    write_whole(str(path), lambda f: f.write(json.dumps(data).encode()))


def symbol(spec: Spec, target: str) -> str:
    return f"kvops_{spec.name}_{target}_{sources_hash()}"


def export_object(name: str, fn, directory: str) -> str:
    """Export one compiled function as an object file `<name>.o` in `directory` (its TVM-FFI symbol: `name`)."""
    obj = os.path.join(directory, f"{name}.o")
    fn.export_to_c(obj, function_name=name, export_only_tvm_ffi_symbols=True)
    return obj


def export_library(functions: Sequence[tuple[str, object]], path: Path, objects: Sequence[str] = ()) -> None:
    """Export compiled functions (symbol, compiled) as objects and link them, with already exported `objects`, into
    one shared library at `path`, atomically (a reader sees the old file or the new one, never half of one)."""
    from cutlass.cute.runtime import find_runtime_libraries

    path.parent.mkdir(parents=True, exist_ok=True)
    libraries = list(find_runtime_libraries(enable_tvm_ffi=True))
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        objects = [*objects, *(export_object(name, fn, tmp) for name, fn in functions)]
        linked = os.path.join(tmp, path.name)
        rpaths = [f"-Wl,-rpath,{d}" for d in sorted({os.path.dirname(lib) for lib in libraries})]
        subprocess.run([os.environ.get("CC", "gcc"), "-shared", "-o", linked, *objects, *libraries, *rpaths],
                       check=True, capture_output=True, text=True)
        os.replace(linked, path)


def cache_dir() -> Path:
    """Where compiled specs persist: $KVOPS_CACHE_DIR (default ~/.cache/kvops), one folder per DSL version,
    TVM-FFI version and kernel sources."""
    import cutlass
    import tvm_ffi

    root = os.environ.get("KVOPS_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvops")
    return Path(root) / f"cute-{cutlass.__version__}-tvmffi{tvm_ffi.__version__}-{sources_hash()}"


def _prebuilt(name: str):
    """`name` from the library built at install, or None."""
    import tvm_ffi

    if not _library:
        _library.append(tvm_ffi.load_module(str(LIBRARY)) if LIBRARY.exists() else None)
    if _library[0] is None:
        return None
    try:
        return _library[0][name]
    except Exception:  # not in the library: another arch or shape class
        return None


def ffi_function(spec: Spec, target: str, prebuilt: bool = True):
    """The TVM-FFI function of `spec` for GPU arch `target`: from the library built at install (unless `prebuilt`
    is False), else from the persistent cache, compiling it there first if it is missing."""
    key = (spec.name, target)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    with _lock:
        if key not in _functions:
            import tvm_ffi

            name = symbol(spec, target)
            fn = _prebuilt(name) if prebuilt else None
            if fn is None:
                path = cache_dir() / f"{name}.so"
                if not path.exists():
                    _refuse_in_capture(f"kvops {spec.name}", key)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with open(path.with_suffix(".lock"), "w") as lock:
                        fcntl.flock(lock, fcntl.LOCK_EX)  # another process compiling it: wait, then load its file
                        if not path.exists():
                            export_library([(name, spec.build(target))], path)
                fn = tvm_ffi.load_module(str(path))[name]
            _functions[key] = fn
    return _functions[key]
