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
    assert out["kvops_capacity_tokens"] == 16 + 48 + 8 + 1
    assert 0 < out["kvops_kv_bytes"] <= out["default_kv_bytes"] * 73 / 160
    assert out["kvops_decode_rounds"] >= 1 and out["kvops_decode_round_s"] > 0  # 12 steps at beta 8
    assert out["default_tokens_per_s"] > 0 and out["kvops_tokens_per_s"] > 0
