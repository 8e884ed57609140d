"""Every Python snippet of README.md runs as pasted, each alone in a fresh interpreter (a reader may paste any one
of them). The vLLM snippet (```python vllm) runs in the vLLM venv: tests/with_vllm/test_readme_vllm.py."""

import re
from pathlib import Path

import pytest

from conftest import run_python

README = Path(__file__).resolve().parents[1] / "README.md"


BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_its_snippets():
    assert len(BLOCKS) >= 7, "README.md lost its Python snippets"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.split("\n", 1)[0][:40] for b in BLOCKS])
def test_readme_python_snippet_runs_alone(block):
    if "transformers" in block:
        pytest.importorskip("transformers")  # the transformers section's snippets
    run_python(block)
