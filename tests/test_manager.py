"""Managers on the reference cache: admission, due rounds, logical positions, and the round's effect."""

import dataclasses
import random
import types

import pytest
import torch
import triton

from conftest import BARE
from kvops.cache import PagedKVCache
from kvops.config import NVFP4ColdPageConfig, TriAttentionConfig, config_from_json
from kvops.manager import (KVCacheCompressionManager, NVFP4ColdPageManager, Request, TriAttentionManager,
                           TriAttentionRound, create_compression_manager, round_order)
from kvops.compaction import MODES
from kvops.compaction.reference import fill_order, ring_order
from kvops.triattention.reference import select_reference

MODEL = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e4)


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "cal.pt"
    torch.save({"E_q": torch.randn(2, 4, 16, dtype=torch.complex64), "E_q_norm": torch.rand(2, 4, 16) + 1}, path)
    return str(path)


def _cache(codec_specs=None):
    return PagedKVCache(2, 2, 32, 8, num_pages=64, host_slots=8, codec_specs=codec_specs)


def _cold_cache(config=NVFP4ColdPageConfig(row_size=32)):
    """A cache whose host tier encodes with `config` (what NVFP4ColdPageManager admits)."""
    return _cache([config.row_spec()] * 2)


def _kv(n):
    return torch.randn(n, 2, 32).bfloat16(), torch.randn(n, 2, 32).bfloat16()


@pytest.mark.parametrize("compaction_order", ["ordered", "fill"])
def test_rounds_follow_budget_and_beta_and_match_the_reference(calibration, compaction_order):
    config = TriAttentionConfig(budget=12, beta=5, eviction_mode="per_head", calibration_path=calibration,
                                compaction_order=compaction_order, **BARE)
    cache = _cache()
    manager = create_compression_manager(config, cache, MODEL)
    assert isinstance(manager, TriAttentionManager)
    for rid, prompt in (("a", 7), ("b", 20)):
        cache.add_request(rid)
        manager.on_request_init(Request(rid, prompt))
        cache.append(rid, *_kv(prompt))
    manager.on_context_step_end([Request("a", 7), Request("b", 20)])
    rounds = []
    for step in range(40):
        manager.on_generation_step_begin(["a", "b"])
        n_b = 6 if step % 4 == 0 else 1  # b sometimes confirms several tokens in one step (up to beta + 1)
        cache.append("a", *_kv(1))
        cache.append("b", *_kv(n_b))
        due = [r for r in ("a", "b") if cache.length(r) - manager.prompt_length[r] > 12
               and manager.since_round[r] + (1 if r == "a" else n_b) >= 5]
        before = {r: (cache.read(r), cache.length(r), manager.logical_position(r)) for r in due}
        if due:  # what the round must keep, from the float64 reference on the same pages
            expect = {}
            for r in due:
                length, start = before[r][1], before[r][2]
                prompt = manager.prompt_length[r]
                tail = max(0, length - prompt - 22)  # beyond budget + 2 beta: the unscored, protected tail
                kept, _ = select_reference([v.cpu() for v in cache.views()], cache.page_table([r]).cpu(),
                                           torch.tensor([length - tail]), torch.tensor([prompt]),
                                           torch.tensor([start]), manager.selector.calibration, 12, "per_head")
                expect[r] = (kept[0], torch.arange(length - tail, length))
        manager.on_generation_step_end([("a", 1), ("b", n_b)])
        for r in due:
            data, length, start = before[r]
            prompt = manager.prompt_length[r]
            kept, tail = expect[r]
            assert cache.length(r) == prompt + 12 + len(tail)
            assert manager.logical_position(r) == start  # evicted tokens still count for positions
            for head in range(2):
                survivors = torch.cat([kept[head].long(), tail])
                if compaction_order == "fill":
                    survivors = torch.tensor(fill_order(survivors.tolist(), prompt))
                order = torch.cat([torch.arange(prompt), survivors])
                assert torch.equal(cache.read(r)[:, :, :, head], data[:, :, order, head])
            rounds.append((step, r))
        cache.check_invariants()
    assert {r for _, r in rounds} == {"a", "b"} and manager.rounds == len({s for s, _ in rounds})
    manager.on_request_finish(Request("a", 7))
    assert "a" not in manager.prompt_length


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compaction_order,prior", [("ordered", 0.0), ("fill", 0.0), ("fill", 2.0)])
def test_keep_policy_rounds_match_the_reference(calibration, mode, compaction_order, prior):
    """sink_tokens, recent_window and recent_layers: each round keeps the prompt, the first 2 generated tokens,
    the newest 3 and, in layer 0, the float64 reference's choice of 12 - 5 among the others, scored on layer 0
    alone; layer 1 (a recent layer) keeps the newest 7 of them instead: in fill order as a ring, oldest first from
    the manager's window offset. With a recency prior, the reference reads each layer-0 slot's logical position
    as the test tracks it."""
    config = TriAttentionConfig(budget=12, beta=5, eviction_mode=mode, calibration_path=calibration,
                                compaction_order=compaction_order, sink_tokens=2, recent_window=3, recent_layers=[1],
                                recency_prior=prior)
    cache = _cache()
    manager = create_compression_manager(config, cache, MODEL)
    chosen, cal = 12 - 2 - 3, manager.selector.calibration
    assert manager.selector.budget == chosen and cal.num_layers == 1
    cache.add_request("a")
    manager.on_request_init(Request("a", 6))
    cache.append("a", *_kv(6))
    manager.on_context_step_end([Request("a", 6)])
    checked, times, offset = 0, list(range(6)), 0  # times: the logical position in each slot of layer 1
    rows = manager.selector.rows
    row_times = [list(range(6)) for _ in range(rows)]  # the same for layer 0's decision rows
    for step in range(40):
        manager.on_generation_step_begin(["a"])
        n = 4 if step % 5 == 0 else 1
        times += range(manager.logical_position("a"), manager.logical_position("a") + n)
        for t in row_times:
            t += range(manager.logical_position("a"), manager.logical_position("a") + n)
        cache.append("a", *_kv(n))
        due = manager.due([("a", n)])
        data, length, start = cache.read("a"), cache.length("a"), manager.logical_position("a")
        if due:
            protected = 6 + 2
            tail = 3 + max(0, length - protected - 3 - (12 + 10 - 5))
            positions = torch.tensor([t[protected:] for t in row_times])[None]
            kept, _ = select_reference([cache.views()[0].cpu()], cache.page_table(["a"]).cpu(),
                                       torch.tensor([length - tail]), torch.tensor([protected]),
                                       torch.tensor([start]), cal, chosen, mode, recency_prior=prior,
                                       positions=positions)
        manager.on_generation_step_end([("a", n)])
        if not due:
            continue
        assert cache.length("a") == protected + chosen + tail and manager.logical_position("a") == start
        scored = length - tail
        newest = torch.arange(scored - chosen, scored)
        if compaction_order == "fill":
            newest = torch.tensor(ring_order(scored, protected, chosen, offset))
            offset = (offset + scored - protected - chosen) % chosen
        if compaction_order == "fill":  # TriAttentionRound derives the ring's offset from the evicted tokens
            assert manager.num_compressed_tokens["a"] % chosen == offset
        for layer in range(2):
            for head in range(2):
                row = 0 if mode == "union" else head
                picked = kept[0, row].long() if layer == 0 else newest
                survivors = torch.cat([picked, torch.arange(length - tail, length)])
                if compaction_order == "fill" and layer == 0:
                    survivors = torch.tensor(fill_order(survivors.tolist(), protected))
                order = torch.cat([torch.arange(protected), survivors])
                assert torch.equal(cache.read("a")[layer, :, :, head], data[layer, :, order, head])
                if layer == 0 and head == row:
                    row_times[row] = [row_times[row][s] for s in order.tolist()]
        # layer 1 holds the newest scored tokens, oldest first from its offset, then the tail
        oldest_first = sorted(times[protected:scored])[-chosen:]
        times = times[:protected] + [times[s] for s in newest.tolist()] + times[scored:length]
        ring = times[protected:protected + chosen]
        assert ring[offset:] + ring[:offset] == oldest_first and times[protected + chosen:] == sorted(times[-tail:])
        checked += 1
        cache.check_invariants()
    assert checked >= 3


