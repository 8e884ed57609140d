"""Tensor parallelism (kvops.distributed): ranks of a process group, each holding its share of the KV heads, keep
and compact what one process holding every head does, restricted to their heads. Ranks are processes
(torch.multiprocessing spawn) over gloo on the CPU, gloo with CUDA tensors on the one GPU, and a one-rank NCCL
group (graph capture of the collective included)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import requires_cuda
from kvops.cache import PagedKVCache
from kvops.compaction import MODES
from kvops.config import NVFP4ColdPageConfig, TriAttentionConfig
from kvops.distributed import all_reduce_union_rows_, check_group, check_same_on_ranks, rank_kv_heads
from kvops.manager import Request, create_compression_manager
from kvops.nvfp4.reference import decode_pages, encode_pages
from kvops.triattention import SHIPPED, TriAttentionSelector, load_calibration

MODEL = SHIPPED["qwen3-8b"].model_config  # the real calibration: 36 layers, 32 query / 8 KV heads, head_dim 128
L, HKV, D = MODEL["num_hidden_layers"], MODEL["num_key_value_heads"], MODEL["head_dim"]
T = 8  # tokens per page


def _spawn(fn, world: int, *args) -> None:
    """fn(rank, world, group, *args) on `world` processes; a failure on any rank fails the test with its traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "rendezvous"), fn, args), nprocs=world)


def _rank_main(rank: int, world: int, rendezvous: str, fn, args) -> None:
    backend, device = args[0], args[1]
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        fn(rank, world, dist.group.WORLD, *args[1:])
        dist.barrier()  # no rank tears its group down while another still talks to it
    finally:
        dist.destroy_process_group()


def _slice(pools, heads: range) -> list[torch.Tensor]:
    """A rank's pools: its KV heads of every layer, its own tensors (as its GPU would hold them)."""
    return [p[:, :, heads.start:heads.stop].contiguous() for p in pools]


def _restrict(kept: torch.Tensor, mode: str, heads: range, layers: int, kv_heads: int) -> torch.Tensor:
    """One process's keep sets [R, rows, budget] restricted to the rows of `heads`."""
    if mode == "union":
        return kept
    if mode == "per_head":
        return kept[:, heads.start:heads.stop]
    R, _, budget = kept.shape
    return kept.view(R, layers, kv_heads, budget)[:, :, heads.start:heads.stop].reshape(R, -1, budget)


