"""kvops.integrations.transformers: TriAttentionCache under model.generate on tiny random models.

The decisive check: with eviction, every generated token's logits equal those of one forward pass over the whole
sequence in which each query row sees exactly what the cache held at that step (the recorded keep sets), at the
token's logical RoPE position. A wrong position or mask would show as a difference; on the CPU there is none (bf16,
exact).
"""

import unittest.mock

import pytest
import torch

from conftest import BARE, DEVICES, TINY, bytes_of, tiny_model

transformers = pytest.importorskip("transformers")

from benchmarks.quality import masked_logits, rounds  # noqa: E402
from kvops.calibrate import calibrate  # noqa: E402
from kvops.config import LayerSplit  # noqa: E402
from kvops.integrations.transformers import (  # noqa: E402
    GROUPED_SDPA, KVOPS_ATTENTION, TriAttentionCache, cache_keyword, grouped_sdpa, install_layer_masks, kv_bytes,
    kvops_attention)
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
    cache = TriAttentionCache(model.config, cal, budget=budget, beta=beta, mode=mode, compaction_order=order,
                              round_history=None, **BARE)
    out = _generate(model, ids, cache, steps)
    seq, n = out.sequences[0], out.sequences.shape[1]
    assert cache.num_rounds >= 5 and cache.held <= prompt + budget + beta
    assert cache.pools[0].shape[3] == prompt + budget + beta + 1  # the memory never grows past that
    assert kv_bytes(cache) < 2 * cache.num_layers * 2 * 2 * (n - 1) * 16  # held bytes, below the full sequence's
    logits = torch.stack(out.logits, 1)[0].float()  # step i predicts position prompt + i
    _assert_logits_of_what_the_cache_held(model, cache, seq, logits, prompt, mode)