@pytest.mark.parametrize("mode", MODES)
def test_slot_positions_follow_every_request_through_rounds_and_seats(calibration, mode):
    """With a recency prior the manager keeps each decode slot's logical position: a seat per request (the table
    grows past its first size, a finished request's seat is taken again). Every token's K carries its logical
    position, so after every round the stored slots must hold what the cache holds there."""
    config = TriAttentionConfig(budget=12, beta=5, eviction_mode=mode, calibration_path=calibration,
                                recency_prior=4.0, sink_tokens=1, recent_window=3, recent_layers=[1])
    cache = _cache()
    manager = create_compression_manager(config, cache, MODEL)
    prompts, logical = {}, {}

    def tokens(rid, n):  # K holds each token's logical position (exact in bf16 below 256)
        k = torch.arange(logical[rid], logical[rid] + n).float().view(n, 1, 1).expand(n, 2, 32).bfloat16()
        logical[rid] += n
        return k, torch.randn(n, 2, 32).bfloat16()

    def admit(rid, prompt):
        prompts[rid], logical[rid] = prompt, 0
        cache.add_request(rid)
        manager.on_request_init(Request(rid, prompt))
        cache.append(rid, *tokens(rid, prompt))
        manager.on_context_step_end([Request(rid, prompt)])

    for rid, prompt in (("a", 5), ("b", 9)):
        admit(rid, prompt)
    checked = 0
    for step in range(45):
        if step == 8:
            admit("c", 3)  # a third seat: the table grows
        if step == 20:
            seat = manager._seats["b"]
            manager.on_request_finish(Request("b", 9))
            cache.finish("b")
            del prompts["b"]
            admit("d", 4)
            assert manager._seats["d"] == seat  # the freed seat
        active = list(prompts)
        manager.on_generation_step_begin(active)
        batch = []
        for i, rid in enumerate(active):
            n = 3 if (step + i) % 7 == 0 else 1
            cache.append(rid, *tokens(rid, n))
            batch.append((rid, n))
        manager.on_generation_step_end(batch)
        for rid in active:
            stored = manager._stored[rid]
            if not stored:
                continue
            P = prompts[rid] + 1
            held = cache.read(rid)[0, 0, P:P + stored, :, 0].float().long()  # layer 0 (scored), K
            table = manager.slot_positions[manager._seats[rid]].cpu().long()
            for row in range(manager.selector.rows):
                assert torch.equal(table[row, :stored], held[:, 0 if mode == "union" else row]), (step, rid, row)
            checked += 1
    assert checked > 30 and manager.slot_positions.shape[0] == 4


@pytest.mark.parametrize("window,order", [(5, "fill"), (7, "ordered")])
def test_a_window_longer_than_beta_keeps_the_newest_tokens_last(calibration, window, order):
    """A round protects its last slots as the window. A fill round scatters its tail into the evicted slots,
    which is right while the next window holds only the beta tokens since: they arrive in order. A longer window
    makes the rounds run "ordered", so that its older tokens are still the last slots, in time order."""
    config = TriAttentionConfig(budget=12, beta=5, eviction_mode="per_head", calibration_path=calibration,
                                recent_window=window, sink_tokens=0, recent_layers=())
    cache = _cache()
    manager = create_compression_manager(config, cache, MODEL)
    assert manager.order == order and config.compaction_order == "fill"
    cache.add_request("a")
    manager.on_request_init(Request("a", 4))
    count = 0

    def tokens(n):  # K holds each token's logical index
        nonlocal count
        k = torch.arange(count, count + n).float().view(n, 1, 1).expand(n, 2, 32).bfloat16()
        count += n
        return k, torch.randn(n, 2, 32).bfloat16()

    cache.append("a", *tokens(4))
    manager.on_context_step_end([Request("a", 4)])
    rounds = 0
    for _ in range(60):
        manager.on_generation_step_begin(["a"])
        cache.append("a", *tokens(1))
        if manager.due([("a", 1)]):  # the round about to run protects the last slots: the newest tokens, in order
            held = cache.read("a")[0, 0, :, 0, 0].float()  # layer 0, K, every slot, KV head 0, dim 0
            assert held[-window:].tolist() == list(range(count - window, count))
            rounds += 1
        manager.on_generation_step_end([("a", 1)])
    assert rounds >= 5


def test_keep_policy_is_checked_against_the_budget_and_the_model(calibration):
    kwargs = dict(budget=12, beta=5, calibration_path=calibration)
    with pytest.raises(ValueError, match="sink_tokens \\+ recent_window .* must be below the budget 12"):
        TriAttentionConfig(**kwargs, sink_tokens=4, recent_window=8)
    with pytest.raises(TypeError, match="recent_window must be an int"):
        TriAttentionConfig(**kwargs, recent_window=2.0)
    with pytest.raises(TypeError, match="recent_layers must be a list or tuple"):
        TriAttentionConfig(**kwargs, recent_layers=0)
    with pytest.raises(ValueError, match="recent_layers has a layer twice"):
        TriAttentionConfig(**kwargs, recent_layers=[0, 0])
    with pytest.raises(ValueError, match="names layers past the model's 2"):
        create_compression_manager(TriAttentionConfig(**kwargs, recent_layers=[2]), _cache(), MODEL)
    with pytest.raises(ValueError, match="recent_layers names every layer"):
        create_compression_manager(TriAttentionConfig(**kwargs, recent_layers=[1, 0]), _cache(), MODEL)
    assert TriAttentionConfig(**kwargs, recent_layers=[1, 0]).recent_layers == (0, 1)


def test_a_cache_with_a_k_scale_gives_it_to_the_selector(calibration):
    """An fp8 cache that stores keys scaled exposes k_scale ([L] or [L, Hkv]); the manager hands it on, checked."""
    cache = _cache()
    cache.k_scale = torch.tensor([0.5, 2.0])
    tri = TriAttentionConfig(calibration_path=calibration, normalize_scores=False, **BARE)
    manager = create_compression_manager(tri, cache, MODEL)
    assert torch.equal(manager.selector.k_scale, torch.tensor([[0.5, 0.5], [2.0, 2.0]]))
    # by default layer 0 keeps its newest tokens: the selector scores layer 1 with its k_scale
    default = create_compression_manager(dataclasses.replace(tri, recent_layers=None), cache, MODEL)
    assert default.policy.recent_layers == (0,)
    assert torch.equal(default.selector.k_scale, torch.tensor([[2.0, 2.0]]))
    cache.k_scale = torch.tensor([0.5, 0.0])
    with pytest.raises(ValueError, match="positive and finite"):
        create_compression_manager(tri, cache, MODEL)
    cache.k_scale = torch.tensor([0.5, 2.0, 3.0])  # the model's layers are counted, not only the scored ones
    with pytest.raises(ValueError, match=r"k_scale must be \[2\] \(per layer\) or \[2, KV heads\]"):
        create_compression_manager(dataclasses.replace(tri, recent_layers=None), cache, MODEL)


