"""kvops calibrate: statistics of the pre-RoPE queries of tiny random transformers models, against the queries
captured where the model applies RoPE; the file round trip; the refusals."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import TINY, TINY_MODELS, run_python, tiny_model

transformers = pytest.importorskip("transformers")

from kvops.calibrate import (QueryStatistics, _split_line, attention_modules, calibrate, check_model_config,  # noqa: E402
                             layer_sensitivity, main)
from kvops.config import LayerSplit, TriAttentionConfig  # noqa: E402
from kvops.triattention import TriAttentionSelector, load_calibration  # noqa: E402


def _captured_queries(name, model, ids, window):
    """Every query the attention hands to RoPE, [tokens, H, D] per layer, captured by wrapping the modeling
    module's apply_rotary_pos_emb (independent of the hooks calibrate uses)."""
    module = sys.modules[f"transformers.models.{TINY_MODELS[name][1]}.modeling_{TINY_MODELS[name][1]}"]
    seen, original = [], module.apply_rotary_pos_emb

    def capture(q, k, cos, sin, *args, **kwargs):
        seen.append(q.detach().transpose(1, 2).reshape(-1, q.shape[1], q.shape[3]).double())  # [tokens, H, D]
        return original(q, k, cos, sin, *args, **kwargs)

    module.apply_rotary_pos_emb = capture
    try:
        with torch.no_grad():
            for start in range(0, ids.numel(), window):
                model(input_ids=ids[start:start + window][None], use_cache=False)
    finally:
        module.apply_rotary_pos_emb = original
    L = model.config.num_hidden_layers
    return [torch.cat(seen[layer::L]) for layer in range(L)]  # the layers run in order, once per window


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_statistics_equal_the_queries_attention_rotates(name):
    model = tiny_model(name)
    ids = torch.randint(0, TINY["vocab_size"], (300,))
    data = calibrate(model, ids, window=128)
    queries = _captured_queries(name, model, ids, 128)
    config = model.config.to_dict()
    F = 8  # every tiny model has head_dim 16
    assert data["metadata"]["tokens"] == 300 and len(data["stats"]) == 2 * model.config.num_attention_heads
    for layer, q in enumerate(queries):
        for head in range(model.config.num_attention_heads):
            re, im = q[:, head, :F], q[:, head, F:2 * F]
            s = data["stats"][f"layer{layer:02d}_head{head:02d}"]
            torch.testing.assert_close(s["q_mean_real"].double(), re.mean(0), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s["q_mean_imag"].double(), im.mean(0), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(s["q_abs_mean"].double(), (re * re + im * im).sqrt().mean(0), rtol=1e-5,
                                       atol=1e-6)
    cal = load_calibration(data, config)  # the dict as the file holds it
    assert cal.num_freqs == F and cal.num_kv_heads == model.config.num_key_value_heads
    assert set(QueryStatistics.MEASURED) == set(data["metadata"])  # what metadata= may not replace


def _restricted_loss(model, name, ids, layer, recent, sinks):
    """The summed loss of the second half of `ids` with layer `layer` limited to its first `sinks` and newest
    `recent` keys (None: no limit), by wrapping the modeling module's eager attention (independent of the
    forward pre-hooks layer_sensitivity uses)."""
    module = sys.modules[f"transformers.models.{TINY_MODELS[name][1]}.modeling_{TINY_MODELS[name][1]}"]
    original = module.eager_attention_forward

    def limited(attention, query, key, value, attention_mask, *args, **kwargs):
        if attention.layer_idx == layer and recent is not None:
            n = key.shape[2]
            t = torch.arange(n)
            far = (t[:, None] - t[None, :] >= recent) & (t[None, :] >= sinks)
            attention_mask = attention_mask.masked_fill(far, torch.finfo(attention_mask.dtype).min)
        return original(attention, query, key, value, attention_mask, *args, **kwargs)

    module.eager_attention_forward = limited
    try:
        with torch.no_grad():
            logits = model(input_ids=ids[None], use_cache=False).logits[0]
    finally:
        module.eager_attention_forward = original
    half = ids.numel() // 2
    return float(torch.nn.functional.cross_entropy(logits[half:-1].double(), ids[half + 1:], reduction="sum"))


@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_layer_sensitivity_is_the_loss_a_recent_window_adds(name):
    """Each layer limited in turn to its sinks and newest r keys, the loss over each window's second half, against
    the same loss through an attention wrapped at the modeling module (eager there, sdpa in the measurement); a
    window the size of the sequence adds nothing."""
    model = tiny_model(name)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, TINY["vocab_size"], (200,))
    got = layer_sensitivity(model, ids, window=128, windows=2, recent=(8, 32, 128), sinks=4)
    assert got["recent"].tolist() == [8, 32, 128] and got["sinks"] == 4 and got["tokens"] == 63 + 35
    assert got["nats"].dtype == torch.float32 and got["nats"].shape == (3, 2)
    model.config._attn_implementation = "eager"
    windows = [ids[:128], ids[128:]]
    for i, r in enumerate((8, 32)):
        for layer in range(2):
            want = sum(_restricted_loss(model, name, w, layer, r, 4) - _restricted_loss(model, name, w, layer, None, 4)
                       for w in windows) / got["tokens"]
            assert abs(float(got["nats"][i, layer]) - want) < 1e-4, (r, layer)
    assert got["nats"][:2].abs().max() > 1e-3  # the windows do limit something
    assert got["nats"][2].abs().max() < 1e-5   # a window of 128 limits nothing in 128-token sequences