def _assert_logits_of_what_the_cache_held(model, cache, seq, logits, prompt, mode="union"):
    """`logits` (one row's generated steps) equal one full forward pass over `seq` in which each query row sees
    exactly what the cache held at that step (its recorded rounds; a layer split's local layers, the prompt and
    their newest local_budget tokens from each of their rounds on, at the times the manager's rule gives), and
    differ from the full cache's."""
    n, device, budget = seq.shape[0], seq.device, cache.budget
    L, Hq, Hkv = model.config.num_hidden_layers, model.config.num_attention_heads, model.config.num_key_value_heads
    scored = cache.scored_layers
    layers = L if mode == "per_layer_perhead" or cache.local_layers else 1
    heads = 1 if mode == "union" else Hq
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    allowed = causal.expand(layers, heads, -1, -1).clone()

    def held_from(t, layer, visible):  # query rows t on of `layer` see the prompt, `visible` and what follows t
        visible[:, :prompt] = True
        visible[:, t:] = True
        allowed[layer, :, t:] = causal[t:] & visible[:, None, :]

    rows = len(scored) if mode == "per_layer_perhead" else 1
    for t, kept in cache.rounds:  # kept [1, rows, budget]: row 0, KV head g, or scored layer i's KV head g: i * Hkv + g
        assert kept.shape == (1, rows * (1 if mode == "union" else Hkv), budget) and (kept >= prompt).all()
        for layer in [scored[0]] if layers == 1 else scored:
            visible = torch.zeros(heads, n, dtype=torch.bool, device=device)
            i = scored.index(layer) if mode == "per_layer_perhead" else 0
            for h in range(heads):
                visible[h, kept[0, 0 if mode == "union" else i * Hkv + h // (Hq // Hkv)]] = True
            held_from(t, min(layer, layers - 1), visible)
    if cache.local_layers:
        times = [t for t in rounds(n, prompt, cache.local_budget, cache.beta) if t < n - 1]
        assert cache.num_local_rounds == len(times) > 0
        for t in times:
            for layer in cache.local_layers:
                visible = torch.zeros(heads, n, dtype=torch.bool, device=device)
                visible[:, t - cache.local_budget:t] = True
                held_from(t, layer, visible)
    attention = model.config._attn_implementation
    model.config._attn_implementation = "eager"  # the simulation's 4-D float masks
    with torch.no_grad():
        sim = masked_logits(model, seq, allowed)
        full = masked_logits(model, seq, causal[None, None])
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
    cache = TriAttentionCache(model.config, cal, budget=12, beta=4, mode="per_layer_perhead", round_history=None,
                              **BARE)
    snapshots, compress = [], cache._compress

    def recorded(held):
        snapshots.append(([p.clone() for p in cache.pools], held, cache.evicted, cache.slot_positions.clone()))
        return compress(held)

    cache._compress = recorded
    _generate(model, torch.randint(1, TINY["vocab_size"], (2, 8)), cache, 30)
    assert len(snapshots) == cache.num_rounds == len(cache.rounds) >= 3
    for (pools, held, evicted, slots), (t, kept) in zip(snapshots, cache.rounds):
        B = pools[0].shape[0]
        i32 = lambda v: torch.full((B,), v, dtype=torch.int32)  # noqa: E731
        ref, _ = select_reference(pools, torch.arange(B, dtype=torch.int32)[:, None], i32(held), i32(8),
                                  i32(held + evicted), cal, 12, "per_layer_perhead")
        assert t == held + evicted
        assert torch.equal(kept.sort(-1).values, slots.gather(-1, ref.long()).sort(-1).values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split", [None, LayerSplit((1,), 4, 28)])
def test_offload_and_onboard_round_trip_through_nvfp4(split, device):
    model, cal = _setup(device=device)
    install_layer_masks(model)
    ids = torch.randint(1, TINY["vocab_size"], (2, 10), device=device)
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4, layer_split=split or False)
    out = model.generate(ids, max_new_tokens=30, do_sample=False, **_with(model, cache))
    held = [cache.local_held if layer in cache.local_layers else cache.held for layer in range(2)]
    assert len(set(held)) == (2 if split else 1)
    before = [p[:, :, :, :n].float().clone() for p, n in zip(cache.pools, held)]
    cache.offload(0)
    with pytest.raises(RuntimeError, match="offloaded"):
        model.generate(out, max_new_tokens=2, do_sample=False, **_with(model, cache))
    cache.offload(1)
    assert cache.pools is None and kv_bytes(cache) == 0
    with pytest.raises(ValueError, match="row must be in \\[0, 1\\]"):
        cache.onboard(5)
    cache.onboard(1)
    cache.onboard(0)
    for p, b, n in zip(cache.pools, before, held):
        got = p[:, :, :, :n].float()
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
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4, mode="union", round_history=None, **BARE)
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
@pytest.mark.parametrize("split", [None, LayerSplit((0,), 8, 24), LayerSplit((1,), 24, 8)])
def test_static_cache_compiles_the_decode_step_once(split, attention, device):
    """static=True: generate compiles the decode step as one graph, every step reuses it (rounds between steps
    included), and every step's logits are those of attention over what the cache held. With a layer split the
    local layer's mask is mapped inside the compiled step, from the offsets on the device."""
    from torch._dynamo.utils import counters

    model, cal = _setup(device=device)
    install_layer_masks(model)
    prompt, budget, beta = 10, 16, 4
    ids = torch.randint(1, TINY["vocab_size"], (1, prompt), device=device)
    cache = TriAttentionCache(model.config, cal, budget=budget, beta=beta, mode="union", static=True,
                              round_history=None, layer_split=split or False, **BARE)
    budget = cache.budget
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
    assert cache.num_rounds >= (1 if split else 5) and cache.held <= prompt + budget + beta
    assert cache.pools[cache.scored_layers[0]].shape[3] == prompt + budget + beta + 1  # what attention reads
    logits = torch.cat([torch.stack(first.logits, 1), torch.stack(out.logits, 1)], 1)[0].float()
    _assert_logits_of_what_the_cache_held(model, cache, out.sequences[0], logits, prompt)


# issue 34: per-layer budgets

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["union", "per_head", "per_layer_perhead"])
@pytest.mark.parametrize("local", [0, 1])
@pytest.mark.parametrize("counts", [(8, 24), (12, 8)])  # (12, 8): the local layer holds the more
def test_a_layer_split_holds_each_groups_count_under_its_own_mask(counts, local, mode, device):
    """layer_split: the local layer keeps its newest local_budget tokens in a pool of that size, with rounds of
    its own, and the scored one the split's budget under the mode's policy; every step's logits are attention over
    what each group held (the local layer's mask mapped by install_layer_masks: layer 0 maps its mask before the
    step's first write runs the due rounds)."""
    model, cal = _setup(device=device)
    install_layer_masks(model)
    prompt, beta = 10, 4
    ids = torch.randint(1, TINY["vocab_size"], (1, prompt), device=device)
    split = LayerSplit((local,), *counts)
    cache = TriAttentionCache(model.config, cal, budget=16, beta=beta, mode=mode, layer_split=split,
                              round_history=None, **BARE)
    out = _generate(model, ids, cache, 44)
    assert cache.local_layers == (local,) and cache.scored_layers == (1 - local,) and cache.budget == counts[1]
    assert cache.pools[local].shape[3] == prompt + counts[0] + beta + 1  # the local layer's memory
    assert cache.pools[1 - local].shape[3] == prompt + counts[1] + beta + 1
    assert cache.num_rounds >= 3 and cache.local_held <= prompt + counts[0] + beta
    assert kv_bytes(cache) == (cache.held + cache.local_held) * 2 * 2 * 16 * 2  # each layer's held, K and V
    logits = torch.stack(out.logits, 1)[0].float()
    _assert_logits_of_what_the_cache_held(model, cache, out.sequences[0], logits, prompt, mode)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_split_cache_takes_several_tokens_in_one_step(attention):
    """A step of several tokens once the groups hold different counts: each layer's mask maps the causal block of
    the new tokens onto its own slots, so the step gives the logits of the same tokens fed one by one."""
    model, cal = _setup()
    install_layer_masks(model)
    model.config._attn_implementation = attention
    seq = torch.randint(1, TINY["vocab_size"], (1, 44))
    caches = [TriAttentionCache(model.config, cal, budget=16, beta=4, layer_split=LayerSplit((0,), 8, 24))
              for _ in range(2)]
    for cache in caches:
        _run(model, cache, seq[:, :10])
        for t in range(10, 36):  # local rounds at 19, 23, ..., 35; scored at 35
            _run(model, cache, seq[:, t:t + 1])
    one = torch.cat([_run(model, caches[0], seq[:, t:t + 1]) for t in range(36, 39)], 1)
    several = _run(model, caches[1], seq[:, 36:39])
    assert caches[1].local_held == 10 + 8 + 4 < caches[1].held == 10 + 24 + 4
    torch.testing.assert_close(several, one, rtol=0, atol=1e-2)
    assert (several - _run(model, TriAttentionCache(model.config, cal, budget=16, beta=4, layer_split=LayerSplit(
        (0,), 8, 24)), seq[:, :39])[:, 36:]).abs().max() > 1e-2  # what was evicted would have changed them