def test_admission(calibration):
    cache = _cache()
    tri = TriAttentionConfig(calibration_path=calibration)
    with pytest.raises(ValueError, match="one method per manager"):
        create_compression_manager([tri, NVFP4ColdPageConfig()], cache, MODEL)
    cache.block_reuse = True
    with pytest.raises(ValueError, match="block reuse"):
        create_compression_manager(tri, cache, MODEL)
    assert isinstance(create_compression_manager(NVFP4ColdPageConfig(row_size=32), _cold_cache(), MODEL),
                      NVFP4ColdPageManager)
    cache.block_reuse, cache.speculative_decoding = False, True
    with pytest.raises(ValueError, match="speculative decoding"):
        create_compression_manager(tri, cache, MODEL)
    cache.speculative_decoding = False
    with pytest.raises(ValueError, match="the cache has 2 layers, the model 3"):  # checked at admission
        create_compression_manager(tri, cache, {**MODEL, "num_hidden_layers": 3})
    with pytest.raises(ValueError, match="the cache has 2 KV heads, the model 4"):
        create_compression_manager(tri, cache, {**MODEL, "num_key_value_heads": 4})
    with pytest.raises(ValueError, match="the model needs"):  # the calibration's geometry
        create_compression_manager(tri, PagedKVCache(2, 2, 64, 8, num_pages=4), {**MODEL, "head_dim": 64})
    base = KVCacheCompressionManager(tri, cache, MODEL)  # every hook is a no-op
    for hook in (base.on_request_init, base.on_request_finish):
        hook(Request("x", 1))
    base.on_context_step_end([])
    base.on_generation_step_begin([])
    base.on_generation_step_end([])


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_decode_step_compiles_fullgraph(calibration, device):
    """The ops a round launches (selection, then in-place compaction) in one fullgraph-compiled step."""
    from kvops.compaction import build_compaction_params, compact
    from kvops.triattention import TriAttentionSelector

    config = TriAttentionConfig(budget=10, beta=4, calibration_path=calibration)
    selector = TriAttentionSelector(config.load_calibration(MODEL), 10, "union", max_decode=30)
    caches = [PagedKVCache(2, 2, 32, 8, num_pages=16, device=device) for _ in range(2)]
    for rid, n in (("a", 30), ("b", 25)):
        k, v = _kv(n)
        for cache in caches:
            cache.add_request(rid)
            cache.append(rid, k.to(device), v.to(device))
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    N, P, starts = i32([30, 25]), i32([4, 9]), torch.tensor([100, 40], device=device)

    def step(params, N, P, starts):
        params.kept.copy_(selector.select(params.pools, params.page_table, N, P, starts))
        return compact(params, 2)

    outs = []
    for cache, fn in zip(caches, (step, torch.compile(step, fullgraph=True,
                                                      backend="aot_eager" if device == "cpu" else "inductor"))):
        params = build_compaction_params(cache.views(), cache.page_table(["a", "b"]),
                                         torch.zeros(2, 1, 10, dtype=torch.int32, device=device), N, i32([0, 0]), P,
                                         max_tail=0)
        outs.append((fn(params, N, P, starts).cpu(), [p.clone() for p in cache.pools]))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][0].tolist() == [14, 19]
    for a, b in zip(outs[0][1], outs[1][1]):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_rounds_replay_from_cuda_graphs(calibration):
    """The manager's round captured per round size (TriAttentionRound) and replayed on fresh inputs equals the
    eager round: same lengths, same cache bytes, step after step, with 1 and 2 requests due at once."""
    config = TriAttentionConfig(budget=12, beta=4, eviction_mode="union", calibration_path=calibration)
    caches = [PagedKVCache(2, 2, 32, 8, num_pages=96, device="cuda") for _ in range(2)]
    managers = [create_compression_manager(config, cache, MODEL) for cache in caches]
    managers[0].cuda_graphs = False  # the eager reference; managers[1] captures (the default)
    prompts = {"a": 3, "b": 9, "c": 16}
    for rid, prompt in prompts.items():
        k, v = _kv(prompt)
        for cache, manager in zip(caches, managers):
            cache.add_request(rid)
            manager.on_request_init(Request(rid, prompt))
            cache.append(rid, k.cuda(), v.cuda())
    sizes = []
    for step in range(60):
        active = [r for r in prompts if step >= {"a": 0, "b": 2, "c": 4}[r]]  # staggered: rounds of 1 and 2
        k, v = _kv(len(active))
        for cache, manager in zip(caches, managers):
            for i, r in enumerate(active):
                cache.append(r, k[i:i + 1].cuda(), v[i:i + 1].cuda())
            before = {r: cache.length(r) for r in active}
            manager.on_generation_step_end([(r, 1) for r in active])
        compacted = sum(caches[1].length(r) < n for r, n in before.items())
        if compacted:
            sizes.append(compacted)
        for r in prompts:
            assert caches[0].length(r) == caches[1].length(r)
            assert torch.equal(caches[0].read(r), caches[1].read(r)), f"step {step}, request {r}"
    graphs = managers[1]._round.graphs
    assert len(set(sizes)) >= 2 and set(graphs) == set(sizes) and len(sizes) > len(graphs)  # some replayed


def test_round_refuses_offloaded_requests(calibration):
    config = TriAttentionConfig(budget=12, beta=5, calibration_path=calibration)
    cache = _cache()
    manager = create_compression_manager(config, cache, MODEL)
    cache.add_request("a")
    manager.on_request_init(Request("a", 3))
    cache.append("a", *_kv(3 + 13))  # 13 decode tokens > budget: due at this step
    cache.offload("a")
    with pytest.raises(RuntimeError, match="offloaded"):
        manager.on_generation_step_end([("a", 13)])
    cache.onboard("a")
    assert cache.length("a") == 16 and manager.rounds == 0
    cache.check_invariants()


def test_hooks_refuse_bad_requests_before_changing_anything(calibration):
    cache = _cache()
    manager = create_compression_manager(TriAttentionConfig(budget=8, beta=4, calibration_path=calibration), cache,
                                         MODEL)
    with pytest.raises(ValueError, match="prompt_length must be >= 0"):
        Request("r", -5)
    with pytest.raises(TypeError, match="prompt_length"):
        Request("r", 2.5)
    manager.on_request_init(Request("a", 4))
    cache.add_request("a")
    cache.append("a", *_kv(5))
    with pytest.raises(ValueError, match="already admitted"):
        manager.on_request_init(Request("a", 4))
    before = dict(manager.since_round)
    with pytest.raises(ValueError, match="request 'zzz' was never admitted"):
        manager.on_generation_step_end([("a", 1), ("zzz", 1)])
    with pytest.raises(ValueError, match="appears twice"):
        manager.on_generation_step_end([("a", 1), ("a", 1)])
    with pytest.raises(TypeError, match="confirmed tokens"):
        manager.on_generation_step_end([("a", 1.5)])
    assert manager.since_round == before


def test_decode_steps_wait_for_the_whole_prompt(calibration):
    """A chunked prefill that has written part of the prompt takes no decode hook: its tokens would count toward
    beta and the round would come early."""
    cache = _cache()
    manager = create_compression_manager(TriAttentionConfig(budget=8, beta=2, calibration_path=calibration), cache,
                                         MODEL)
    cache.add_request("a")
    manager.on_request_init(Request("a", 10))
    cache.append("a", *_kv(4))
    _refused(manager, cache, lambda: manager.on_generation_step_begin(["a"]), ValueError,
             "has written 4 of its 10 prompt tokens")  # before its first context step too
    manager.on_context_step_end([Request("a", 10)])  # 4 of 10
    cache.append("a", *_kv(6))
    _refused(manager, cache, lambda: manager.on_generation_step_end([("a", 6)]), ValueError,
             "has written 4 of its 10 prompt tokens")
    _refused(manager, cache, lambda: manager.on_generation_step_begin(["a"]), ValueError,
             "has written 4 of its 10 prompt tokens")
    manager.on_context_step_end([Request("a", 10)])  # the rest of the prompt
    manager.on_generation_step_begin(["a"])
    cache.append("a", *_kv(1))
    manager.on_generation_step_end([("a", 1)])
    assert manager.since_round == {"a": 1}


# issue 30: bad input, second pass

def _snapshot(manager, cache):
    """Every piece of manager and cache state, pools as bytes: what a refused call must leave as it was."""
    return ({name: dict(getattr(manager, name, {})) for name in
             ("prompt_length", "since_round", "num_compressed_tokens", "accounted_length")}, manager.rounds,
            list(cache._free_pages), list(cache._free_slots),
            {r: (q.length, list(q.pages), q.slots and list(q.slots)) for r, q in cache._requests.items()},
            [p.view(torch.uint8).clone() for p in cache.pools], cache.host.clone())


def _same(a, b):
    return a[:5] == b[:5] and all(torch.equal(x, y) for x, y in zip(a[5], b[5])) and torch.equal(a[6], b[6])


def _refused(manager, cache, fn, exc, match):
    before = _snapshot(manager, cache)
    with pytest.raises(exc, match=match):
        fn()
    assert _same(before, _snapshot(manager, cache))
    cache.check_invariants()


def _admit(manager, cache, rid, prompt, decode=0):
    cache.add_request(rid)
    manager.on_request_init(Request(rid, prompt))
    cache.append(rid, *_kv(prompt))
    manager.on_context_step_end([Request(rid, prompt)])
    for _ in range(decode):
        cache.append(rid, *_kv(1))
        manager.on_generation_step_end([(rid, 1)])


