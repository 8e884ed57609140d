"""Triton kernels built ahead of time (kvops/_triton.py, csrc/triton_aot.cpp): the install holds a cubin for every
declared kernel variant and target, a fresh process runs a whole round without Triton's compiler, a kernel without a
prebuilt cubin falls back to the JIT (once, with a warning), and the C++ launcher refuses bad arguments."""

import json
import os
import warnings

import pytest
import torch

from conftest import requires_cuda, run_python
from kvops import _C, _triton
from kvops._targets import install_archs


@pytest.mark.skipif(not _C.CUDA_KERNELS or not install_archs(), reason="an install without CUDA kernels or archs "
                    "builds no Triton kernels")
def test_the_install_holds_every_declared_kernel_for_every_target():
    built = {(e["symbol"], e["arch"]): e for e in _triton.installed()}
    assert _triton.KERNELS, "no Triton kernel is declared"
    for kernel in _triton.KERNELS.values():
        for variant in kernel.variants:
            for target in install_archs():
                entry = built[(kernel.symbol(variant), target)]
                assert entry["source"] == kernel.fn.cache_key, f"{entry['symbol']} was built from other sources"
                assert entry["params"].rstrip("s") == kernel.params


def test_a_variant_compiles_without_a_gpu():
    kernel = _triton.KERNELS["compaction_pack"]
    entry = _triton.compile_variant(kernel, kernel.variants[0], "sm_90a")
    assert entry["arch"] == "sm_90a" and entry["params"].startswith(kernel.params)
    assert set(entry["params"][len(kernel.params):]) <= {"s"}  # Triton's scratch pointers, left null
    assert len(entry["cubin"]) > 1000 and entry["num_warps"] == kernel.num_warps


def test_a_declaration_must_name_every_constexpr():
    fn = _triton.KERNELS["compaction_pack"].fn
    with pytest.raises(ValueError, match="a variant must give the constexprs"):
        _triton.Kernel("test_bad", fn, _triton.KERNELS["compaction_pack"].signature, variants=[{}])
    with pytest.raises(ValueError, match="declared twice"):
        _triton.Kernel("compaction_pack", fn, {}, variants=[])
    with pytest.raises(TypeError, match="takes 11 runtime arguments, got 2"):
        _triton.KERNELS["compaction_pack"][(1,)](torch.zeros(1), 3, BLOCK=512)


def test_register_refuses_bad_arguments():
    cubin = torch.ones(8, dtype=torch.uint8)
    register = torch.ops.kvops._triton_register
    for bad in (cubin.float(), cubin.to("meta")):  # a non-CPU cubin is named too, not a missing kernel
        with pytest.raises(ValueError, match="cubin must be"):
            register("t", "f", bad, "p", 4, 0)
    with pytest.raises(ValueError, match="params may hold only"):
        register("t", "f", cubin, "px", 4, 0)
    with pytest.raises(ValueError, match="num_warps"):
        register("t", "f", cubin, "p", 0, 0)
    register("test_same", "f", cubin, "p", 4, 0)
    register("test_same", "f", cubin, "p", 4, 0)  # the same kernel again: nothing changes
    with pytest.raises(ValueError, match="registered already"):
        register("test_same", "f", cubin + 1, "p", 4, 0)