def test_a_layer_split_is_refused_by_name():
    """layer_split: a bool or a LayerSplit naming layers of the model with counts of at least one; True needs the
    calibration's layer sensitivity; it names the layers on recency, so recent_layers stays unset. A model whose
    local layers would attend under the scored layers' mask (no install_layer_masks) is refused at its first
    step, which then holds nothing."""
    from dataclasses import replace

    model, cal = _setup()
    for kw, error, match in (
            (dict(layer_split="yes"), TypeError, "layer_split must be a bool or a kvops.config.LayerSplit"),
            (dict(layer_split=(0,)), TypeError, "layer_split must be a bool"),
            (dict(layer_split=LayerSplit((2,), 8, 24)), ValueError, "names layers past the model's 2"),
            (dict(layer_split=LayerSplit((0, 1), 8, 24)), ValueError, "names every layer"),
            (dict(layer_split=LayerSplit((0,), 0, 24)), ValueError, "local_budget must be in"),
            (dict(layer_split=LayerSplit((0,), 8, 2.5)), TypeError, "budget must be an int"),
            (dict(layer_split=LayerSplit((0,), 8, 24), recent_layers=(1,)), ValueError, "leave recent_layers None"),
            (dict(layer_split=True, calibration=replace(cal, layer_sensitivity=None)), ValueError,
             "needs the calibration's layer sensitivity")):
        args = {"calibration": cal, **kw}
        with pytest.raises(error, match=match):
            TriAttentionCache(model.config, args.pop("calibration"), budget=16, beta=4, **args)
    plain = TriAttentionCache(model.config, replace(cal, layer_sensitivity=None), budget=16, beta=4)
    assert plain.layer_split is None and plain.local_held == plain.held == 0
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4, layer_split=LayerSplit((1,), 8, 24))
    with pytest.raises(RuntimeError, match="install_layer_masks"):
        _run(model, cache, torch.randint(1, TINY["vocab_size"], (1, 10)))
    assert cache.pools is None and cache.held == 0
    with pytest.raises(TypeError, match="model must be a transformers model"):
        install_layer_masks(model.config)
    with pytest.raises(ValueError, match="layer_mask: layer_idx 2 is out of range"):
        cache.layer_mask(2, None)
    with pytest.raises(TypeError, match="layer_idx must be an int"):
        cache.layer_mask("1", None)
    for mask in (torch.ones(1, 10, dtype=torch.bool), [[True] * 10]):  # a local layer maps 4-D mask tensors only
        with pytest.raises(TypeError, match="need a 4-D mask tensor"):
            cache.layer_mask(1, mask)
        with pytest.raises(RuntimeError, match="install_layer_masks"):  # the refused call marked no layer
            _run(model, cache, torch.randint(1, TINY["vocab_size"], (1, 10)))
    assert cache.layer_mask(0, "any") == "any"  # a scored layer's mask is transformers' own
    install_layer_masks(install_layer_masks(model))  # once per model
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 2
    _run(model, cache, torch.randint(1, TINY["vocab_size"], (1, 10)))
    assert cache.held == cache.local_held == 10
    other = tiny_model("qwen3").to(torch.bfloat16)  # the same cache through a model without the hooks
    other.config._attn_implementation = "eager"
    before = _state(cache, held_only=True)  # refused at layer 1: layer 0 wrote past what is held, as any layer's
    with pytest.raises(RuntimeError, match="install_layer_masks"):  # refusal mid-step does
        _run(other, cache, torch.randint(1, TINY["vocab_size"], (1, 1)))
    _assert_same(before, _state(cache, held_only=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_grouped_sdpa_equals_sdpa_under_a_mask(groups, device):
    """Grouped heads under a mask shared by the heads (a decode step, a prefill chunk): the packed call equals sdpa
    over repeated K/V, for boolean and additive masks, broadcast over the batch or the query tokens or not."""
    from transformers.integrations.sdpa_attention import repeat_kv

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = groups, True
    B, Hkv, S, D = 3, 2, 37, 16
    k, v = (torch.randn(B, Hkv, S, D, device=device) for _ in range(2))
    for q, mask_shape, additive in ((1, (B, 1, 1, S), False), (5, (B, 1, 5, S), False), (5, (1, 1, 5, S), True),
                                    (4, (B, 1, 1, S), False)):
        query = torch.randn(B, Hkv * groups, q, D, device=device)
        mask = torch.rand(mask_shape, device=device) > 0.3
        mask[..., 0] = True
        if additive:
            mask = torch.zeros(mask_shape, device=device).masked_fill(~mask, float("-inf"))
        got, _ = grouped_sdpa(module, query, k, v, mask, scaling=0.3)
        want = torch.nn.functional.scaled_dot_product_attention(
            query, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=0.3).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_kind", ["dynamic", "static-dense", "kvops", "kvops-static"])
def test_kvops_attention_generates_what_sdpa_does(cache_kind, device):
    """KVOPS_ATTENTION's decode steps (kvops.attention.decode_attention, each row's slots bounded by its mask) give
    sdpa's tokens and logits, with left padding, for transformers' caches and TriAttentionCache (nothing evicted)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(**{**TINY, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64})
    model = transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=torch.bfloat16).eval()
    cal = load_calibration(calibrate(model, torch.randint(0, TINY["vocab_size"], (128,), device=device)),
                           model.config.to_dict())
    ids = torch.randint(1, TINY["vocab_size"], (3, 11), device=device)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    new = 24

    def run(attention):
        model.set_attn_implementation(attention)
        cache = {"dynamic": lambda: transformers.DynamicCache(config=model.config),
                 "static-dense": lambda: transformers.StaticCache(config=model.config, max_cache_len=11 + new),
                 "kvops": lambda: TriAttentionCache(model.config, cal, budget=64, beta=8),
                 "kvops-static": lambda: TriAttentionCache(model.config, cal, budget=64, beta=8, static=True),
                 }[cache_kind]()
        return _generate(model, ids, cache, new, attention_mask=mask, min_new_tokens=new)

    want, got = run("sdpa"), run(KVOPS_ATTENTION)
    # bf16 rounding can flip a near-tie of the random model's logits: compare every step while the tokens agree,
    # the one where they first differ included (so it must be such a tie)
    differ = (got.sequences != want.sequences).any(0).nonzero()
    steps = new if len(differ) == 0 else int(differ[0]) - ids.shape[1] + 1
    torch.testing.assert_close(torch.stack(got.logits[:steps]), torch.stack(want.logits[:steps]), atol=3e-2,
                               rtol=3e-2)


def _holed_masks(device, B=3, N=40):
    """Decode-step masks [B, 1, 1, N] of every shape a row can take: left padding, a hole (right padding of the
    prompt, then the generated tokens), scattered zeros, one slot, none."""
    mask = torch.ones(B, 1, 1, N, dtype=torch.bool, device=device)
    mask[0, ..., :5] = False
    mask[1, ..., 10:30] = False
    masks = [mask]
    for _ in range(3):
        masks.append(torch.rand(B, 1, 1, N, device=device) > 0.4)
    single = torch.zeros_like(mask)
    single[0, ..., 17] = single[1, ..., 0] = True  # row 2 admits nothing: zeros
    return masks + [single]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_kvops_attention_reads_exactly_the_slots_a_mask_admits(device, compiled):
    """A decode step's mask with holes (right padding, zeros inside attention_mask) takes the kernel, eager and
    compiled, and attends to exactly the slots it admits: sdpa's result, on fresh masks and data each call, the
    compiled step in one graph. The pools' slots a mask leaves out hold huge values, so reading one shows."""
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    attention = torch.compile(kvops_attention, fullgraph=True, dynamic=False) if compiled else kvops_attention
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for mask in _holed_masks(device):
        query = torch.randn(3, 4, 1, 64, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(3, 2, 40, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
        poisoned_k, poisoned_v = (t.masked_fill(~mask[:, :, 0, :, None], 3e4) for t in (k, v))
        want, _ = grouped_sdpa(module, query, k, v, mask)
        want = torch.where(mask.any(-1).view(-1, 1, 1, 1), want.float(), 0)  # a row that admits nothing: zeros
        with unittest.mock.patch(f"{kvops_attention.__module__}.grouped_sdpa", side_effect=AssertionError):
            got, _ = attention(module, query, poisoned_k, poisoned_v, mask)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    if compiled:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_kvops_attention_pages_the_layouts_caches_hold(device):
    """The one-token pages over the caches' layouts: a pool's planes (TriAttentionCache), a batch of one, a
    cache wider than the mask's row; K and V strided unlike each other go to grouped_sdpa."""
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    query = torch.randn(3, 4, 1, 64, device=device, dtype=torch.bfloat16)
    mask = _holed_masks(device)[0]
    pool = torch.randn(3, 2, 2, 48, 64, device=device, dtype=torch.bfloat16)
    cases = [(pool[:, 0, :, :40], pool[:, 1, :, :40], mask),
             (pool[:1, 0, :, :40], pool[:1, 1, :, :40], mask[1:2]),
             (pool[:, 0, :, 8:], pool[:, 1, :, 8:], mask)]
    with unittest.mock.patch(f"{kvops_attention.__module__}.grouped_sdpa", side_effect=AssertionError):
        for k, v, m in cases:
            got, _ = kvops_attention(module, query[:k.shape[0]], k, v, m)
            want, _ = grouped_sdpa(module, query[:k.shape[0]], k.contiguous(), v.contiguous(), m)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    k = pool[:, 0, :, :40]
    v = pool[:, 1, :, :40].contiguous()  # strides unlike K's
    got, _ = kvops_attention(module, query, k, v, mask)
    assert torch.equal(got, grouped_sdpa(module, query, k, v, mask)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_kvops_attention_leaves_what_its_kernels_do_not_serve_to_grouped_sdpa(device):
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    mask = torch.rand(2, 1, 1, 9, device=device) > 0.3
    mask[..., 0] = True
    for D, dtype in ((64, torch.float32), (16, torch.bfloat16)):  # a dtype, then a head_dim, the op does not take
        query = torch.randn(2, 4, 1, D, device=device, dtype=dtype)
        k, v = (torch.randn(2, 2, 9, D, device=device, dtype=dtype) for _ in range(2))
        got, _ = kvops_attention(module, query, k, v, mask, scaling=0.3)
        want, _ = grouped_sdpa(module, query, k, v, mask, scaling=0.3)
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_what_the_packed_paths_cannot_take_goes_to_sdpa(device):
    """A mask per head (or of another shape), a V head_dim unlike K's, or a soft cap: each attention function gives
    what transformers' sdpa gives (a soft cap or attention sinks: a refusal), never a result that ignores it."""
    from transformers.integrations.sdpa_attention import repeat_kv

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    query = torch.randn(2, 4, 1, 64, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 9, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
    per_head = torch.rand(2, 4, 1, 9, device=device) > 0.3
    per_head[..., 0] = True
    for mask, value in ((per_head, v), (per_head[:, :1], v[..., :32])):
        want = torch.nn.functional.scaled_dot_product_attention(
            query.float(), repeat_kv(k, 2).float(), repeat_kv(value, 2).float(), attn_mask=mask).transpose(1, 2)
        for attention in (grouped_sdpa, kvops_attention):
            got, _ = attention(module, query, k, value, mask)
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    for attention in (grouped_sdpa, kvops_attention):
        for name in ("softcap", "s_aux"):
            with pytest.raises(ValueError, match=name):
                attention(module, query, k, v, per_head[:, :1], **{name: torch.ones(4, device=device)})


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
    torch.library.opcheck(torch.ops.kvops.transformers_write_slots_.default, (pool, slots, k, v))


def test_static_cache_refuses_a_step_it_cannot_take():
    """A static cache checks each step where generate builds its mask, before a compiled step could write: an
    offloaded row, or more tokens than its slots hold."""
    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4, static=True)
    out = model.generate(torch.randint(1, TINY["vocab_size"], (2, 10)), max_new_tokens=8, do_sample=False,
                         **_with(model, cache))
    with pytest.raises(ValueError, match="do not fit"):
        cache.get_mask_sizes(16 + 4 + 2)
    cache.offload(0)
    with pytest.raises(RuntimeError, match="offloaded"):
        model.generate(out, max_new_tokens=2, do_sample=False, **_with(model, cache))
    cache.onboard(0)
    more = model.generate(out, max_new_tokens=2, do_sample=False, **_with(model, cache))
    assert torch.equal(more[:, :out.shape[1]], out)


# issue 30: bad input, second pass

def _state(cache, held_only=False) -> dict:
    """Every piece of the cache's state a call may change: host counters, the rounds, the offloaded set, and the
    bytes of the pools (`held_only`: of their held slots), the slot positions and the host tier."""
    clone = lambda t: None if t is None else bytes_of(t).clone()  # noqa: E731
    end = cache.held if held_only else None
    return dict(held=cache.held, evicted=cache.evicted, prompt=cache.prompt, logical=int(cache.get_seq_length()),
                rounds=cache.num_rounds, round_held=cache._round_held, offloaded=sorted(cache._offloaded),
                step=cache._step, pools=None if cache.pools is None else [clone(p[:, :, :, :end]) for p in cache.pools],
                slots=clone(cache.slot_positions[..., :end]), host=clone(cache._host), local=(
                    cache.local_held, cache.local_evicted, cache.num_local_rounds, cache._local_round_held))


def _assert_same(before: dict, after: dict) -> None:
    for key, want in before.items():
        got = after[key]
        if isinstance(want, list) and want and isinstance(want[0], torch.Tensor):
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), key
        elif isinstance(want, torch.Tensor):
            assert got is not None and torch.equal(got, want), key
        else:
            assert got == want, key


def _refused(cache, fn, error, match):
    before = _state(cache)
    with pytest.raises(error, match=match):
        fn()
    _assert_same(before, _state(cache))


def _run(model, cache, ids):
    with torch.no_grad():
        return model(input_ids=ids, **_with(model, cache)).logits


@pytest.mark.parametrize("static", [False, True])
def test_offload_and_onboard_take_int_rows(static):
    """A row is a real int: 0.5 would pass a range check and encode row 0 again, True would be row 1."""
    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4, static=static)
    model.generate(torch.randint(1, TINY["vocab_size"], (2, 10)), max_new_tokens=6, do_sample=False,
                   **_with(model, cache))
    for bad in (0.5, True, 1.0, "0", None, [0], {0: 1}, torch.tensor(0)):
        _refused(cache, lambda: cache.offload(bad), TypeError, "row must be an int")
    for bad in (-1, 2):
        _refused(cache, lambda: cache.offload(bad), ValueError, "row must be in \\[0, 1\\]")
    cache.offload(0)
    _refused(cache, lambda: cache.offload(0.5), TypeError, "row must be an int")  # would release the pools
    _refused(cache, lambda: cache.offload(0), ValueError, "not a resident")
    for bad in (0.0, False, [0], {0: 1}):
        _refused(cache, lambda: cache.onboard(bad), TypeError, "row must be an int")
    _refused(cache, lambda: cache.onboard(1), ValueError, "not offloaded")
    cache.offload(1)
    assert cache.pools is None
    _refused(cache, lambda: cache.onboard(True), TypeError, "row must be an int")
    cache.onboard(1)
    cache.onboard(0)
    assert not cache._offloaded and cache.pools is not None


@pytest.mark.parametrize("static", [False, True])
def test_a_second_generate_with_another_batch_size_is_refused_before_any_change(static):
    """The step is checked against the pools (batch, heads, head_dim, dtype, device) before held or the slot
    positions move; the cache then takes the right batch and still runs its rounds."""
    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4, static=static)
    out = model.generate(torch.randint(1, TINY["vocab_size"], (2, 10)), max_new_tokens=8, do_sample=False,
                         **_with(model, cache))
    other = torch.randint(1, TINY["vocab_size"], (3, out.shape[1]))
    _refused(cache, lambda: model.generate(other, max_new_tokens=2, do_sample=False, **_with(model, cache)),
             ValueError, "batch size 3.*holds 2")
    _refused(cache, lambda: _run(model, cache, other[:, :1]), ValueError, "batch size 3")
    more = model.generate(out, max_new_tokens=30, do_sample=False, **_with(model, cache))
    assert torch.equal(more[:, :out.shape[1]], out) and cache.num_rounds >= 3  # the rounds still run


def test_a_layer_write_refused_mid_step_leaves_the_cache_as_before():
    """A step whose second layer's K/V do not match the first's is refused there: nothing of it stays (held, the
    held slots and their positions, the pending step), and the next steps and rounds run as if it never
    happened."""
    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4)
    kv = lambda B, q: torch.randn(B, 2, q, 16).bfloat16()  # noqa: E731

    def step(q):
        cache.get_mask_sizes(q)
        for layer in range(2):
            cache.update(kv(2, q), kv(2, q), layer)

    for q in (10, 1, 1, 1):
        step(q)
    before = _state(cache, held_only=True)
    for bad in (kv(3, 1), kv(2, 2), kv(2, 1).half(), torch.randn(2, 1, 1, 16).bfloat16()):
        cache.get_mask_sizes(1)
        cache.update(kv(2, 1), kv(2, 1), 0)
        with pytest.raises((ValueError, TypeError), match="key_states"):
            cache.update(bad, kv(2, 1), 1)
        _assert_same(before, _state(cache, held_only=True))
    for bad in (2, -1, 1.0, True):
        cache.update(kv(2, 1), kv(2, 1), 0)
        with pytest.raises((ValueError, TypeError), match="layer_idx"):
            cache.update(kv(2, 1), kv(2, 1), bad)
        _assert_same(before, _state(cache, held_only=True))
    with pytest.raises(ValueError, match="starts at layer 0"):
        cache.update(kv(2, 1), kv(2, 1), 1)
    _assert_same(before, _state(cache, held_only=True))
    for _ in range(15):  # 18 generated tokens: one round ran before the 18th
        step(1)
    assert cache.num_rounds == 1 and cache.held == 10 + 16 + 1 and cache.evicted == 1


def test_a_cache_for_fewer_layers_than_the_model_is_refused_and_holds_nothing():
    from dataclasses import replace

    model, cal = _setup()
    config = transformers.Qwen3Config(**{**model.config.to_dict(), "num_hidden_layers": 1, "layer_types": None})
    one = replace(cal, q_mean=cal.q_mean[:1], q_abs_mean=cal.q_abs_mean[:1], layer_sensitivity=None)
    for static in (False, True):
        cache = TriAttentionCache(config, one, budget=16, beta=4, static=static)
        with pytest.raises(ValueError, match="layer_idx 1.*1 layer"):
            model.generate(torch.randint(1, TINY["vocab_size"], (2, 10)), max_new_tokens=4, do_sample=False,
                           **_with(model, cache))
        assert cache.pools is None and cache.held == 0 and cache.get_seq_length() == 0


def test_a_model_with_fewer_layers_than_the_cache_is_refused_at_its_next_call():
    """A forward that stops before the cache's last layer (a model with fewer layers, or one that raised) holds
    nothing: the first such step is refused at the next call, and a cache that has completed steps drops it."""
    from dataclasses import replace

    model, cal = _setup()
    config = transformers.Qwen3Config(**{**model.config.to_dict(), "num_hidden_layers": 3, "layer_types": None})
    three = replace(cal, q_mean=torch.cat([cal.q_mean, cal.q_mean[:1]]),
                    q_abs_mean=torch.cat([cal.q_abs_mean, cal.q_abs_mean[:1]]), layer_sensitivity=None)
    cache = TriAttentionCache(config, three, budget=16, beta=4)
    with pytest.raises(RuntimeError, match="2 of the cache's 3 layers"):
        model.generate(torch.randint(1, TINY["vocab_size"], (2, 10)), max_new_tokens=4, do_sample=False,
                       **_with(model, cache))
    assert cache.pools is None and cache.held == 0
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4)
    seq = torch.randint(1, TINY["vocab_size"], (1, 12))
    _run(model, cache, seq[:, :10])
    cache.update(*(torch.randn(1, 2, 1, 16).bfloat16() for _ in range(2)), 0)  # a forward that stopped there
    _run(model, cache, seq[:, 10:12])
    assert cache.held == 12 and cache._step is None


