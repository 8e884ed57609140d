"""Method configs: validation naming the field, the admission contract, dict/JSON round trips."""

import os

import pytest
import torch

from kvops.config import (DEFAULT_MODE, KeepPolicy, NVFP4ColdPageConfig, TriAttentionConfig, config_from_dict,
                          config_from_json, resolve_keep_policy)
from kvops.triattention import SHIPPED



@pytest.fixture
def calibration(tmp_path):
    stats = {f"layer{layer:02d}_head{h:02d}": {"q_mean_real": torch.randn(8), "q_mean_imag": torch.randn(8),
                                              "q_abs_mean": torch.rand(8) + 1} for layer in range(2) for h in range(4)}
    path = tmp_path / "cal.pt"
    torch.save({"metadata": {"head_dim": 16}, "stats": stats}, path)
    return str(path)


def test_round_trips_and_contract(calibration):
    configs = [NVFP4ColdPageConfig(), NVFP4ColdPageConfig(row_size=576, rope_range=(512, 64),
                                                          skip_rope_quantization=True, plane_dim=None),
               NVFP4ColdPageConfig(row_size=128, rope_range=(0, 64), residual_dim=32, global_scale="identity"),
               TriAttentionConfig(budget=512, beta=64, eviction_mode="per_layer_perhead", calibration_path=calibration)]
    for c in configs:
        assert config_from_json(c.to_json()) == c and config_from_dict(c.to_dict()) == c
    nv, tri = configs[0], configs[-1]
    assert not nv.changes_physical_kv_length and nv.supports_block_reuse() and nv.supports_speculative_decoding()
    assert tri.changes_physical_kv_length and not tri.supports_block_reuse()
    assert not tri.supports_speculative_decoding()
    assert configs[1].row_spec().quantized_range == (0, 512)
    assert configs[2].row_spec().residual_range == (0, 32)
    cal = tri.load_calibration(dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    rope_theta=1e4))
    assert cal.q_mean.shape == (2, 4, 8)
    with pytest.raises(ValueError, match="does not have|missing"):
        tri.load_calibration(dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  rope_theta=1e4))


def test_shipped_calibration_by_name():
    tri = TriAttentionConfig(calibration_path="qwen3-8b")
    assert tri.load_calibration(SHIPPED["qwen3-8b"].model_config).num_layers == 36
    assert config_from_json(tri.to_json()) == tri  # the name, not a path, is what the config holds


def test_invalid_values_name_the_field(tmp_path, calibration):
    (tmp_path / "junk.pt").write_bytes(os.urandom(64))
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other.pt")
    cases = [
        (lambda: TriAttentionConfig(budget=0, calibration_path=calibration), "budget"),
        (lambda: TriAttentionConfig(budget=True, calibration_path=calibration), "budget"),
        (lambda: TriAttentionConfig(beta=-3, calibration_path=calibration), "beta"),
        (lambda: TriAttentionConfig(eviction_mode="per_token", calibration_path=calibration), "eviction_mode"),
        (lambda: TriAttentionConfig(normalize_scores=1, calibration_path=calibration), "normalize_scores"),
        (lambda: TriAttentionConfig(), "calibration_path"),
        (lambda: TriAttentionConfig(calibration_path=str(tmp_path / "absent.pt")), "calibration_path: no file"),
        (lambda: TriAttentionConfig(calibration_path=str(tmp_path / "junk.pt")), "not a readable"),
        (lambda: TriAttentionConfig(calibration_path=str(tmp_path / "other.pt")), "no calibration statistics"),
        (lambda: NVFP4ColdPageConfig(row_size=100), "row_size"),
        (lambda: NVFP4ColdPageConfig(residual_dim=8, rope_range=(0, 64)), "residual_dim"),
        (lambda: NVFP4ColdPageConfig(residual_dim=32), "residual_dim"),
        (lambda: NVFP4ColdPageConfig(rope_range=(32, 32), skip_rope_quantization=True), "rope_range"),
        (lambda: NVFP4ColdPageConfig(rope_range=(0, 256)), "rope_range"),
        (lambda: NVFP4ColdPageConfig(global_scale="per_token"), "global_scale"),
        (lambda: config_from_dict({"algorithm": "h2o"}), "algorithm"),
        (lambda: config_from_dict({"budget": 3}), "algorithm"),
        (lambda: config_from_dict({"algorithm": "triattention", "budgett": 3}), "no field"),
        (lambda: config_from_dict({"algorithm": "triattention", 1: 2, "zz": 3}), "no field\\(s\\) 'zz', 1"),
    ]
    cases += [
        (lambda: NVFP4ColdPageConfig(plane_dim=0), "plane_dim"),
        (lambda: NVFP4ColdPageConfig(rope_range=(0,)), "rope_range"),
        (lambda: NVFP4ColdPageConfig(rope_range=("a", "b")), "rope_range start"),
        (lambda: NVFP4ColdPageConfig(skip_rope_quantization="no"), "skip_rope_quantization"),
        (lambda: NVFP4ColdPageConfig(global_scale=True), "global_scale"),
        (lambda: NVFP4ColdPageConfig(row_size=True), "row_size"),
        (lambda: TriAttentionConfig(calibration_path=3), "calibration_path"),
        (lambda: TriAttentionConfig(calibration_path="qwen3-8b", compaction_order="sorted"), "compaction_order"),
    ]
    for make, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            make()