def test_layer_sensitivity_replays_the_layers_below_the_limited_one(monkeypatch):
    """The layers below the limited one return the full forward's attention instead of attending again: the same
    nats, bit for bit, as computing every layer, with L + R x L(L+1)/2 attentions a window instead of
    (1 + R x L) x L."""
    import contextlib

    from kvops import calibrate as calibration_module

    model = tiny_model("qwen3")
    ids = torch.randint(0, TINY["vocab_size"], (200,))
    L, R = model.config.num_hidden_layers, 3
    computed = []
    for attention in attention_modules(model).values():
        attention.q_proj.register_forward_hook(lambda *_: computed.append(1))  # runs only where a layer attends
    replayed = layer_sensitivity(model, ids, window=128, windows=2, recent=(8, 32, 128), sinks=4)
    assert len(computed) == 2 * (L + R * L * (L + 1) // 2)
    computed.clear()
    monkeypatch.setattr(calibration_module, "_replayed", lambda *a: contextlib.nullcontext())
    every = layer_sensitivity(model, ids, window=128, windows=2, recent=(8, 32, 128), sinks=4)
    assert len(computed) == 2 * (1 + R * L) * L
    assert torch.equal(replayed["nats"], every["nats"]) and replayed["nats"].abs().max() > 1e-3
    assert all("forward" not in a.__dict__ for a in attention_modules(model).values())
    monkeypatch.undo()
    wrapped = attention_modules(model)[0]
    own = wrapped.forward  # an instance forward of the module's own (accelerate's hooks set one) stays
    wrapped.forward = own
    layer_sensitivity(model, ids, window=128, windows=1, recent=(8,), sinks=4)
    assert wrapped.__dict__["forward"] is own


def test_forwards_replaced_checks_every_entry_before_it_replaces_any():
    from kvops.calibrate import forwards_replaced

    model = tiny_model("qwen3")
    first, second = model.model.layers[0].mlp, model.model.layers[1].mlp
    for bad in ({first: print, "mlp": print}, {first: print, second: 3}):
        with pytest.raises(TypeError, match="forwards must map modules to callables"):
            with forwards_replaced(bad):
                pass
        assert "forward" not in first.__dict__ and "forward" not in second.__dict__


def test_a_calibration_file_carries_the_layer_sensitivity():
    """calibrate writes it (sensitivity_windows=0: not); load_calibration reads it back, for_layers keeps the
    layers' columns; a file without one (the shipped ones) loads with None; a malformed one is refused by name."""
    model = tiny_model("qwen3")
    model.config._attn_implementation = "sdpa"
    config = model.config.to_dict()
    ids = torch.randint(0, TINY["vocab_size"], (160,))
    data = calibrate(model, ids, window=80)
    entry = data["layer_sensitivity"]
    assert entry["nats"].shape == (3, 2) and entry["tokens"] == 39 + 39
    torch.testing.assert_close(entry["nats"], layer_sensitivity(model, ids, window=80)["nats"])
    cal = load_calibration(data, config)
    assert cal.layer_sensitivity.recent == (64, 256, 1024) and cal.layer_sensitivity.sinks == 16
    torch.testing.assert_close(cal.layer_sensitivity.nats, entry["nats"])
    torch.testing.assert_close(cal.for_layers([1]).layer_sensitivity.nats, entry["nats"][:, 1:])
    assert "layer_sensitivity" not in calibrate(model, ids, window=80, sensitivity_windows=0)
    assert "layer_sensitivity" not in calibrate(model, ids[:2])  # no second half to measure
    with pytest.raises(ValueError, match="at least 3 tokens"):
        layer_sensitivity(model, ids[:2])
    assert load_calibration({k: v for k, v in data.items() if k != "layer_sensitivity"}, config).layer_sensitivity \
        is None
    for bad, match in (({"recent": entry["recent"], "nats": entry["nats"]}, "dict of recent, nats and sinks"),
                       ({**entry, "recent": torch.tensor([64, 32, 1024])}, "recent must be increasing"),
                       ({**entry, "recent": torch.tensor([0, 32, 1024])}, r"recent\[0\] must be >= 1"),
                       ({**entry, "recent": entry["recent"].float()}, "1-D int64 tensor"),
                       ({**entry, "nats": entry["nats"][:, :1]}, r"has shape \(3, 1\)"),
                       ({**entry, "nats": entry["nats"] * float("nan")}, "NaN"),
                       ({**entry, "sinks": -1}, "sinks")):
        with pytest.raises(ValueError, match=match):
            load_calibration({**data, "layer_sensitivity": bad}, config)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="must take a 4-D mask"):  # refused before the statistics run
        calibrate(model, ids)
    for kw, error, match in ((dict(window=1), ValueError, "window must be >= 2"),
                             (dict(windows=0), ValueError, "windows must be >= 1"),
                             (dict(recent=(64, 8)), ValueError, "recent must be increasing"),
                             (dict(recent=(64, 64)), ValueError, "recent must be increasing"),
                             (dict(recent=()), TypeError, "recent must be a non-empty"),
                             (dict(recent=(8, "x")), TypeError, r"recent\[1\] must be an int"),
                             (dict(sinks=-1), ValueError, "sinks must be >= 0"),
                             (dict(window=2.0), TypeError, "window must be an int")):
        with pytest.raises(error, match=match):
            layer_sensitivity(model, ids, **kw)