def test_refused_steps_count_no_confirmed_tokens(calibration):
    """A step refused for a due request that is offloaded, one that confirms too many tokens past a due round,
    or one naming a request the cache has released counts nothing; the step goes through once it can."""
    cache = _cache()
    manager = create_compression_manager(TriAttentionConfig(budget=12, beta=5, calibration_path=calibration), cache,
                                         MODEL)
    _admit(manager, cache, "a", 3, decode=8)
    _admit(manager, cache, "b", 5, decode=2)
    cache.append("a", *_kv(5))  # 13 decode tokens: due
    cache.offload("a")
    _refused(manager, cache, lambda: manager.on_generation_step_end([("b", 0), ("a", 5)]), RuntimeError,
             "offloaded")
    cache.onboard("a")
    cache.append("a", *_kv(15))  # 28 decode tokens: 6 past the 22 a round scores, more than beta
    _refused(manager, cache, lambda: manager.on_generation_step_end([("a", 20)]), RuntimeError, "more than beta")
    cache.shrink(["a"], [3 + 13])  # back to the 13 decode tokens of the due step
    cache.add_request("gone")
    manager.on_request_init(Request("gone", 2))
    cache.append("gone", *_kv(2))
    cache.finish("gone")  # released by the cache only
    cache.append("b", *_kv(1))
    _refused(manager, cache, lambda: manager.on_generation_step_end([("b", 1), ("gone", 0)]), ValueError,
             "'gone' is admitted here but unknown to the cache")
    assert manager.since_round == {"a": 8, "b": 2, "gone": 0}
    manager.on_generation_step_end([("a", 5), ("b", 1)])  # the step, counted once: a round
    assert manager.rounds == 1 and cache.length("a") == 3 + 12 and manager.since_round == {"a": 0, "b": 3, "gone": 0}
    assert manager.logical_position("a") == 3 + 13
    cache.check_invariants()


def test_confirmed_tokens_must_be_what_the_cache_gained(calibration):
    """A hook called twice for one step, or a count other than the tokens written since the last hook, would
    shift every later round (beta halved, rounds before budget): refused, naming the request."""
    cache = _cache()
    manager = create_compression_manager(TriAttentionConfig(budget=12, beta=5, calibration_path=calibration), cache,
                                         MODEL)
    _admit(manager, cache, "a", 7, decode=3)
    _admit(manager, cache, "b", 4)
    cache.append("a", *_kv(1))
    cache.append("b", *_kv(2))
    manager.on_generation_step_end([("a", 1), ("b", 2)])
    step = lambda batch: (lambda: manager.on_generation_step_end(batch))  # noqa: E731
    _refused(manager, cache, step([("a", 1), ("b", 2)]), ValueError, "request 'a' confirmed 1 tokens, but its cache "
             "grew by 0")  # the same hook twice
    cache.append("a", *_kv(1))
    _refused(manager, cache, step([("a", 2)]), ValueError, "'a' confirmed 2 tokens, but its cache grew by 1")
    cache.append("a", *_kv(1))
    _refused(manager, cache, step([("a", 1)]), ValueError, "'a' confirmed 1 tokens, but its cache grew by 2")
    manager.on_generation_step_end([("a", 2)])
    assert manager.since_round == {"a": 6, "b": 2} and manager.accounted_length == {"a": 13, "b": 6}
    # the prefill: the context step may see part of the prompt (chunked), never more than all of it
    cache.add_request("c")
    manager.on_request_init(Request("c", 6))
    cache.append("c", *_kv(4))
    manager.on_context_step_end([Request("c", 6)])
    cache.append("c", *_kv(3))
    _refused(manager, cache, step([("c", 3)]), ValueError, "'c' has written 4 of its 6 prompt tokens")
    _refused(manager, cache, lambda: manager.on_context_step_end([Request("c", 6)]), ValueError,
             "holds 7 tokens after its context step, more than its prompt_length 6")
    _refused(manager, cache, lambda: manager.on_context_step_end([Request("c", 5)]), ValueError,
             "admitted with 6")
    cache.shrink(["c"], [6])
    manager.on_context_step_end([Request("c", 6)])
    cache.append("c", *_kv(1))
    manager.on_generation_step_end([("c", 1)])
    assert manager.since_round["c"] == 1


def test_hooks_name_bad_argument_types(calibration):
    cache = _cache()
    manager = create_compression_manager(TriAttentionConfig(budget=12, beta=5, calibration_path=calibration), cache,
                                         MODEL)
    _admit(manager, cache, "a", 4, decode=1)
    cases = [
        (lambda: manager.on_request_finish(0), TypeError, "on_request_finish: request must be a Request, got int"),
        (lambda: manager.on_request_finish("a"), TypeError, "request must be a Request"),
        (lambda: manager.on_request_finish(Request("zzz", 1)), ValueError, "'zzz' .* never admitted"),
        (lambda: manager.on_request_init(("a", 4)), TypeError, "on_request_init: request must be a Request"),
        (lambda: manager.on_context_step_end(Request("a", 4)), TypeError, "requests must be a sequence"),
        (lambda: manager.on_context_step_end("a"), TypeError, "requests must be a sequence"),
        (lambda: manager.on_context_step_end(["a"]), TypeError, "requests\\[0\\] must be a Request"),
        (lambda: manager.on_context_step_end([Request("a", 4)] * 2), ValueError, "twice"),
        (lambda: manager.on_generation_step_begin(3), TypeError, "batch must be a sequence"),
        (lambda: manager.on_generation_step_begin(["a", ["a"]]), TypeError, "batch\\[1\\] must be hashable"),
        (lambda: manager.on_generation_step_begin(["a", "zzz"]), ValueError, "batch\\[1\\]: request 'zzz' was never"),
        (lambda: manager.on_generation_step_begin(["a", "a"]), ValueError, "twice"),
        (lambda: manager.on_generation_step_end(None), TypeError, "batch must be a sequence"),
        (lambda: manager.on_generation_step_end(["a"]), TypeError, "batch\\[0\\] must be a \\(request id"),
        (lambda: manager.on_generation_step_end([(["a"], 1)]), TypeError, "batch\\[0\\] must be hashable"),
        (lambda: manager.on_generation_step_end([("a", -1)]), ValueError, "confirmed tokens must be >= 0"),
        (lambda: manager.on_generation_step_end([("a", True)]), TypeError, "confirmed tokens"),
        (lambda: manager.logical_position(["a"]), TypeError, "rid must be hashable"),
        (lambda: manager.logical_position("zzz"), ValueError, "never admitted"),
    ]
    for fn, exc, match in cases:
        _refused(manager, cache, fn, exc, match)
    request = Request("b", 3)
    request.id = ["b"]  # a mutable dataclass: checked again at each hook
    _refused(manager, cache, lambda: manager.on_request_init(request), TypeError, "request.id must be hashable")
    manager.on_generation_step_begin(("a",))
    manager.on_request_finish(Request("a", 4))
    assert manager.prompt_length == {} and manager.accounted_length == {}


def test_unhashable_request_ids_are_refused_by_name(calibration):
    with pytest.raises(TypeError, match="Request: id must be hashable"):
        Request([1], 3)
    cache = _cache()
    _refused_cache = lambda fn, match: _refused(manager, cache, fn, TypeError, match)  # noqa: E731
    manager = create_compression_manager(TriAttentionConfig(calibration_path=calibration), cache, MODEL)
    cache.add_request((1, 2))  # any hashable id
    _refused_cache(lambda: cache.add_request([1]), "add_request: rid must be hashable")
    _refused_cache(lambda: cache.add_request((1, [2])), "rid must be hashable")
    for method in (cache.length, cache.resident, cache.read, cache.finish, cache.offload, cache.onboard):
        _refused_cache(lambda: method([1]), "request id must be hashable")
    _refused_cache(lambda: cache.shrink([(1, 2), [1]], [0, 0]), "rids\\[1\\] must be hashable")
    _refused_cache(lambda: cache.shrink({(1, 2)}, [0]), "rids must be a list or tuple")
    _refused_cache(lambda: cache.page_table("ab"), "rids must be a list or tuple")


