"""TriAttention selection (mean phase -> scores -> reductions -> top-k) against the float64 reference."""

import pytest
import torch

from conftest import DEVICES, opcheck, paged_pools, requires_cuda, run_python, synthetic_calibration
from kvops.triattention import SHIPPED, load_calibration, mean_phase
from kvops.compaction import SlotPositions
from kvops.compaction.reference import slot_positions_torch
from kvops.triattention.prior import add_recency_prior_
from kvops.triattention.reference import select_reference
from kvops.triattention.select import TriAttentionSelector, score_rows


def _positions(rows: int, cache, prompt, starts, width: int, device, spread: int = 3) -> torch.Tensor:
    """Logical positions of each row's decode tokens, out of slot order (as fill rounds leave them): distinct ages
    in [1, spread * n], shuffled per row; int32 [R, rows, width], -7 past a request's decode tokens."""
    out = torch.full((len(cache), rows, width), -7, dtype=torch.int32)
    for r, (n, p) in enumerate(zip(cache, prompt)):
        for row in range(rows):
            ages = torch.randperm(spread * (n - p))[:n - p] + 1
            out[r, row, :n - p] = (int(starts[r]) - ages).int()
    return out.to(device)


def _check(cal, device, mode, budget, prompt, cache, T=16, normalize=True, k_scale=None, dtype=torch.bfloat16,
           prior=0.0):
    pools, table, N, P = paged_pools(cal, prompt, cache, T, device, dtype)
    starts = (N + torch.randint(0, 2 ** 22, N.shape, device=device)).long()
    max_decode = max(n - p for n, p in zip(cache, prompt)) + 5
    selector = TriAttentionSelector(cal, budget, mode, normalize, max_decode=max_decode, k_scale=k_scale,
                                    recency_prior=prior)
    positions = _positions(selector.rows, cache, prompt, starts, max_decode, device) if prior else None
    kept = selector.select(pools, table, N, P, starts, positions=positions)
    ref, ref_rows = select_reference([p.cpu() for p in pools], table.cpu(), N.cpu(), P.cpu(), starts.cpu(), cal,
                                     budget, mode, normalize, k_scale, prior, None if positions is None else
                                     positions.cpu())
    if prior:  # score_rows below gives the rows before the prior
        bare = select_reference([p.cpu() for p in pools], table.cpu(), N.cpu(), P.cpu(), starts.cpu(), cal, budget,
                                mode, normalize, k_scale)[1]
        for r, (with_prior, without) in enumerate(zip(ref_rows, bare)):
            n = with_prior.shape[1]
            age = starts[r].item() - positions[r, :, :n].double().cpu()
            assert torch.allclose(with_prior - without, prior * (1 - age / n).clamp(0, 1))
    else:
        bare = ref_rows
    scale = None if k_scale is None or normalize else selector.k_scale.to(device)
    rows = score_rows(pools, table, N, P, mean_phase(starts, cal.omega.to(device)), cal, mode, max_decode, normalize,
                      k_scale=scale)
    for r, want in enumerate(bare):
        got = rows[r, :, :want.shape[1]].double().cpu()
        assert ((got - want).abs() / want.abs().clamp_min(1.0)).max() < 1e-4
        assert torch.isinf(rows[r, :, want.shape[1]:]).all()
    mismatch = (kept.cpu() != ref).any(-1)
    for r, row in mismatch.nonzero().tolist():
        # allowed only at the reference's own boundary: every token kept instead of one of the reference's scores
        # (in float64) within the kernel's score accuracy (checked above: 1e-4 relative) of the one it displaced
        scores = ref_rows[r][row]
        mine, theirs = (set(x[x >= 0].long().tolist()) for x in (kept[r, row].cpu(), ref[r, row]))
        tol = 1e-4 * max(float(scores.abs().max()), 1.0)
        extra = [scores[i - int(P[r])] for i in mine - theirs]
        missing = [scores[i - int(P[r])] for i in theirs - mine]
        assert extra and len(extra) == len(missing) and min(extra) >= max(missing) - 2 * tol, \
            f"request {r} row {row} keeps a different set, not at a (near) tie: {extra} for {missing}"
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
@pytest.mark.parametrize("device", DEVICES)
def test_a_recency_prior_keeps_what_the_reference_does(mode, device):
    """The prior moves each keep set toward the tokens of the newest logical positions (not slots), as the float64
    reference's does; a large one keeps the newest budget tokens of every row."""
    cal = synthetic_calibration()
    kwargs = dict(budget=10, prompt=[3, 0, 17], cache=[50, 12, 64], T=8)
    pools, table, N, P = paged_pools(cal, kwargs["prompt"], kwargs["cache"], kwargs["T"], device)
    starts = N.long() + 1000
    for prior in (2.0, 1e4):
        selector = TriAttentionSelector(cal, 10, mode, max_decode=70, recency_prior=prior)
        # ages within n when the prior decides alone: older ones all gain nothing
        positions = _positions(selector.rows, kwargs["cache"], kwargs["prompt"], starts, 70, device,
                               1 if prior > 100 else 3)
        kept = selector.select(pools, table, N, P, starts, positions=positions)
        want = select_reference([p.cpu() for p in pools], table.cpu(), N.cpu(), P.cpu(), starts.cpu(), cal, 10, mode,
                                recency_prior=prior, positions=positions.cpu())[0]
        assert torch.equal(kept.cpu(), want)
        for r, (p, n) in enumerate(zip(kwargs["prompt"], kwargs["cache"])):
            for row in range(selector.rows):
                newest = positions[r, row, :n - p].topk(min(10, n - p)).indices.sort().values + p
                if prior > 100:
                    assert kept[r, row, :newest.numel()].tolist() == newest.tolist()
    _check(cal, device, mode, prior=2.0, **kwargs)


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
    selector = TriAttentionSelector(cal, 8, "union", max_decode=40, recency_prior=0.5)
    positions = _positions(1, [40, 30], [3, 4], starts, 40, "cuda")
    selector.select(pools, table, N, P, starts, positions=positions)  # warm-up (compiles the kernels)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = selector.select(pools, table, N, P, starts, positions=positions)
    for p in pools:
        p.copy_(torch.randn_like(p, dtype=torch.float32))
    starts += 1000
    positions.copy_(_positions(1, [40, 30], [3, 4], starts, 40, "cuda"))
    graph.replay()
    assert torch.equal(out, selector.select(pools, table, N, P, starts, positions=positions))


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
    for bad, error in (("1", TypeError), (True, TypeError), (-0.5, ValueError), (float("nan"), ValueError),
                       (float("inf"), ValueError)):
        with pytest.raises(error, match="recency_prior must be"):
            TriAttentionSelector(cal, 8, recency_prior=bad)
    pools, table, N, P = paged_pools(cal, [3], [20], 8, "cpu")
    leaning = TriAttentionSelector(cal, 8, "per_head", recency_prior=1.0)
    with pytest.raises(ValueError, match="needs positions"):
        leaning.select(pools, table, N, P, N.long())
    good = torch.zeros(1, leaning.rows, 24, dtype=torch.int32)
    for bad in (good[:, :1], good[..., :23], good.long(), good.transpose(1, 2).contiguous().transpose(1, 2)[:, :, :5],
                good.mT.contiguous().mT):
        with pytest.raises(ValueError, match="positions must be int32"):
            leaning.select(pools, table, N, P, N.long(), positions=bad)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dense", [True, False])
