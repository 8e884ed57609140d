"""setup.py's build decisions, checked in seconds without building: the CUDA toolkit it finds (or refuses at once)
and the torch release the wheel requires."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def setup_py(*args, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH", "KVOPS_NO_CUDA")}
    return subprocess.run([sys.executable, "setup.py", *args], cwd=ROOT, env=base | env, capture_output=True,
                          text=True, timeout=300)


def test_a_cuda_home_that_is_no_toolkit_fails_at_once_naming_it(tmp_path):
    out = setup_py("--name", CUDA_HOME=str(tmp_path))
    if torch.version.cuda is None:  # a CPU torch never looks for a toolkit
        assert out.returncode == 0
        return
    assert out.returncode != 0
    assert f"CUDA_HOME={tmp_path} is not a CUDA toolkit (no include/cuda_runtime.h)" in out.stderr
    assert "KVOPS_NO_CUDA=1" in out.stderr


def test_a_cpu_build_is_said_and_the_wheel_pins_this_torch(tmp_path):
    out = setup_py("--name", KVOPS_NO_CUDA="1", CUDA_HOME=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "building the CPU kernels only (KVOPS_NO_CUDA=1)" in out.stderr
    code = ("import runpy, setuptools, sys; seen = {}; setuptools.setup = lambda **kw: seen.update(kw); "
            "runpy.run_path('setup.py'); print(seen['install_requires'])")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"} | {"KVOPS_NO_CUDA": "1"}
    req = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert req.returncode == 0, req.stderr
    assert f"torch=={torch.__version__.split('+')[0]}" in req.stdout and "cutlass" not in req.stdout