def test_model_head_dim_is_checked_against_the_cache_and_the_row_size(calibration):
    tri = TriAttentionConfig(calibration_path=calibration)
    wide = PagedKVCache(2, 2, 64, 8, num_pages=4)
    for config in (tri, NVFP4ColdPageConfig(row_size=64)):
        with pytest.raises(ValueError, match="the cache's head_dim is 64, the model's KV rows hold 32"):
            create_compression_manager(config, wide, MODEL)
    with pytest.raises(ValueError, match="row_size is 128, the model's KV rows hold 32"):
        create_compression_manager(NVFP4ColdPageConfig(row_size=128), _cache(), MODEL)
    no_head_dim = {k: v for k, v in MODEL.items() if k != "head_dim"}
    with pytest.raises(ValueError, match="head_dim is 32, the model's KV rows hold 16"):  # 64 // 4 heads
        create_compression_manager(NVFP4ColdPageConfig(row_size=32), _cache(), {**no_head_dim, "hidden_size": 64})
    create_compression_manager(NVFP4ColdPageConfig(row_size=32), _cold_cache(), {**no_head_dim, "hidden_size": 128})
    mla = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, kv_lora_rank=512,
               qk_rope_head_dim=64, head_dim=192)
    wide = NVFP4ColdPageConfig(row_size=576)
    create_compression_manager(wide, PagedKVCache(2, 1, 576, 8, num_pages=2, codec_specs=[wide.row_spec()] * 2), mla)
    for cache in (None, object()):
        with pytest.raises(TypeError, match="kv_cache must be a paged KV cache"):
            create_compression_manager(tri, cache, MODEL)
    with pytest.raises(TypeError, match="model_config must be a dict"):
        create_compression_manager(NVFP4ColdPageConfig(row_size=32), _cache(), [("head_dim", 32)])
    with pytest.raises(TypeError, match="TriAttentionManager: config must be a TriAttentionConfig, got dict"):
        TriAttentionManager({"budget": 8}, _cache(), MODEL)
    for key, value in (("num_hidden_layers", "2"), ("head_dim", "32"), ("head_dim", True), ("kv_lora_rank", "a"),
                       ("num_key_value_heads", 2.0)):  # the sizes the checks compare are ints
        for config in (tri, NVFP4ColdPageConfig(row_size=32)):
            with pytest.raises(TypeError, match=f"model_config: {key} must be an int"):
                create_compression_manager(config, _cold_cache(), {**MODEL, key: value})


def test_a_round_over_no_requests_does_nothing(calibration):
    """TriAttentionRound.run with R = 0 launches nothing (the selector cannot size an empty score matrix); the
    round's capacities and inputs are checked before anything is copied."""
    cache = _cache()
    manager = create_compression_manager(TriAttentionConfig(budget=12, beta=5, calibration_path=calibration), cache,
                                         MODEL)
    _admit(manager, cache, "a", 5, decode=4)
    for requests, width, match in ((0, 2, "requests must be >= 1"), (1, 0, "width must be >= 1")):
        with pytest.raises(ValueError, match=match):
            TriAttentionRound(manager.selector, cache, requests, width, 5, False)
    round_ = TriAttentionRound(manager.selector, cache, 2, 3, 5, False)
    before = _snapshot(manager, cache)
    round_.run(torch.zeros(0, 4, dtype=torch.int32), [], [], [], [])
    table = cache.page_table(["a"], 4)
    for args in ((table, [9], [5], [0], [9, 9]), (table[:, :2], [9], [5], [0], [9]),
                 (cache.page_table(["a"] * 3, 4), [9] * 3, [5] * 3, [0] * 3, [9] * 3)):
        with pytest.raises(ValueError, match="TriAttentionRound.run: page_table"):
            round_.run(*args)
    buffers = round_.page_table.clone(), round_.lengths.clone()
    for args, error, match in (((table, [9], [5], [0], [2**40]), ValueError, r"positions\[0\] must be in"),
                               ((table, [9], [5], [-1], [9]), ValueError, r"tails\[0\] must be in"),
                               ((table, [9.5], [5], [0], [9]), TypeError, r"scored\[0\] must be an int"),
                               ((table, [True], [5], [0], [9]), TypeError, r"scored\[0\] must be an int"),
                               ((table, torch.tensor([9]), [5], [0], [9]), TypeError, "scored must be a list"),
                               ((table, [4], [5], [0], [9]), ValueError, "prompt <= scored"),
                               ((table, [9], [5], [2], [10]), ValueError, "position at least scored \\+ tail"),
                               ((table.float(), [9], [5], [0], [9]), ValueError, "page_table must be int32")):
        with pytest.raises(error, match=match):  # before any buffer is written
            round_.run(*args)
        assert torch.equal(round_.page_table, buffers[0]) and torch.equal(round_.lengths, buffers[1])
    for kw, error, match in ((dict(cuda_graphs="no"), TypeError, "cuda_graphs must be a bool"),
                             (dict(recent_layers=[5]), ValueError, "names layers past the model's 2"),
                             (dict(recent_layers=[0, 0]), ValueError, "recent_layers has a layer twice"),
                             (dict(recent_layers=[0, 1]), ValueError, "recent_layers names every layer")):
        with pytest.raises(error, match=match):
            TriAttentionRound(manager.selector, cache, 1, 4, 5, **{"cuda_graphs": False, **kw})
    for args, error, match in ((("zz", 3, 2), ValueError, "order must be one of"),
                               (("fill", True, 2), TypeError, "recent_window must be an int"),
                               (("fill", 3, 0), ValueError, "beta must be >= 1")):
        with pytest.raises(error, match=match):
            round_order(*args)
    assert _same(before, _snapshot(manager, cache))


def test_a_round_with_a_prior_checks_its_table_seats_and_stored_slots(calibration):
    """A selector with a recency prior needs the round's slot-position table; each request's seat and stored
    slots are checked before anything is copied."""
    cache = _cache()
    config = TriAttentionConfig(budget=12, beta=5, eviction_mode="union", calibration_path=calibration)
    manager = create_compression_manager(config, cache, MODEL)
    assert manager.selector.recency_prior == 8.0
    _admit(manager, cache, "a", 5, decode=4)
    _admit(manager, cache, "b", 5, decode=4)
    C = manager.selector.budget + manager.max_tail
    for table, error, match in ((None, TypeError, "slot_positions must be a tensor"),
                                (torch.zeros(2, 1, C - 1, dtype=torch.int32), ValueError,
                                 "slot_positions must be contiguous int32"),
                                (torch.zeros(2, 2, C, dtype=torch.int32), ValueError,
                                 "slot_positions must be contiguous int32"),
                                (torch.zeros(2, 1, C), ValueError, "slot_positions must be int32")):
        with pytest.raises(error, match=match):
            TriAttentionRound(manager.selector, cache, 2, 3, manager.max_tail, False, slot_positions=table)
    round_ = TriAttentionRound(manager.selector, cache, 2, 3, manager.max_tail, False,
                               slot_positions=torch.zeros(2, 1, C, dtype=torch.int32))
    table = cache.page_table(["a", "b"], 4)
    buffers = round_.page_table.clone(), round_.lengths.clone()
    base = (table, [14, 14], [5, 5], [0, 0], [14, 14])
    for seats, stored, error, match in (([], [], ValueError, "seats and stored slots"),
                                        ([0, 2], [0, 0], ValueError, "a seat below 2"),
                                        ([1, 1], [0, 0], ValueError, "share a seat"),
                                        ([0, 1], [0, 10], ValueError, "stored slots, within its decode tokens"),
                                        ([0, -1], [0, 0], ValueError, r"seats\[1\] must be in"),
                                        ([0, 1], [0, 1.0], TypeError, r"stored\[1\] must be an int")):
        with pytest.raises(error, match=match):
            round_.run(*base, seats, stored)
        assert torch.equal(round_.page_table, buffers[0]) and torch.equal(round_.lengths, buffers[1])


def _round_kept(old, new, prompt, budget, tail):
    """A round's effect on one request's [L, 2, n, H, D] contents: the prompt stays; per (layer, KV head) the
    budget + tail decode rows it holds after are distinct rows of the decode tokens it held before (scored or
    tail), the tail among them (fill order may move tail tokens into holes)."""
    n = old.shape[2]
    assert new.shape[2] == prompt + budget + tail and torch.equal(new[:, :, :prompt], old[:, :, :prompt])
    row = lambda x, layer, head, i: tuple(x[layer, :, i, head].view(torch.int16).reshape(-1).tolist())  # noqa: E731
    for layer in range(old.shape[0]):
        for head in range(old.shape[3]):
            kept = [row(new, layer, head, i) for i in range(prompt, new.shape[2])]
            before = {row(old, layer, head, i) for i in range(prompt, n)}
            assert len(set(kept)) == len(kept) and set(kept) <= before
            assert {row(old, layer, head, i) for i in range(n - tail, n)} <= set(kept)