def test_paths_and_nhd_planes_are_accepted(tmp_path, calibration):
    from pathlib import Path

    tri = TriAttentionConfig(calibration_path=Path(calibration))
    assert tri.calibration_path == calibration and config_from_json(tri.to_json()) == tri
    nhd = NVFP4ColdPageConfig(plane_dim=2)  # [page, token, plane, head, dim]
    assert nhd.row_spec().plane_dim == 2 and config_from_json(nhd.to_json()) == nhd


# issue 30: bad input, second pass

def test_list_values_and_bounds_name_the_field(calibration):
    cases = [
        (lambda: TriAttentionConfig(budget=[1], calibration_path=calibration), TypeError, "budget must be an int"),
        (lambda: TriAttentionConfig(beta=[4], calibration_path=calibration), TypeError, "beta must be an int"),
        (lambda: TriAttentionConfig(eviction_mode=["union"], calibration_path=calibration), TypeError,
         "eviction_mode must be a str"),
        (lambda: TriAttentionConfig(compaction_order=["fill"], calibration_path=calibration), TypeError,
         "compaction_order must be a str"),
        (lambda: TriAttentionConfig(calibration_path=[calibration]), TypeError, "calibration_path: must be a path"),
        (lambda: TriAttentionConfig(normalize_scores=[True], calibration_path=calibration), TypeError,
         "normalize_scores must be a bool"),
        (lambda: NVFP4ColdPageConfig(global_scale=[1.0]), TypeError, "global_scale: must be a policy name"),
        (lambda: NVFP4ColdPageConfig(global_scale={"per_page"}), TypeError, "global_scale"),
        (lambda: NVFP4ColdPageConfig(row_size=[128]), TypeError, "row_size must be an int"),
        (lambda: NVFP4ColdPageConfig(plane_dim=[1]), TypeError, "plane_dim must be an int"),
        (lambda: NVFP4ColdPageConfig(residual_dim=[16]), TypeError, "residual_dim must be an int"),
        (lambda: config_from_dict({"algorithm": ["triattention"]}), TypeError, "algorithm must be a str"),
        # int32 cache positions bound what a round scores: budget + 2 * beta
        (lambda: TriAttentionConfig(budget=10**12, calibration_path=calibration), ValueError,
         "budget must be in \\[1, 2147483647\\]"),
        (lambda: TriAttentionConfig(budget=2**31 - 2, beta=1, calibration_path=calibration), ValueError,
         "budget \\+ 2 \\* beta .* at most 2147483647"),
        # the codec takes at most 4 dims between page and row: the plane dim is one of them
        (lambda: NVFP4ColdPageConfig(plane_dim=5), ValueError,
         "plane_dim: .* plane_dim must be in \\[1, 4\\] \\(or None\\), got 5"),
    ]
    for make, exc, match in cases:
        with pytest.raises(exc, match=match):
            make()
    assert TriAttentionConfig(budget=2**31 - 3, beta=1, calibration_path=calibration).budget == 2**31 - 3
    assert NVFP4ColdPageConfig(plane_dim=4).row_spec().plane_dim == 4
    assert NVFP4ColdPageConfig(global_scale=2).row_spec().global_scale == 2
    with pytest.raises(ValueError, match="config_from_json: not valid JSON"):
        config_from_json('{"algorithm": ')
    with pytest.raises(TypeError, match="config_from_json: text must be a JSON string, got dict"):
        config_from_json({"algorithm": "nvfp4_cold_page"})


