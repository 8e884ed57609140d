"""README.md's vLLM snippet runs as pasted (the model id swapped for the test model), in a fresh interpreter with
vLLM's default multiprocessing: the engine core and the worker in processes of their own, each loading the plugin
from its entry point."""

import os
import re
import subprocess
import sys
from pathlib import Path

from vllm_env import model_dir  # noqa: F401  (fixture)

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_vllm_snippet_runs(model_dir, tmp_path):
    (snippet,) = re.findall(r"^```python vllm\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    code, n = re.subn(r'^MODEL_DIR = ".*?"', f"MODEL_DIR = {model_dir!r}", snippet, flags=re.M)
    assert n == 1
    (tmp_path / "snippet.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    out = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env | {"VLLM_CPU_KVCACHE_SPACE": "1"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    runs = [line for line in out.stdout.splitlines() if line.startswith("[")]
    assert len(runs) == 2 and all(len(eval(r)) == 16 for r in runs), out.stdout[-2000:]


def test_readme_eviction_snippet_runs(model_dir, tmp_path):
    """The eviction snippet as pasted (model and calibration swapped for the test model's), multiprocess."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvops.calibrate import calibrate

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(1, model.config.vocab_size, (1024,), generator=torch.Generator().manual_seed(0))
    torch.save(calibrate(model, ids, window=512, sensitivity_windows=0), tmp_path / "calibration.pt")
    (snippet,) = re.findall(r"^```python vllm-eviction\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    code, n = re.subn(r'^MODEL_DIR = ".*?"', f"MODEL_DIR = {model_dir!r}", snippet, flags=re.M)
    code, m = re.subn(r'^CALIBRATION = ".*?"', 'CALIBRATION = "calibration.pt"', code, flags=re.M)
    assert n == m == 1
    (tmp_path / "snippet.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    out = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env | {"VLLM_CPU_KVCACHE_SPACE": "1"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "1024 tokens, each step attending" in out.stdout, out.stdout[-2000:]
    assert "KvopsEvictionConnector: TriAttention per_head, budget 512, beta 64" in out.stdout + out.stderr


def test_the_installed_wheel_runs_the_readme_codec_snippet(tmp_path):
    """This venv's kvops is a wheel (scripts/install_vllm.sh: pip wheel, then pip install), built against vLLM's
    torch: the README's codec snippet runs on it from outside the source tree."""
    import kvops

    assert "site-packages" in kvops.__file__, kvops.__file__
    (snippet,) = [b for b in re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
                  if "PageBlobCodec(" in b]
    out = subprocess.run([sys.executable, "-c", snippet + "\nimport kvops; print(kvops.__file__)"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "site-packages" in out.stdout
