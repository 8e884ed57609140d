"""The main job runs end to end (tiny preset on the CPU; the GPU preset on the device)."""

import json

import torch

from conftest import requires_cuda
from kvops.__main__ import main
from kvops.demo import run


def _check(r):
    assert r["eviction_rounds"] >= 1 and r["pages_freed_by_eviction"] > 0
    assert r["kv_bytes_with_eviction"] < r["kv_bytes_without_eviction"]
    assert r["cold_page_bytes"] * 3.5 < r["hot_page_bytes"]
    assert 0 < r["codec_rel_rms_error"]["K"] < 0.15 and 0 < r["codec_rel_rms_error"]["V"] < 0.15


def test_tiny_preset_on_cpu(tmp_path):
    assert main(["demo", "--device", "cpu", "--json", str(tmp_path / "demo.json")]) == 0
    _check(json.loads((tmp_path / "demo.json").read_text()))


@requires_cuda
def test_gpu_preset():
    _check(run("gpu", "cuda", torch.bfloat16, log=lambda *a: None))


def test_cli_errors_are_one_line(tmp_path, capsys):
    import pytest

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            main(["demo", "--device", "cuda"])
        assert e.value.code == 2 and "no CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # refused before the run, not after it
        main(["demo", "--device", "cpu", "--json", str(tmp_path / "missing" / "demo.json")])
    assert e.value.code == 2 and "cannot write there" in capsys.readouterr().err


def test_info_and_usage(capsys):
    from kvops import _C, _cute

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out
    # what was built: the CUDA kernels as kvops._C says, the CuTe library as the file is there
    assert _C.CUDA_KERNELS in (0, 1)
    assert f"CUDA kernels {'yes' if _C.CUDA_KERNELS else 'no'}" in out
    assert f"CuTe library {'yes' if _cute.LIBRARY.is_file() else 'no'}" in out
    from kvops import _triton  # every prebuilt Triton kernel, by name and arch

    assert f"prebuilt Triton kernels: {len(_triton.installed())}" in out
    assert all(f"  {e['symbol']} {e['arch']} " in out for e in _triton.installed())
    assert main([]) == 2 and main(["nope"]) == 2


# issue 30: bad input, second pass

def test_usage_errors_go_to_stderr(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert not captured.out and captured.err.strip().splitlines()[-1].startswith("kvops: error: a command is required")
    assert main(["bogus"]) == 2
    err = capsys.readouterr().err
    assert "kvops: error: unknown command 'bogus' (choose from demo, calibrate, warmup, info)" in err
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: kvops demo" in out and all(f"\n  {c} " in out for c in ("demo", "calibrate", "warmup", "info"))


def test_info_takes_only_help(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["info", "--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["info", "--help"])
    assert e.value.code == 0 and "kvops info" in capsys.readouterr().out


def test_demo_json_is_written_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    import pytest

    import kvops.demo

    def fail(*args, **kwargs):
        raise RuntimeError("the run failed")

    monkeypatch.setattr(kvops.demo, "run", fail)
    with pytest.raises(RuntimeError):  # a run that fails after the checks leaves no --json file behind
        main(["demo", "--device", "cpu", "--json", str(tmp_path / "demo.json")])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SystemExit) as e:
        main(["demo", "--device", "cpu", "--json", str(tmp_path)])
    assert e.value.code == 2 and "is a directory" in capsys.readouterr().err
