"""kvops.integrations.transformers: TriAttentionCache under model.generate on tiny random models.

The decisive check: with eviction, every generated token's logits equal those of one forward pass over the whole
sequence in which each query row sees exactly what the cache held at that step (the recorded keep sets), at the
token's logical RoPE position. A wrong position or mask would show as a difference; on the CPU there is none (bf16,
exact).
"""

import pytest
import torch

from conftest import DEVICES, TINY, bytes_of, tiny_model

transformers = pytest.importorskip("transformers")

from benchmarks.quality import _forward  # noqa: E402
from kvops.calibrate import calibrate  # noqa: E402
from kvops.integrations.transformers import (  # noqa: E402
    GROUPED_SDPA, TriAttentionCache, cache_keyword, grouped_sdpa, kv_bytes)
from kvops.triattention import load_calibration  # noqa: E402
from kvops.triattention.reference import select_reference  # noqa: E402


def _setup(name="qwen3", device="cpu"):
    model = tiny_model(name).to(device=device, dtype=torch.bfloat16)
    model.config._attn_implementation = "eager"  # the simulation's 4-D float masks
    cal = load_calibration(calibrate(model, torch.randint(0, TINY["vocab_size"], (256,), device=device)),
                           model.config.to_dict())
    return model, cal


def _with(model, cache) -> dict:
    """The keyword that hands generate a cache: `cache` from transformers 5.24 on, `past_key_values` before."""
    return {cache_keyword(model): cache}


def _generate(model, ids, cache, n, **kw):
    return model.generate(ids, max_new_tokens=n, do_sample=False, return_dict_in_generate=True, output_logits=True,
                          **_with(model, cache), **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["qwen3", "llama3"])
def test_no_eviction_generates_what_the_default_cache_does(name, device):
    model, cal = _setup(name, device)
    ids = torch.randint(1, TINY["vocab_size"], (2, 12), device=device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in row 1
    want = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    cache = TriAttentionCache(model.config, cal, budget=64, beta=8)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, **_with(model, cache))
    assert torch.equal(got, want) and not cache.rounds and cache.get_seq_length() == 12 + 29


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["union", "per_head", "per_layer_perhead"])
@pytest.mark.parametrize("order", ["ordered", "fill"])
def test_with_eviction_logits_equal_attention_over_what_the_cache_holds(mode, order, device):
    """On the GPU the rounds replay from CUDA graphs (the first of each batch size is captured)."""
    model, cal = _setup(device=device)
    prompt, budget, beta, steps = 10, 16, 4, 44
    ids = torch.randint(1, TINY["vocab_size"], (1, prompt), device=device)
    cache = TriAttentionCache(model.config, cal, budget=budget, beta=beta, mode=mode, compaction_order=order)
    out = _generate(model, ids, cache, steps)
    seq, n = out.sequences[0], out.sequences.shape[1]
    assert len(cache.rounds) >= 5 and cache.held <= prompt + budget + beta
    assert cache.pools[0].shape[3] == prompt + budget + beta + 1  # the memory never grows past that
    assert kv_bytes(cache) < 2 * cache.num_layers * 2 * 2 * (n - 1) * 16  # held bytes, below the full sequence's
    logits = torch.stack(out.logits, 1)[0].float()  # step i predicts position prompt + i
    _assert_logits_of_what_the_cache_held(model, cache, seq, logits, prompt, mode)