HOOK_OPS = {"admit": 4, "prefill": 4, "step": 16, "lie": 2, "burst": 1, "again": 1, "bad_batch": 1, "offload": 2,
            "onboard": 3, "corrupt": 1, "finish": 1, "drop": 0.5, "begin": 1, "bad_type": 1}


@pytest.mark.parametrize("mode", MODES)
def test_random_hooks_and_churn_match_a_shadow_model(calibration, mode):
    """Admissions, (chunked) prefills, decode steps with rounds, offload/onboard, finishes (also by the cache
    alone), and calls that must be refused (bad batches, a hook called twice, counts other than what was written,
    due requests offloaded or too far past a round, onboards of a corrupt host slot, unknown or unhashable ids,
    wrong types), against a shadow of the hook contract: every accepted call leaves the manager's tables, the
    cache's lengths, residency and contents and the logical positions as the shadow says; every refused call
    leaves all of it, pools and host bytes included, as it was. The ops are drawn from the test's torch seed
    (KVOPS_TEST_SEED reproduces a run)."""
    rng = random.Random(int(torch.randint(2**31, ())))
    order = rng.choice(["fill", "ordered"])
    budget, beta, T = 3, 2, 4
    cache = PagedKVCache(2, 2, 32, T, num_pages=32, host_slots=16)
    config = TriAttentionConfig(budget=budget, beta=beta, eviction_mode=mode, calibration_path=calibration,
                                compaction_order=order)
    manager = create_compression_manager(config, cache, MODEL)
    mgr: dict[int, dict] = {}   # rid -> prompt, accounted, since, compressed: the manager's view
    held: dict[int, dict] = {}  # rid -> content [L, 2, n, H, D], offloaded: the cache's view
    rounds, last_batch = 0, []
    length = lambda r: held[r]["content"].shape[2]  # noqa: E731

    def refused(fn):
        before = _snapshot(manager, cache)
        with pytest.raises((ValueError, TypeError, RuntimeError)):
            fn()
        assert _same(before, _snapshot(manager, cache))

    def append(r, n):
        k, v = _kv(n)
        if triton.cdiv(length(r) + n, T) - triton.cdiv(length(r), T) > cache.num_free_pages:
            return refused(lambda: cache.append(r, k, v))
        cache.append(r, k, v)
        held[r]["content"] = torch.cat([held[r]["content"], torch.stack([k, v])[None].expand(2, -1, -1, -1, -1)], 2)

    def step(batch):
        nonlocal rounds
        ok = all(r in held and c == length(r) - mgr[r]["accounted"] for r, c in batch)
        due = [r for r, c in batch if ok and length(r) - mgr[r]["prompt"] > budget
               and mgr[r]["since"] + c >= beta]
        tails = {r: max(0, length(r) - mgr[r]["prompt"] - (budget + 2 * beta)) for r in due}
        if not ok or any(held[r]["offloaded"] for r in due) or any(t > beta for t in tails.values()):
            refused(lambda: manager.on_generation_step_end(batch))
            for r in due:  # the engine drops what a step wrote too far past a due round
                if tails[r] > beta and not held[r]["offloaded"]:
                    cache.shrink([r], [mgr[r]["accounted"]])
                    held[r]["content"] = held[r]["content"][:, :, :mgr[r]["accounted"]]
            return
        old = {r: held[r]["content"] for r in due}
        manager.on_generation_step_end(batch)
        for r, c in batch:
            mgr[r]["since"] += c
            mgr[r]["accounted"] = length(r)
        for r in due:
            prompt, n = mgr[r]["prompt"], length(r)
            held[r]["content"] = cache.read(r)
            _round_kept(old[r], held[r]["content"], prompt, budget, tails[r])
            mgr[r].update(since=0, accounted=length(r), compressed=mgr[r]["compressed"] + n - length(r))
        rounds += bool(due)

    for _ in range(160):
        op = rng.choices(list(HOOK_OPS), weights=list(HOOK_OPS.values()))[0]
        n = rng.randrange(128)
        fitting = {"admit": [r for r in range(6) if r not in mgr and r not in held],
                   "prefill": [r for r in sorted(mgr) if r in held and length(r) < mgr[r]["prompt"]],
                   "offload": [r for r in sorted(held) if not held[r]["offloaded"]],
                   "onboard": [r for r in sorted(held) if held[r]["offloaded"]],
                   "corrupt": [r for r in sorted(held) if held[r]["offloaded"] and length(r)],
                   "finish": sorted(mgr), "drop": sorted(held)}.get(op)
        # mostly a request the op fits (prefill: one still short of its prompt), else any id (often refused)
        rid = rng.choice(fitting) if fitting and rng.random() < 0.85 else rng.randrange(6)
        # a step's batch: often every prefilled resident request; now and then an offloaded one (refused when it
        # is due) or one the cache alone has released (refused)
        decodable = [r for r in sorted(mgr) if r in held and length(r) >= mgr[r]["prompt"]]
        chosen = [r for r in decodable if (n < 64 or n >> r & 1) and (not held[r]["offloaded"] or n % 4 == 0)]
        chosen += [r for r in sorted(mgr) if r not in held] if n % 8 == 0 else []
        if op == "admit":
            prompt = n % 7 + 1
            if rid in held:
                refused(lambda: cache.add_request(rid))
            else:
                cache.add_request(rid)
                held[rid] = dict(content=torch.zeros(2, 2, 0, 2, 32, dtype=torch.bfloat16), offloaded=False)
            if rid in mgr:
                refused(lambda: manager.on_request_init(Request(rid, prompt)))
            else:
                manager.on_request_init(Request(rid, prompt))
                mgr[rid] = dict(prompt=prompt, accounted=prompt, since=0, compressed=0)
        if op == "prefill" or op == "admit" and n % 4:  # (most admissions prefill at once)
            prompt = mgr[rid]["prompt"] if rid in mgr else n % 7 + 1
            if rid in held and not held[rid]["offloaded"] and length(rid) < prompt:
                append(rid, prompt - length(rid) if n % 8 else min(prompt - length(rid), n % prompt + 1))  # or a chunk
            if rid in mgr and rid in held and length(rid) <= prompt:
                manager.on_context_step_end([Request(rid, prompt)])
                mgr[rid]["accounted"] = length(rid)
            else:
                refused(lambda: manager.on_context_step_end([Request(rid, prompt)]))
        if op in ("step", "burst", "lie") and chosen:
            for i, r in enumerate(chosen):
                if r in held and not held[r]["offloaded"]:
                    k = 1
                    if op == "burst" and i == 0:  # to 1 .. beta + 2 tokens past what a round scores
                        k = max(1, budget + 2 * beta - (length(r) - mgr[r]["prompt"]) + 1 + n % (beta + 2))
                    append(r, k)
            r = chosen[0]
            if op == "burst" and n & 1 and r in held and not held[r]["offloaded"] \
                    and triton.cdiv(length(r), T) <= cache.num_free_slots:
                cache.offload(r)  # due, and offloaded: the step is refused until it is back
                held[r]["offloaded"] = True
            last_batch = [(r, length(r) - mgr[r]["accounted"] if r in held else 0) for r in chosen]
            if op == "lie":  # a count other than what the cache gained (the same hook twice confirms 0 of 1)
                r, c = last_batch[0]
                last_batch[0] = (r, c + 1 if n & 1 or c == 0 else c - 1)
            step(last_batch)
        elif op == "again":
            step(last_batch)
        elif op == "bad_batch":
            good = [(r, length(r) - mgr[r]["accounted"] if r in held else 0) for r in chosen] or [(rid, 0)]
            bad = [good + good[:1], good + [(99, 1)], good + [([rid], 1)], good + [rid], good + [(rid, True)],
                   good + [(rid, -1)], good + [(rid, 1.0)], dict(good), iter(good)][n % 9]
            refused(lambda: manager.on_generation_step_end(bad))
        elif op == "offload":
            if rid in held and not held[rid]["offloaded"] and triton.cdiv(length(rid), T) <= cache.num_free_slots:
                cache.offload(rid)
                held[rid]["offloaded"] = True
            else:
                refused(lambda: cache.offload(rid))
        elif op == "onboard":
            if rid in held and held[rid]["offloaded"] and triton.cdiv(length(rid), T) <= cache.num_free_pages:
                cache.onboard(rid)
                held[rid]["offloaded"] = False
            else:
                refused(lambda: cache.onboard(rid))
        elif op == "corrupt" and rid in held and held[rid]["offloaded"] and length(rid):
            slot = rng.choice(cache._requests[rid].slots)  # a host slot overwritten: its global scale negative
            saved = cache.host[slot].clone()
            cache.host[slot, :4] = torch.tensor([-rng.random()]).view(torch.uint8)
            refused(lambda: cache.onboard(rid))
            cache.host[slot] = saved
        elif op in ("finish", "drop"):  # drop: the cache releases the request before the manager hears of it
            if op == "finish":
                request = Request(rid, mgr[rid]["prompt"] if rid in mgr else 1)
                if rid in mgr:
                    manager.on_request_finish(request)
                    del mgr[rid]
                else:
                    refused(lambda: manager.on_request_finish(request))
            if rid in held:
                cache.finish(rid)
                del held[rid]
            else:
                refused(lambda: cache.finish(rid))
        elif op == "begin":
            batch = chosen + [rid] * (n >> 4 & 1) + [100] * (n >> 5 & 1)
            # admitted, distinct, in the cache, and the whole prompt written and accounted
            if all(r in mgr and r in held and min(length(r), mgr[r]["accounted"]) >= mgr[r]["prompt"]
                   for r in batch) and len(set(batch)) == len(batch):
                before = _snapshot(manager, cache)
                manager.on_generation_step_begin(batch)
                assert _same(before, _snapshot(manager, cache))
            else:
                refused(lambda: manager.on_generation_step_begin(batch))
        elif op == "bad_type":
            refused([lambda: manager.on_request_finish(rid), lambda: manager.on_request_finish(0.5),
                     lambda: manager.on_request_init(rid), lambda: manager.on_context_step_end(Request(rid, 1)),
                     lambda: manager.on_context_step_end([rid]), lambda: manager.on_generation_step_begin(rid),
                     lambda: manager.on_generation_step_begin([[rid]]), lambda: manager.logical_position([rid]),
                     lambda: cache.add_request([rid]), lambda: cache.length({rid}),
                     lambda: cache.shrink([rid, rid], [0, 0]), lambda: manager.on_context_step_end("ab")][n % 12])
        cache.check_invariants()
        for name, key in (("prompt_length", "prompt"), ("accounted_length", "accounted"), ("since_round", "since"),
                          ("num_compressed_tokens", "compressed")):
            assert getattr(manager, name) == {r: s[key] for r, s in mgr.items()}, name
        assert manager.rounds == rounds
        for r, h in held.items():
            assert cache.length(r) == length(r) and cache.resident(r) == (not h["offloaded"])
            if not h["offloaded"]:
                assert torch.equal(cache.read(r), h["content"])
            if r in mgr:
                assert manager.logical_position(r) == length(r) + mgr[r]["compressed"]