def test_a_long_step_into_a_used_cache_is_refused_before_the_due_round():
    model, cal = _setup()
    for static in (False, True):
        cache = TriAttentionCache(model.config, cal, budget=16, beta=4, static=static)
        seq = torch.randint(1, TINY["vocab_size"], (1, 27))
        _run(model, cache, seq[:, :10])
        for t in range(10, 27):  # 17 generated tokens: a round is due before the next step
            _run(model, cache, seq[:, t:t + 1])
        assert not cache.rounds and cache.held == 27
        _refused(cache, lambda: _run(model, cache, torch.randint(1, TINY["vocab_size"], (1, 20))),
                 ValueError, "do not fit")
        _run(model, cache, seq[:, :1])
        assert cache.num_rounds == 1 and cache.held == 10 + 16 + 1
    install_layer_masks(model)
    for static in (False, True):  # both groups due: the local layers at 8 tokens, the scored layer at 24
        cache = TriAttentionCache(model.config, cal, budget=16, beta=4, static=static,
                                  layer_split=LayerSplit((1,), 8, 24))
        seq = torch.randint(1, TINY["vocab_size"], (1, 35))
        _run(model, cache, seq[:, :10])
        for t in range(10, 35):
            _run(model, cache, seq[:, t:t + 1])
        assert not cache.rounds and cache.num_local_rounds == 4 and cache.local_held == 10 + 8 + 4
        _refused(cache, lambda: _run(model, cache, torch.randint(1, TINY["vocab_size"], (1, 20))),
                 ValueError, "do not fit")
        _run(model, cache, seq[:, :1])
        assert cache.num_rounds == 1 and cache.held == 10 + 24 + 1
        assert cache.num_local_rounds == 5 and cache.local_held == 10 + 8 + 1