def test_recency_prior_op(device, dense):
    """add_recency_prior_ against the formula in float64, from a dense tensor or a table read through seats, stored
    counts and bases; columns past a row's length untouched (-inf and a poisoned finite value); its opcheck and
    its refusals."""
    R, rows, n = 3, 4, 50
    scores = torch.randn(R, rows, n, device=device)
    lengths = torch.randint(0, n + 1, (R, rows), dtype=torch.int32, device=device)
    starts = torch.randint(1000, 10**6, (R,), dtype=torch.int32, device=device)
    if dense:
        positions = (starts[:, None, None] - torch.randint(1, 120, (R, rows, n + 7), device=device)).int()
        want_positions = positions[..., :n]
    else:
        i32 = lambda *v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
        table = torch.randint(0, 999, (5, rows, 30), dtype=torch.int32, device=device)
        positions = SlotPositions(table, i32(4, 0, 2), i32(30, 0, 17), starts - n - 3)
        want_positions = slot_positions_torch(*positions, n)
        assert torch.equal(want_positions[0, :, :30], table[4]) and \
            torch.equal(want_positions[1], (starts[1] - n - 3 + torch.arange(n, device=device)).int().expand(rows, n))
    scores[..., -1] = -float("inf")
    before = scores.clone()
    add_recency_prior_(scores, lengths, starts, positions, 3.0)
    age = (starts[:, None, None] - want_positions).double()
    want = before.double() + 3.0 * (1 - age / lengths[..., None].clamp(min=1).double()).clamp(0, 1)
    inside = torch.arange(n, device=device) < lengths[..., None]
    torch.testing.assert_close(scores[inside].double(), want[inside], rtol=1e-6, atol=1e-6)
    assert torch.equal(scores[~inside], before[~inside])
    slots = SlotPositions.dense(positions) if dense else positions
    opcheck(torch.ops.kvops.triattention_recency_prior_.default, (scores, lengths, starts, *slots, 3.0))
    bad_positions = ((positions[..., :n - 1], ValueError, "positions must be int32"),
                     (scores.view(torch.int32), ValueError, "shares memory")) if dense else \
        ((tuple(positions), TypeError, "SlotPositions"),
         (positions._replace(seats=positions.seats[:2]), ValueError, "seats, stored and bases"),
         (positions._replace(table=positions.table[:, :2]), ValueError, "table must be int32"))
    for change, error, words in ((dict(scores=scores.double()), ValueError, "scores must be contiguous float32"),
                                 (dict(lengths=lengths[:, :2]), ValueError, "lengths must be contiguous"),
                                 (dict(round_starts=starts.long()), ValueError, "round_starts must be int32"),
                                 (dict(prior=-1.0), ValueError, "prior must be finite"),
                                 (dict(prior="1"), TypeError, "prior must be a number"),
                                 *((dict(positions=p), e, w) for p, e, w in bad_positions)):
        args = dict(scores=scores, lengths=lengths, round_starts=starts, positions=positions, prior=1.0) | change
        kept = scores.clone()
        with pytest.raises(error, match=words):
            add_recency_prior_(**args)
        assert torch.equal(scores, kept)


