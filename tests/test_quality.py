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