@pytest.mark.parametrize("all_rows", [False, True])
def test_onboard_of_a_corrupted_host_slot_is_refused(all_rows):
    """A host slot whose blob holds no valid global scale is refused before any page is written."""
    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4)
    model.generate(torch.randint(1, TINY["vocab_size"], (2, 10)), max_new_tokens=6, do_sample=False,
                   **_with(model, cache))
    cache.offload(1)
    if all_rows:
        cache.offload(0)
    cache._host[1].fill_(255)  # NaN scales
    _refused(cache, lambda: cache.onboard(1), ValueError, "slot 1")
    assert (cache.pools is None) == all_rows
    if all_rows:
        cache.onboard(0)


def test_constructor_checks_every_argument():
    model, cal = _setup()
    for kw, error, match in (
            (dict(cuda_graphs="no"), TypeError, "cuda_graphs must be a bool"),
            (dict(cuda_graphs=1), TypeError, "cuda_graphs must be a bool"),
            (dict(static="yes"), TypeError, "static must be a bool"),
            (dict(budget=16.0), TypeError, "budget must be an int"),
            (dict(budget=True), TypeError, "budget must be an int"),
            (dict(budget=0), ValueError, r"budget must be in \[1, "),
            (dict(beta=2.5), TypeError, "beta must be an int"),
            (dict(budget=2**31), ValueError, r"budget must be in \[1, 2147483647\]"),
            (dict(budget=2**31 - 8, beta=4), ValueError, "budget \\+ 2 \\* beta"),
            (dict(round_history=10**20), ValueError, "round_history must be in"),
            (dict(mode=1), TypeError, "mode must be a str"),
            (dict(mode="per_token"), ValueError, "mode must be one of"),
            (dict(compaction_order=["fill"]), TypeError, "compaction_order must be a str"),
            (dict(recent_window=-1), ValueError, "recent_window must be >= 0"),
            (dict(sink_tokens="4"), TypeError, "sink_tokens must be an int"),
            (dict(budget=16, sink_tokens=8, recent_window=8), ValueError, "must be below the budget 16"),
            (dict(recent_layers=0), TypeError, "recent_layers must be a list or tuple"),
            (dict(recent_layers=[2]), ValueError, "names layers past the model's 2"),
            (dict(recent_layers=[0, 1]), ValueError, "recent_layers names every layer"),
            (dict(calibration=42), TypeError, "calibration"),
            (dict(config="qwen3"), TypeError, "config must be"),
            (dict(config={**model.config.to_dict(), "num_hidden_layers": None}), TypeError, "num_hidden_layers"),
            (dict(config={k: v for k, v in model.config.to_dict().items() if k != "num_hidden_layers"}), ValueError,
             "num_hidden_layers"),
            (dict(config={**model.config.to_dict(), "layer_types": 5}), TypeError, "layer_types must be a list")):
        args = {"config": model.config, "calibration": cal, **kw}
        with pytest.raises(error, match=match):
            TriAttentionCache(args.pop("config"), args.pop("calibration"), **args)
    assert TriAttentionCache(model.config.to_dict(), cal).num_layers == 2  # a dict config is a config


