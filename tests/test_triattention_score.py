"""The TriAttention scoring ops: raw scores and chunk statistics from the paged pools (CuTe DSL on the GPU), and
the normalize-and-reduce (csrc/triattention), each against the float64 reference."""

import pytest
import torch
import triton

from conftest import (DEVICES, SYNTHETIC, bytes_of, opcheck, paged_pools, poison_, requires_cuda, run_python,
                      synthetic_calibration)
from kvops.triattention import SHIPPED, load_calibration, mean_phase
from kvops.triattention.reference import (gather_keys, normalize_reference, raw_scores_reference, reduce_reference,
                                         reduce_torch)
from kvops.triattention.reduce import reduce_rows, reduce_unchecked
from kvops.triattention.score import CHUNK, STATS, score


# Synthetic geometries cover every kernel shape class (the GPU machine has no calibration files):
# (layers, query heads, KV heads, F) like Qwen3-8B (G=4, F=64), GPT-OSS (G=8, F=32), a small G=4 F=16, and G=3.
SYNTHETIC_SHAPES = {"qwen-like": (2, 8, 2, 64), "oss-like": (2, 16, 2, 32), "small": (3, 8, 2, 16),
                    "group-of-3": (2, 6, 2, 16)}


def _cases():
    """(calibration, config, layout, dtype): every synthetic shape class in both layouts and dtypes; the real
    calibrations (36 layers, slow on the CPU) once each."""
    cases = [(name, None, layout, dtype) for name in SYNTHETIC_SHAPES for layout in ("HND", "NHD")
             for dtype in (torch.bfloat16, torch.float16)]
    cases += [("small", None, layout, dtype) for layout, dtype in (("HND", torch.float8_e4m3fn),
                                                                   ("NHD", torch.float8_e5m2))]
    cases += [(name, SHIPPED[name].model_config, "NHD", torch.bfloat16) for name in sorted(SHIPPED)]
    return cases


def _load(name, config):
    if config is not None:
        return load_calibration(name, config)
    L, Hq, Hkv, F = SYNTHETIC_SHAPES[name]
    return load_calibration({"E_q": torch.randn(L, Hq, F, dtype=torch.complex64), "E_q_norm": torch.rand(L, Hq, F) + 1},
                            dict(num_hidden_layers=L, num_attention_heads=Hq, num_key_value_heads=Hkv, head_dim=2 * F,
                                 rope_theta=1e4))


def _run_score(cal, pools, table, N, P, starts, n):
    device = table.device
    weights = tuple(w.to(device) for w in cal.score_weights())
    phase = mean_phase(starts, cal.omega.to(device))
    R, L, Hq = table.shape[0], cal.num_layers, cal.num_query_heads
    raw = poison_(torch.empty(R, L, Hq, n, device=device))
    stats = poison_(torch.empty(R, L, Hq, triton.cdiv(n, CHUNK), STATS, device=device))
    raw_before, stats_before = raw.clone(), stats.clone()
    torch.ops.kvops.triattention_score_(pools, table, P, N, phase, *weights, raw, stats)
    return raw, stats, raw_before, stats_before


