"""Build the CuTe kernels kvops ships into one library, kvops/_cute_kernels.so (kvops/_cute.py says how they are
found): ``python -m kvops._cute_build [--out PATH] [--arch sm_90a --arch sm_100a]``. setup.py runs it at install.
No GPU is needed: each kernel is compiled for each arch with ``--gpu-arch``.

``python -m kvops warmup`` (``warmup``) makes sure every kernel a model geometry needs is at hand, in the library
or the persistent cache, compiling what is missing into the cache."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from . import _cute
from ._targets import install_archs
from ._files import read_json_object
from .topk import SPECS as TOPK_SPECS
from ._checks import check_int
from .triattention.rope import head_dim_of
from .triattention.score import KV_DTYPES, check_scorer_class, scorer_spec

# Scorer shape classes built at install: head_dim 128 (64 rotary frequencies), GQA groups 1 (MHA) to 8, pages of
# 16, 32 and 64 tokens, every KV dtype (bf16, fp16, fp8 e4m3fn and e5m2). Any other class compiles once into the
# cache at first use.
SCORER_CLASSES = [(dtype, 64, group, page) for dtype in KV_DTYPES for group in (1, 2, 4, 8) for page in (16, 32, 64)]


def shipped_specs() -> list[_cute.Spec]:
    return [*TOPK_SPECS.values(), *(scorer_spec(*c) for c in SCORER_CLASSES)]


def build(out: Path, archs: tuple[str, ...] | None = None, jobs: int | None = None) -> None:
    """Compile every shipped spec for every arch and link them into the library at `out`. The compiles run in
    `jobs` processes (default: MAX_JOBS, as for kvops._C, else the CPU count), each exporting its objects."""
    archs = install_archs() if archs is None else archs
    if not archs:
        print(f"no arch of {_cute.ARCHS} in TORCH_CUDA_ARCH_LIST: no CuTe library (the kernels compile into the cache)")
        return
    todo = [(i, target) for target in archs for i in range(len(shipped_specs()))]
    jobs = max(1, min(len(todo), jobs or int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)))
    start = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        shares = [todo[j::jobs] for j in range(jobs)]
        if jobs == 1:
            objects = export_objects(shares[0], tmp, start)
        else:  # spawned: a forked child would inherit the parent's torch and DSL state
            from kvops import _cute_build  # this module by its name, also when run as __main__, so it pickles
            with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
                objects = [o for part in pool.map(_cute_build.export_objects, shares, [tmp] * jobs, [start] * jobs)
                           for o in part]
        _cute.export_library([], out, objects)
    _cute.save_sources_hash(out.with_name(_cute.SOURCES.name))
    print(f"{out}: {len(todo)} kernels for {', '.join(archs)} in {time.time() - start:.0f} s ({jobs} processes)")


def export_objects(share: list[tuple[int, str]], directory: str, start: float) -> list[str]:
    """Compile the shipped specs `share` lists (index, arch) and export each as an object in `directory`."""
    torch.set_num_threads(1)
    specs, objects = shipped_specs(), []
    for i, target in share:
        name = _cute.symbol(specs[i], target)
        objects.append(_cute.export_object(name, specs[i].build(target), directory))
        print(f"{name} ({time.time() - start:.0f} s)", flush=True)
    return objects


def _model_geometry(ap: argparse.ArgumentParser, model: str) -> tuple[int, int]:
    """(head_dim, group) from the config.json of a Hugging Face model directory (its text_config when nested)."""
    path = Path(model) / "config.json"
    if not Path(model).is_dir():
        ap.error(f"--model {model}: no such directory")
    try:
        config = read_json_object(str(path))
    except FileNotFoundError:
        ap.error(f"--model {model}: not a Hugging Face model directory (no config.json)")
    except ValueError as e:
        ap.error(f"--model {model}: {e}")
    config = config.get("text_config") or config
    if not isinstance(config, dict):
        ap.error(f"--model {model}: {path}'s text_config must be a JSON object")
    try:
        heads = check_int("config.json", "num_attention_heads", config.get("num_attention_heads"), 1)
        kv_heads = config.get("num_key_value_heads")
        kv_heads = heads if kv_heads is None else check_int("config.json", "num_key_value_heads", kv_heads, 1)
        if heads % kv_heads:
            raise ValueError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                             f"{kv_heads}")
        return head_dim_of(config), heads // kv_heads
    except (TypeError, ValueError) as e:
        ap.error(f"--model {model}: {e}")


def _positive(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def warmup(argv=None) -> int:
    """kvops warmup: the kernels of one model geometry, from the library or compiled into the cache."""
    ap = argparse.ArgumentParser(prog="kvops warmup", description=warmup.__doc__)
    ap.add_argument("--model", help="a Hugging Face model directory: head_dim and group from its config.json")
    ap.add_argument("--head-dim", type=_positive, help="dims per head (default 128)")
    ap.add_argument("--group", type=_positive, action="append", help="query heads per KV head (repeatable; default 4)")
    ap.add_argument("--page-size", type=_positive, action="append", help="tokens per page (repeatable; default 16)")
    ap.add_argument("--dtype", choices=[str(d).removeprefix("torch.") for d in KV_DTYPES], default="bfloat16")
    ap.add_argument("--arch", action="append", choices=_cute.ARCHS,
                    help="GPU arch (repeatable; default: this machine's GPU, or every arch the install builds)")
    args = ap.parse_args(argv)
    if args.model:
        if args.head_dim is not None or args.group:
            ap.error("--model gives head_dim and the group; pass --head-dim and --group without it")
        args.head_dim, group = _model_geometry(ap, args.model)
        args.group = [group]
    elif args.head_dim is None:
        args.head_dim = 128
    groups, pages = sorted(set(args.group or [4])), sorted(set(args.page_size or [16]))
    source, group_flag = (f"--model {args.model}: head_dim", "group") if args.model else ("--head-dim", "--group")
    if args.head_dim % 2:
        ap.error(f"{source} must be even (rotate-half RoPE pairs dims f and f + head_dim/2), got {args.head_dim}")
    for group in groups:
        try:  # the rule the scorer applies to its pools at run time
            check_scorer_class("kvops warmup", args.head_dim // 2, group)
        except ValueError as e:
            ap.error(f"{source} {args.head_dim} (F = {args.head_dim // 2}) with {group_flag} {group}: "
                     f"{str(e).removeprefix('kvops warmup: ')}")
    if args.arch:
        archs = list(dict.fromkeys(args.arch))
    elif torch.cuda.is_available():
        archs = [_cute.arch(torch.device("cuda"))]
        if archs[0] not in _cute.ARCHS:
            ap.error(f"this GPU is {archs[0]}; kvops builds CuTe kernels for {', '.join(_cute.ARCHS)} only "
                     "(pass --arch to warm those up)")
    else:
        archs = list(_cute.ARCHS)
    try:
        _cute.require_dsl()
    except ImportError as e:
        ap.error(f"the CuTe DSL cannot be used here: {e}")
    dtype = getattr(torch, args.dtype)
    specs = [*TOPK_SPECS.values(), *(scorer_spec(dtype, args.head_dim // 2, g, t) for g in groups for t in pages)]
    todo = [(spec, target) for target in archs for spec in specs]
    for i, (spec, target) in enumerate(todo, 1):
        before, start = _cute.compile_count, time.time()
        _cute.ffi_function(spec, target)
        how = "compiled into the cache" if _cute.compile_count > before else "ready"
        print(f"[{i}/{len(todo)}] {_cute.symbol(spec, target)}: {how} ({time.time() - start:.1f} s)", flush=True)
    print(f"cache: {_cute.cache_dir()}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvops._cute_build", description=__doc__)
    ap.add_argument("--out", type=Path, default=_cute.LIBRARY)
    ap.add_argument("--arch", action="append", help=f"GPU arch (repeatable; default {' '.join(_cute.ARCHS)}, "
                                                    f"narrowed by TORCH_CUDA_ARCH_LIST)")
    ap.add_argument("--jobs", type=int, help="compile processes (default: MAX_JOBS, else the CPU count)")
    args = ap.parse_args(argv)
    build(args.out, tuple(args.arch) if args.arch else None, args.jobs)
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