@pytest.mark.parametrize("field, value, match", [
    ("num_hidden_layers", 3, r"3 layers"), ("num_attention_heads", 8, r"8 query heads"),
    ("num_key_value_heads", 1, r"num_kv_heads is 2, the model's is 1"), ("head_dim", 32, r"16 rotary frequencies"),
    ("partial_rotary_factor", 0.5, r"4 rotary frequencies")])
def test_a_calibration_for_another_model_is_refused_at_construction(field, value, match):
    model, cal = _setup()
    config = {**model.config.to_dict(), field: value}
    with pytest.raises(ValueError, match=f"calibration.*{match}"):
        TriAttentionCache(config, cal)


def test_a_first_step_past_int32_positions_is_refused_before_allocating():
    """The prompt plus the slots a round needs must fit int32 cache positions: checked before any pool exists."""
    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=2**31 - 9, beta=4)  # room for a prompt of 3 tokens
    k = torch.randn(1, 2, 4, 16).bfloat16()
    with pytest.raises(ValueError, match="int32 cache positions"):
        cache.update(k, k, 0)
    assert cache.pools is None and cache.prompt == 0 and cache._step is None


def test_a_model_unlike_its_config_is_refused_before_allocating():
    """K/V whose heads or head_dim differ from the config (a model the config does not describe) or float32 K/V
    are refused at the first layer, before the pools exist."""
    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal)
    for k, error, match in ((torch.randn(1, 4, 5, 16).bfloat16(), ValueError, "2 KV heads"),
                            (torch.randn(1, 2, 5, 8).bfloat16(), ValueError, "head_dim 16"),
                            (torch.randn(2, 5, 16).bfloat16(), ValueError, "4-D"),
                            (torch.randn(1, 2, 5, 16), TypeError, "bfloat16 or float16"),
                            (torch.empty(1, 2, 5, 16, dtype=torch.bfloat16, device="meta"), ValueError, "meta"),
                            ("k", TypeError, "key_states must be a tensor")):
        with pytest.raises(error, match=match):
            cache.update(k, k, 0)
        assert cache.pools is None and cache._step is None
    k = torch.randn(1, 2, 5, 16).bfloat16()
    with pytest.raises(ValueError, match="value_states"):
        cache.update(k, k[:, :, :4], 0)
    with pytest.raises(ValueError, match="starts at layer 0"):
        cache.update(k, k, 1)
    assert cache.pools is None


