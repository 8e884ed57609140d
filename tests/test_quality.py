"""benchmarks.quality on tiny random models: the mechanics of the eviction-quality harness, and its keep sets
against TriAttentionCache decoding token by token."""

from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from kvops.calibrate import calibrate  # noqa: E402
from kvops.triattention import LayerSensitivity, load_calibration  # noqa: E402
from conftest import BARE, TINY, tiny_model  # noqa: E402


def _calibrated(model, tokens=128):
    return load_calibration(calibrate(model, torch.randint(0, TINY["vocab_size"], (tokens,))), model.config.to_dict())


def test_policies_parse_and_name_themselves():
    from benchmarks.quality import Policy

    for text in ("full", "recent", "sinks", "random", "oracle+l0", "triattention_per_head+w16+s4+l0.2",
                 "triattention_union", "recent+w8", "triattention_per_head+default+f0.5", "recent+l0+f2",
                 "triattention_union+w16+s4+l0+p4", "triattention_per_head+p0.5", "recent+split",
                 "triattention_per_head+default+split", "triattention_union+w16+split"):
        assert Policy.parse(text).name == text
    assert Policy.parse("triattention_per_layer_perhead+l3.1").recent_layers == (3, 1)
    assert Policy.parse("triattention_per_head+default+f0.25").share == 0.25
    for bad in ("triattention", "oracle_union", "recent_union", "triattention_per_head+x3", "window", "random+w",
                "recent+l0+f0", "recent+l0+f-1", "recent+fx", "recent+p2", "triattention_union+p-1", "full+split",
                "recent+l0+split", "recent+split+f0.5", "recent+splits"):
        with pytest.raises(ValueError):
            Policy.parse(bad)


def test_quality_harness_runs_and_full_cache_agrees_with_itself():
    """Every method runs on a tiny random model over two windows: the full cache agrees with itself, the rows
    carry confidence intervals and the paired difference from the recent window (zero for the window itself)."""
    from benchmarks.quality import evaluate

    model = tiny_model("qwen3")
    model.config._attn_implementation = "eager"
    windows = [torch.randint(0, TINY["vocab_size"], (96,)) for _ in range(2)]
    methods = ["full", "recent", "sinks", "random", "oracle", "oracle+l0", "triattention_union",
               "triattention_per_head+w4+s2", "triattention_per_layer_perhead+l0"]
    rows = evaluate(model, windows, _calibrated(model), [16], beta=4, prompt=8, methods=methods, log=lambda *a: None,
                    tokenizer=_Chars())
    by = {r["method"]: r for r in rows}
    assert list(by) == methods and all(r["windows"] == 2 for r in rows)
    # the long-range tokens (the full cache right, the recent window wrong: a random model is seldom right, so
    # test_long_range_measures_... checks what they hold) and the probes are the same tokens for every method
    assert len({r["long_range_tokens"] for r in rows}) == 1
    assert len({r["probes"] for r in rows}) == 1
    assert all(0.0 <= r["probe_accuracy"] <= 1.0 if r["probes"] else r["probe_accuracy"] != r["probe_accuracy"]
               for r in rows)
    assert by["full"]["agreement"] == 1.0 and by["full"]["loss_ci95"] >= 0
    assert by["recent"]["vs_recent"] == 0.0
    assert all(0.0 <= r["agreement"] <= 1.0 and r["loss"] > 0 and r["loss_ci95"] == r["loss_ci95"] for r in rows)
    assert len({round(r["loss"], 6) for r in rows}) > 4  # the methods keep different tokens


def test_simulated_rounds_hold_the_prompt_the_budget_and_the_tail():
    from benchmarks.quality import Policy, rounds, simulate

    model = tiny_model("qwen3")
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, TINY["vocab_size"], (96,))
    times = list(rounds(96, 8, 16, 4))
    assert times[0] == 8 + 17 and all(b - a == 4 for a, b in zip(times, times[1:]))
    record = []
    simulate(model, ids, 8, 16, 4, Policy.parse("recent+w4+s2"), record=record)
    assert [t for t, _ in record] == times
    for t, held in record:
        assert held.shape == (1, 2, t) and (held.sum(-1) == 8 + 16).all()
        assert held[..., :8 + 2].all() and held[..., t - 16 + 2:].all()  # prompt, sinks, the newest 14


