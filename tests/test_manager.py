"""Managers on the reference cache: admission, due rounds, logical positions, and the round's effect."""

import pytest
import torch

from kvops.cache import PagedKVCache
from kvops.config import NVFP4ColdPageConfig, TriAttentionConfig
from kvops.manager import (KVCacheCompressionManager, NVFP4ColdPageManager, Request, TriAttentionManager,
                           create_compression_manager)
from kvops.compaction.reference import fill_order
from kvops.triattention.reference import select_reference

MODEL = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e4)


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "cal.pt"
    torch.save({"E_q": torch.randn(2, 4, 16, dtype=torch.complex64), "E_q_norm": torch.rand(2, 4, 16) + 1}, path)
    return str(path)


def _cache():
    return PagedKVCache(2, 2, 32, 8, num_pages=64, host_slots=8)


def _kv(n):
    return torch.randn(n, 2, 32).bfloat16(), torch.randn(n, 2, 32).bfloat16()


@pytest.mark.parametrize("compaction_order", ["ordered", "fill"])
def test_rounds_follow_budget_and_beta_and_match_the_reference(calibration, compaction_order):
    config = TriAttentionConfig(budget=12, beta=5, eviction_mode="per_head", calibration_path=calibration,
                                compaction_order=compaction_order)
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


def test_a_cache_with_a_k_scale_gives_it_to_the_selector(calibration):
    """An fp8 cache that stores keys scaled exposes k_scale ([L] or [L, Hkv]); the manager hands it on, checked."""
    cache = _cache()
    cache.k_scale = torch.tensor([0.5, 2.0])
    tri = TriAttentionConfig(calibration_path=calibration, normalize_scores=False)
    manager = create_compression_manager(tri, cache, MODEL)
    assert torch.equal(manager.selector.k_scale, torch.tensor([[0.5, 0.5], [2.0, 2.0]]))
    cache.k_scale = torch.tensor([0.5, 0.0])
    with pytest.raises(ValueError, match="positive and finite"):
        create_compression_manager(tri, cache, MODEL)


def test_admission(calibration):
    cache = _cache()
    tri = TriAttentionConfig(calibration_path=calibration)
    with pytest.raises(ValueError, match="one method per manager"):
        create_compression_manager([tri, NVFP4ColdPageConfig()], cache, MODEL)
    cache.block_reuse = True
    with pytest.raises(ValueError, match="block reuse"):
        create_compression_manager(tri, cache, MODEL)
    assert isinstance(create_compression_manager(NVFP4ColdPageConfig(row_size=32), cache, MODEL),
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
        create_compression_manager(tri, cache, {**MODEL, "head_dim": 64})
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