def test_batch_and_length_operations_of_transformers():
    """Beam search reorders the rows (equal to the default cache's beam search while nothing is evicted), reset
    empties the cache, and what an evicting one-batch cache cannot do is refused by name."""
    model, cal = _setup()
    ids = torch.randint(1, TINY["vocab_size"], (2, 10))
    want = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False)
    cache = TriAttentionCache(model.config, cal, budget=64, beta=8)
    got = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False, **_with(model, cache))
    assert torch.equal(got, want)
    for bad in (torch.tensor([0, 1]), torch.zeros(6), [0] * 6, torch.zeros(6, 1, dtype=torch.long)):
        _refused(cache, lambda: cache.reorder_cache(bad), ValueError, "beam_idx must be a 1-D integer tensor of 6")
    for bad in (torch.tensor([0, 1, 2, 3, 4, 6]), torch.tensor([0, 1, 2, 3, 4, -1])):  # a row index out of range
        _refused(cache, lambda: cache.reorder_cache(bad), ValueError, r"row indices in \[0, 6\)")
    for bad in (torch.tensor(1), torch.zeros(1, 5)):  # not a step's 1-D positions
        _refused(cache, lambda: cache.get_mask_sizes(bad), ValueError, "query_length must be an int or")
    for name, args in (("crop", (-1,)), ("batch_repeat_interleave", (2,)),
                       ("batch_select_indices", (torch.tensor([0]),)),
                       ("early_initialization", (1, 2, 16, torch.bfloat16, "cpu"))):
        _refused(cache, lambda: getattr(cache, name)(*args), NotImplementedError, f"TriAttentionCache.{name}")
    cache.reset()
    assert cache.pools is None and cache.held == 0 and cache.get_seq_length() == 0 and not cache.rounds
    with pytest.raises(ValueError, match="holds no tokens yet"):
        cache.reorder_cache(torch.arange(6))
    again = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False, **_with(model, cache))
    assert torch.equal(again, want)