def _check_split(record, local, local_budget, scored, budget, t_local, t_scored, newest=None):
    """After each round: a group whose round it is holds its count of decode tokens (the local one its newest);
    a group between its rounds holds at most its count plus the tokens since its last round (beta)."""
    assert record and {t for t, _ in record} == set(t_local) | set(t_scored)
    for t, held in record:
        decode = held[..., 8:].sum(-1)  # the prompt is 8 tokens
        assert (decode[local] == local_budget).all() == (t in t_local) and (decode[local] <= local_budget + 4).all()
        assert (decode[scored] == budget).all() if t in t_scored else (decode[scored] <= budget + 4).all()
        if t in t_local:
            assert held[local, :, t - local_budget:].all()
        if t in t_scored and newest:
            assert held[scored, :, t - newest:].all()


def test_a_per_layer_split_holds_the_same_total():
    """+fF: the layers on recency keep their newest F x budget, the others share the rest of the same total; each
    group runs its rounds when it holds more than its count."""
    from benchmarks.quality import Policy, rounds, simulate

    model = tiny_model("qwen3")  # 2 layers
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, TINY["vocab_size"], (96,))
    record = []
    simulate(model, ids, 8, 16, 4, Policy.parse("recent+l0+f0.5"), record=record)
    # layer 0: its newest 8; layer 1: the other 24 of the 2 x 16, its newest
    _check_split(record, 0, 8, 1, 24, list(rounds(96, 8, 8, 4)), list(rounds(96, 8, 24, 4)), newest=24)
    with pytest.raises(ValueError, match="per-layer split"):
        simulate(model, ids, 8, 16, 4, Policy.parse("recent+f0.5"))


def test_a_calibrated_split_puts_the_insensitive_layers_on_recency():
    """+split: the calibration's layer sensitivity picks the layers on recency (kvops.config.layer_split): here
    layer 1 (a hundredth of layer 0's loss) keeps its newest half budget and layer 0 the rest of the same total;
    the default policy's own recent layer (0) gives way to the split's."""
    from benchmarks.quality import Policy, full_attention, rounds, simulate

    model = tiny_model("qwen3")  # 2 layers
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, TINY["vocab_size"], (96,))
    cal = _calibrated(model)
    cal = replace(cal, layer_sensitivity=LayerSensitivity((4, 64), torch.tensor([[0.5, 0.005], [0.2, 0.002]]), 4))
    times = list(rounds(96, 8, 8, 4)), list(rounds(96, 8, 24, 4))
    attention = full_attention(model, ids)[1]
    for method, newest in (("recent+split", 24), ("triattention_per_head+default+split", 4),  # min(24 // 4, 4)
                           ("oracle+split", None), ("random+split", None)):
        record = []
        simulate(model, ids, 8, 16, 4, Policy.parse(method), cal, attention, record=record)
        _check_split(record, 1, 8, 0, 24, *times, newest=newest)
    with pytest.raises(ValueError, match="layer sensitivity"):
        simulate(model, ids, 8, 16, 4, Policy.parse("recent+split"), replace(cal, layer_sensitivity=None))


@pytest.mark.parametrize("mode,options", [("union", {}), ("per_head", {}), ("union", BARE),
                                          ("per_head", dict(sink_tokens=2, recent_window=3)),
                                          ("per_head", dict(sink_tokens=1, recent_window=8)),  # window > beta
                                          ("per_layer_perhead", dict(recent_window=2, recent_layers=(0,))),
                                          ("union", dict(sink_tokens=1, recent_layers=(1,))),
                                          ("per_head", dict(recency_prior=3.0)), ("per_layer_perhead", {})])