def test_keep_policy_defaults_are_each_modes_measured_best(calibration):
    """None takes the mode's default (benchmarks/RESULTS.md, "Eviction quality"); a given field is kept."""
    assert DEFAULT_MODE == "per_head"
    resolve = lambda mode, budget, beta=128, layers=36, **given: resolve_keep_policy(  # noqa: E731
        "test", mode, budget, beta, layers, **given)
    assert resolve("per_head", 2048) == KeepPolicy(0, 128, (0,), 0.0)      # budget // 4 capped at beta
    assert resolve("per_head", 256, beta=128) == KeepPolicy(0, 64, (0,), 0.0)
    for mode, prior in (("union", 8.0), ("per_layer_perhead", 16.0)):
        assert resolve(mode, 2048) == KeepPolicy(4, 128, (0,), prior)
        assert resolve(mode, 8, beta=2) == KeepPolicy(4, 2, (0,), prior)
        assert resolve(mode, 5, beta=4) == KeepPolicy(3, 1, (0,), prior)   # sinks clipped: one token scored
        assert resolve(mode, 1, beta=1) == KeepPolicy(0, 0, (0,), prior)
    assert resolve("per_head", 64, layers=1) == KeepPolicy(0, 16, (), 0.0)  # no recent layer in a one-layer model
    # given fields stay; the others fit around them
    assert resolve("union", 16, beta=4, recent_window=14) == KeepPolicy(1, 14, (0,), 8.0)
    assert resolve("union", 16, beta=4, sink_tokens=12) == KeepPolicy(12, 3, (0,), 8.0)
    assert resolve("per_head", 64, sink_tokens=0, recent_window=0, recent_layers=[]) == KeepPolicy(0, 0, (), 0.0)
    assert resolve("per_head", 64, recency_prior=2).recency_prior == 2.0
    with pytest.raises(TypeError, match="recent_window must be an int"):
        resolve("union", 16, recent_window=1.5)
    for bad, error in (("2", TypeError), (-1, ValueError), (float("inf"), ValueError)):
        with pytest.raises(error, match="recency_prior must be"):
            resolve("union", 16, recency_prior=bad)
    with pytest.raises(ValueError, match="must be below the budget"):
        resolve("per_head", 16, sink_tokens=8, recent_window=8)
    with pytest.raises(ValueError, match="mode must be one of"):
        resolve("per_token", 16)
    with pytest.raises(ValueError, match=r"beta must be in \[1, "):
        resolve("per_head", 16, beta=0)
    # the config keeps None (its dict and JSON too) and resolves for a model
    tri = TriAttentionConfig(budget=512, beta=64, calibration_path=calibration)
    assert (tri.eviction_mode, tri.sink_tokens, tri.recent_window, tri.recent_layers) == ("per_head", None, None, None)
    assert config_from_json(tri.to_json()) == tri and tri.to_dict()["recent_window"] is None
    assert tri.keep_policy(2) == KeepPolicy(0, 64, (0,), 0.0) and tri.keep_policy(1) == KeepPolicy(0, 64, (), 0.0)
    bare = TriAttentionConfig(budget=512, beta=64, calibration_path=calibration, eviction_mode="union",
                              sink_tokens=0, recent_window=0, recent_layers=[], recency_prior=0)
    assert bare.keep_policy(2) == KeepPolicy(0, 0, (), 0.0) and config_from_dict(bare.to_dict()) == bare
    leaning = TriAttentionConfig(budget=512, beta=64, calibration_path=calibration, recency_prior=1.5)
    assert config_from_json(leaning.to_json()) == leaning and leaning.keep_policy(2).recency_prior == 1.5
    with pytest.raises(ValueError, match="recency_prior must be finite and >= 0"):
        TriAttentionConfig(budget=512, calibration_path=calibration, recency_prior=-2.0)
    with pytest.raises(ValueError, match="must be below the budget 512"):
        TriAttentionConfig(budget=512, calibration_path=calibration, sink_tokens=12, recent_window=500)