def test_the_nvfp4_manager_admits_a_cache_whose_codec_is_its_config():
    """A host tier that would offload in another format than the config (lossless, the default; another RoPE
    range kept lossless) is refused at admission, naming the layer; a cache without a codec (an engine's) is not checked."""
    config = NVFP4ColdPageConfig(row_size=32)
    lossless_rope = NVFP4ColdPageConfig(row_size=32, rope_range=(16, 16), skip_rope_quantization=True)
    for specs, layer in ((None, 0), ([config.row_spec(), lossless_rope.row_spec()], 1)):
        with pytest.raises(ValueError, match=f"encodes layer {layer} as .* build the cache with codec_specs"):
            create_compression_manager(config, _cache(specs), MODEL)
    with pytest.raises(TypeError, match="config must be an NVFP4ColdPageConfig, got TriAttentionConfig"):
        NVFP4ColdPageManager(TriAttentionConfig(calibration_path="qwen3-8b"), _cold_cache(), MODEL)
    engine = types.SimpleNamespace(pools=_cache().pools, num_kv_heads=2, head_dim=32, device="cpu")
    assert isinstance(create_compression_manager(config, engine, MODEL), NVFP4ColdPageManager)


def test_the_default_hooks_check_their_argument_types():
    """A manager that keeps no per-request state (NVFP4 cold pages) still refuses what no engine could mean."""
    manager = create_compression_manager(NVFP4ColdPageConfig(row_size=32), _cold_cache(), MODEL)
    what = "NVFP4ColdPageManager.on_"
    cases = [
        (lambda: manager.on_request_init(("a", 3)), f"{what}request_init: request must be a Request"),
        (lambda: manager.on_request_finish(0), f"{what}request_finish: request must be a Request, got int"),
        (lambda: manager.on_context_step_end(Request("a", 3)), f"{what}context_step_end: requests must be a seq"),
        (lambda: manager.on_context_step_end([3]), "requests\\[0\\] must be a Request"),
        (lambda: manager.on_generation_step_begin("ab"), f"{what}generation_step_begin: batch must be a sequence"),
        (lambda: manager.on_generation_step_begin([{"a"}]), "batch\\[0\\] must be hashable"),
        (lambda: manager.on_generation_step_end([("a", 1), ("b",)]), "batch\\[1\\] must be a \\(request id"),
        (lambda: manager.on_generation_step_end([("a", 0.5)]), "batch\\[0\\] confirmed tokens must be an int"),
    ]
    for fn, match in cases:
        with pytest.raises(TypeError, match=match):
            fn()
    for fn in (lambda: manager.on_generation_step_begin(["a", "a"]),  # a request twice in one batch
               lambda: manager.on_generation_step_end([("a", 1), ("a", 1)]),
               lambda: manager.on_context_step_end([Request("a", 1), Request("a", 1)])):
        with pytest.raises(ValueError, match="a request appears twice"):
            fn()
    manager.on_request_init(Request("a", 3))
    manager.on_context_step_end((Request("a", 3),))
    manager.on_generation_step_begin(["a"])
    manager.on_generation_step_end([("a", 1)])
    manager.on_request_finish(Request("a", 3))


# issue 34: per-layer budgets through the manager

SPLIT_MODEL = dict(MODEL, num_hidden_layers=3)


def _split_calibration(tmp_path, sensitivity=True):
    """3 layers; layer 1 loses 1 nat on a short window, layers 0 and 2 a thousandth: at budget 12 they are local
    at 6 tokens and layer 1 scored at 24 (kvops.config.layer_split). Also the file of layer 1 alone."""
    q, norm = torch.randn(3, 4, 16, dtype=torch.complex64), torch.rand(3, 4, 16) + 1
    data = {"E_q": q, "E_q_norm": norm}
    if sensitivity:
        data["layer_sensitivity"] = {"recent": torch.tensor([4]), "nats": torch.tensor([[0.001, 1.0, 0.002]]),
                                     "sinks": 4}
    torch.save(data, tmp_path / "split.pt")
    torch.save({"E_q": q[1:2], "E_q_norm": norm[1:2]}, tmp_path / "layer1.pt")
    return str(tmp_path / "split.pt"), str(tmp_path / "layer1.pt")


