"""TriAttention calibration loading, RoPE parameters, and the float64 reference's own sanity."""

import math
import os
import pickle

import pytest
import torch

from kvops.triattention.calibration import SHIPPED, LayerSensitivity, load_calibration
from kvops.triattention.reference import mean_phase_reference, normalize_reference, reduce_reference
from kvops.triattention.rope import rope_parameters

QWEN3_8B, GPT_OSS_120B = (SHIPPED[name].model_config for name in ("qwen3-8b", "gpt-oss-120b"))


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_files_load_and_match_the_file(name):
    config, path = SHIPPED[name].model_config, SHIPPED[name].path
    cal = load_calibration(name, config)
    L, Hq, D = config["num_hidden_layers"], config["num_attention_heads"], config["head_dim"]
    assert (cal.num_layers, cal.num_query_heads, cal.num_freqs, cal.num_kv_heads) == (L, Hq, D // 2, 8)
    raw = torch.load(path, weights_only=True)["stats"]
    for layer, head in [(0, 0), (L - 1, Hq - 1), (int(torch.randint(L, ())), int(torch.randint(Hq, ())))]:
        s = raw[f"layer{layer:02d}_head{head:02d}"]
        assert torch.equal(cal.q_mean[layer, head].real, s["q_mean_real"])
        assert torch.equal(cal.q_mean[layer, head].imag, s["q_mean_imag"])
        assert torch.equal(cal.q_abs_mean[layer, head], s["q_abs_mean"])
    omega, fss = rope_parameters(config)
    assert torch.equal(cal.omega, omega) and torch.equal(cal.freq_scale_sq, fss)


def _official(L=2, Hq=4, F=8):
    stats = {f"layer{layer:02d}_head{head:02d}": {"q_mean_real": torch.randn(F), "q_mean_imag": torch.randn(F),
                                                  "q_abs_mean": torch.rand(F) + 1}
             for layer in range(L) for head in range(Hq)}
    return {"metadata": {"head_dim": 2 * F, "sampled_heads": [[i, j] for i in range(L) for j in range(Hq)]},
            "stats": stats}


CONFIG = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0)


def test_flat_format_round_trip(tmp_path):
    cal = load_calibration(_official(), CONFIG)
    flat = {"E_q": cal.q_mean, "E_q_norm": cal.q_abs_mean, "omega": cal.omega * 0.5,
            "freq_scale_sq": cal.freq_scale_sq * 2}
    torch.save(flat, tmp_path / "flat.pt")
    again = load_calibration(tmp_path / "flat.pt", CONFIG)
    assert torch.equal(again.q_mean, cal.q_mean) and torch.equal(again.q_abs_mean, cal.q_abs_mean)
    assert torch.equal(again.omega, cal.omega * 0.5)  # the file's RoPE wins over the config's
    explicit = load_calibration(flat, CONFIG, omega=cal.omega)
    assert torch.equal(explicit.omega, cal.omega)