def test_recency_prior_kernel_matches_torch_in_the_interpreter():
    code = (
        "import torch\n"
        "from kvops.compaction import SlotPositions\n"
        "from kvops.triattention.prior import add_recency_prior_\n"
        "from kvops.triattention.reference import recency_prior_torch\n"
        "s = torch.randn(2, 3, 1500); s[0, 1, 7] = -float('inf')\n"
        "lengths = torch.tensor([[0, 1500, 9], [1100, 3, 1499]], dtype=torch.int32)\n"
        "starts = torch.tensor([5000, 2**30], dtype=torch.int32)\n"
        "i = lambda *v: torch.tensor(v, dtype=torch.int32)\n"
        "table = (2**30 - torch.randint(-5, 3000, (4, 3, 1300))).int()\n"
        "for pos in (SlotPositions.dense((starts[:, None, None] - torch.randint(-5, 3000, (2, 3, 1600))).int()),\n"
        "            SlotPositions(table, i(3, 1), i(1300, 700), i(3000, 2**30 - 1600))):\n"
        "    a, b = s.clone(), s.clone()\n"
        "    add_recency_prior_(a, lengths, starts, pos, 2.5)\n"
        "    recency_prior_torch(b, lengths, starts, pos, 2.5)\n"
        "    torch.testing.assert_close(a, b)\n")
    run_python(code, TRITON_INTERPRET="1")
