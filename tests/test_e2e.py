"""benchmarks/e2e.py on the CPU (--tiny): the mechanics of the end-to-end comparison, not its speed."""

import json

import pytest

pytest.importorskip("transformers")

from benchmarks.e2e import main  # noqa: E402


def test_tiny_run_fills_decodes_and_reports(tmp_path, capsys):
    path = tmp_path / "e2e.json"
    assert main(["--tiny", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "mechanics" in printed  # says a tiny random model shows no speed
    assert "{" not in printed  # the table alone on stdout; each row's JSON is progress, on stderr
    assert len([line for line in captured.err.splitlines() if line.startswith("{")]) == 5
    out = json.loads(path.read_text())
    rows = {r["cache"]: r for r in out["rows"]}
    assert sorted(rows) == ["default", "dense-static", "kvops", "kvops-split-static", "kvops-static"]
    # 160 tokens held by the dense caches, at most prompt + budget + beta + 1 = 73 slots by kvops
    for name in ("kvops", "kvops-static"):
        r = rows[name]
        assert r["capacity_tokens"] == 16 + 48 + 8 + 1
        assert 0 < r["kv_bytes"] <= rows["default"]["kv_bytes"] * 73 / 160
        assert r["decode_rounds"] >= 1 and r["decode_round_s"] > 0  # 12 timed steps at beta 8
    # layer 0 local at 24 tokens, layer 1 scored at the other 72 of 2 x 48: its pool is the larger
    split = rows["kvops-split-static"]
    assert split["capacity_tokens"] == 16 + 72 + 8 + 1 and split["decode_round_s"] > 0
    assert 0 < split["kv_bytes"] <= rows["default"]["kv_bytes"] * (16 + 48 + 8 + 1) / 160
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0
        # the floor counts the weights and what the cache holds: kvops reads fewer bytes than the dense caches
        assert r["step_read_bytes"] > out["weight_bytes"]
    assert rows["kvops"]["step_read_bytes"] < rows["dense-static"]["step_read_bytes"]
    assert "vs dense-static" in printed and "1.00x" in printed  # dense-static against itself


def test_arguments_are_checked(capsys):
    for argv in (["--tiny", "--peak"], ["--tiny", "--context", "8"], ["--tiny", "--context", "x"],
                 ["--tiny", "--caches", "dense"], ["--tiny", "--batch", "0"], ["--tiny", "--split-scored", "2"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


def test_peak_steps_down_while_the_benchmark_runs_out_of_memory(monkeypatch, capsys):
    """--peak: a batch _fits admitted but the fill or the compiled step could not hold is stepped down by 1/8."""
    import argparse

    import torch

    from benchmarks import e2e

    measured = []

    def measure(name, model, calibration, ids, args, device, r):
        measured.append(ids.shape[0])
        r["phase"] = "fill"
        if ids.shape[0] > 3:
            raise torch.cuda.OutOfMemoryError("fake")
        del r["phase"]
        r.update(kv_bytes=1, decode_s=1.0, tokens_per_s=1.0)

    monkeypatch.setattr(e2e, "_measure", measure)
    monkeypatch.setattr(e2e, "_peak_batch", lambda *a: 5)
    args = argparse.Namespace(tiny=True, batch=0, context=[32], prompt=16, new_tokens=4, budget=8, beta=4,
                              mode="union", caches=["kvops-static"], attention="kvops", dense_attention="kvops",
                              peak=True)
    out = e2e.run(args)
    assert measured == [5, 4, 3]
    assert [(r["batch"], r["peak"], r.get("oom", False)) for r in out["rows"]] == [(3, True, False)]
    printed = capsys.readouterr().err  # progress
    assert printed.count('"oom": true') == 2 and printed.count('"phase": "fill"') == 2  # each failed batch, where


def test_bounded_mlps_give_the_same_values_and_restore_the_model():
    """The fill's MLPs in slices of a few tokens: the same hidden states as the whole forward (each token's MLP
    alone), and the model as it was afterwards (no instance forward left for generate to compile)."""
    import torch

    from benchmarks import e2e

    model = e2e._model(e2e.TINY, "cpu")
    ids = torch.randint(1, e2e.TINY["vocab_size"], (3, 11))
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        calls = []
        mlp = model.model.layers[0].mlp
        forward = mlp.forward
        mlp.forward = lambda x: calls.append(x.shape) or forward(x)  # counts the slices reaching the MLP
        with e2e._bounded_mlps(model, tokens=4):
            bounded = model(input_ids=ids).logits
        del mlp.forward
    assert torch.equal(bounded, whole)
    assert calls == [(4, 64)] * 8 + [(1, 64)]  # 33 tokens in slices of 4
    assert all("forward" not in layer.mlp.__dict__ for layer in model.model.layers)