def test_the_defaults_are_per_head_under_each_modes_keep_policy():
    """TriAttentionCache resolves the keep policy it is not given (kvops.config.resolve_keep_policy) and runs
    a window longer than beta with ordered rounds."""
    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4)
    assert (cache.selector.mode, cache.sink_tokens, cache.recent_window, cache.recent_layers, cache.recency_prior,
            cache.order) == ("per_head", 0, 4, (0,), 0.0, "fill")
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4, mode="union")
    assert (cache.sink_tokens, cache.recent_window, cache.recent_layers, cache.recency_prior, cache.order) == \
        (4, 4, (0,), 8.0, "fill")
    assert cache.selector.recency_prior == 8.0
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4, mode="union", recent_window=12)
    assert (cache.sink_tokens, cache.recent_window, cache.order) == (3, 12, "ordered")
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4, mode="union", **BARE)
    assert (cache.sink_tokens, cache.recent_window, cache.recent_layers, cache.recency_prior, cache.order) == \
        (0, 0, (), 0.0, "fill")


@pytest.mark.parametrize("history,kept", [(1, 1), (0, 0), (2, 2), (None, "all")])
def test_round_history_bounds_what_the_cache_keeps_of_its_rounds(history, kept):
    """rounds holds the last round_history rounds' kept positions (device memory that grows with every round),
    num_rounds counts them all."""
    from kvops.integrations.transformers import cache_keyword

    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4, round_history=history)
    with torch.no_grad():
        model.generate(torch.randint(1, TINY["vocab_size"], (1, 10)), max_new_tokens=30, do_sample=False,
                       **{cache_keyword(model): cache})
    assert cache.num_rounds >= 3
    assert len(cache.rounds) == (cache.num_rounds if kept == "all" else kept)
    if cache.rounds:  # the newest round is the last one
        assert cache.rounds[-1][0] == int(cache.get_seq_length()) - (cache.held - 16 - 10)
    for bad, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="round_history"):
            TriAttentionCache(model.config, cal, round_history=bad)


def test_a_cache_for_fewer_layers_is_emptied_under_the_layer_mask_hook():
    """With install_layer_masks the hook meets the layer past the cache first: refused as update refuses it, the
    cache emptied, so a retry is refused the same way and holds nothing (not the prompt twice)."""
    from dataclasses import replace

    model, cal = _setup()
    install_layer_masks(model)
    config = transformers.Qwen3Config(**{**model.config.to_dict(), "num_hidden_layers": 1, "layer_types": None})
    one = replace(cal, q_mean=cal.q_mean[:1], q_abs_mean=cal.q_abs_mean[:1], layer_sensitivity=None)
    cache = TriAttentionCache(config, one, budget=16, beta=4)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"layer_mask: layer_idx 1 is out of range: the cache holds 1 layer"):
            model.generate(torch.randint(1, TINY["vocab_size"], (2, 10)), max_new_tokens=4, do_sample=False,
                           **_with(model, cache))
        assert cache.pools is None and cache.held == 0 and cache.get_seq_length() == 0


def test_reorder_cache_reorders_each_rounds_history():
    """Beam search's reorder moves each row's round history with its pools and slot positions."""
    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=8, beta=4)
    model.generate(torch.randint(1, TINY["vocab_size"], (3, 6)), max_new_tokens=20, do_sample=False,
                   **_with(model, cache))
    assert cache.rounds
    before = [(end, kept.clone()) for end, kept in cache.rounds]
    assert not torch.equal(before[-1][1][0], before[-1][1][1])  # rows kept different tokens
    idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(idx)
    assert [end for end, _ in cache.rounds] == [end for end, _ in before]
    for (_, kept), (_, old) in zip(cache.rounds, before):
        assert torch.equal(kept, old[idx])


def test_a_used_cache_refuses_a_shorter_prompt_by_saying_so():
    """generate slices off the tokens a cache holds: a new, shorter prompt reaches the cache as a step of no
    tokens. The error says the cache holds a sequence already and how to start again; reset() does."""
    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=16, beta=4)
    model.generate(torch.randint(1, TINY["vocab_size"], (1, 12)), max_new_tokens=4, do_sample=False,
                   **_with(model, cache))
    short = torch.randint(1, TINY["vocab_size"], (1, 5))
    with pytest.raises(ValueError, match=r"already holds a sequence of \d+ tokens.*reset\(\)"):
        model.generate(short, max_new_tokens=4, do_sample=False, **_with(model, cache))
    cache.reset()
    model.generate(short, max_new_tokens=4, do_sample=False, **_with(model, cache))
    assert cache.get_seq_length() == 5 + 3


def test_a_step_too_long_is_told_how_many_tokens_fit():
    """The refusal of a long step states the rule at this phase: the step of 'at most M' tokens it names fits,
    M + 1 does not (with beta 4 that is 3 to 5 tokens, by phase)."""
    import re

    model, cal = _setup()
    cache = TriAttentionCache(model.config, cal, budget=8, beta=4)
    seq = torch.randint(1, TINY["vocab_size"], (1, 60))
    _run(model, cache, seq[:, :6])
    seen = set()
    for t in range(6, 46):
        with pytest.raises(ValueError, match="may add at most") as e:
            cache.get_mask_sizes(100)
        most = int(re.search(r"at most (\d+) tokens", str(e.value)).group(1))
        seen.add(most)
        cache.get_mask_sizes(most)
        _refused(cache, lambda: cache.get_mask_sizes(most + 1), ValueError, f"at most {most} tokens, not {most + 1}")
        _run(model, cache, seq[:, t:t + 1])
    assert min(seen) >= 1 and len(seen) > 1
