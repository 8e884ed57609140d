"""TriAttention selection (mean phase -> scores -> reductions -> top-k) against the float64 reference."""

import pytest
import torch

from conftest import DEVICES, paged_pools, requires_cuda, synthetic_calibration
from kvops.triattention import SHIPPED, load_calibration, mean_phase
from kvops.triattention.reference import select_reference
from kvops.triattention.select import TriAttentionSelector, score_rows


def _check(cal, device, mode, budget, prompt, cache, T=16, normalize=True, k_scale=None, dtype=torch.bfloat16):
    pools, table, N, P = paged_pools(cal, prompt, cache, T, device, dtype)
    starts = (N + torch.randint(0, 2 ** 22, N.shape, device=device)).long()
    max_decode = max(n - p for n, p in zip(cache, prompt)) + 5
    selector = TriAttentionSelector(cal, budget, mode, normalize, max_decode=max_decode, k_scale=k_scale)
    kept = selector.select(pools, table, N, P, starts)
    ref, ref_rows = select_reference([p.cpu() for p in pools], table.cpu(), N.cpu(), P.cpu(), starts.cpu(), cal,
                                     budget, mode, normalize, k_scale)
    scale = None if k_scale is None or normalize else selector.k_scale.to(device)
    rows = score_rows(pools, table, N, P, mean_phase(starts, cal.omega.to(device)), cal, mode, max_decode, normalize,
                      k_scale=scale)
    for r, want in enumerate(ref_rows):
        got = rows[r, :, :want.shape[1]].double().cpu()
        assert ((got - want).abs() / want.abs().clamp_min(1.0)).max() < 1e-4
        assert torch.isinf(rows[r, :, want.shape[1]:]).all()
    mismatch = (kept.cpu() != ref).any(-1)
    for r, row in mismatch.nonzero().tolist():  # allowed only where the reference ties at its own boundary
        scores = ref_rows[r][row]
        threshold = scores[ref[r, row][ref[r, row] >= 0].long() - int(P[r])].min()
        assert (scores == threshold).sum() > 1, f"request {r} row {row} keeps a different set without a tie"
    return kept


@pytest.mark.parametrize("name", sorted(SHIPPED))
@pytest.mark.parametrize("mode", ["union", "per_head", "per_layer_perhead"])
@pytest.mark.parametrize("device", DEVICES)
def test_real_calibrations_all_modes(name, mode, device):
    cal = load_calibration(name, SHIPPED[name].model_config)
    # ragged; a prompt longer than the budget; one request with N - P <= budget (nothing evicted)
    kept = _check(cal, device, mode, budget=24, prompt=[5, 60, 0, 9], cache=[70, 101, 33, 30])
    assert kept[3, :, :21].tolist() == [list(range(9, 30))] * kept.shape[1]  # 21 decode tokens <= 24: all kept
    assert (kept[3, :, 21:] == -1).all()


