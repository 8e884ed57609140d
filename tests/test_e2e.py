"""benchmarks/e2e.py on the CPU (--tiny): the mechanics of the end-to-end comparison, not its speed."""

import json

import pytest

pytest.importorskip("transformers")

from benchmarks.e2e import main  # noqa: E402


def test_tiny_run_fills_decodes_and_reports(tmp_path, capsys):
    path = tmp_path / "e2e.json"
    assert main(["--tiny", "--json", str(path)]) == 0
    out = json.loads(path.read_text())
    assert "mechanics" in capsys.readouterr().out  # says a tiny random model shows no speed
    # 160 tokens held by the default cache, at most prompt + budget + beta + 1 = 73 slots by kvops
    default = out["default"]
    for name in ("kvops", "kvops-static"):
        r = out[name]
        assert r["capacity_tokens"] == 16 + 48 + 8 + 1
        assert 0 < r["kv_bytes"] <= default["kv_bytes"] * 73 / 160
        assert r["decode_rounds"] >= 1 and r["decode_round_s"] > 0  # 12 timed steps at beta 8
        assert r["tokens_per_s"] > 0
    assert default["tokens_per_s"] > 0
