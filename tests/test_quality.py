"""benchmarks.quality on a tiny random model: the mechanics of the eviction-quality harness."""

import pytest
import torch

pytest.importorskip("transformers")

from kvops.calibrate import calibrate  # noqa: E402
from kvops.triattention import TriAttentionSelector, load_calibration  # noqa: E402
from conftest import TINY, tiny_model  # noqa: E402


def test_quality_harness_runs_and_full_cache_agrees_with_itself(tmp_path):
    """benchmarks.quality on a tiny random model: the mechanics (rounds, masks, kvops keep sets) run, the full cache
    agrees with itself, and every query row sees exactly the prompt, the budget and itself after a round."""
    from benchmarks.quality import METHODS, Simulation, evaluate

    model = tiny_model("qwen3")
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, TINY["vocab_size"], (96,))
    cal = load_calibration(calibrate(model, torch.randint(0, TINY["vocab_size"], (128,))), model.config.to_dict())
    rows = evaluate(model, [ids], cal, [16], beta=4, prompt=8, log=lambda *a: None)
    by = {r["method"]: r for r in rows}
    assert by["full"]["agreement"] == 1.0 and set(by) == set(METHODS)
    assert all(0.0 <= r["agreement"] <= 1.0 and r["loss"] > 0 for r in rows)
    sim = Simulation(model, ids, prompt=8, budget=16, beta=4)
    times = list(sim.rounds())
    assert times[0] == 8 + 17 and all(b - a == 4 for a, b in zip(times, times[1:]))
    allowed = sim.run("recent")
    t = times[-1]
    assert allowed.shape == (1, 1, 96, 96)
    assert allowed[0, 0, t, :8].all() and allowed[0, 0, t, t - 16:t + 1].all()  # the prompt, the last 16, itself
    assert int(allowed[0, 0, t].sum()) == 8 + 16 + 1
    G = model.config.num_attention_heads // model.config.num_key_value_heads
    for mode in ("per_head", "per_layer_perhead"):
        masks = sim.run(f"triattention_{mode}", TriAttentionSelector(cal, 16, mode))
        layers = model.config.num_hidden_layers if mode == "per_layer_perhead" else 1
        assert masks.shape == (layers, model.config.num_attention_heads, 96, 96)
        assert (masks[:, :, t].sum(-1) == 8 + 16 + 1).all()
        assert torch.equal(masks[:, 0], masks[:, G - 1])  # a KV head's query heads share its keep set


@pytest.mark.parametrize("mode", ["union", "per_head", "per_layer_perhead"])
def test_harness_keeps_what_decoding_with_the_kvops_cache_keeps(mode):
    """Two independent paths to the same keep sets: the harness (pools rebuilt from masked forwards each round) and
    TriAttentionCache fed the same tokens one by one (slots tracked through the compactions)."""
    from benchmarks.quality import Simulation
    from kvops.integrations.transformers import TriAttentionCache, cache_keyword

    model = tiny_model("qwen3").to(torch.bfloat16)
    model.config._attn_implementation = "eager"
    cal = load_calibration(calibrate(model, torch.randint(0, TINY["vocab_size"], (256,))), model.config.to_dict())
    seq, prompt, budget, beta = torch.randint(1, TINY["vocab_size"], (70,)), 10, 16, 4
    cache = TriAttentionCache(model.config, cal, budget=budget, beta=beta, mode=mode)
    with torch.no_grad():
        model(input_ids=seq[None, :prompt], **{cache_keyword(model): cache})
        for t in range(prompt, seq.numel()):
            model(input_ids=seq[None, t:t + 1], **{cache_keyword(model): cache})
    sim, chosen = Simulation(model, seq, prompt, budget, beta), []
    select = sim._select
    sim._select = lambda *args: chosen.append(select(*args)) or chosen[-1]
    sim.run(f"triattention_{mode}", TriAttentionSelector(cal, budget, mode))
    Hkv = model.config.num_key_value_heads
    G = model.config.num_attention_heads // Hkv
    assert len(chosen) == len(cache.rounds) >= 10
    for (_, kept), sets in zip(cache.rounds, chosen):
        for layer, heads in enumerate(sets):
            for h in range(0, len(heads), G):
                row = 0 if mode == "union" else h // G + (layer * Hkv if mode == "per_layer_perhead" else 0)
                assert sorted(kept[0, row].tolist()) == sorted(heads[h].tolist())


def test_real_caches_decode_with_and_without_an_nvfp4_cycle():
    """evaluate_caches: the bf16 caches decode the window token by token; TriAttention's cache keeps its memory
    bound, and an NVFP4 offload/onboard cycle changes its predictions by codec error only."""
    from benchmarks.quality import evaluate_caches

    model = tiny_model("qwen3")
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, TINY["vocab_size"], (80,))
    cal = load_calibration(calibrate(model, torch.randint(0, TINY["vocab_size"], (128,))), model.config.to_dict())
    rows = evaluate_caches(model, [ids], cal, [16], beta=4, prompt=8, modes=("union",), log=lambda *a: None)
    by = {r["method"]: r for r in rows}
    assert set(by) == {"full_cache", "triattention_union_cache", "triattention_union_nvfp4"}
    assert by["full_cache"]["agreement"] > 0.9  # bf16 against the float32 full cache
    assert by["triattention_union_cache"]["kv_tokens_max"] == 8 + 16 + 4 < by["full_cache"]["kv_tokens_max"]
    assert all(r["tokens_per_s"] > 0 and r["positions"] == by["full_cache"]["positions"] > 0 for r in rows)
    plain, cycled = by["triattention_union_cache"], by["triattention_union_nvfp4"]
    assert plain["loss"] != cycled["loss"] and abs(plain["loss"] - cycled["loss"]) < 0.5
    assert all(abs(r["perplexity"] - torch.tensor(r["loss"]).exp().item()) < 1e-3 * r["perplexity"] for r in rows)