def test_the_python_api_refuses_what_the_model_cannot_run():
    """Ids outside the vocabulary (the embedding would index outside its table), no tokens, a meta tensor, an
    object that is no model, and metadata that would replace measured fields are refused before the model runs;
    the model's train mode is restored."""
    model = tiny_model("qwen3").train()
    ids = torch.randint(0, TINY["vocab_size"], (20,))
    for args, kw, error, match in (
            ((model, torch.tensor([5, TINY["vocab_size"]])), {}, ValueError, "token_ids must be ids in"),
            ((model, torch.tensor([5, -1])), {}, ValueError, "token_ids must be ids in"),
            ((model, torch.zeros(0, dtype=torch.int64)), {}, ValueError, "at least one token"),
            ((model, torch.zeros(3, dtype=torch.int64, device="meta")), {}, ValueError, "at least one token"),
            ((object(), ids), {}, TypeError, "model must be a transformers model"),
            ((model, ids), {"metadata": [1]}, TypeError, "metadata must be a dict"),
            ((model, ids), {"metadata": {"tokens": 999}}, ValueError, "may not replace the measured fields"),
            ((model, ids), {"progress": "no"}, TypeError, "progress must be a bool"),
            ((model, ids), {"sensitivity_windows": -1}, ValueError, "sensitivity_windows must be >= 0"),
            ((model, ids), {"sensitivity_windows": True}, TypeError, "sensitivity_windows must be an int")):
        with pytest.raises(error, match=match):
            calibrate(*args, **kw)
    data = calibrate(model, ids, metadata={"note": "x"})
    assert data["metadata"]["note"] == "x" and data["metadata"]["tokens"] == 20 and model.training