@pytest.mark.parametrize("name,config,layout,dtype", _cases())
@pytest.mark.parametrize("device", DEVICES)
def test_raw_scores_and_chunk_stats(name, config, layout, dtype, device, cute_call):
    if device == "cpu" and cute_call == "cache":
        pytest.skip("a GPU call path")
    cal = _load(name, config)
    # ragged: several chunks with a partial last one, a prompt, an empty request, a request shorter than a chunk
    long = CHUNK + 301 if config is None else 301
    prompt, cache, T = [7, 0, 30, 2], [7 + long, 0, 30 + 45, 2 + (2 * CHUNK if config is None else 200)], 16
    pools, table, N, P = paged_pools(cal, prompt, cache, T, device, dtype)
    if layout == "NHD":  # same logical view over [page, plane, token, head, dim] storage
        pools = [p.transpose(2, 3).contiguous().transpose(2, 3) for p in pools]
    starts = (N + torch.randint(0, 2 ** 22, N.shape, device=device)).long()
    n = max(c - p for c, p in zip(cache, prompt)) + 3
    raw, stats, raw_before, stats_before = _run_score(cal, pools, table, N, P, starts, n)
    phase = mean_phase(starts, cal.omega.to(device)).double().cpu()
    for r in range(len(prompt)):
        count = cache[r] - prompt[r]
        keys = gather_keys([p.cpu() for p in pools], table.cpu(), r, prompt[r], cache[r])
        want = raw_scores_reference(keys, cal, phase[r, 0], phase[r, 1])           # [L, Hq, count] float64
        got = raw[r, :, :, :count].double().cpu()
        assert not ((got - want).abs() / want.abs().clamp_min(1.0) >= 1e-4).any()
        assert torch.equal(bytes_of(raw[r, :, :, count:]), bytes_of(raw_before[r, :, :, count:]))  # not written
        for c in range(stats.shape[3]):
            part = want[..., c * CHUNK:(c + 1) * CHUNK]
            if part.shape[-1] == 0:
                assert torch.equal(bytes_of(stats[r, :, :, c]), bytes_of(stats_before[r, :, :, c]))
                continue
            mean, m2 = part.mean(-1), ((part - part.mean(-1, keepdim=True)) ** 2).sum(-1)
            got_mean, got_m2 = stats[r, :, :, c, 0].double().cpu(), stats[r, :, :, c, 1].double().cpu()
            assert ((got_mean - mean).abs() / mean.abs().clamp_min(1.0)).max() < 1e-4
            assert ((got_m2 - m2).abs() / m2.clamp_min(1.0)).max() < 1e-3
            assert (stats[r, :, :, c, 2].cpu() == part.shape[-1]).all()  # every score finite