def test_layer_split_keeps_the_same_total_and_localizes_the_insensitive_layers():
    """Fresh random sensitivities: the local layers are those at most the threshold of the most sensitive one, at
    the window of their share (the largest measured one not above it); the totals stay within rounding of
    L x budget; nothing is local where no layer is that low or none needs anything."""
    from kvops.config import LOCAL_SHARE, LOCAL_THRESHOLD, LayerSplit, layer_split, split_budget
    from kvops.triattention import LayerSensitivity

    gen = torch.Generator().manual_seed(1)
    for trial in range(50):
        L = int(torch.randint(2, 40, (), generator=gen))
        nats = torch.rand(3, L, generator=gen) ** 4  # a few sensitive layers, many near 0
        sensitivity = LayerSensitivity((64, 256, 1024), nats, 16)
        budget = int(torch.randint(1, 3000, (), generator=gen))
        split = layer_split(sensitivity, budget)
        local_budget = max(1, int(LOCAL_SHARE * budget))
        row = nats[max([i for i, r in enumerate((64, 256, 1024)) if r <= local_budget], default=0)]
        want = tuple(i for i in range(L) if row[i] <= LOCAL_THRESHOLD * row.max())
        assert split.local_layers == want and len(want) < L
        assert split == (split if want else LayerSplit((), budget, budget)) and split.budget >= budget
        assert split.local_budget == (local_budget if want else budget)
        total = len(want) * split.local_budget + (L - len(want)) * split.budget
        assert L * budget - (L - len(want)) < total <= L * budget
    flat = LayerSensitivity((64,), torch.full((1, 4), 0.3), 16)
    assert layer_split(flat, 100) == LayerSplit((), 100, 100)  # no layer below a tenth of the most sensitive
    assert layer_split(LayerSensitivity((64,), torch.zeros(1, 4), 16), 100) == LayerSplit((), 100, 100)
    one = LayerSensitivity((64, 256), torch.tensor([[0.04, 0.5, 0.01], [0.2, 0.5, 0.01]]), 16)
    assert layer_split(one, 100) == LayerSplit((0, 2), 50, 200)        # at 64 (50 is below every window)
    assert layer_split(one, 600) == LayerSplit((2,), 300, 750)         # at 256: layer 0 needs 0.2 there
    for fields, error, match in ((((64,), [[0.1]], 16), TypeError, "nats must be a float32 CPU tensor"),
                                 (((64,), torch.zeros(1, 2).double(), 16), TypeError, "nats must be a float32"),
                                 (((64, 256), torch.zeros(1, 2), 16), ValueError, r"nats must be \[2 windows"),
                                 (((64,), torch.zeros(1, 0), 16), ValueError, "layers >= 1"),
                                 (((64,), torch.full((1, 2), float("nan")), 16), ValueError, "NaN"),
                                 (((256, 64), torch.zeros(2, 2), 16), ValueError, "recent must be increasing"),
                                 (([64], torch.zeros(1, 2), 16), TypeError, "recent must be a non-empty tuple"),
                                 (((64,), torch.zeros(1, 2), -1), ValueError, "sinks must be >= 0")):
        with pytest.raises(error, match=match):
            LayerSensitivity(*fields)
    assert split_budget((2, 0), 100, 4, 0.25) == LayerSplit((0, 2), 25, 175)
    assert split_budget((), 100, 4, 3.0) == LayerSplit((), 100, 100)
    for args, error, match in ((((0, 0), 100, 4, 0.5), ValueError, "a layer twice"),
                               (((0, 4), 100, 4, 0.5), ValueError, "past the model's 4"),
                               (((0, 1, 2, 3), 100, 4, 0.5), ValueError, "names every layer"),
                               (((0,), 100, 4, 0), ValueError, "share must be finite and > 0"),
                               (((0, 1), 100, 3, 2.0), ValueError, "leave the other 1 none"),
                               (((0,), 0, 4, 0.5), ValueError, "budget must be >= 1"),
                               ((0, 100, 4, 0.5), TypeError, "list or tuple")):
        with pytest.raises(error, match=match):
            split_budget(*args)
    for args, error, match in (((nats, 100), TypeError, "LayerSensitivity"), ((one, 0), ValueError, "budget"),
                               ((one, 100, 1.0), ValueError, "share must be below 1"),
                               ((one, 100, 0.5, 0), ValueError, "threshold must be finite and > 0"),
                               ((one, 100, True), TypeError, "share must be a number")):
        with pytest.raises(error, match=match):
            layer_split(*args)