def _selections(rank, world, group, device, seed, cal=None):
    """Random pools and a ragged round: every mode's keep sets on this rank equal the one-process sets. `cal`:
    the model (by default Qwen3-8B's calibration, 8 KV heads split in blocks; a model with fewer KV heads than
    ranks has each replicated)."""
    gen = torch.Generator().manual_seed(seed)  # the same problem on every rank
    cal = load_calibration("qwen3-8b", MODEL) if cal is None else cal
    layers, HKV, D = cal.num_layers, cal.num_kv_heads, cal.head_dim
    heads = rank_kv_heads("test", group, HKV)
    if HKV >= world:
        assert len(heads) == HKV // world and heads.start == rank * len(heads)
    else:
        assert heads == range(rank * HKV // world, rank * HKV // world + 1)
    P, width = 40, 10
    pools = [torch.randn(P, 2, HKV, T, D, generator=gen).bfloat16().to(device) for _ in range(layers)]
    R = 3
    page_table = torch.randperm(P, generator=gen)[:R * width].view(R, width).int().to(device)
    prompts = torch.tensor([5, 0, 17], dtype=torch.int32, device=device)
    lengths = torch.tensor([61, 80, 40], dtype=torch.int32, device=device)
    starts = torch.tensor([61, 500, 4000], dtype=torch.int32, device=device)
    # A NaN key in one head of one layer poisons its token in every row that reduces over it: ranked last, on
    # every rank (the union row's max over the ranks must not revive it). The tokens the union keeps, poisoned
    # in the last rank's head: the other ranks' rows alone would keep some of them.
    kept = TriAttentionSelector(cal, 16, "union").select(pools, page_table, lengths, prompts, starts)[1, 0]
    for position in kept.tolist():
        pools[3][page_table[1, position // T], 0, HKV - 1, position % T, 5] = float("nan")
    local = _slice(pools, heads)
    for mode in MODES:
        budget = 16
        full = TriAttentionSelector(cal, budget, mode).select(pools, page_table, lengths, prompts, starts)
        selector = TriAttentionSelector(cal, budget, mode, process_group=group)
        for validate in (True, False):
            mine = selector.select(local, page_table, lengths, prompts, starts, validate=validate)
            assert torch.equal(mine, _restrict(full, mode, heads, layers, HKV)), (rank, mode, validate)
        if mode == "union":
            assert not torch.isin(full[1], kept).any()
    if world == 1:
        return
    # a round whose lengths differ between ranks raises on every rank, before anything runs
    odd = lengths.clone()
    odd[1] -= rank
    selector = TriAttentionSelector(cal, 16, "union", process_group=group)
    with pytest.raises(ValueError, match="cache_lengths differs between the ranks"):
        selector.select(local, page_table, odd, prompts, starts, validate=True)
    # so does a round whose selectors differ (another budget, or another mode: union's collective would wait on
    # the ranks that skip it), before any collective of the round
    for budget, mode in ((16 + rank, "union"), (16, "union" if rank else "per_head")):
        selector = TriAttentionSelector(cal, budget, mode, process_group=group)
        with pytest.raises(ValueError, match="selector_settings differs between the ranks"):
            selector.select(local, page_table, lengths, prompts, starts, validate=True)


def _append(caches, rid, kv: torch.Tensor) -> None:
    """kv [L, 2, n, Hkv, D] (every layer its own keys) into each (cache, heads) pair: the cache's heads of it."""
    for cache, heads in caches:
        part = kv[:, :, :, heads.start:heads.stop].to(cache.device)
        cache.append(rid, part[0, 0], part[0, 1])  # allocates the pages; writes layer 0's K/V everywhere
        n, length = kv.shape[2], cache.length(rid)
        pos = torch.arange(length - n, length)
        pages = cache.page_table([rid], device="cpu")[0].long()[pos // T].to(cache.device)
        for layer, view in enumerate(cache.views()):
            view[pages, :, :, (pos % T).to(cache.device)] = part[layer].transpose(0, 1).to(view.dtype)


def _manager_rounds(rank, world, group, device, seed):
    """The manager over the reference cache, hooks driven alike on every rank: after each step, the rank's cache
    holds what one process's cache holds, restricted to its heads."""
    gen = torch.Generator().manual_seed(seed)
    heads = rank_kv_heads("test", group, HKV)
    for mode in MODES:
        config = TriAttentionConfig(budget=12, beta=5, eviction_mode=mode, calibration_path="qwen3-8b")
        full = PagedKVCache(L, HKV, D, T, num_pages=48, device=device)
        mine = PagedKVCache(L, len(heads), D, T, num_pages=48, device=device)
        managers = [create_compression_manager(config, full, MODEL),
                    create_compression_manager(config, mine, MODEL, process_group=group, validate=True)]
        pairs = [(full, range(HKV)), (mine, heads)]
        for rid, prompt in (("a", 7), ("b", 20)):
            for (cache, _), manager in zip(pairs, managers):
                cache.add_request(rid)
                manager.on_request_init(Request(rid, prompt))
            _append(pairs, rid, torch.randn(L, 2, prompt, HKV, D, generator=gen))
        for manager in managers:
            manager.on_context_step_end([Request("a", 7), Request("b", 20)])
        for step in range(30):
            confirmed = {"a": 1, "b": 3 if step % 4 == 0 else 1}
            for manager in managers:
                manager.on_generation_step_begin(["a", "b"])
            for rid, n in confirmed.items():
                _append(pairs, rid, torch.randn(L, 2, n, HKV, D, generator=gen))
            for manager in managers:
                manager.on_generation_step_end(list(confirmed.items()))
            for rid in ("a", "b"):
                assert mine.length(rid) == full.length(rid)
                want = full.read(rid)[:, :, :, heads.start:heads.stop]
                assert torch.equal(mine.read(rid), want), (rank, mode, step, rid)
        assert managers[0].rounds == managers[1].rounds > 0
        if device == "cuda":  # NCCL's all-reduce is captured with the round; gloo's runs eagerly
            assert (managers[1]._round.graphs is None) == (dist.get_backend(group) == "gloo")
        if world == 1:
            continue
        # a step whose lengths differ between ranks (a rank wrote a token the others did not) raises everywhere
        managers[1].on_generation_step_begin(["a"])
        extra = rank % 2
        if extra:
            _append([(mine, heads)], "a", torch.randn(L, 2, 1, HKV, D, generator=gen))
        with pytest.raises(ValueError, match="differs between the ranks"):
            managers[1].on_generation_step_end([("a", extra)])
    if world > 1:  # managers configured differently (here a recent window on odd ranks) refuse every step
        config = TriAttentionConfig(budget=12, beta=5, recent_window=4 * (rank % 2), calibration_path="qwen3-8b")
        cache = PagedKVCache(L, len(heads), D, T, num_pages=8, device=device)
        manager = create_compression_manager(config, cache, MODEL, process_group=group, validate=True)
        cache.add_request("c")
        manager.on_request_init(Request("c", 3))
        _append([(cache, heads)], "c", torch.randn(L, 2, 3, HKV, D, generator=gen))
        manager.on_context_step_end([Request("c", 3)])
        manager.on_generation_step_begin(["c"])
        _append([(cache, heads)], "c", torch.randn(L, 2, 1, HKV, D, generator=gen))
        with pytest.raises(ValueError, match="manager_settings differs between the ranks"):
            manager.on_generation_step_end([("c", 1)])


def _gather(pools, pages: torch.Tensor, n: int) -> torch.Tensor:
    """[L, 2, n, H, D]: the first n tokens of the pages `pages`, as PagedKVCache.read returns them."""
    pos = torch.arange(n)
    return torch.stack([p[pages.long()[pos // T], :, :, pos % T].transpose(0, 1) for p in pools])


def _cold_pages(rank, world, group, device, seed):
    """The cold-page codec per rank, on its own pools: what it offloads comes back as the reference's round trip
    of those pools, and with a fixed global scale as one process's restricted to the rank's heads."""
    gen = torch.Generator().manual_seed(seed)
    heads = rank_kv_heads("test", group, HKV)
    for scale in ("per_page_pow2", 64.0):
        config = NVFP4ColdPageConfig(row_size=D, global_scale=scale)
        specs = [config.row_spec()] * L
        kv = torch.randn(L, 2, 30, HKV, D, generator=gen)
        results = []
        for held in (range(HKV), heads):  # one process, then this rank
            cache = PagedKVCache(L, len(held), D, T, num_pages=8, host_slots=8, device=device, codec_specs=specs)
            create_compression_manager(config, cache, MODEL, process_group=None if len(held) == HKV else group)
            cache.add_request("r")
            _append([(cache, held)], "r", kv)
            pools, pages = [p.cpu() for p in cache.pools], cache.page_table(["r"], device="cpu")[0]
            cache.offload("r")
            cache.onboard("r")
            results.append(cache.read("r").cpu())
            blobs = torch.zeros(len(pages), cache.host.shape[1], dtype=torch.uint8)
            slots = torch.arange(len(pages), dtype=torch.int32)
            encode_pages(pools, specs, blobs, torch.stack((slots, pages), 1))
            back = [torch.zeros_like(p) for p in pools]
            decode_pages(blobs, back, specs, torch.stack((pages, slots), 1))
            assert torch.equal(results[-1], _gather(back, pages, 30)), (rank, scale, len(held))
        if scale != "per_page_pow2":  # otherwise a page's global scale comes from the amax of the rank's heads
            assert torch.equal(results[1], results[0][:, :, :, heads.start:heads.stop])


def _everything(rank, world, group, device, seed):
    _selections(rank, world, group, device, seed)
    # 2 KV heads over 2 or 4 ranks: each rank holds one, replicated on world / 2 ranks
    small = dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64, rope_theta=1e4)
    gen = torch.Generator().manual_seed(seed)
    cal = load_calibration({"E_q": torch.randn(4, 8, 32, dtype=torch.complex64, generator=gen),
                            "E_q_norm": torch.rand(4, 8, 32, generator=gen) + 1}, small)
    _selections(rank, world, group, device, seed, cal)
    _manager_rounds(rank, world, group, device, seed)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_over_gloo_match_one_process(world):
    _spawn(_everything, world, "gloo", "cpu", int(torch.randint(1 << 30, ())))


@requires_cuda
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_on_one_gpu_over_gloo_match_one_process(world):
    _spawn(_everything, world, "gloo", "cuda", int(torch.randint(1 << 30, ())))


@requires_cuda
def test_a_one_rank_nccl_group_runs_the_same_path_captured():
    _spawn(_one_rank_nccl, 1, "nccl", "cuda", int(torch.randint(1 << 30, ())))


def _one_rank_nccl(rank, world, group, device, seed):
    _everything(rank, world, group, device, seed)
    # the manager's rounds replay from CUDA graphs with the all-reduce recorded in them
    config = TriAttentionConfig(budget=12, beta=5, eviction_mode="union", calibration_path="qwen3-8b")
    cache = PagedKVCache(L, HKV, D, T, num_pages=48, device=device)
    manager = create_compression_manager(config, cache, MODEL, process_group=group)
    assert manager.cuda_graphs
    gen = torch.Generator().manual_seed(seed)
    cache.add_request("a")
    manager.on_request_init(Request("a", 4))
    _append([(cache, range(HKV))], "a", torch.randn(L, 2, 4, HKV, D, generator=gen))
    manager.on_context_step_end([Request("a", 4)])
    for _ in range(40):
        manager.on_generation_step_begin(["a"])
        _append([(cache, range(HKV))], "a", torch.randn(L, 2, 1, HKV, D, generator=gen))
        manager.on_generation_step_end([("a", 1)])
    assert manager.rounds >= 3 and manager._round.graphs


def test_cold_pages_per_rank_over_gloo():
    _spawn(_cold_pages, 2, "gloo", "cpu", int(torch.randint(1 << 30, ())))


def test_bad_tensor_parallel_arguments_are_refused_by_name():
    cal = load_calibration("qwen3-8b", MODEL)
    with pytest.raises(TypeError, match="process_group must be a torch.distributed ProcessGroup"):
        TriAttentionSelector(cal, 8, "union", process_group="world")
    with pytest.raises(TypeError, match="kv_heads must be a range"):
        TriAttentionSelector(cal, 8, "union", kv_heads=[0, 1])
    for bad in (range(0, 8, 2), range(3, 3), range(6, 9), range(-1, 2)):
        with pytest.raises(ValueError, match="kv_heads must be a non-empty range of step 1"):
            TriAttentionSelector(cal, 8, "union", kv_heads=bad)
    with pytest.raises(ValueError, match="pass the process_group that holds the others"):
        TriAttentionSelector(cal, 8, "per_head", kv_heads=range(0, 4))
    assert TriAttentionSelector(cal, 8, "per_head", kv_heads=range(8)).rows == HKV  # every head: one rank
    assert check_group("test", None) is None
    cache = PagedKVCache(L, 4, D, T, num_pages=4)
    with pytest.raises(ValueError, match="the cache has 4 KV heads, the model 8"):
        create_compression_manager(TriAttentionConfig(budget=8, beta=4, calibration_path="qwen3-8b"), cache, MODEL)
    with pytest.raises(TypeError, match="validate must be a bool"):
        create_compression_manager(TriAttentionConfig(budget=8, beta=4, calibration_path="qwen3-8b"),
                                   PagedKVCache(L, HKV, D, T, num_pages=4), MODEL, validate=1)


def _helpers_refuse(rank, world, group, device):
    rows = torch.tensor([[[1.0, -float("inf"), 2.0]]])
    saved = rows.clone()
    for args, error, match in (((rows, torch.tensor([3]), "world"), TypeError, "group must be a torch.distributed"),
                               ((rows, torch.tensor([1.5]), group), ValueError, "count must be int32 or int64"),
                               ((rows.int(), torch.tensor([3]), group), ValueError, "rows must be float32"),
                               ((rows, torch.tensor([3, 3]), group), ValueError, "count must be")):
        with pytest.raises(error, match=match):
            all_reduce_union_rows_(*args)
        assert torch.equal(rows, saved)  # refused before the poisoned columns are flipped
    for bad in (torch.tensor([0.4]), torch.tensor([1j]), [1, 2], torch.empty(2, dtype=torch.int64, device="meta")):
        with pytest.raises(TypeError, match="x must be an integer tensor"):  # a float would be truncated first
            check_same_on_ranks("test", group, torch.device(device), x=bad)
    for bad, error in ((0, ValueError), (True, TypeError), ("4", TypeError)):
        with pytest.raises(error, match="num_kv_heads"):
            rank_kv_heads("test", group, bad)
    cache = PagedKVCache(L, HKV, D, T, num_pages=4)
    from kvops.manager import TriAttentionManager
    with pytest.raises(ValueError, match="the cache holds 8 KV heads, kv_heads range\\(0, 1\\) names 1"):
        TriAttentionManager(TriAttentionConfig(budget=8, beta=4, calibration_path="qwen3-8b"), cache, MODEL,
                            process_group=group, kv_heads=range(0, 1))


def test_the_helpers_refuse_bad_arguments_before_changing_anything():
    _spawn(_helpers_refuse, 1, "gloo", "cpu")


def test_a_rank_calibration_is_the_model_one_restricted_to_its_heads():
    cal = load_calibration("qwen3-8b", MODEL)
    part = cal.for_kv_heads(range(2, 4))
    G = cal.group_size
    assert part.num_kv_heads == 2 and part.num_query_heads == 2 * G
    assert torch.equal(part.q_mean, cal.q_mean[:, 2 * G:4 * G]) and torch.equal(part.omega, cal.omega)
    assert all(torch.equal(a, b[:, 2 * G:4 * G]) for a, b in zip(part.score_weights(), cal.score_weights()))
    with pytest.raises(ValueError, match="for_kv_heads: kv_heads must be"):
        cal.for_kv_heads(range(7, 9))