def _stats_of(raw: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Chunk (mean, M2, count) of the finite values of raw [R, L, Hq, n] in float64, per (r, l, h), written
    independently of the kernels."""
    R, L, Hq, n = raw.shape
    stats = torch.zeros(R, L, Hq, triton.cdiv(n, CHUNK), STATS, dtype=torch.float64)
    for r in range(R):
        for c in range(stats.shape[3]):
            for layer in range(L):
                for h in range(Hq):
                    part = raw[r, layer, h, c * CHUNK:min((c + 1) * CHUNK, int(count[r]))].double()
                    part = part[torch.isfinite(part)]
                    if part.numel():
                        stats[r, layer, h, c] = torch.stack([part.mean(), ((part - part.mean()) ** 2).sum(),
                                                             torch.tensor(float(part.numel()))])
    return stats.float()


@pytest.mark.parametrize("mode", ["union", "per_head", "per_layer_perhead"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_reduce_against_reference(mode, normalize, device):
    R, L, Hkv, G, n = 3, 4, 2, 3, CHUNK + 200
    raw = torch.randn(R, L, Hkv * G, n) * 3 + torch.randn(R, L, Hkv * G, 1) * 10
    P = torch.tensor([5, 0, 9], dtype=torch.int32)
    N = P + torch.tensor([n, 1, 40], dtype=torch.int32)
    stats = _stats_of(raw, N - P)
    rows = reduce_rows(raw.to(device), stats.to(device), N.to(device), P.to(device), mode, Hkv, normalize).cpu()
    for r in range(R):
        count = int(N[r] - P[r])
        z = raw[r, :, :, :count].double()
        want = reduce_reference(normalize_reference(z) if normalize else z, mode, Hkv)
        assert torch.allclose(rows[r, :, :count].double(), want, rtol=1e-5, atol=1e-5)
        assert torch.isinf(rows[r, :, count:]).all() and (rows[r, :, count:] < 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("R", [1, 2, 66])
def test_reduce_op_matches_the_batched_torch_path(device, R):
    """The op (csrc/triattention) against reference.reduce_torch: every mode, with and without normalization, the
    keys' scale, non-finite scores, and counts of 0, 1 and past a chunk. On the GPU, 1 and 2 requests split a union
    row over blocks of layers; 66 requests of 3 column groups fill the SMs without splitting. The top-k's per-row
    lengths and offsets come out too."""
    torch.manual_seed(R)
    L, Hkv, G, n = 3, 2, 2, CHUNK + 188
    raw = torch.randn(R, L, Hkv * G, n, device=device) * 3
    raw[0, 1, 2, 5] = float("nan")
    raw[-1, 2, 0, 9] = float("inf")
    stats = torch.randn(R, L, Hkv * G, 2, STATS, device=device).abs()
    stats[..., 2] = torch.randint(1, 1000, (R, L, Hkv * G, 2), device=device).float()
    P = torch.randint(0, 5, (R,), dtype=torch.int32, device=device)
    N = P + torch.tensor([CHUNK + 188, CHUNK + 1, 7, 0, CHUNK, 1] * 11, dtype=torch.int32, device=device)[:R]
    ks = torch.rand(L, Hkv, device=device) + 0.5  # the keys' scale per (layer, KV head), read without normalization
    for mode in ("union", "per_head", "per_layer_perhead"):
        for normalize in (True, False):
            got, lengths, offsets = reduce_unchecked(raw, stats, N, P, mode, Hkv, normalize, ks, topk_args=True)
            want = torch.empty_like(got)
            reduce_torch(raw, stats, P, N, want, mode, Hkv, normalize, None if normalize else ks)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (R, mode, normalize)
            assert torch.equal(lengths, (N - P).clamp(0, n)[:, None].expand_as(lengths))
            assert torch.equal(offsets, P[:, None].expand_as(offsets))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    cal = synthetic_calibration()
    pools, table, N, P = paged_pools(cal, [3, 0], [40, 600], 8, device)
    weights = tuple(w.to(device) for w in cal.score_weights())
    phase = mean_phase(N.long() + 5, cal.omega.to(device))
    n = CHUNK + 610
    raw = torch.randn(2, cal.num_layers, cal.num_query_heads, n, device=device)
    stats = torch.randn(2, cal.num_layers, cal.num_query_heads, 2, STATS, device=device)
    opcheck(torch.ops.kvops.triattention_score_.default, (pools, table, P, N, phase, *weights, raw, stats))
    rows = torch.empty(2, cal.num_kv_heads, n, device=device)
    opcheck(torch.ops.kvops.triattention_reduce_.default, (raw, stats.abs(), P, N, rows, "per_head",
                                                           cal.num_kv_heads, True))
    k_scale = torch.rand(cal.num_layers, cal.num_kv_heads, device=device) + 0.5
    union = torch.empty(2, 1, n, device=device)
    opcheck(torch.ops.kvops.triattention_reduce_.default, (raw, stats.abs(), P, N, union, "union",
                                                           cal.num_kv_heads, False, k_scale))
    lengths = torch.empty(2, 2, cal.num_kv_heads, dtype=torch.int32, device=device)
    opcheck(torch.ops.kvops.triattention_reduce_.default, (raw, stats.abs(), P, N, rows, "per_head",
                                                           cal.num_kv_heads, True, None, lengths[0], lengths[1]))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments(device):
    cal = synthetic_calibration()
    pools, table, N, P = paged_pools(cal, [3], [40], 8, device)
    weights = tuple(w.to(device) for w in cal.score_weights())
    phase = mean_phase(N.long(), cal.omega.to(device))
    ok = (pools, table, N, P, phase, weights, 40)

    def bad(match, **change):
        args = dict(zip(("k_pools", "page_table", "cache_lengths", "prompt_lengths", "phase", "weights",
                         "max_decode"), ok), **change)
        with pytest.raises(ValueError, match=match):
            score(*args.values())

    bad("k_pools must be a list of 3", k_pools=pools[:2])
    bad("must be one of", k_pools=[p.float() for p in pools])
    bad(r"k_pools\[1\] differs", k_pools=[pools[0], pools[1][:-1], pools[2]])
    bad("unit dim stride", k_pools=[p.transpose(3, 4) for p in pools])
    bad("page_table must be int32", page_table=table.long())
    bad("cache_lengths must be int32", cache_lengths=N[:0])
    bad("phase must be contiguous float32", phase=phase[:, :, :4])
    bad(r"weights\[2\]", weights=(weights[0], weights[1], weights[2].double()))
    bad("max_decode", max_decode=-1)
    bad("kv_head count 2 must divide the calibration's 7 query heads",
        weights=tuple(w[:, :7].contiguous() for w in weights))
    for degenerate in (lambda p: p[:0], lambda p: p[:, :0], lambda p: p[:, :, :0], lambda p: p[:, :, :, :0]):
        bad("k_pools need at least one page, plane .K., KV head and token", k_pools=[degenerate(p) for p in pools])
    bad("weights must be the 3 tensors", weights=weights[:2])
    bad("weights must be the 3 tensors", weights=weights + weights[:1])
    bad(r"weights\[0\] must be \[layers, query heads, frequencies\]", weights=tuple(w[0] for w in weights))
    bad(r"weights\[1\] must be contiguous float32", weights=(weights[0], weights[1][:, :4], weights[2]))
    bad(r"max_decode must be in \[0, 2147483647\]", max_decode=2**40)  # int32 positions, not an allocation error
    for weights_of_a_kind in (None, (weights[0], None, weights[2]), weights[0]):
        with pytest.raises(TypeError, match="weights must be a tuple of 3 tensors"):
            score(pools, table, N, P, phase, weights_of_a_kind, 40)
    if device == "cpu":  # host prompt lengths are read on every call; device ones are trusted
        bad(r"prompt_lengths\[0\] = -1; it must be >= 0", prompt_lengths=torch.full_like(P, -1))
    with pytest.raises(ValueError, match="mode"):
        reduce_rows(torch.zeros(1, 3, 8, 4), torch.zeros(1, 3, 8, 1, 2), N, P, "per_token", 2)
    with pytest.raises(ValueError, match="stats"):
        reduce_rows(torch.zeros(1, 3, 8, 4), torch.zeros(1, 3, 8, 2, 2), N, P, "union", 2)
    raw, stats = (torch.zeros(1, 3, 8, 4, device=device), torch.zeros(1, 3, 8, 1, STATS, device=device))
    with pytest.raises(ValueError, match="raw must be contiguous float32"):
        reduce_rows(raw.double(), stats, N, P, "union", 2)
    with pytest.raises(ValueError, match="raw must be a 4-D"):
        reduce_rows(raw[0], stats, N, P, "union", 2)
    with pytest.raises(ValueError, match="cache_lengths must be int32"):
        reduce_rows(raw, stats, N.long(), P, "union", 2)
    with pytest.raises(ValueError, match="one per request"):
        reduce_rows(raw, stats, N.repeat(2), P.repeat(2), "union", 2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        reduce_rows(raw, stats, N, P, "union", 3)
    for k_scale in (torch.ones(3, 2, dtype=torch.float64), torch.ones(3), torch.ones(2, 3).t()):
        with pytest.raises(ValueError, match=r"k_scale must be contiguous float32 \[3, 2\]"):
            reduce_rows(raw, stats, N, P, "union", 2, False, k_scale.to(raw.device))
    for value in (-1.0, 0.0, float("nan"), float("inf")):  # a host k_scale's values are read (the selector's rule)
        with pytest.raises(ValueError, match="k_scale must be positive and finite"):
            reduce_rows(raw.cpu(), stats.cpu(), N.cpu(), P.cpu(), "union", 2, False, torch.full((3, 2), value))
    for normalize in (None, "no", 1):
        with pytest.raises(TypeError, match="normalize must be a bool"):
            reduce_rows(raw, stats, N, P, "union", 2, normalize)
    # the native op checks what its callers pass it, before it writes anything
    op, rows = torch.ops.kvops.triattention_reduce_, torch.full((1, 2, 4), 7.0, device=device)
    topk_args = torch.zeros(2, 1, 2, dtype=torch.int32, device=device)
    for args, match in (((raw, stats, P, N, raw.view(-1)[:8].view(1, 2, 4), "per_head", 2, True), "rows shares memory"),
                        ((raw, stats, P, N, rows, "per_head", 2, True, None, topk_args[0]), "go together"),
                        ((raw, stats, P, N, rows, "per_head", 2, True, None, topk_args[0], topk_args[0]),
                         "row_lengths and row_offsets share memory"),
                        ((raw, stats, P, N, rows[:, :1], "per_head", 2, True), "rows must have shape")):
        with pytest.raises(ValueError, match=match):
            op(*args)
    assert (rows == 7).all() and (topk_args == 0).all()


@requires_cuda
@pytest.mark.parametrize("Hq,D,T", [(8, 128, 16), (6, 128, 32), (8, 32, 16)])  # in the library; cached; cached
def test_the_cached_scorer_scores_what_the_library_scorer_does(Hq, D, T, monkeypatch, cute_cache_dir):
    """The scorer from the library built at install (or, for a class it lacks, the cache) against the same class
    compiled into the cache, bit for bit, eagerly and replayed from a CUDA graph on fresh keys."""
    from kvops import _cute

    monkeypatch.setenv("KVOPS_CACHE_DIR", str(cute_cache_dir))
    L, F = 2, D // 2
    config = {**SYNTHETIC, "num_hidden_layers": L, "num_attention_heads": Hq, "num_key_value_heads": 2, "head_dim": D}
    cal = load_calibration({"E_q": torch.randn(L, Hq, F, dtype=torch.complex64),
                            "E_q_norm": torch.rand(L, Hq, F) * 2 + 1}, config)
    pools, table, N, P = paged_pools(cal, [5, 0, 9], [5 + CHUNK + 77, 40, 9 + 300], T, "cuda")
    phase, weights = mean_phase(N.long(), cal.omega.cuda()), tuple(w.cuda() for w in cal.score_weights())
    n = CHUNK + 80
    raw = torch.full((3, L, Hq, n), 7.0, device="cuda")
    stats = torch.full((3, L, Hq, triton.cdiv(n, CHUNK), STATS), 7.0, device="cuda")

    def run(prebuilt):
        monkeypatch.setattr(_cute, "_functions", {})
        monkeypatch.setattr(_cute, "_prebuilt", _cute._prebuilt if prebuilt else lambda name: None)
        out = raw.clone(), stats.clone()
        torch.ops.kvops.triattention_score_(pools, table, P, N, phase, *weights, *out)
        return out

    for got, want in zip(run(True), run(False)):
        assert torch.equal(bytes_of(got), bytes_of(want))
    captured = raw.clone(), stats.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.kvops.triattention_score_(pools, table, P, N, phase, *weights, *captured)
    for p in pools:
        p.copy_(torch.randn_like(p, dtype=torch.float32))
    graph.replay()
    for got, want in zip(captured, run(False)):
        assert torch.equal(bytes_of(got), bytes_of(want))


@requires_cuda
def test_misaligned_pools_are_refused():
    cal = synthetic_calibration()
    pools, table, N, P = paged_pools(cal, [3], [40], 8, "cuda")
    flat = [torch.empty(p.numel() + 8, dtype=p.dtype, device="cuda") for p in pools]
    shifted = [f[4:4 + p.numel()].view(p.shape) for f, p in zip(flat, pools)]  # 8 bytes off 16-byte alignment
    weights = tuple(w.cuda() for w in cal.score_weights())
    with pytest.raises(ValueError, match="aligned"):
        score(shifted, table, N, P, mean_phase(N.long(), cal.omega.cuda()), weights, 40)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the kernels themselves")
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_cute_kernels_compile_without_a_gpu(arch):
    """CI has no GPU: still compile every CuTe kernel and shape class, so an API break fails CI."""
    pytest.importorskip("cutlass")
    code = ("import sys, torch\n"
            "from kvops.triattention.score import scorer_spec\n"
            "from kvops.topk import SPECS\n"
            "for spec in SPECS.values():\n"
            f"    spec.build({arch!r})\n"
            "for F, G in ((32, 8), (16, 4)):\n"
            f"    scorer_spec(torch.bfloat16, F, G, 16).build({arch!r})\n")
    run_python(code)


@pytest.mark.parametrize("mode", ["union", "per_head", "per_layer_perhead"])
@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_scores_rank_last_and_leave_the_statistics_alone(mode, device):
    """NaN and Inf raw scores (a NaN/Inf key, or an absent page): the token is -inf in every row that reduces
    over it, and the other tokens' z-scores use only the finite scores."""
    R, L, Hkv, G, n = 2, 3, 2, 2, CHUNK + 70
    raw = torch.randn(R, L, Hkv * G, n) * 3 + torch.randn(R, L, Hkv * G, 1) * 10
    raw[0, 1, 3, 5] = float("nan")
    raw[0, 2, 0, CHUNK + 3] = float("inf")
    raw[1, 0, :, 17] = float("-inf")
    P = torch.tensor([4, 1], dtype=torch.int32)
    N = P + torch.tensor([n, 900], dtype=torch.int32)
    stats = _stats_of(raw, N - P)
    rows = reduce_rows(raw.to(device), stats.to(device), N.to(device), P.to(device), mode, Hkv, True).cpu()
    for r in range(R):
        count = int(N[r] - P[r])
        want = reduce_reference(normalize_reference(raw[r, :, :, :count].double()), mode, Hkv)
        assert torch.equal(torch.isinf(rows[r, :, :count]), torch.isinf(want))
        finite = torch.isfinite(want)
        assert torch.allclose(rows[r, :, :count].double()[finite], want[finite], rtol=1e-5, atol=1e-5)
    union = reduce_rows(raw, stats, N, P, "union", Hkv, True)
    assert union[0, 0, 5] == -float("inf") and union[0, 0, CHUNK + 3] == -float("inf")
    assert union[1, 0, 17] == -float("inf") and torch.isfinite(union[0, 0, 6])


@pytest.mark.parametrize("device", DEVICES)
def test_absent_pages_and_nan_keys_score_nan(device):
    """A page-table entry of -1 or past the pool, a cache length past the table, and a NaN key: NaN raw scores
    for exactly those tokens (the reference gathers NaN keys there), finite statistics over the rest."""
    cal = synthetic_calibration()
    T = 8
    pools, table, N, P = paged_pools(cal, [3, 2], [60, 45], T, device)
    table = torch.cat([table, torch.full((2, 1), -1, dtype=torch.int32, device=device)], 1)
    table[0, 2] = -1                      # positions 16..23 of request 0
    table[1, 3] = pools[0].shape[0] + 5   # positions 24..31 of request 1: outside the pool
    N[1] = table.shape[1] * T + 6         # 6 positions past the table
    pools[1][table[0, 5].long(), 0, 1, 4, 3] = float("nan")  # request 0, layer 1, KV head 1, position 44
    starts = (N + 100).long()
    n = int((N - P).max())
    raw, stats, _, _ = _run_score(cal, pools, table, N, P, starts, n)
    phase = mean_phase(starts, cal.omega.to(device)).double().cpu()
    for r in range(2):
        count = int(N[r] - P[r])
        keys = gather_keys([p.cpu() for p in pools], table.cpu(), r, int(P[r]), int(N[r]))
        want = raw_scores_reference(keys, cal, phase[r, 0], phase[r, 1])
        got = raw[r, :, :, :count].double().cpu()
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(want).any()
        ok = ~torch.isnan(want)
        assert ((got[ok] - want[ok]).abs() / want[ok].abs().clamp_min(1.0)).max() < 1e-4
        assert torch.isfinite(stats[r, :, :, 0]).all()
        assert (stats[r, :, :, 0, 2].cpu() == (~torch.isnan(want)).sum(-1)).all()