@pytest.mark.parametrize("mode", ["union", "per_head", "per_layer_perhead"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def testsynthetic_calibration(mode, normalize, device):
    _check(synthetic_calibration(), device, mode, budget=10, prompt=[3, 0, 17], cache=[50, 12, 64], T=8,
           normalize=normalize)


@pytest.mark.parametrize("mode", ["union", "per_head", "per_layer_perhead"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_pools_with_a_k_scale_keep_what_the_dequantized_keys_do(mode, normalize, per_head, device):
    """fp8 e4m3 pools with a positive K scale per layer (or per layer and KV head) against the reference on the
    dequantized keys. With normalization the scale cannot change the keep set: it equals the unscaled one."""
    cal = synthetic_calibration()
    k_scale = torch.rand(cal.num_layers, *([cal.num_kv_heads] if per_head else [])) * 4 + 0.1
    kept = _check(cal, device, mode, budget=10, prompt=[3, 0, 17], cache=[50, 12, 64], T=8, normalize=normalize,
                  k_scale=k_scale, dtype=torch.float8_e4m3fn)
    if normalize:
        torch.manual_seed(0)
        pools, table, N, P = paged_pools(cal, [3, 0], [50, 12], 8, device, torch.float8_e4m3fn)
        starts = N.long() + 5
        scaled = TriAttentionSelector(cal, 10, mode, max_decode=60, k_scale=k_scale).select(pools, table, N, P, starts)
        plain = TriAttentionSelector(cal, 10, mode, max_decode=60).select(pools, table, N, P, starts)
        assert torch.equal(scaled, plain) and kept.shape[1] == scaled.shape[1]


def test_k_scale_is_refused_unless_positive_finite_float32_per_layer():
    cal = synthetic_calibration()
    L, Hkv = cal.num_layers, cal.num_kv_heads
    for bad, error, match in ((torch.ones(L, dtype=torch.float64), TypeError, "float32"),
                              ([1.0] * L, TypeError, "float32"),
                              (torch.ones(L + 1), ValueError, r"\[3\] \(per layer\) or \[3, 2\]"),
                              (torch.ones(L, Hkv, 1), ValueError, "per layer"),
                              (torch.tensor([1.0, 0.0, 1.0]), ValueError, "positive and finite"),
                              (torch.tensor([1.0, -2.0, 1.0]), ValueError, "positive and finite"),
                              (torch.tensor([1.0, float("nan"), 1.0]), ValueError, "positive and finite"),
                              (torch.full((L, Hkv), float("inf")), ValueError, "positive and finite"),
                              (torch.ones(L, device="meta"), ValueError, "k_scale is a meta tensor")):
        with pytest.raises(error, match=match):
            TriAttentionSelector(cal, 8, k_scale=bad)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    cal = synthetic_calibration()
    pools, table, N, P = paged_pools(cal, [3, 4], [40, 30], 8, device)
    starts = N.long() + 7
    selector = TriAttentionSelector(cal, 8, "per_head", max_decode=40)
    eager = selector.select(pools, table, N, P, starts)
    compiled = torch.compile(selector.select, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    assert torch.equal(compiled(pools, table, N, P, starts), eager)


@requires_cuda
def test_cuda_graph_replay_fresh_data():
    cal = synthetic_calibration()
    pools, table, N, P = paged_pools(cal, [3, 4], [40, 30], 8, "cuda")
    starts = N.long() + 7
    selector = TriAttentionSelector(cal, 8, "union", max_decode=40)
    selector.select(pools, table, N, P, starts)  # warm-up (compiles the kernels)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = selector.select(pools, table, N, P, starts)
    for p in pools:
        p.copy_(torch.randn_like(p, dtype=torch.float32))
    starts += 1000
    graph.replay()
    assert torch.equal(out, selector.select(pools, table, N, P, starts))


def test_bad_arguments():
    cal = synthetic_calibration()
    with pytest.raises(ValueError, match="mode"):
        TriAttentionSelector(cal, 8, "per_token")
    with pytest.raises(ValueError, match="budget"):
        TriAttentionSelector(cal, 0)
    with pytest.raises(ValueError, match="max_decode"):  # 0 is not "unset"
        TriAttentionSelector(cal, 8, max_decode=0)
    with pytest.raises(TypeError, match="calibration must be a Calibration"):
        TriAttentionSelector({"E_q": cal.q_mean}, 8)
    with pytest.raises(TypeError, match="normalize_scores"):
        TriAttentionSelector(cal, 8, normalize_scores="no")
    with pytest.raises(ValueError, match="max_decode"):
        TriAttentionSelector(cal, 8, max_decode=4)
    pools, table, N, P = paged_pools(cal, [3], [20], 8, "cpu")
    with pytest.raises(ValueError, match="pools"):
        TriAttentionSelector(cal, 8).select(pools[:2], table, N, P, N.long())
    with pytest.raises(ValueError, match=r"round_starts must be \[1\]"):
        TriAttentionSelector(cal, 8).select(pools, table, N, P, N.long().repeat(2))
    with pytest.raises(ValueError, match=r"cache_lengths must be int32 \[1\]"):
        TriAttentionSelector(cal, 8).select(pools, table, N.repeat(2), P, N.long())
    for name, value in (("budget", 2**31), ("max_decode", 2**40)):  # int32 positions
        with pytest.raises(ValueError, match=f"{name} must be in \\[.*, 2147483647\\]"):
            TriAttentionSelector(cal, **{"budget": 8, name: value})
    selector = TriAttentionSelector(cal, 4, "per_head")
    pools0, table0, N0, _ = paged_pools(cal, [0], [4], 8, "cpu")
    with pytest.raises(ValueError, match=r"prompt_lengths\[0\] = -6; it must be >= 0"):  # host lengths are read
        selector.select(pools0, table0, N0, torch.tensor([-6], dtype=torch.int32), N0.long() + 5)
    with pytest.raises(ValueError, match=r"round_starts\[0\] = -1; it must be >= 0"):
        selector.select(pools, table, N, P, torch.tensor([-1]))
    with pytest.raises(ValueError, match="round_starts must be a 1-D int32 or int64"):
        selector.select(pools, table, N, P, N.float())
    for degenerate in (lambda p: p[:0], lambda p: p[:, :0], lambda p: p[:, :, :0], lambda p: p[:, :, :, :0]):
        for sel in (selector, TriAttentionSelector(cal, 4, "per_head", max_decode=20)):
            with pytest.raises(ValueError, match="k_pools need at least one page, plane .K., KV head and token"):
                sel.select([degenerate(p) for p in pools], table, N, P, N.long())


def test_the_calibrations_fields_are_checked_at_construction():
    """A Calibration made by hand (not load_calibration) is checked as validate_calibration checks one, less the
    model: garbage statistics would give garbage keep sets, and wrong shapes would fail deep inside select."""
    from dataclasses import replace

    cal = synthetic_calibration()  # 3 layers, 8 query / 2 KV heads, F = 16, head_dim 32
    for broken, error, match in (
            (replace(cal, q_mean=cal.q_mean * float("nan")), ValueError, "q_mean must be finite everywhere"),
            (replace(cal, freq_scale_sq=-cal.freq_scale_sq), ValueError, "freq_scale_sq must be finite and > 0"),
            (replace(cal, omega=cal.omega * 0), ValueError, "omega must be finite and > 0"),
            (replace(cal, q_abs_mean=-cal.q_abs_mean), ValueError, "q_abs_mean must be finite and >= 0"),
            (replace(cal, q_abs_mean=cal.q_abs_mean.double()), ValueError, "q_abs_mean must be float32"),
            (replace(cal, q_mean=cal.q_mean.to(torch.complex128)), ValueError, "q_mean must be complex64"),
            (replace(cal, omega=cal.omega[:3]), ValueError, r"omega has shape \(3,\); q_mean's \(3, 8, 16\)"),
            (replace(cal, q_abs_mean=cal.q_abs_mean[:2]), ValueError, "q_abs_mean has shape"),
            (replace(cal, q_mean=cal.q_mean[:0], q_abs_mean=cal.q_abs_mean[:0]), ValueError, "each >= 1"),
            (replace(cal, num_kv_heads=3), ValueError, "num_kv_heads 3 must divide q_mean's 8 query heads"),
            (replace(cal, num_kv_heads=0), ValueError, "num_kv_heads must be >= 1"),
            (replace(cal, head_dim=16), ValueError, "head_dim 16 is below the 32 rotary dims"),
            (replace(cal, head_dim=32.0), TypeError, "head_dim must be an int"),
            (replace(cal, omega=cal.omega.tolist()), TypeError, "omega must be a tensor"),
            (replace(cal, freq_scale_sq=cal.freq_scale_sq.to("meta")), ValueError, "freq_scale_sq is a meta tensor")):
        with pytest.raises(error, match=f"TriAttentionSelector: calibration.*{match}"):
            TriAttentionSelector(broken, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_without_max_decode_every_length_the_table_holds_is_scored(device):
    """No max_decode: the bound comes from the page table, so a request of 36 decode tokens with budget 8 keeps
    the reference's set (it used to score only the first 2 * budget)."""
    cal = synthetic_calibration()
    pools, table, N, P = paged_pools(cal, [5, 3], [41, 20], 8, device)
    starts = (N + 77).long()
    kept = TriAttentionSelector(cal, 8).select(pools, table, N, P, starts)
    ref, _ = select_reference([p.cpu() for p in pools], table.cpu(), N.cpu(), P.cpu(), starts.cpu(), cal, 8)
    assert torch.equal(kept.cpu(), ref)
    assert (kept[0] >= 5 + 16).any()  # tokens past 2 * budget can be kept
    small = TriAttentionSelector(cal, 8, max_decode=16)
    with pytest.raises(ValueError, match="request 0 .*more decode tokens than max_decode=16"):
        small.select(pools, table, N, P, starts, validate=True)


@pytest.mark.parametrize("device", DEVICES)
def test_absent_pages_rank_last_or_raise_with_validate(device):
    """A page-table entry of -1 (or past the pool) and a cache length past the table: with validate=True the
    selector raises naming the request; without it those positions are never kept while others exist, and the
    rest of the keep set is the reference's on the same (absent = NaN) keys."""
    cal = synthetic_calibration()
    T = 8
    pools, table, N, P = paged_pools(cal, [4, 2], [64, 50], T, device)
    starts = (N + 5).long()
    table[0, 3] = -1                     # positions 24..31
    table[1, 4] = pools[0].shape[0]      # positions 32..39: outside the pool
    pools[1][table[0, 6].long(), 0, 0, 2, 7] = float("nan")  # request 0, position 50: a NaN key
    selector = TriAttentionSelector(cal, 16, "per_head")
    for match, bad_table in (("request 0 .*outside \\[0, ", table), ("request 0 .*exceeds the page table",
                                                                       table[:, :6].contiguous())):
        with pytest.raises(ValueError, match=match):
            selector.select(pools, bad_table, N, P, starts, validate=True)
    kept = selector.select(pools, table, N, P, starts)
    ref, rows = select_reference([p.cpu() for p in pools], table.cpu(), N.cpu(), P.cpu(), starts.cpu(), cal, 16,
                                 "per_head")
    assert torch.equal(kept.cpu(), ref)
    assert not set(range(24, 32)) & set(kept[0].flatten().tolist()) and 50 not in kept[0, 0].tolist()
    assert not set(range(32, 40)) & set(kept[1].flatten().tolist())


# ---- issue 30: bad input, second pass ----------------------------------------------------------------------

def test_pools_must_have_the_calibrations_geometry():
    """Pools of another model (a KV-head count that still divides the query heads, another head_dim, another
    layer count) would score query head h against the wrong KV head: refused, naming the counts."""
    cal = synthetic_calibration()  # 3 layers, 8 query / 2 KV heads, head_dim 32
    pools, table, N, P = paged_pools(cal, [3], [20], 8, "cpu")
    selector = TriAttentionSelector(cal, 8)
    one_head = [p[:, :, :1].contiguous() for p in pools]
    with pytest.raises(ValueError, match="k_pools have 1 KV heads; the calibration has 2"):
        selector.select(one_head, table, N, P, N.long())
    four_heads = [p.repeat(1, 1, 2, 1, 1) for p in pools]
    with pytest.raises(ValueError, match="k_pools have 4 KV heads; the calibration has 2"):
        selector.select(four_heads, table, N, P, N.long())
    wide = [torch.nn.functional.pad(p, (0, 16)) for p in pools]
    with pytest.raises(ValueError, match="k_pools have head_dim 48; the calibration has 32"):
        selector.select(wide, table, N, P, N.long())
    with pytest.raises(ValueError, match="k_pools must be a list of 3 per-layer pools, got 4"):
        selector.select(pools + pools[:1], table, N, P, N.long())
    selector.select(pools, table, N, P, N.long())


@pytest.mark.parametrize("mode", ["union", "per_layer_perhead"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_round_over_no_requests_keeps_nothing(mode, device):
    """R = 0 (an engine's step with no due request): an empty [0, rows, budget] keep set, no error."""
    cal = synthetic_calibration()
    pools, table, N, P = paged_pools(cal, [3], [20], 8, device)
    selector = TriAttentionSelector(cal, 8, mode, max_decode=24)
    kept = selector.select(pools, table[:0], N[:0], P[:0], N[:0].long())
    assert kept.shape == (0, selector.rows, 8) and kept.dtype == torch.int32
