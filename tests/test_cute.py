"""The CuTe kernels ahead of time (kvops/_cute.py): the library built at install, the persistent cache, warm-up.

These run without a GPU: compiling for an arch, exporting, linking and loading need none (calling does; the GPU
tests of the ops call them)."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("cutlass")
pytest.importorskip("tvm_ffi")

from kvops import _cute  # noqa: E402
from kvops._cute_build import install_archs, shipped_specs  # noqa: E402

# A scorer class the install does not build (group 3), so it must come from the cache.
UNSHIPPED = "from kvops.triattention.score import scorer_spec; spec = scorer_spec(torch.bfloat16, 64, 3, 16)\n"


def _python(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", "import torch\nfrom kvops import _cute\n" + code],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.skipif(os.environ.get("KVOPS_NO_CUTE") == "1" or not install_archs(),
                    reason="installed without the CuTe library")
def test_the_installed_library_holds_every_shipped_kernel():
    import tvm_ffi

    assert _cute.LIBRARY.exists(), f"{_cute.LIBRARY} was not built (setup.py runs python -m kvops._cute_build)"
    library = tvm_ffi.load_module(str(_cute.LIBRARY))
    missing = []
    for target in install_archs():
        for spec in shipped_specs():
            try:
                library[_cute.symbol(spec, target)]
            except AttributeError:
                missing.append(_cute.symbol(spec, target))
    assert not missing, missing


def test_a_kernel_outside_the_library_compiles_once_into_the_cache_and_a_second_process_reuses_it(tmp_path):
    code = UNSHIPPED + "fn = _cute.ffi_function(spec, 'sm_90a'); print(_cute.compile_count, type(fn).__name__)\n"
    env = dict(KVOPS_CACHE_DIR=str(tmp_path))
    assert _python(code, **env).split() == ["1", "Function"]
    assert _python(code, **env).split() == ["0", "Function"]  # loaded from the cache: no compile
    assert len(list(tmp_path.glob("cute-*/kvops_score_bfloat16_f64_g3_t16_sm_90a_*.so"))) == 1


def test_a_library_without_a_kernel_falls_back_to_the_cache(tmp_path):
    """A library holding only the vector top-k: that one comes from it, the scalar one is compiled (once)."""
    code = ("from pathlib import Path\nfrom kvops.topk import SPECS\n"
            f"_cute.export_library([(_cute.symbol(SPECS[True], 'sm_90a'), SPECS[True].build('sm_90a'))], "
            f"Path({str(tmp_path / 'lib.so')!r}))\n")
    _python(code)
    code = ("from pathlib import Path\nfrom kvops.topk import SPECS\n"
            f"_cute.LIBRARY = Path({str(tmp_path / 'lib.so')!r})\n"
            "_cute.ffi_function(SPECS[True], 'sm_90a'); print(_cute.compile_count)\n"
            "_cute.ffi_function(SPECS[False], 'sm_90a'); print(_cute.compile_count)\n")
    assert _python(code, KVOPS_CACHE_DIR=str(tmp_path / "cache")).split() == ["0", "1"]


def test_two_processes_compiling_one_kernel_at_once_compile_it_once(tmp_path):
    code = UNSHIPPED + "_cute.ffi_function(spec, 'sm_100a'); print(_cute.compile_count)\n"
    env = {**os.environ, "KVOPS_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", "import torch\nfrom kvops import _cute\n" + code], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    counts = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        counts.append(int(out.split()[-1]))
    assert sorted(counts) == [0, 1]


def test_warmup_fills_the_cache_for_a_geometry(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvops", "warmup", "--arch", "sm_90a", "--group", "3"],
                         env={**os.environ, "KVOPS_CACHE_DIR": str(tmp_path)}, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"[3/3] kvops_score_bfloat16_f64_g3_t16_sm_90a_{_cute.sources_hash()}: compiled into the cache" in out.stdout
    # the top-k kernels come from the library when the install built it
    assert len(list(tmp_path.glob("cute-*/*.so"))) == (1 if _cute.LIBRARY.exists() else 3)


def test_warmup_reads_the_geometry_from_a_model_config(tmp_path):
    (tmp_path / "config.json").write_text('{"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 384}')
    out = subprocess.run([sys.executable, "-m", "kvops", "warmup", "--model", str(tmp_path), "--arch", "sm_90a",
                          "--page-size", "32"], env={**os.environ, "KVOPS_CACHE_DIR": str(tmp_path / "cache")},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kvops_score_bfloat16_f32_g3_t32_sm_90a" in out.stdout  # head_dim 384 / 6 = 64: 32 frequencies; group 3


def test_an_old_dsl_is_refused_with_a_clear_message(monkeypatch):
    import cutlass

    monkeypatch.setattr(cutlass, "__version__", "4.3.5")
    with pytest.raises(ImportError, match=r"nvidia-cutlass-dsl >= 4\.8\.1 \(found 4\.3\.5\)"):
        _cute.require_dsl()


def test_arch_names():
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        assert _cute.arch(torch.device("cuda")) == f"sm_{major}{minor}a"
    assert _cute.symbol(shipped_specs()[0], "sm_90a") == f"kvops_topk_vector_sm_90a_{_cute.sources_hash()}"


# issue 30: bad input, second pass

def _model(tmp_path, body):
    (tmp_path / "m").mkdir()
    if body is not None:
        (tmp_path / "m" / "config.json").write_text(body)
    return ["--model", str(tmp_path / "m")]


@pytest.mark.parametrize("argv, match", [
    (["--head-dim", "40"], "--head-dim 40 (F = 20) with --group 4: the GPU scorer needs F a multiple of 8"),
    (["--head-dim", "40", "--group", "8"], "F a multiple of 4 with F/4 a power of two <= 32, got F=20"),
    (["--head-dim", "96", "--group", "2"], "F a multiple of 8 with F/8 a power of two <= 32, got F=48"),
    (["--head-dim", "1024"], "F/8 a power of two <= 32, got F=512"),
    (["--head-dim", "131"], "must be even"),
    (["--head-dim", "0"], "argument --head-dim: must be >= 1, got 0"),
    (["--group", "0"], "argument --group: must be >= 1, got 0"),
    (["--group", "-3"], "argument --group: must be >= 1, got -3"),
    (["--group", "two"], "argument --group: expected an int, got 'two'"),
    (["--page-size", "0"], "argument --page-size: must be >= 1, got 0"),
    (["--arch", "sm_75"], "argument --arch: invalid choice: 'sm_75'"),
    (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such directory"),
    ("no config", "no config.json"),
    ("{not json", "not a readable JSON model config"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"hidden_size": 384}', "num_attention_heads must be an int, got NoneType"),
    ('{"num_attention_heads": 6, "num_key_value_heads": 4, "hidden_size": 384}', "is not a multiple of"),
    ('{"num_attention_heads": 6, "head_dim": 64.5}', "head_dim must be an int"),
    ('{"num_attention_heads": "6", "hidden_size": 384}', "num_attention_heads must be an int"),
    ('{"num_attention_heads": 6, "hidden_size": 240}', "F a multiple of 8 with F/8 a power of two <= 32, got F=20"),
])
def test_warmup_misuse_is_an_argparse_error(tmp_path, capsys, argv, match):
    from kvops._cute_build import warmup

    if isinstance(argv, str):
        argv = _model(tmp_path, None if argv == "no config" else argv)
    with pytest.raises(SystemExit) as e:
        warmup(argv + ["--arch", "sm_90a"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and last.startswith("kvops warmup: error:") and match in last, last


def test_warmup_model_and_explicit_geometry_do_not_mix(tmp_path, capsys):
    from kvops._cute_build import warmup

    argv = _model(tmp_path, '{"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 384}')
    with pytest.raises(SystemExit) as e:
        warmup(argv + ["--group", "4", "--arch", "sm_90a"])
    assert e.value.code == 2 and "pass --head-dim and --group without it" in capsys.readouterr().err


def test_warmup_refuses_a_gpu_kvops_builds_no_kernels_for(monkeypatch, capsys):
    from kvops._cute_build import warmup

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_cute, "arch", lambda device: "sm_80a")
    with pytest.raises(SystemExit) as e:
        warmup([])
    assert e.value.code == 2 and "this GPU is sm_80a" in capsys.readouterr().err


# issue 31: the kernel sources are found, not listed

def test_the_kernel_sources_are_found_from_what_imports_cutlass():
    """Every file with CuTe code or a spec is hashed (a kernel file cannot be missed), with the kvops modules those
    import outside functions; modules no kernel depends on are not (editing them keeps the library valid)."""
    import re
    from pathlib import Path

    root = Path(_cute.__file__).parent
    found = {p.relative_to(root).as_posix() for p in _cute.kernel_sources()}
    for path in root.rglob("*.py"):
        text = path.read_text()
        if re.search(r"@cute\.(jit|kernel)|\bSpec\(|^\s*(import|from) cutlass", text, re.M):
            assert path.relative_to(root).as_posix() in found, path
    assert {"_cute.py", "topk/ops.py", "topk/radix_cute.py", "topk/reference.py",
            "triattention/score.py", "triattention/score_cute.py"} <= found
    assert not found & {"__main__.py", "manager.py", "config.py", "compaction/compact.py", "triattention/select.py"}


def test_the_kernel_sources_follow_module_level_imports(tmp_path):
    """_imports: cutlass anywhere counts; kvops imports count outside functions, a submodule by its own name."""
    from pathlib import Path

    mod = tmp_path / "m.py"
    mod.write_text("from .. import _cute\nfrom .x import y\nimport kvops.z\n"
                   "def f():\n    import cutlass\n    from . import w\n")
    modules = {name: Path(name) for name in ("kvops", "kvops._cute", "kvops.p.x", "kvops.z", "kvops.p.w")}
    assert _cute._imports(mod, "kvops.p.m", modules) == (True, {"kvops._cute", "kvops.p.x", "kvops.z"})


def test_the_saved_sources_hash_is_used_only_while_no_module_changed(tmp_path, monkeypatch):
    """sources_hash() reads the build's saved hash (no parsing of the package at a first round) while every module
    has the size and modification time the build saw, and recomputes it otherwise."""
    import json

    saved = tmp_path / "sources.json"
    monkeypatch.setattr(_cute, "SOURCES", saved)
    _cute.save_sources_hash(saved)
    data = json.loads(saved.read_text())
    assert data["hash"] == _cute._hash_sources() and "_cute.py" in data["files"]
    try:
        saved.write_text(json.dumps({**data, "hash": "saved-hash"}))
        _cute.sources_hash.cache_clear()
        assert _cute.sources_hash() == "saved-hash"
        data["files"]["_cute.py"][1] += 1  # a module edited since the build
        saved.write_text(json.dumps({**data, "hash": "saved-hash"}))
        _cute.sources_hash.cache_clear()
        assert _cute.sources_hash() == _cute._hash_sources()
        saved.write_text("{not json")
        _cute.sources_hash.cache_clear()
        assert _cute.sources_hash() == _cute._hash_sources()
    finally:
        _cute.sources_hash.cache_clear()
