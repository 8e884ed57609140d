"""Every Python snippet of README.md runs as pasted, in order, in one fresh interpreter (later snippets use what
earlier ones defined, as a reader going down the page would)."""

import re
from pathlib import Path

import pytest

from conftest import run_python

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_snippets_run_as_pasted():
    pytest.importorskip("transformers")  # the transformers section's snippets
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    assert len(blocks) >= 6, "README.md lost its Python snippets"
    run_python("\n".join(blocks))