def _rows(kv: torch.Tensor) -> list:
    """A [tokens, H, D] K plane's rows as a sorted list (a ring holds them in another order)."""
    return sorted(tuple(row.flatten().tolist()) for row in kv.float())


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("mode,order", [("per_head", "fill"), ("union", "ordered"), ("per_layer_perhead", "fill")])
def test_a_layer_split_runs_each_group_at_its_count(tmp_path, mode, order, device):
    """layer_split: the scored layer's cache goes exactly as a manager without a split on that layer alone at
    the split's budget (its calibration row, the keep policy for that budget); the local layers' cache keeps each
    request's prompt and newest local_budget tokens, with rounds of its own (on the GPU, replayed from CUDA
    graphs); every step writes both caches and confirms the same tokens."""
    path, layer1 = _split_calibration(tmp_path)
    config = TriAttentionConfig(budget=12, beta=4, eviction_mode=mode, calibration_path=path, compaction_order=order,
                                layer_split=True)
    cal = config.load_calibration(SPLIT_MODEL)
    assert config.layer_groups(cal) == (( 0, 2), 6, 24)
    scored, local = (PagedKVCache(n, 2, 32, 8, num_pages=64, device=device) for n in (1, 2))
    manager = create_compression_manager(config, (scored, local), SPLIT_MODEL)
    plain = PagedKVCache(1, 2, 32, 8, num_pages=64, device=device)
    reference = create_compression_manager(
        TriAttentionConfig(budget=24, beta=4, eviction_mode=mode, calibration_path=layer1, compaction_order=order),
        plain, dict(MODEL, num_hidden_layers=1))
    assert manager.policy == reference.policy and manager.local_cache is local
    history = {}
    for rid, prompt in (("a", 7), ("b", 12)):
        k, v = _kv(prompt)
        history[rid] = [k]
        for cache, m in ((scored, manager), (local, None), (plain, reference)):
            cache.add_request(rid)
            cache.append(rid, k.to(device), v.to(device))
        manager.on_request_init(Request(rid, prompt))
        reference.on_request_init(Request(rid, prompt))
    for m in (manager, reference):
        m.on_context_step_end([Request("a", 7), Request("b", 12)])
    local_rounds = 0
    for step in range(60):
        n = {"a": 1, "b": 5 if step % 7 == 3 else 1}
        for m in (manager, reference):
            m.on_generation_step_begin(["a", "b"])
        for rid in ("a", "b"):
            k, v = _kv(n[rid])
            history[rid].append(k)
            for cache in (scored, local, plain):
                cache.append(rid, k.to(device), v.to(device))
        before = {r: local.length(r) for r in ("a", "b")}
        manager.on_generation_step_end([(r, n[r]) for r in ("a", "b")])
        reference.on_generation_step_end([(r, n[r]) for r in ("a", "b")])
        for rid, prompt in (("a", 7), ("b", 12)):
            assert scored.length(rid) == plain.length(rid) and torch.equal(scored.read(rid), plain.read(rid))
            assert manager.logical_position(rid) == reference.logical_position(rid)
            seen = torch.cat(history[rid])
            length = manager.local_length(rid)
            local_rounds += length < before[rid]
            assert length == (prompt + 6 if length < before[rid] else before[rid]) <= prompt + 6 + 4 + 4
            assert length + manager.local_compressed[rid] == seen.shape[0]  # the same logical position
            held = local.read(rid)  # [2 layers, 2 planes, length, H, D]
            assert torch.equal(held[0], held[1])
            want = torch.cat((seen[:prompt], seen[prompt + seen.shape[0] - length:])) if length > prompt else seen
            assert _rows(held[0, 0].cpu()) == _rows(want[:length] if length <= prompt else want)
        scored.check_invariants()
        local.check_invariants()
    assert local_rounds >= 10 and reference.rounds == manager.rounds >= 3


def test_a_layer_split_is_checked_before_anything_runs(tmp_path):
    """The config refuses a split on a calibration without a layer sensitivity, and a split with recent_layers;
    the manager wants the pair of caches, each holding its group's layers; a step whose local cache did not grow
    by the confirmed tokens, or whose local round finds a request offloaded, changes nothing."""
    path, _ = _split_calibration(tmp_path)
    bare, _ = _split_calibration(tmp_path / "..", sensitivity=False)
    with pytest.raises(ValueError, match="holds no layer sensitivity"):
        TriAttentionConfig(budget=12, beta=4, calibration_path=bare, layer_split=True)
    with pytest.raises(ValueError, match="leave recent_layers None"):
        TriAttentionConfig(budget=12, beta=4, calibration_path=path, layer_split=True, recent_layers=(0,))
    with pytest.raises(TypeError, match="layer_split must be a bool"):
        TriAttentionConfig(budget=12, beta=4, calibration_path=path, layer_split=1)
    config = TriAttentionConfig(budget=12, beta=4, calibration_path=path, layer_split=True)
    assert config_from_json(config.to_json()) == config
    assert TriAttentionConfig(budget=12, beta=4, calibration_path=path).layer_groups(None) == ((), 12, 12)
    with pytest.raises(TypeError, match="loaded with its layer sensitivity"):
        config.layer_groups(None)
    scored, local = PagedKVCache(1, 2, 32, 8, num_pages=64), PagedKVCache(2, 2, 32, 8, num_pages=64, host_slots=8)
    for kv_cache, error, match in ((PagedKVCache(3, 2, 32, 8, num_pages=8), TypeError, "must be the pair"),
                                   ((local, scored), ValueError, "the scored layers' cache holds 2 layers"),
                                   ((scored, scored), ValueError, "the caches have 2 layers, the model 3"),
                                   ((scored, "local"), TypeError, "a str has no")):
        with pytest.raises(error, match=match):
            create_compression_manager(config, kv_cache, SPLIT_MODEL)
    flat = tmp_path / "flat.pt"  # every layer as sensitive: no local layer, so one cache
    torch.save({**torch.load(path), "layer_sensitivity": {"recent": torch.tensor([4]),
                                                          "nats": torch.ones(1, 3), "sinks": 4}}, flat)
    with pytest.raises(TypeError, match="must be one paged cache"):
        create_compression_manager(TriAttentionConfig(budget=12, beta=4, calibration_path=str(flat), layer_split=True),
                                   (scored, local), SPLIT_MODEL)
    manager = create_compression_manager(config, (scored, local), SPLIT_MODEL)
    for cache in (scored, local):
        cache.add_request("a")
        cache.append("a", *_kv(5))
    manager.on_request_init(Request("a", 5))
    manager.on_context_step_end([Request("a", 5)])
    for _ in range(6):  # the local layers' round is due after 6 + 1 tokens and 4 since the last
        manager.on_generation_step_begin(["a"])
        for cache in (scored, local):
            cache.append("a", *_kv(1))
        manager.on_generation_step_end([("a", 1)])
    manager.on_generation_step_begin(["a"])
    scored.append("a", *_kv(1))
    state = (dict(manager.accounted_length), dict(manager.local_accounted), dict(manager.local_since))
    with pytest.raises(ValueError, match="its local layers' cache grew by 0"):
        manager.on_generation_step_end([("a", 1)])
    assert state == (dict(manager.accounted_length), dict(manager.local_accounted), dict(manager.local_since))
    local.append("a", *_kv(1))
    local.offload("a")
    with pytest.raises(RuntimeError, match="offloaded from the local layers' cache"):
        manager.on_generation_step_end([("a", 1)])
    assert local.length("a") == 5 + 7 and state[1] == dict(manager.local_accounted)
    local.onboard("a")
    manager.on_generation_step_end([("a", 1)])
    assert manager.local_length("a") == 5 + 6 and scored.length("a") == 5 + 7
    manager.on_request_finish(Request("a", 5))
    assert "a" not in manager.local_accounted
    with pytest.raises(ValueError, match="was never admitted"):
        manager.local_length("a")
    whole = PagedKVCache(3, 2, 32, 8, num_pages=8)
    whole.add_request("b")
    plain = create_compression_manager(TriAttentionConfig(budget=12, beta=4, calibration_path=path), whole,
                                       SPLIT_MODEL)
    plain.on_request_init(Request("b", 5))
    with pytest.raises(ValueError, match="no layer split with local layers"):
        plain.local_length("b")


def test_a_layer_split_refuses_one_cache_as_both_groups(tmp_path):
    """A layer split's pair must be two caches over pools of their own: one cache passed as both groups, or two
    cache objects over the same pools, would let the local round compact the scored layers (tokens lost, the
    logical position behind the writes). Refused at creation."""
    q, norm = torch.randn(2, 4, 16, dtype=torch.complex64), torch.rand(2, 4, 16) + 1
    torch.save({"E_q": q, "E_q_norm": norm, "layer_sensitivity": {"recent": torch.tensor([4]),
                                                                  "nats": torch.tensor([[0.001, 1.0]]), "sinks": 4}},
               tmp_path / "two.pt")
    config = TriAttentionConfig(budget=12, beta=4, calibration_path=str(tmp_path / "two.pt"), layer_split=True)
    assert config.layer_groups(config.load_calibration(MODEL)).local_layers == (0,)
    cache = PagedKVCache(1, 2, 32, 8, num_pages=64)
    with pytest.raises(ValueError, match="was passed as both"):
        create_compression_manager(config, (cache, cache), MODEL)
    twin = PagedKVCache(1, 2, 32, 8, num_pages=64)
    twin.pools = [cache.pools[0][:]]  # another cache object over the same memory
    with pytest.raises(ValueError, match="share memory; each layer group needs pools of its own"):
        create_compression_manager(config, (cache, twin), MODEL)
    create_compression_manager(config, (cache, PagedKVCache(1, 2, 32, 8, num_pages=64)), MODEL)