def _assert_logits_of_what_the_cache_held(model, cache, seq, logits, prompt, mode="union"):
    """`logits` (one row's generated steps) equal one full forward pass over `seq` in which each query row sees
    exactly what the cache held at that step (its recorded rounds), and differ from the full cache's."""
    n, device, budget = seq.shape[0], seq.device, cache.budget
    L, Hq, Hkv = model.config.num_hidden_layers, model.config.num_attention_heads, model.config.num_key_value_heads
    layers = L if mode == "per_layer_perhead" else 1
    heads = 1 if mode == "union" else Hq
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    allowed = causal.expand(layers, heads, -1, -1).clone()
    for t, kept in cache.rounds:  # kept [1, rows, budget]: row 0, KV head g, or layer l's KV head g at l * Hkv + g
        assert kept.shape == (1, layers * (1 if mode == "union" else Hkv), budget) and (kept >= prompt).all()
        visible = torch.zeros(layers, heads, n, dtype=torch.bool, device=device)
        visible[..., :prompt] = True
        visible[..., t:] = True
        for layer in range(layers):
            for h in range(heads):
                visible[layer, h, kept[0, 0 if mode == "union" else layer * Hkv + h // (Hq // Hkv)]] = True
        allowed[:, :, t:] = causal[t:] & visible[:, :, None]
    attention = model.config._attn_implementation
    model.config._attn_implementation = "eager"  # the simulation's 4-D float masks
    with torch.no_grad():
        sim, _ = _forward(model, seq, allowed, want_keys=False)
        full, _ = _forward(model, seq, causal[None, None], want_keys=False)
    model.config._attn_implementation = attention
    # A decode step and a full pass may sum their GEMMs in different orders (GPU, and threaded CPU BLAS: the
    # device's CPU differs in the last bf16 bit); a wrong kept set differs by far more.
    cpu = device.type == "cpu"
    torch.testing.assert_close(logits, sim[prompt - 1:n - 1], rtol=0 if cpu else 1e-2, atol=1e-2 if cpu else 3e-2)
    after = cache.rounds[0][0] - prompt + 1
    assert (logits[after:] - full[prompt - 1 + after:n - 1]).abs().max() > 1e-3  # eviction did change something


def test_rounds_keep_what_the_reference_selects():
    """Each round's kept tokens are the float64 reference's selection over the same held keys."""
    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=12, beta=4, mode="per_layer_perhead")
    snapshots, compress = [], cache._compress

    def recorded(held):
        snapshots.append(([p.clone() for p in cache.pools], held, cache.evicted, cache.slot_positions.clone()))
        return compress(held)

    cache._compress = recorded
    _generate(model, torch.randint(1, TINY["vocab_size"], (2, 8)), cache, 30)
    assert len(snapshots) == len(cache.rounds) >= 3
    for (pools, held, evicted, slots), (t, kept) in zip(snapshots, cache.rounds):
        B = pools[0].shape[0]
        i32 = lambda v: torch.full((B,), v, dtype=torch.int32)  # noqa: E731
        ref, _ = select_reference(pools, torch.arange(B, dtype=torch.int32)[:, None], i32(held), i32(8),
                                  i32(held + evicted), cal, 12, "per_layer_perhead")
        assert t == held + evicted
        assert torch.equal(kept.sort(-1).values, slots.gather(-1, ref.long()).sort(-1).values)


@pytest.mark.parametrize("device", DEVICES)
def test_offload_and_onboard_round_trip_through_nvfp4(device):
    model, cal = _setup(device=device)
    ids = torch.randint(1, TINY["vocab_size"], (2, 10), device=device)
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4)
    out = model.generate(ids, max_new_tokens=30, do_sample=False, **_with(model, cache))
    before = [p[:, :, :, :cache.held].float().clone() for p in cache.pools]
    cache.offload(0)
    with pytest.raises(RuntimeError, match="offloaded"):
        model.generate(out, max_new_tokens=2, do_sample=False, **_with(model, cache))
    cache.offload(1)
    assert cache.pools is None and kv_bytes(cache) == 0
    with pytest.raises(ValueError, match="not offloaded"):
        cache.onboard(5)
    cache.onboard(1)
    cache.onboard(0)
    for p, b in zip(cache.pools, before):
        got = p[:, :, :, :cache.held].float()
        assert (got - b).norm() / b.norm() < 0.15 and not torch.equal(bytes_of(got), bytes_of(b))  # codec error only
    more = model.generate(out, max_new_tokens=8, do_sample=False, **_with(model, cache))
    assert torch.equal(more[:, :out.shape[1]], out) and more.shape[1] == out.shape[1] + 8


def test_refusals():
    model, cal = _setup()
    with pytest.raises(ValueError, match="beta"):
        TriAttentionCache(model.config, cal, budget=16, beta=0)
    with pytest.raises(ValueError, match="compaction_order"):
        TriAttentionCache(model.config, cal, compaction_order="shuffled")
    with pytest.raises(TypeError, match="static"):
        TriAttentionCache(model.config, cal, static=1)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        model.float().generate(torch.randint(1, 99, (1, 4)), max_new_tokens=2,
                               **_with(model, TriAttentionCache(model.config, cal, budget=16, beta=4)))
    sliding = transformers.Qwen3Config(**{**TINY, "num_attention_heads": 4, "num_key_value_heads": 2,
                                          "head_dim": 16, "layer_types": ["full_attention", "sliding_attention"],
                                          "sliding_window": 8, "use_sliding_window": True})
    with pytest.raises(ValueError, match="full-attention layers only"):
        TriAttentionCache(sliding, cal)