@requires_cuda
def test_a_fresh_process_runs_rounds_without_compiling_any_triton_kernel(tmp_path):
    """Empty Triton and kvops caches: a whole round in each compaction order and mode (select, pack or fill lists,
    the move) runs, selects what the reference does, falls back to no JIT, and leaves Triton's cache empty. (The
    synthetic calibration's scorer class is not in the CuTe library: it compiles into the empty kvops cache.)"""
    triton_cache = tmp_path / "triton"
    triton_cache.mkdir()
    code = (
        "import warnings, torch\n"
        "warnings.filterwarnings('error', message='kvops: Triton kernel')  # a JIT fallback fails the test\n"
        "from types import SimpleNamespace\n"
        "from conftest import paged_pools, synthetic_calibration\n"
        "from test_triattention_select import _check\n"
        "from kvops.manager import TriAttentionRound\n"
        "from kvops.triattention import TriAttentionSelector\n"
        "cal = synthetic_calibration()\n"
        "for mode in ('union', 'per_head', 'per_layer_perhead'):\n"
        "    _check(cal, 'cuda', mode, budget=64, prompt=[3, 10], cache=[200, 150])  # against the reference\n"
        "    for order in ('ordered', 'fill'):\n"
        "        pools, table, N, P = paged_pools(cal, [3, 10], [200, 150], 16, 'cuda')\n"
        "        rnd = TriAttentionRound(TriAttentionSelector(cal, 64, mode, max_decode=256),\n"
        "                                SimpleNamespace(device=torch.device('cuda'), views=lambda: pools), 2,\n"
        "                                table.shape[1], 16, False, order)\n"
        "        table = torch.nn.functional.pad(table, (0, rnd.width - table.shape[1]), value=-1)\n"
        "        rnd.run(table, N.tolist(), P.tolist(), [0, 0], N.tolist())\n"
        "        assert rnd.params.new_lengths[:2].tolist() == (P + 64).tolist(), (mode, order)\n"
        "torch.cuda.synchronize()\n")
    run_python(code, TRITON_CACHE_DIR=str(triton_cache), KVOPS_CACHE_DIR=str(tmp_path / "kvops"),
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    assert not any(triton_cache.iterdir()), sorted(p.name for p in triton_cache.rglob("*"))[:10]


@requires_cuda
def test_without_a_prebuilt_cubin_the_kernel_compiles_with_triton_and_says_so_once(monkeypatch):
    from kvops.compaction.pack import pack_move_sources

    kept = torch.randint(0, 50, (3, 2, 8), dtype=torch.int32, device="cuda").sort(-1).values
    scored = torch.full((3,), 60, dtype=torch.int32, device="cuda")
    tail = torch.tensor([0, 3, 5], dtype=torch.int32, device="cuda")
    bases = torch.tensor([0, 2, 4], dtype=torch.int32, device="cuda")

    def run():
        sources = torch.full((3, 3, 16), 7, dtype=torch.int32, device="cuda")
        lengths = torch.full((3,), 7, dtype=torch.int32, device="cuda")
        pack_move_sources(kept, scored, tail, bases, sources, lengths)
        return sources, lengths

    prebuilt = run()
    monkeypatch.setattr(_triton, "_prebuilt", {_triton.arch(kept.device): {}})
    monkeypatch.setattr(_triton, "_registered", set())
    monkeypatch.setattr(_triton, "_warned", set())
    with pytest.warns(UserWarning, match="compaction_pack_BLOCK512 has no prebuilt cubin"):
        jit = run()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(torch.equal(a, b) for a, b in zip(run(), jit))
    assert all(torch.equal(a, b) for a, b in zip(prebuilt, jit))


@requires_cuda
def test_launch_refuses_bad_arguments():
    kernel = _triton.KERNELS["compaction_pack"]
    entry = next((e for e in _triton.installed() if e["arch"] == _triton.arch(torch.device("cuda")) and
                  e["symbol"].startswith("compaction_pack")), None)
    if entry is None:
        pytest.skip("no prebuilt kernel for this GPU")
    _triton._prebuilt_ready(kernel, entry["symbol"], torch.device("cuda"))
    launch = torch.ops.kvops._triton_launch
    t = torch.zeros(4, dtype=torch.int32, device="cuda")
    tensors, ints = [t] * 6, [0, 0, 0, 0, 4]
    with pytest.raises(ValueError, match="no prebuilt Triton kernel"):
        launch("not_a_kernel", [1, 1, 1], tensors, ints, [])
    with pytest.raises(ValueError, match="takes more ints than the 4 given"):
        launch(entry["symbol"], [1, 1, 1], tensors, ints[:4], [])
    with pytest.raises(ValueError, match="takes 6 tensors, 5 ints and 0 floats; got 6, 6 and 0"):
        launch(entry["symbol"], [1, 1, 1], tensors, ints + [1], [])
    with pytest.raises(ValueError, match="takes more tensors"):
        launch(entry["symbol"], [1, 1, 1], tensors[:5], ints, [])
    with pytest.raises(ValueError, match="takes CUDA tensors"):
        launch(entry["symbol"], [1, 1, 1], [t.cpu()] + tensors[1:], ints, [])
    with pytest.raises(ValueError, match="exceeds int32"):
        launch(entry["symbol"], [1, 1, 1], tensors, ints[:2] + [2**40] + ints[3:], [])
    with pytest.raises(ValueError, match="grid"):
        launch(entry["symbol"], [1, 1], tensors, ints, [])


def test_the_artifact_is_json_of_cubins():
    if not _triton.ARTIFACT.exists():
        pytest.skip("no Triton kernels were built (no CUDA kernels)")
    data = json.loads(_triton.ARTIFACT.read_text())
    assert {"symbol", "arch", "function", "params", "num_warps", "shared", "source", "cubin"} <= set(data["kernels"][0])