def test_bad_calibrations_raise_clearly(tmp_path):
    def broken(mutate):
        data = _official()
        mutate(data)
        return data

    s = "layer01_head03"
    cases = [
        (broken(lambda d: d["stats"].pop(s)), "layer01_head03 is missing"),
        (broken(lambda d: d["stats"][s].update(q_abs_mean=torch.rand(7))), "q_abs_mean has shape"),
        (broken(lambda d: d["stats"][s]["q_mean_real"].__setitem__(2, float("nan"))), "NaN or Inf"),
        (broken(lambda d: d["stats"][s].pop("q_mean_imag")), "q_mean_imag must be a tensor"),
        (broken(lambda d: d["metadata"].update(head_dim=32)), "head_dim=32 does not match"),
        ({"E_q": torch.zeros(2, 4, 8, dtype=torch.complex64)}, "E_q_norm must be a tensor"),
        ({"E_q": torch.zeros(3, 4, 8, dtype=torch.complex64)}, "E_q has shape"),
        ({"weights": 1}, "unknown format"),
        (broken(lambda d: d["stats"].__setitem__(s, [torch.rand(8)] * 3)), "layer01_head03 must be a dict"),
        ({"E_q": torch.zeros(2, 4, 8), "E_q_norm": torch.rand(2, 4, 8)}, "E_q must be a complex"),
        ({"E_q": torch.zeros(2, 4, 8, dtype=torch.complex64), "E_q_norm": torch.ones(2, 4, 8, dtype=torch.int64)},
         "E_q_norm must be a real floating-point"),
    ]
    for data, match in cases:
        with pytest.raises(ValueError, match=match):
            load_calibration(data, CONFIG)
    for source in ([1, 2], None, 7, b"cal.pt"):
        with pytest.raises(TypeError, match="source must be a shipped name"):
            load_calibration(source, CONFIG)
    torch.save([torch.rand(8)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="holds a list, expected a dict"):
        load_calibration(tmp_path / "list.pt", CONFIG)
    with pytest.raises(ValueError, match="does not have"):
        load_calibration(_official(L=3), CONFIG)   # a layer the model lacks
    with pytest.raises(ValueError, match="missing"):
        load_calibration(_official(Hq=3), CONFIG)  # a head missing
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        load_calibration(_official(), {**CONFIG, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_calibration(_official(), {k: v for k, v in CONFIG.items() if k != "num_hidden_layers"})
    for key, value in (("num_attention_heads", "four"), ("num_hidden_layers", True), ("num_key_value_heads", 0)):
        with pytest.raises((ValueError, TypeError), match=key):
            load_calibration(_official(), {**CONFIG, key: value})
    with pytest.raises(ValueError, match="no calibration file"):
        load_calibration(tmp_path / "absent.pt", CONFIG)
    (tmp_path / "corrupt.pt").write_bytes(os.urandom(200))
    with pytest.raises(ValueError, match="cannot read"):
        load_calibration(tmp_path / "corrupt.pt", CONFIG)
    with open(tmp_path / "code.pt", "wb") as f:  # not weights-only: must be refused, not executed
        pickle.dump({"stats": os.getcwd}, f, protocol=2)
    with pytest.raises(ValueError, match="cannot read"):
        load_calibration(tmp_path / "code.pt", CONFIG)


def test_rope_default_and_errors():
    omega, fss = rope_parameters(dict(head_dim=128, rope_theta=1e6))
    expect = torch.tensor([1e6 ** (-2 * i / 128) for i in range(64)], dtype=torch.float64)
    assert torch.allclose(omega.double(), expect, rtol=2e-7, atol=0) and torch.equal(fss, torch.ones(64))
    half, _ = rope_parameters(dict(head_dim=128, rope_theta=1e6, partial_rotary_factor=0.5))
    assert half.shape == (32,)
    nested, _ = rope_parameters(dict(head_dim=128, rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                                                        partial_rotary_factor=0.5)))
    assert torch.equal(nested, half)  # where transformers 5 keeps it
    with pytest.raises(ValueError, match="not supported"):
        rope_parameters(dict(head_dim=64, rope_theta=1e4, rope_scaling={"rope_type": "longrope"}))
    with pytest.raises(ValueError, match="rope_theta"):
        rope_parameters(dict(head_dim=64))
    with pytest.raises(ValueError, match="needs 'low_freq_factor'"):
        rope_parameters(dict(head_dim=64, rope_theta=1e4, rope_scaling={"rope_type": "llama3", "factor": 8.0}))


ROPE_CASES = [
    dict(rope_theta=1e6, head_dim=128, rope_scaling={"rope_type": "linear", "factor": 4.0}),
    dict(rope_theta=5e5, head_dim=128, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    GPT_OSS_120B,
    dict(rope_theta=1e4, head_dim=128, partial_rotary_factor=0.5,
         rope_scaling={"rope_type": "yarn", "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                       "original_max_position_embeddings": 4096}),
]


@pytest.mark.parametrize("config", ROPE_CASES)
def test_rope_matches_transformers(config):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base = dict(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072)
    kwargs = {k: v for k, v in {**base, **config}.items() if k not in ("num_hidden_layers", "num_key_value_heads")}
    hf = transformers.LlamaConfig(**kwargs)
    inv_freq, attention = ROPE_INIT_FUNCTIONS[config["rope_scaling"]["rope_type"]](hf, "cpu")
    omega, fss = rope_parameters({**base, **config})
    assert torch.equal(omega, inv_freq.float())
    assert math.isclose(float(fss[0]), attention ** 2, rel_tol=1e-6)


def test_reference_pieces():
    p = torch.tensor([0, 5, 2 ** 24 - 70000])
    omega = torch.rand(8)
    C, S = mean_phase_reference(p, omega)
    o = torch.tensor([2.0 ** i for i in range(17)], dtype=torch.float64)
    for r in range(3):
        angle = (float(p[r]) + o)[:, None] * omega.double()
        assert torch.allclose(C[r], angle.cos().mean(0)) and torch.allclose(S[r], angle.sin().mean(0))
    z = normalize_reference(torch.randn(2, 3, 50, dtype=torch.float64) * 5 + 2)
    assert torch.allclose(z.mean(-1), torch.zeros(2, 3, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(z.std(-1, correction=0), torch.ones(2, 3, dtype=torch.float64))
    assert torch.equal(normalize_reference(torch.full((1, 1, 4), 3.0)), torch.zeros(1, 1, 4))  # std 0: no NaN
    g = torch.randn(3, 4, 10, dtype=torch.float64)  # L=3, Hq=4, Hkv=2
    assert torch.equal(reduce_reference(g, "union", 2), g.amax((0, 1))[None])
    assert torch.equal(reduce_reference(g, "per_layer_perhead", 2)[3], g[1, 2:].amax(0))
    assert torch.allclose(reduce_reference(g, "per_head", 2)[0], g[:, :2].amax(1).mean(0))


# issue 30: bad input, second pass

def test_calibration_values_out_of_range_are_refused():
    data = _official()
    data["stats"]["layer01_head02"]["q_abs_mean"][3] = -torch.rand(()) - 0.1  # a mean of magnitudes below 0
    with pytest.raises(ValueError, match=r"q_abs_mean must be finite and >= 0 everywhere; at \[1, 2, 3\]"):
        load_calibration(data, CONFIG)
    cal = load_calibration(_official(), CONFIG)
    flat = {"E_q": cal.q_mean, "E_q_norm": cal.q_abs_mean, "omega": cal.omega, "freq_scale_sq": -cal.freq_scale_sq}
    with pytest.raises(ValueError, match="freq_scale_sq must be finite and > 0"):  # would flip every score
        load_calibration(flat, CONFIG)
    for name, value, match in (("freq_scale_sq", torch.zeros(8), "freq_scale_sq must be finite and > 0"),
                               ("omega", -torch.rand(8), "omega must be finite and > 0"),
                               ("omega", torch.full((8,), float("inf")), "omega holds NaN or Inf"),
                               ("freq_scale_sq", torch.rand(8).double().add(1), None)):
        if match is None:  # float64 is taken (cast to float32)
            assert load_calibration(_official(), CONFIG, **{name: value}).freq_scale_sq.dtype == torch.float32
            continue
        with pytest.raises(ValueError, match=match):
            load_calibration(_official(), CONFIG, **{name: value})


@pytest.mark.parametrize("key, value", [
    ("head_dim", 16.7), ("head_dim", 16.0), ("head_dim", "16"), ("head_dim", True), ("head_dim", [16]),
    ("hidden_size", 64.5), ("rope_theta", [1e6]), ("rope_theta", "1e6"), ("rope_theta", float("nan")),
    ("rope_theta", 1.0), ("partial_rotary_factor", "0.5"), ("partial_rotary_factor", 1.5), ("partial_rotary_factor", 0),
    ("rope_scaling", ["yarn"]), ("rope_scaling", "linear"), ("num_key_value_heads", 2.0),
])
def test_model_config_fields_of_the_wrong_type_or_range_are_named(key, value):
    config = {**CONFIG, key: value}
    if key == "hidden_size":
        config.pop("head_dim")
    with pytest.raises((TypeError, ValueError), match=key if key != "rope_scaling" else "rope_scaling"):
        load_calibration(_official(), config)


@pytest.mark.parametrize("key, value", [
    ("head_dim", "16"), ("head_dim", 16.7), ("head_dim", [16]), ("num_layers", None), ("num_layers", 2.0),
    ("num_attention_heads", [4]), ("num_attention_heads", True),
])
def test_file_metadata_of_the_wrong_type_is_named(key, value):
    data = _official()
    data["metadata"][key] = value
    with pytest.raises(TypeError, match=f"metadata: {key} must be an int"):
        load_calibration(data, CONFIG)


def test_file_metadata_must_be_a_dict():
    data = _official()
    data["metadata"] = [["head_dim", 16]]
    with pytest.raises(ValueError, match="'metadata' must be a dict"):
        load_calibration(data, CONFIG)
    data["metadata"] = None  # absent metadata is fine
    assert load_calibration(data, CONFIG).num_layers == 2


def test_yarn_and_llama3_without_their_fields_name_the_field():
    base = dict(head_dim=64, rope_theta=1e4)
    with pytest.raises(ValueError, match="yarn' needs 'original_max_position_embeddings'"):
        rope_parameters({**base, "rope_scaling": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match="yarn' needs 'factor'"):
        rope_parameters({**base, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 4096}})
    with pytest.raises(ValueError, match="yarn' needs 'factor'"):  # the fallback gives the context, not the factor
        rope_parameters({**base, "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn"}})
    with pytest.raises(TypeError, match="rope_scaling factor must be a number"):
        rope_parameters({**base, "rope_scaling": {"rope_type": "yarn", "factor": "32",
                                                  "original_max_position_embeddings": 4096}})
    with pytest.raises(TypeError, match="truncate must be a bool"):
        rope_parameters({**base, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "truncate": "no",
                                                  "original_max_position_embeddings": 4096}})
    with pytest.raises(ValueError, match="original_max_position_embeddings must be finite and > 0"):
        rope_parameters({**base, "rope_scaling": {"rope_type": "yarn", "factor": 32.0,
                                                  "original_max_position_embeddings": -1}})
    with pytest.raises(ValueError, match="high_freq_factor .* must be > low_freq_factor"):
        rope_parameters({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    with pytest.raises(ValueError, match="rope_scaling factor must be finite and > 0"):
        rope_parameters({**base, "rope_scaling": {"rope_type": "linear", "factor": 0}})


def test_meta_calibrations_are_refused(tmp_path):
    torch.save(_official(), tmp_path / "cal.pt")
    on_meta = torch.load(tmp_path / "cal.pt", map_location="meta", weights_only=True)
    with pytest.raises(ValueError, match="meta tensor"):
        load_calibration(on_meta, CONFIG)
    cal = load_calibration(_official(), CONFIG)
    flat = {"E_q": cal.q_mean, "E_q_norm": cal.q_abs_mean.to("meta")}
    with pytest.raises(ValueError, match="E_q_norm is a meta tensor"):
        load_calibration(flat, CONFIG)
    with pytest.raises(ValueError, match="omega is a meta tensor"):
        load_calibration(_official(), CONFIG, omega=cal.omega.to("meta"))


def test_validate_calibration_checks_a_calibration_object():
    from dataclasses import replace

    from kvops.triattention import validate_calibration

    cal = load_calibration(_official(), CONFIG)
    assert validate_calibration(cal, CONFIG) is cal
    for config, match in (({**CONFIG, "num_hidden_layers": 3}, r"q_mean has shape \(2, 4, 8\)"),
                          ({**CONFIG, "num_attention_heads": 8}, r"q_mean has shape"),
                          ({**CONFIG, "num_key_value_heads": 4}, "num_kv_heads is 2, the model's is 4"),
                          ({**CONFIG, "head_dim": 32}, r"q_mean has shape"),
                          ({**CONFIG, "partial_rotary_factor": 0.5}, r"q_mean has shape"),
                          ({**CONFIG, "head_dim": 16.0}, "head_dim must be an int")):
        with pytest.raises((TypeError, ValueError), match=match):
            validate_calibration(cal, config)
    bad = [(replace(cal, q_abs_mean=-cal.q_abs_mean), "q_abs_mean must be finite and >= 0"),
           (replace(cal, freq_scale_sq=-cal.freq_scale_sq), "freq_scale_sq must be finite and > 0"),
           (replace(cal, omega=cal.omega * float("nan")), "omega must be finite"),
           (replace(cal, q_mean=cal.q_mean * float("inf")), "q_mean must be finite"),
           (replace(cal, head_dim=16.7), "head_dim must be an int"),
           (replace(cal, num_kv_heads=True), "num_kv_heads must be an int"),
           (replace(cal, q_mean=cal.q_mean.to(torch.complex128)), "q_mean must be complex64"),
           (replace(cal, q_abs_mean=cal.q_abs_mean.half()), "q_abs_mean must be float32"),
           (replace(cal, omega=cal.omega.tolist()), "omega must be a tensor"),
           (replace(cal, omega=cal.omega.to("meta")), "omega is a meta tensor"),
           (replace(cal, q_mean=cal.q_mean.to("meta"), q_abs_mean=cal.q_abs_mean.to("meta")), "meta tensor"),
           (replace(cal, omega=cal.omega[:3]), r"omega has shape \(3,\); q_mean's \(2, 4, 8\) needs \(8,\)"),
           (replace(cal, q_mean=cal.q_mean[0]), r"q_mean must be \[layers, query heads, frequencies\]"),
           (replace(cal, num_kv_heads=3), "num_kv_heads 3 must divide q_mean's 4 query heads"),
           (replace(cal, head_dim=8), "head_dim 8 is below the 16 rotary dims"),
           (replace(cal, layer_sensitivity=LayerSensitivity((64,), torch.zeros(1, 3), 16)),
            r"layer_sensitivity must be None or a LayerSensitivity whose nats are \[windows, 2\]"),
           (replace(cal, layer_sensitivity=torch.zeros(1, 2)), "layer_sensitivity must be None or")]
    for broken, match in bad:
        with pytest.raises((TypeError, ValueError), match=match):
            validate_calibration(broken, CONFIG)
    with pytest.raises(TypeError, match="calibration must be a Calibration"):
        validate_calibration({"E_q": cal.q_mean}, CONFIG)
    with pytest.raises(TypeError, match="model_config must be a dict"):
        validate_calibration(cal, [CONFIG])
    assert torch.equal(cal.for_layers(range(1, 2)).q_mean, cal.q_mean[1:])
    for layers, error, match in (([True], TypeError, r"layers\[0\] must be an int, got bool"),
                                 (5, TypeError, "layers must be a list, tuple or range"),
                                 (torch.tensor([0]), TypeError, "layers must be a list, tuple or range"),
                                 ((0, 2), ValueError, r"layers\[1\] must be in \[0, 1\]"),
                                 ([1, 1], ValueError, "layers must be distinct"), ([], ValueError, "layers must be")):
        with pytest.raises(error, match=match):
            cal.for_layers(layers)


def test_calibration_to_takes_a_real_device():
    cal = load_calibration(_official(), CONFIG)
    assert cal.to("cpu").q_mean.device.type == "cpu"
    with pytest.raises(ValueError, match="device must be a torch.device, a device string or a CUDA index, got 'gpu7'"):
        cal.to("gpu7")
    with pytest.raises(TypeError, match="device must be"):
        cal.to(3.5)
    with pytest.raises(ValueError, match="meta device has no values"):
        cal.to("meta")