def test_a_step_that_overshoots_a_round_is_scored_whole():
    """Two tokens in one step past a due round: the round scores every held token (none dropped unscored)."""
    from kvops.integrations.transformers import cache_keyword

    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4)
    assert cache.selector.max_decode == 16 + 4 + 1
    seq = torch.randint(1, TINY["vocab_size"], (1, 33))
    snapshots, compress = [], cache._compress
    cache._compress = lambda held: (snapshots.append(([p.clone() for p in cache.pools], held,
                                                      cache.slot_positions[0, 0].clone())), compress(held))[1]
    with torch.no_grad():  # round 1 before token 27; tokens 27-29 one by one, 30-31 in one step, then 32
        for start, end in ((0, 10), *((t, t + 1) for t in range(10, 30)), (30, 32), (32, 33)):
            model(input_ids=seq[:, start:end], **{cache_keyword(model): cache})
    assert len(snapshots) == 2
    pools, held, held_logical = snapshots[1]  # held_logical: the logical position of each slot
    assert held == 10 + 21  # budget + beta + 1 generated tokens at the second round
    assert sorted(held_logical[:held].tolist()) == list(range(10)) + sorted(cache.rounds[0][1][0, 0].tolist()) + \
        list(range(27, 32))
    i32 = lambda v: torch.tensor([v], dtype=torch.int32)  # noqa: E731
    ref, _ = select_reference(pools, torch.zeros(1, 1, dtype=torch.int32), i32(held), i32(10), i32(held), cal, 16)
    slots = cache.rounds[1][1]  # logical positions of the kept slots
    assert torch.equal(slots[0, 0].sort().values, held_logical[ref[0, 0].long()].sort().values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("attention", ["eager", GROUPED_SDPA])
def test_static_cache_compiles_the_decode_step_once(attention, device):
    """static=True: generate compiles the decode step as one graph, every step reuses it (rounds between steps
    included), and every step's logits are those of attention over what the cache held."""
    from torch._dynamo.utils import counters

    model, cal = _setup(device=device)
    prompt, budget, beta = 10, 16, 4
    ids = torch.randint(1, TINY["vocab_size"], (1, prompt), device=device)
    cache = TriAttentionCache(model.config, cal, budget=budget, beta=beta, static=True)
    model.config._attn_implementation = attention
    assert cache.is_compileable and not TriAttentionCache(model.config, cal).is_compileable
    # fullgraph: a graph break fails the test. On the GPU generate's own choice otherwise (inductor, CUDA graphs);
    # on the CPU, where generate compiles only when told to, dynamo alone.
    config = transformers.CompileConfig(fullgraph=True)
    if device == "cpu":
        config = transformers.CompileConfig(fullgraph=True, backend="eager", mode=None)
        config._compile_all_devices = True
    kw = dict(compile_config=config)
    torch._dynamo.reset()
    first = _generate(model, ids, cache, 2, **kw)  # the prompt's forward, then one compiled step
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    out = _generate(model, first.sequences, cache, 41, **kw)
    assert counters["stats"]["unique_graphs"] == graphs  # 40 more steps and their rounds: nothing recompiled
    assert len(cache.rounds) >= 5 and cache.held <= prompt + budget + beta
    assert cache.pools[0].shape[3] == prompt + budget + beta + 1  # what attention reads in every step
    logits = torch.cat([torch.stack(first.logits, 1), torch.stack(out.logits, 1)], 1)[0].float()
    _assert_logits_of_what_the_cache_held(model, cache, out.sequences[0], logits, prompt)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_sdpa_equals_sdpa_under_a_mask(groups, device):
    """One query token of grouped heads under a mask: the packed call equals sdpa over repeated K/V; other shapes
    are sdpa's own."""
    from transformers.integrations.sdpa_attention import repeat_kv

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    B, Hkv, S, D = 3, 2, 37, 16
    k, v = (torch.randn(B, Hkv, S, D, device=device) for _ in range(2))
    for q in (1, 5):
        query = torch.randn(B, Hkv * groups, q, D, device=device)
        mask = torch.rand(B, 1, q, S, device=device) > 0.3
        mask[..., 0] = True
        got, _ = grouped_sdpa(module, query, k, v, mask, scaling=0.3)
        want = torch.nn.functional.scaled_dot_product_attention(
            query, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=0.3).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_write_slots_op(device):
    """The static cache's write op: the step's K and V land in exactly the given slots of both planes."""
    from kvops.integrations.transformers import _write_slots

    pool = torch.randn(2, 2, 3, 9, 4, device=device).to(torch.bfloat16)
    k, v = (torch.randn(2, 3, 2, 4, device=device).to(torch.bfloat16) for _ in range(2))
    slots = torch.tensor([5, 2], device=device)
    want = pool.clone()
    want[:, 0, :, [5, 2]], want[:, 1, :, [5, 2]] = k, v
    _write_slots(pool, slots, k, v)
    assert torch.equal(pool, want)
    torch.library.opcheck(_write_slots, (pool, slots, k, v))


def test_static_cache_refuses_a_step_it_cannot_take():
    """A static cache checks each step where generate builds its mask, before a compiled step could write: an
    offloaded row, or more tokens than its slots hold."""
    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4, static=True)
    out = model.generate(torch.randint(1, TINY["vocab_size"], (2, 10)), max_new_tokens=8, do_sample=False,
                         **_with(model, cache))
    with pytest.raises(RuntimeError, match="do not fit"):
        cache.get_mask_sizes(16 + 4 + 2)
    cache.offload(0)
    with pytest.raises(RuntimeError, match="offloaded"):
        model.generate(out, max_new_tokens=2, do_sample=False, **_with(model, cache))
    cache.onboard(0)
    more = model.generate(out, max_new_tokens=2, do_sample=False, **_with(model, cache))
    assert torch.equal(more[:, :out.shape[1]], out)