def test_harness_keeps_what_decoding_with_the_kvops_cache_keeps(mode, options):
    """Two independent paths to the same keep sets: the harness (chunks over a cache that keeps every key, masks
    narrowed at each round) and TriAttentionCache fed the same tokens one by one (slots tracked through the
    compactions), under the same keep policy: given, or the mode's defaults the cache resolved."""
    from benchmarks.quality import Policy, simulate
    from kvops.integrations.transformers import TriAttentionCache, cache_keyword

    model = tiny_model("qwen3").to(torch.bfloat16)
    model.config._attn_implementation = "eager"
    cal = _calibrated(model, 256)
    seq, prompt, budget, beta = torch.randint(1, TINY["vocab_size"], (70,)), 10, 16, 4
    cache = TriAttentionCache(model.config, cal, budget=budget, beta=beta, mode=mode, round_history=None,
                              **options)
    with torch.no_grad():
        model(input_ids=seq[None, :prompt], **{cache_keyword(model): cache})
        for t in range(prompt, seq.numel()):
            model(input_ids=seq[None, t:t + 1], **{cache_keyword(model): cache})
    policy = Policy("triattention", mode, recent=cache.recent_window, sinks=cache.sink_tokens,
                    recent_layers=cache.recent_layers, prior=cache.recency_prior)
    record = []
    with torch.no_grad():
        simulate(model, seq, prompt, budget, beta, policy, cal, record=record)
    L, Hkv = model.config.num_hidden_layers, model.config.num_key_value_heads
    decision = {"union": 1, "per_head": Hkv, "per_layer_perhead": L * Hkv}[mode]
    assert len(record) == len(cache.rounds) >= 10
    for (t, held), (t_cache, kept) in zip(record, cache.rounds):
        assert t == t_cache
        for layer in range(L):
            for g in range(Hkv):
                row = decision if layer in policy.recent_layers else \
                    {"union": 0, "per_head": g, "per_layer_perhead": layer * Hkv + g}[mode]
                want = held[min(layer, held.shape[0] - 1), g, prompt:].nonzero().flatten() + prompt
                assert sorted(kept[0, row].tolist()) == want.tolist(), (t, layer, g)


@pytest.mark.parametrize("mode", ["union", "per_head", "per_layer_perhead"])
def test_harness_split_is_what_the_split_cache_decodes(mode):
    """+split against TriAttentionCache(layer_split=True) fed the same tokens one by one: the scored layer keeps
    the same tokens at the same rounds, and the logits agree to bf16 rounding (the local layer's ring holds its
    tokens in another slot order); a local layer holding other tokens would differ by far more."""
    from benchmarks.quality import Policy, simulate
    from kvops.integrations.transformers import TriAttentionCache, cache_keyword, install_layer_masks

    model = tiny_model("qwen3").to(torch.bfloat16)
    model.config._attn_implementation = "eager"
    install_layer_masks(model)
    cal = replace(_calibrated(model, 256),  # layer 1 local: 8 tokens, layer 0 scored: 24
                  layer_sensitivity=LayerSensitivity((4, 64), torch.tensor([[0.5, 0.005], [0.2, 0.002]]), 4))
    seq, prompt, budget, beta = torch.randint(1, TINY["vocab_size"], (70,)), 10, 16, 4
    cache = TriAttentionCache(model.config, cal, budget=budget, beta=beta, mode=mode, layer_split=True,
                              round_history=None)
    with torch.no_grad():
        logits = [model(input_ids=seq[None, :prompt], **{cache_keyword(model): cache}).logits[0]]
        logits += [model(input_ids=seq[None, t:t + 1], **{cache_keyword(model): cache}).logits[0]
                   for t in range(prompt, seq.numel())]
        record = []
        sim = simulate(model, seq, prompt, budget, beta, Policy.parse(f"triattention_{mode}+default+split"), cal,
                       record=record)
    assert cache.local_layers == (1,) and cache.num_local_rounds >= 10 and cache.num_rounds >= 5
    by_time = dict(record)
    Hkv = model.config.num_key_value_heads
    for t, kept in cache.rounds:
        for g in range(Hkv):
            want = by_time[t][0, g, prompt:].nonzero().flatten() + prompt
            assert sorted(kept[0, 0 if mode == "union" else g].tolist()) == want.tolist(), (t, g)
    torch.testing.assert_close(torch.cat(logits).float(), sim.float(), rtol=0, atol=2e-2)


def test_real_caches_decode_with_and_without_an_nvfp4_cycle():
    """evaluate_caches: the bf16 caches decode the window token by token; TriAttention's cache keeps its memory
    bound, and an NVFP4 offload/onboard cycle changes its predictions by codec error only. A calibration with a
    layer sensitivity adds the cache under its layer split (and one without, none)."""
    from benchmarks.quality import evaluate_caches

    model = tiny_model("qwen3")
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, TINY["vocab_size"], (80,))
    cal = replace(_calibrated(model), layer_sensitivity=LayerSensitivity((64,), torch.tensor([[0.5, 0.005]]), 4))
    rows = evaluate_caches(model, [ids], cal, [16], beta=4, prompt=8, modes=("union",), log=lambda *a: None,
                           recent_window=2)
    by = {r["method"]: r for r in rows}
    assert set(by) == {"full_cache", "triattention_union_cache", "triattention_union_nvfp4", "triattention_union_split"}
    assert by["triattention_union_split"]["loss"] != by["triattention_union_cache"]["loss"]
    rows = evaluate_caches(model, [ids], replace(cal, layer_sensitivity=None), [16], beta=4, prompt=8,
                           modes=("union",), log=lambda *a: None)
    assert "triattention_union_split" not in {r["method"] for r in rows}
    assert by["full_cache"]["agreement"] > 0.9  # bf16 against the float32 full cache
    assert by["triattention_union_cache"]["kv_tokens_max"] == 8 + 16 + 4 < by["full_cache"]["kv_tokens_max"]
    assert all(r["tokens_per_s"] > 0 and r["positions"] == by["full_cache"]["positions"] > 0 for r in rows)
    plain, cycled = by["triattention_union_cache"], by["triattention_union_nvfp4"]
    assert plain["loss"] != cycled["loss"] and abs(plain["loss"] - cycled["loss"]) < 0.5
    assert all(abs(r["perplexity"] - torch.tensor(r["loss"]).exp().item()) < 1e-3 * r["perplexity"] for r in rows)