def _tokenizer(text, directory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(directory)


def test_command_writes_a_file_the_selector_runs_on(tmp_path, capsys):
    text = "def f(x):\n    return [y * 2 for y in range(x) if y % 3]\n" * 60
    (tmp_path / "text.txt").write_text(text)
    model_dir = tmp_path / "model"
    tiny_model("qwen3").save_pretrained(model_dir)
    _tokenizer(text, model_dir)
    out = tmp_path / "cal.pt"
    assert main([str(model_dir), "--text", str(tmp_path / "text.txt"), "--max-tokens", "200", "--window", "64",
                 "--out", str(out), "--device", "cpu", "--budgets", "8,32"]) == 0
    printed = capsys.readouterr().out
    assert "200 tokens" in printed
    config = json.loads((model_dir / "config.json").read_text())
    cal = load_calibration(str(out), config)
    for budget in (8, 32):  # the split it prints is the one the config makes from the file
        split = TriAttentionConfig(budget=budget, beta=4, calibration_path=str(out), layer_split=True).layer_groups(cal)
        assert _split_line(budget, split) in printed.splitlines()
    assert _split_line(512, LayerSplit((0, 1, 3), 256, 896)) == \
        "layer_split at budget 512: layers 0, 1, 3 keep their newest 256 tokens, every other layer 896"
    assert _split_line(64, LayerSplit((), 64, 64)) == \
        "layer_split at budget 64: no layer is local (every layer scored at 64)"
    assert torch.load(out, weights_only=True)["metadata"]["tokens"] == 200
    assert torch.isfinite(cal.q_abs_mean).all() and (cal.q_abs_mean > 0).all()
    L, Hkv, T, D = 2, 2, 8, 16
    pools = [torch.randn(6, 2, Hkv, T, D).bfloat16() for _ in range(L)]
    table = torch.arange(6, dtype=torch.int32)[None]
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    kept = TriAttentionSelector(cal, 8).select(pools, table, i32(40), i32(4), i32(40).long(), validate=True)
    assert kept.shape == (1, 1, 8) and (kept >= 4).all() and (kept < 40).all()


@pytest.mark.parametrize("config, match", [
    (dict(model_type="phi", partial_rotary_factor=0.5, rope_theta=1e4), "partial_rotary_factor=0.5"),
    (dict(model_type="deepseek_v3", kv_lora_rank=512, q_lora_rank=1536, rope_theta=1e4), "latent attention"),
    (dict(model_type="gpt2"), "model_type 'gpt2' is not one"),
    (dict(model_type="qwen3", head_dim=16, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                                             "factor": 2.0}), "not supported"),
])
def test_refuses_attention_it_cannot_measure(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        check_model_config(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "t.txt").write_text("x")
    with pytest.raises(SystemExit) as e:  # refused before any weight is loaded
        main([str(tmp_path), "--text", str(tmp_path / "t.txt"), "--out", str(tmp_path / "c.pt")])
    assert e.value.code == 2 and not (tmp_path / "c.pt").exists()  # refused: no --out file, not even an empty one


def test_bad_command_lines(tmp_path):
    for argv in (["/nonexistent", "--text", "x", "--out", "y"], [str(tmp_path), "--text", "x", "--out", "y"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


def test_import_kvops_does_not_import_transformers():
    run_python("import sys, kvops\nassert 'transformers' not in sys.modules, 'import kvops imported transformers'")



# issue 30: bad input, second pass

TEXT = "def f(x):\n    return [y * 2 for y in range(x) if y % 3]\n" * 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 with its tokenizer, saved as a local model directory."""
    directory = tmp_path_factory.mktemp("model")
    tiny_model("qwen3").save_pretrained(directory)
    _tokenizer(TEXT, directory)
    return directory


def _refused(argv, capsys, match):
    """main(argv) is an argparse error: exit 2, the last stderr line names the flag and the rule, no traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert match in err.strip().splitlines()[-1] and err.strip().splitlines()[-1].startswith("kvops calibrate: error:")
    return err


def test_a_refused_run_keeps_an_existing_out_file_and_a_run_replaces_it_whole(tmp_path, model_dir, capsys):
    text, out = tmp_path / "t.txt", tmp_path / "cal.pt"
    text.write_text(TEXT)
    old = os.urandom(64)
    out.write_bytes(old)
    _refused([str(model_dir), "--text", str(text), "--out", str(out), "--window", "0"], capsys, "--window")
    assert out.read_bytes() == old
    # a text shorter than one window is one shorter window
    assert main([str(model_dir), "--text", str(text), "--out", str(out), "--window", "4096", "--max-tokens", "50",
                 "--device", "cpu"]) == 0
    assert torch.load(out, weights_only=True)["metadata"]["tokens"] == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.pt", "t.txt"]  # no temporary file left behind


def _bad_cases(tmp, model):
    """(argv, the error's text) for each misuse; `tmp` holds the inputs they need."""
    text = tmp / "t.txt"
    text.write_text(TEXT)
    (tmp / "binary.txt").write_bytes(b"\xff\xfe\x00\x81" + os.urandom(64))
    (tmp / "empty.txt").write_text("")
    config = json.loads((model / "config.json").read_text())
    for name, body in (("float_head_dim", json.dumps({**config, "head_dim": 16.5})), ("garbage", "{not json"),
                       ("list", "[1, 2]"), ("unknown", '{"model_type": "nonesuch"}'),
                       ("bad_rope", json.dumps({**config, "rope_parameters": {"rope_type": "yarn",
                                                                               "rope_theta": 1e4}}))):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(body)
    (tmp / "no_config").mkdir()
    (tmp / "no_tokenizer").mkdir()
    (tmp / "no_tokenizer" / "config.json").write_text((model / "config.json").read_text())
    (tmp / "big_vocab").mkdir()  # a tokenizer whose ids the model's embedding does not have
    for f in model.iterdir():
        (tmp / "big_vocab" / f.name).write_bytes(f.read_bytes())
    (tmp / "big_vocab" / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    (tmp / "no_weights").mkdir()
    (tmp / "truncated").mkdir()  # safetensors raises its own SafetensorError on it
    for f in model.iterdir():
        if not f.name.endswith(".safetensors"):
            (tmp / "no_weights" / f.name).write_bytes(f.read_bytes())
        data = f.read_bytes()
        (tmp / "truncated" / f.name).write_bytes(data[:len(data) // 2] if f.name.endswith(".safetensors") else data)
    weights = [f.name for f in model.iterdir() if f.name.endswith(".safetensors")]

    def ok(directory=model, t=text, out=tmp / "c.pt"):
        return [str(directory), "--text", str(t), "--out", str(out)]

    cases = [
        (ok() + ["--device", "gpu7"], "--device gpu7: expected cpu, cuda or cuda:N"),
        (ok() + ["--device", "meta"], "--device meta: expected cpu, cuda or cuda:N"),
        (ok() + ["--device", "cuda:99"], "--device cuda:99"),
        (ok(directory=tmp / "absent"), "no such directory"),
        (ok(directory=tmp / "no_config"), "no config.json"),
        (ok(directory=tmp / "garbage"), "not a readable JSON model config"),
        (ok(directory=tmp / "list"), "must hold a JSON object"),
        (ok(directory=tmp / "unknown"), "transformers cannot read it"),
        (ok(directory=tmp / "float_head_dim"), "transformers cannot read it"),
        (ok(directory=tmp / "bad_rope"), "'factor'"),
        (ok(directory=tmp / "no_tokenizer"), "makes no tokens of it"),
        (ok(directory=tmp / "big_vocab"), "the model's vocab_size is 100"),
        (ok(directory=tmp / "no_weights"), "cannot load the model's weights"),
        (ok(directory=tmp / "truncated"), f"{tmp / 'truncated' / weights[0] if len(weights) == 1 else tmp / 'truncated'}: "
                                          f"cannot load the model's weights"),
        (ok(t=tmp / "binary.txt"), "not UTF-8 text"),
        (ok(t=tmp / "empty.txt"), "the file is empty"),
        (ok(t=tmp / "absent.txt"), "cannot read it (No such file or directory)"),
        (ok(t=tmp), "cannot read it"),
        (ok() + ["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (ok() + ["--max-tokens", "-1"], "--max-tokens must be >= 1, got -1"),
        (ok() + ["--window", "0"], "--window must be >= 1, got 0"),
        (ok() + ["--sensitivity-windows", "-1"], "--sensitivity-windows must be >= 0"),
        (ok() + ["--window", "1"], "needs --window >= 2"),
        (ok() + ["--budgets", "0"], "--budgets must be positive integers"),
        (ok() + ["--budgets", "128,x"], "--budgets must be positive integers"),
        (ok() + ["--budgets", ""], "--budgets must be positive integers"),
        (ok(out=tmp / "missing" / "c.pt"), "does not exist"),
        (ok(out=tmp), "is a directory"),
        (ok(out=text), "is the --text file"),
    ]
    if not torch.cuda.is_available():
        cases.append((ok() + ["--device", "cuda"], "--device cuda: no CUDA GPU"))
    return cases


def test_every_misuse_is_an_argparse_error_that_writes_nothing(tmp_path, model_dir, capsys):
    cases = _bad_cases(tmp_path, model_dir)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    for argv, match in cases:
        _refused(argv, capsys, match)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before  # nothing written, nothing created


def test_python_m_kvops_calibrate_misuse_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvops", "calibrate", str(tmp_path), "--text", "x", "--out", "y",
                          "--device", "gpu7"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("kvops calibrate: error:")


def test_the_help_names_every_option_in_its_usage_line():
    """--help's description shows the command with every option, without a run of stray spaces (a line
    continuation inside the docstring once joined two lines)."""
    import re

    from kvops import calibrate as module

    usage = module.__doc__.split("::", 1)[1].strip().split("\n\n", 1)[0]
    for option in ("--text", "--out", "--max-tokens", "--window", "--sensitivity-windows", "--budgets", "--device",
                   "--dtype"):
        assert option in usage, option
    assert not re.search(r"\S {3,}\S", usage), usage