class _Chars:
    """A tokenizer of one character per token (a token id is the character's code)."""

    @staticmethod
    def decode(ids):
        return "".join(map(chr, ids))


def test_retrieval_probes_find_names_that_come_back_from_the_text_alone():
    from benchmarks.quality import retrieval_probes

    text = "ab = 1\nlen(ab)\nself.cd(x)\nx.cd + ab + len\nab"
    ids = torch.tensor([ord(c) for c in text])
    probes = retrieval_probes(_Chars(), ids, prompt=0).tolist()
    # ab at 11 (its last use ended at 1), cd at 28 (21), ab at 33 (12), ab at 42 (34); not len, self or x (a
    # builtin, a common name, a one-token name)
    assert probes == [[12, 12, 10], [29, 29, 7], [34, 34, 21], [43, 43, 8]]
    assert [text[s - 1:e + 1] for s, e, _ in probes] == ["ab", "cd", "ab", "ab"]
    # a name first seen in the prompt is not probed where it comes back; occurrences in the prompt are not probed
    assert retrieval_probes(_Chars(), ids, prompt=7).tolist() == [[29, 29, 7], [34, 34, 21], [43, 43, 8]]
    assert retrieval_probes(_Chars(), ids[:0], prompt=0).shape == (0, 3)


def test_long_range_measures_judge_every_method_on_the_same_tokens():
    """long_range_tokens: where the full cache predicts the next token and the recent window does not; _cell
    counts a probe completed only when every one of its tokens is predicted, and loss and agreement on the
    long-range tokens alone."""
    from benchmarks.quality import _cell, long_range_tokens

    n, vocab, first = 12, 5, 3
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1))
    onehot = lambda tokens: torch.nn.functional.one_hot(tokens, vocab).float() * 4  # noqa: E731
    right = onehot(torch.cat((ids[1:], ids[:1])))  # row i predicts ids[i + 1]
    wrong = onehot((torch.cat((ids[1:], ids[:1])) + 1) % vocab)
    full = right.clone()
    full[5] = wrong[5]                       # the full cache misses position 6
    recent = right.clone()
    recent[[4, 5, 7]] = wrong[[4, 5, 7]]     # the window misses 5, 6 and 8
    long = long_range_tokens(full, recent, ids, first)
    assert long.tolist() == [i + first in (4, 7) for i in range(n - 1 - first)]
    method = right.clone()
    method[7] = wrong[7]                     # gets 5 back, still misses 8
    probes = torch.tensor([[5, 6, 40], [8, 8, 40], [9, 10, 40]])
    loss, agree, count, long_loss, long_agree, long_count, completed, probed = _cell(method, full, ids, first, long,
                                                                                      probes)
    assert (count, long_count, probed) == (n - 1 - first, 2, 3)
    assert long_agree == 1 and agree == count - 2  # 8 differs from the full cache, and 6 (the full cache's miss)
    assert completed == 2  # 5-6 and 9-10 completed, 8 missed
    ce = torch.nn.functional.cross_entropy(method[first:-1], ids[first + 1:], reduction="none")
    assert long_loss == pytest.approx(float(ce[[4 - first, 7 - first]].sum()))
    assert loss == pytest.approx(float(ce.sum()))


def test_counts_are_checked_before_the_model_loads():
    from benchmarks.quality import main

    for option in ("--skip-windows", "--threads", "--sensitivity-windows"):
        with pytest.raises(SystemExit) as e:
            main(["--model", "no-such-dir", "--text", "no-such-file", option, "-1"])
        assert e.value.code == 2
