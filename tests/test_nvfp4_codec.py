"""The NVFP4 cold-page codec: layouts, reference agreement, canaries, round trips, ops, errors."""

import pytest
import torch

import kvops

from kvops.nvfp4 import PageBlobCodec, RowSpec, dequantize, quantize
from kvops.nvfp4 import reference as ref

from conftest import DEVICES, bytes_of, opcheck, poison_, requires_cuda

HOT = [torch.bfloat16, torch.float16, torch.float8_e4m3fn]
POLICIES = ["per_page_pow2", "per_page", "identity", 0.5]


def _kv(shape, dtype, device="cpu", v_scale=0.05):
    """Lognormal-ish K with small V (the case that makes identity scaling underflow)."""
    x = torch.randn(shape).sign() * torch.exp(torch.randn(shape) * 0.8)
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-448, 448)
    return (x * v_scale if v_scale else x).to(dtype).to(device)


def _geometries(dtype, device, policy, num_pages=9):
    """(pools, specs) for the layouts engines use."""
    P = num_pages
    hnd = _kv((P, 2, 2, 16, 128), dtype, device, None)
    hnd[:, 1] = hnd[:, 1] * 0.03 if dtype != torch.float8_e4m3fn else hnd[:, 1]
    nhd = _kv((P, 16, 2, 2, 64), dtype, device, None)
    k, v = _kv((P, 16, 2, 64), dtype, device, None), _kv((P, 16, 2, 64), dtype, device)
    mla = _kv((P, 16, 576), dtype, device, None)
    side = torch.randn(P, 3, 8, device=device)  # fp32 lossless side state
    vllm = _kv((2, P, 16, 2, 64), dtype, device, None).permute(1, 0, 3, 2, 4)  # a strided view
    return {
        "hnd": ([hnd], [RowSpec.full(128, plane_dim=1, global_scale=policy)]),
        "nhd": ([nhd], [RowSpec.full(64, plane_dim=2, global_scale=policy)]),
        "split_kv": ([k, v], [RowSpec.full(64, global_scale=policy), RowSpec.full(64, global_scale=policy)]),
        "mla_skip_rope": ([mla], [RowSpec.for_rope(576, (512, 64), skip_rope_quantization=True, global_scale=policy)]),
        "mla_residual": ([mla], [RowSpec.for_rope(576, (512, 64), rope_residual=True, global_scale=policy)]),
        "rope_prefix_partial": ([nhd], [RowSpec((32, 32), plane_dim=2, global_scale=policy)]),
        "vllm_view_and_side": ([vllm, side], [RowSpec.full(64, plane_dim=1, global_scale=policy), RowSpec.lossless()]),
    }


def _pairs(n, limit_dst, limit_src, device="cpu"):
    dst = torch.randperm(limit_dst)[:n]
    src = torch.randperm(limit_src)[:n]  # distinct, so the reverse pairs are valid decode pairs
    return torch.stack([dst, src], 1).to(torch.int32).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HOT)
@pytest.mark.parametrize("policy", POLICIES)
def test_matches_reference_with_canaries(device, dtype, policy):
    for name, (pools, specs) in _geometries(dtype, device, policy).items():
        codec = PageBlobCodec(pools, specs)
        assert codec.cold_page_bytes % 16 == 0
        # A wider buffer: canary columns right of each blob and canary slots must survive.
        buf = poison_(torch.empty(12, codec.cold_page_bytes + 48, dtype=torch.uint8, device=device))
        cold = buf[:, :codec.cold_page_bytes]
        before = buf.clone()
        pairs = _pairs(5, 12, pools[0].shape[0], device)
        codec.encode(pools, cold, pairs)
        expect = before.clone().cpu()
        ref.encode_pages([p.cpu() for p in pools], specs, expect[:, :codec.cold_page_bytes], pairs.cpu())
        assert torch.equal(buf.cpu(), expect), f"{name}: encode differs from the reference"

        # Poisoned pools: pages not decoded into are canaries and must survive.
        outs = [poison_(p.clone()) for p in pools]
        expect_pools = [o.cpu().clone() for o in outs]
        dpairs = torch.stack([torch.randperm(pools[0].shape[0])[:5], pairs[:, 0].cpu()], 1).to(torch.int32).to(device)
        codec.decode(cold, outs, dpairs)
        ref.decode_pages(cold.cpu(), expect_pools, specs, dpairs.cpu())
        for o, e in zip(outs, expect_pools):
            assert torch.equal(bytes_of(o), bytes_of(e)), f"{name}: decode differs from the reference"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["per_page_pow2", "identity"])
def test_planes_larger_than_a_tile(device, policy):
    """128-token pages: a 256 KiB bf16 plane spans four encode tiles (amax pass, then tile by tile)."""
    pool = _kv((3, 2, 8, 128, 128), torch.bfloat16, device, None)
    specs = [RowSpec.full(128, plane_dim=1, global_scale=policy)]
    codec = PageBlobCodec([pool], specs)
    cold = poison_(codec.allocate(3, device=device))
    pairs = torch.tensor([[2, 0], [0, 2]], dtype=torch.int32, device=device)
    codec.encode([pool], cold, pairs)
    expect = cold.cpu().clone()
    ref.encode_pages([pool.cpu()], specs, expect, pairs.cpu())
    assert torch.equal(cold.cpu(), expect)
    out = poison_(pool.clone())
    expect_out = out.cpu().clone()
    codec.decode(cold, [out], pairs)
    ref.decode_pages(cold.cpu(), [expect_out], specs, pairs.cpu())
    assert torch.equal(bytes_of(out), bytes_of(expect_out))


@pytest.mark.parametrize("device", DEVICES)
def test_lossless_bytes_and_non_finite(device):
    """NaN/Inf outside the quantized run come back bit-exact; inside, NaN poisons only its block."""
    pool = torch.randn(4, 8, 576).to(torch.bfloat16).to(device)
    pool[:, :, 530] = float("nan")
    pool[:, :, 560] = float("inf")
    pool[1, 3, 17] = float("nan")
    pool[2, 5, 100] = float("inf")
    specs = [RowSpec.for_rope(576, (512, 64), skip_rope_quantization=True)]
    codec = PageBlobCodec([pool], specs)
    cold = codec.allocate(4, device=device)
    pairs = torch.tensor([[0, 0], [1, 1], [2, 2], [3, 3]], dtype=torch.int32, device=device)
    codec.encode([pool], cold, pairs)
    out = poison_(torch.empty_like(pool))
    codec.decode(cold, [out], pairs)
    assert torch.equal(bytes_of(out[..., 512:]), bytes_of(pool[..., 512:]))
    assert out[1, 3, 16:32].isnan().all() and not out[1, 3, :16].isnan().any()
    assert out[2, 5, 96:112].isfinite().all()  # Inf saturates to 6 * 448 / g
    expect = torch.zeros_like(cold.cpu())
    ref.encode_pages([pool.cpu()], specs, expect, pairs.cpu())
    assert torch.equal(cold.cpu(), expect)


def _roundtrip(codec, pools, device):
    cold = codec.allocate(pools[0].shape[0], device=device)
    n = pools[0].shape[0]
    pairs = torch.stack([torch.arange(n), torch.arange(n)], 1).to(torch.int32).to(device)
    codec.encode(pools, cold, pairs)
    outs = [poison_(torch.empty_like(p)) for p in pools]
    codec.decode(cold, outs, pairs)
    return outs, cold


def _normal_scale_blocks(cold, codec):
    """Bool [pages, planes*rows*blocks]: block scale bytes whose E4M3 exponent is non-zero and not NaN."""
    lay = codec.layouts[0]
    nb = lay.rows * lay.spec.quantized_range[1] // 16
    out = []
    for p in range(lay.planes):
        base = lay.section_offset + lay.plane_offset + p * lay.plane_bytes + lay.off_scales
        sc = cold[:, base:base + nb].cpu()
        out.append(((sc & 0x78) != 0) & ((sc & 0x7F) != 0x7F))
    return torch.cat(out, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HOT)
@pytest.mark.parametrize("policy", ["per_page_pow2", "identity"])
def test_every_bit_pattern_round_trip(device, dtype, policy):
    """Every bit pattern of the hot dtype, laid out in pages: reference bytes, lossless part exact,
    and no error accumulation: D(E(D(E(x)))) == D(E(x)) where block scales are normal (fp8: from trip 2)."""
    n = 1 << (8 * dtype.itemsize)
    bits = torch.arange(n, dtype=torch.int32).to(torch.int16 if n > 256 else torch.uint8)
    x = bits.view(dtype)
    # [pages, 2 planes, 4 rows, 64]: every pattern once in the 32 quantized and once in the 32 lossless columns
    q = x.reshape(-1, 2, 4 if n > 256 else 1, 32)  # fp8: small pages, so most hold no NaN
    pool = torch.cat([q, x[torch.randperm(n)].reshape(q.shape)], -1).contiguous().to(device)
    specs = [RowSpec((0, 32), plane_dim=1, global_scale=policy)]
    codec = PageBlobCodec([pool], specs)
    (y1,), cold1 = _roundtrip(codec, [pool], device)
    expect = torch.zeros_like(cold1.cpu())
    ref.encode_pages([pool.cpu()], specs, expect, torch.stack([torch.arange(pool.shape[0])] * 2, 1).int())
    assert torch.equal(cold1.cpu(), expect)
    assert torch.equal(bytes_of(y1[..., 32:]), bytes_of(pool[..., 32:]))
    (y2,), cold2 = _roundtrip(codec, [y1], device)
    if dtype == torch.float8_e4m3fn:
        (y3,), _ = _roundtrip(codec, [y2], device)
        y1, y2, cold1, cold2 = y2, y3, cold2, None
        cold2 = _roundtrip(codec, [y1], device)[1]
    ok = _normal_scale_blocks(cold1, codec) & _normal_scale_blocks(cold2, codec)  # [pages, planes*rows*2]
    # Pages holding Inf/NaN (or that overflow fp16 on decode, which rounds, not saturates) get g = 1
    # on the next trip, so they are outside the claim.
    finite = lambda t: t[..., :32].float().isfinite().reshape(t.shape[0], -1).all(-1, keepdim=True).cpu()  # noqa: E731
    ok &= finite(pool if dtype != torch.float8_e4m3fn else y1) & finite(y1)
    a = bytes_of(y1[..., :32]).view(y1.shape[0], -1, 16 * y1.element_size())
    b = bytes_of(y2[..., :32]).view(y1.shape[0], -1, 16 * y1.element_size())
    same = (a == b).all(-1)
    assert ok.float().mean() > 0.3, "too few normal blocks to say anything"
    assert bool(same[ok].all()), f"{int((~same[ok]).sum())} normal blocks changed on the second trip"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_pages", [1, 257, 10_000])
def test_batches(device, num_pages):
    pool = _kv((num_pages, 2, 1, 16, 64), torch.bfloat16, device, None)
    specs = [RowSpec.full(64, plane_dim=1)]
    codec = PageBlobCodec([pool], specs)
    cold = poison_(codec.allocate(num_pages + 3, device=device))
    perm = torch.randperm(num_pages + 3)[:num_pages]
    pairs = torch.stack([perm, torch.arange(num_pages)], 1).to(torch.int32).to(device)
    codec.encode([pool], cold, pairs)
    out = poison_(torch.empty_like(pool))
    codec.decode(cold, [out], torch.stack([torch.arange(num_pages), perm], 1).to(torch.int32).to(device))
    # Against the CPU kernel (the float64 reference is too slow for 10k pages; it checks the CPU kernel above).
    cold_cpu = cold.cpu().clone()
    out_cpu = torch.empty_like(out.cpu())
    codec.encode([pool.cpu()], cold_cpu, pairs.cpu())
    assert torch.equal(cold_cpu, cold.cpu())
    codec.decode(cold_cpu, [out_cpu], torch.stack([torch.arange(num_pages), perm], 1).to(torch.int32))
    assert torch.equal(bytes_of(out_cpu), bytes_of(out))
    sub = torch.randint(0, num_pages, (3,))
    for i in sub.tolist():
        e = ref.encode_page(pool[i].cpu(), codec.layouts[0])
        assert torch.equal(cold[perm[i]].cpu(), e)


@requires_cuda
@pytest.mark.parametrize("dtype", HOT)
def test_pinned_host_blobs_no_sync_between(dtype):
    """Encode into pinned host memory and decode back, enqueued back to back with no sync."""
    pools, specs = _geometries(dtype, "cuda", "per_page_pow2", num_pages=40)["hnd"]
    codec = PageBlobCodec(pools, specs)
    host = poison_(codec.allocate(50, device="cpu", pin_memory=True))
    dev = poison_(codec.allocate(50, device="cuda"))
    pairs = _pairs(30, 50, 40, "cuda")
    host_pairs = pairs.cpu().pin_memory()
    codec.encode(pools, host, pairs)
    codec.encode(pools, dev, host_pairs)  # pairs in pinned host memory work too
    outs = [torch.empty_like(pools[0])]
    back = torch.stack([pairs[:, 1], pairs[:, 0]], 1).contiguous()
    codec.decode(host, outs, back)
    torch.cuda.synchronize()
    slots = pairs[:, 0].long().cpu()
    assert torch.equal(host[slots], dev.cpu()[slots])
    ref_out = [torch.empty_like(pools[0])]
    codec.decode(dev, ref_out, back)
    pages = pairs[:, 1].long()
    assert torch.equal(bytes_of(outs[0][pages]), bytes_of(ref_out[0][pages]))


@requires_cuda
@pytest.mark.parametrize("dtype", HOT)
def test_cpu_and_cuda_bytes_identical(dtype):
    for name, (pools, specs) in _geometries(dtype, "cpu", "per_page_pow2").items():
        codec = PageBlobCodec(pools, specs)
        pairs = _pairs(6, 8, pools[0].shape[0])
        a, b = codec.allocate(8), codec.allocate(8, device="cuda")
        codec.encode(pools, a, pairs)
        codec.encode([p.cuda() for p in pools], b, pairs.cuda())
        assert torch.equal(a, b.cpu()), name


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for dtype in HOT:
        pools, specs = _geometries(dtype, device, "per_page_pow2")["mla_residual"]
        codec = PageBlobCodec(pools, specs)
        cold = codec.allocate(4, device=device)
        pairs = _pairs(3, 4, pools[0].shape[0], device)
        opcheck(torch.ops.kvops.nvfp4_encode_pages_.default, (pools, cold, pairs, codec.plan, False))
        dp = torch.stack([pairs[:, 1], pairs[:, 0]], 1).contiguous()
        opcheck(torch.ops.kvops.nvfp4_decode_pages_.default, (cold, [p.clone() for p in pools], dp, codec.plan, False))
        cold[0, :16] = 0  # slot 0's scales: refused, and counted
        opcheck(torch.ops.kvops.nvfp4_decode_pages_.default,
                (cold, [p.clone() for p in pools], dp, codec.plan, False, torch.zeros(1, dtype=torch.int32,
                                                                                    device=device)))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    pools, specs = _geometries(torch.bfloat16, device, "per_page_pow2")["hnd"]
    codec = PageBlobCodec(pools, specs)

    def offload_onboard(pools, cold, pairs, back, outs):
        codec.encode(pools, cold, pairs)
        codec.decode(cold, outs, back)
        return outs[0] * 2

    cold, cold2 = codec.allocate(6, device=device), codec.allocate(6, device=device)
    pairs = _pairs(4, 6, pools[0].shape[0], device)
    back = torch.stack([pairs[:, 1], pairs[:, 0]], 1).contiguous()
    outs, outs2 = [torch.zeros_like(pools[0])], [torch.zeros_like(pools[0])]
    compiled = torch.compile(offload_onboard, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    r = compiled(pools, cold, pairs, back, outs)
    e = offload_onboard(pools, cold2, pairs, back, outs2)
    assert torch.equal(cold, cold2) and torch.equal(bytes_of(r), bytes_of(e))


@requires_cuda
def test_cuda_graph_replay_fresh_data():
    pools, specs = _geometries(torch.bfloat16, "cuda", "per_page_pow2", num_pages=16)["mla_residual"]
    codec = PageBlobCodec(pools, specs)
    host = codec.allocate(16, device="cpu", pin_memory=True)
    pairs = torch.zeros(8, 2, dtype=torch.int32, device="cuda")
    back = torch.zeros(8, 2, dtype=torch.int32, device="cuda")
    outs = [torch.zeros_like(pools[0])]
    codec.encode(pools, host, pairs)  # warm up outside capture
    codec.decode(host, outs, back)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        codec.encode(pools, host, pairs)
        codec.decode(host, outs, back)
    for _ in range(3):
        pools[0].copy_(_kv(pools[0].shape, torch.bfloat16, "cuda", None))
        slots, pages = torch.randperm(16)[:8], torch.randperm(16)[:8]
        pairs.copy_(torch.stack([slots, pages], 1))
        back.copy_(torch.stack([torch.randperm(16)[:8], slots], 1))
        outs[0].zero_()
        graph.replay()
        torch.cuda.synchronize()
        expect = torch.zeros_like(host)
        ref.encode_pages([pools[0].cpu()], specs, expect, pairs.cpu())
        assert torch.equal(host[slots], expect[slots])
        exp_out = torch.zeros_like(outs[0].cpu())
        ref.decode_pages(host, [exp_out], specs, back.cpu())
        assert torch.equal(bytes_of(outs[0]), bytes_of(exp_out))


def test_config_errors_name_the_pool():
    pool = torch.zeros(4, 2, 8, 16, 128, dtype=torch.bfloat16)
    cases = [
        (RowSpec((8, 64)), "multiples of 16"),
        (RowSpec((0, 144)), "outside the row"),
        (RowSpec((0, 64), residual_range=(64, 16)), "outside quantized_range"),
        (RowSpec((0, 64), residual_range=(0, 8)), "multiples of 16"),
        (RowSpec.full(128, plane_dim=4), "plane_dim"),
        (RowSpec.full(128, global_scale="per_token"), "global_scale"),
        (RowSpec.full(128, global_scale=-1.0), "positive"),
        (RowSpec.full(128, global_scale=float("nan")), "positive"),
        (RowSpec.full(128, global_scale=1e39), "float32"),
        (RowSpec.full(128, global_scale=1e-50), "float32"),
    ]
    for spec, msg in cases:
        with pytest.raises(ValueError, match=rf"pools\[1\].*{msg}"):
            PageBlobCodec([pool, pool], [RowSpec.lossless(), spec])
    with pytest.raises(ValueError, match="can be quantized"):
        PageBlobCodec([torch.zeros(4, 8, 64)], [RowSpec.full(64)])
    with pytest.raises(ValueError, match="not a multiple of 16"):
        PageBlobCodec([torch.zeros(4, 8, 4, dtype=torch.bfloat16)], [RowSpec.lossless()])
    with pytest.raises(ValueError, match="middle of a row"):
        RowSpec.for_rope(128, (32, 64), skip_rope_quantization=True)
    with pytest.raises(ValueError, match="whole row is RoPE"):
        RowSpec.for_rope(128, (0, 128), skip_rope_quantization=True)
    with pytest.raises(ValueError, match="2 pools"):
        PageBlobCodec([pool, pool], [RowSpec.lossless()])


@pytest.mark.parametrize("device", DEVICES)
def test_call_errors_touch_nothing(device):
    pools, specs = _geometries(torch.bfloat16, device, "per_page_pow2")["split_kv"]
    codec = PageBlobCodec(pools, specs)
    cold = poison_(codec.allocate(4, device=device))
    saved = cold.clone()
    ok = torch.tensor([[0, 0]], dtype=torch.int32, device=device)

    def expect(exc, msg, fn):
        with pytest.raises(exc, match=msg):
            fn()
        assert torch.equal(cold, saved)

    expect(ValueError, "slot 4 is out of range", lambda: codec.encode(pools, cold, torch.tensor([[4, 0]], dtype=torch.int32)))
    expect(ValueError, "page 9 is out of range", lambda: codec.encode(pools, cold, torch.tensor([[0, 9]], dtype=torch.int32)))
    expect(ValueError, "slot 1 is written twice", lambda: codec.encode(pools, cold, torch.tensor([[1, 0], [1, 2]], dtype=torch.int32)))
    expect(ValueError, "page_pairs must be int32", lambda: codec.encode(pools, cold, ok.long()))
    expect(ValueError, "page_pairs must be int32", lambda: codec.encode(pools, cold, ok[0]))
    expect(ValueError, "cold_pages must be \\[num_slots", lambda: codec.encode(pools, cold[:, :16], ok))
    expect(ValueError, "pools\\[1\\] was configured", lambda: codec.encode([pools[0], pools[1][:, :8]], cold, ok))
    expect(ValueError, "list of 2 pools", lambda: codec.encode(pools[:1], cold, ok))
    expect(ValueError, "pools\\[0\\] and pools\\[1\\] share memory", lambda: codec.encode([pools[0]] * 2, cold, ok))
    expect(ValueError, "meta", lambda: codec.encode(pools, cold, ok.to("meta")))
    expect(ValueError, "meta", lambda: torch.ops.kvops.nvfp4_encode_pages_(pools, cold, ok.to("meta"), codec.plan))
    expect(ValueError, "plan has", lambda: torch.ops.kvops.nvfp4_encode_pages_(pools, cold, ok, codec.plan[:-1]))
    expect(ValueError, "cold_pages must be uint8",
           lambda: torch.ops.kvops.nvfp4_encode_pages_(pools, cold.view(torch.int8), ok, codec.plan))
    bad_plan = list(codec.plan)
    bad_plan[1] = 80  # quantized length past the row
    expect(ValueError, "quantized range", lambda: torch.ops.kvops.nvfp4_encode_pages_(pools, cold, ok, bad_plan))
    bad_plan = list(codec.plan)
    bad_plan[7] = codec.cold_page_bytes  # section past the blob
    expect(ValueError, "does not fit", lambda: torch.ops.kvops.nvfp4_encode_pages_(pools, cold, ok, bad_plan))
    outs = [p.clone() for p in pools]
    with pytest.raises(ValueError, match="slot 7 is out of range"):
        codec.decode(cold, outs, torch.tensor([[0, 7]], dtype=torch.int32))
    # pairs inside what the call writes: the first pair's write would turn the later pairs into garbage
    in_pool = outs[0][-1].view(-1)[:4].view(torch.int32).view(1, 2)
    in_pool.zero_()
    saved_outs = [p.clone() for p in outs]
    with pytest.raises(ValueError, match=r"page_pairs shares memory with pools\[0\]"):
        codec.decode(cold, outs, in_pool)
    assert all(torch.equal(a, b) for a, b in zip(outs, saved_outs))
    expect(ValueError, r"page_pairs shares memory with pools\[0\]", lambda: codec.encode(outs, cold, in_pool))
    in_cold = cold[0, :8].view(torch.int32).view(1, 2)
    expect(ValueError, "page_pairs shares memory with cold_pages", lambda: codec.encode(pools, cold, in_cold))
    if device == "cuda":
        expect(ValueError, "pinned", lambda: codec.encode(pools, cold, ok.cpu()))
        expect(ValueError, "pinned", lambda: codec.encode(pools, torch.zeros_like(cold.cpu()), ok))
        bad = torch.tensor([[0, 9]], dtype=torch.int32, device="cuda")
        expect(ValueError, "page 9 is out of range", lambda: codec.encode(pools, cold, bad, validate=True))
        codec.encode(pools, cold, bad)  # without validate the kernel skips the bad pair and writes nothing
        torch.cuda.synchronize()
        assert torch.equal(cold, saved)
        expect(ValueError, "expected cpu", lambda: codec.encode([p.cpu() for p in pools], cold, ok))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [0.0, -0.0, -2.0, float("nan"), float("inf")])
def test_decode_refuses_scales_encode_never_writes(device, bad):
    """A slot never encoded (zeroed: global scale 0) or a corrupt scale: the plane is left untouched and counted;
    validate=True raises naming the slot before anything is written. The other pages decode as usual."""
    pools, specs = _geometries(torch.bfloat16, device, "per_page_pow2")["vllm_view_and_side"]
    codec = PageBlobCodec(pools, specs)
    cold = codec.allocate(3, device=device)
    codec.encode(pools, cold, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device))
    cold[1].zero_()   # slot 1: never encoded
    g_table = cold[2, :16].view(torch.float32)  # slot 2, pool 0: the layout tag, then K's and V's global scales
    g_table[2] = bad  # the V plane is corrupt
    outs = [poison_(p.clone()) for p in pools]
    saved = [o.clone() for o in outs]
    pairs = torch.tensor([[4, 0], [5, 1], [6, 2]], dtype=torch.int32, device=device)  # (page, slot)
    with pytest.raises(ValueError, match=r"slot 1's section of pools\[0\] carries layout tag 0"):
        codec.decode(cold, outs, pairs, validate=True)
    with pytest.raises(ValueError, match="slot 2 holds global scale .* for pools\\[0\\] plane 1"):
        codec.decode(cold, outs, pairs[2:], validate=True)
    assert all(torch.equal(bytes_of(a), bytes_of(b)) for a, b in zip(outs, saved))
    counter = codec.refused(device)
    counter.zero_()
    codec.decode(cold, outs, pairs)
    assert int(counter) == 3 + 1  # slot 1: pool 0's K and V planes and the side pool; slot 2: pool 0's V plane
    same = lambda a, b: torch.equal(bytes_of(a), bytes_of(b))  # noqa: E731  (poisoned bytes may be NaN)
    for o, s in zip(outs, saved):
        assert same(o[5], s[5]) and not same(o[4], s[4])
    assert same(outs[0][6, 1], saved[0][6, 1]) and not same(outs[0][6, 0], saved[0][6, 0])
    assert torch.equal(outs[1][6], pools[1][3])  # the side pool of slot 2 is intact and lossless


@pytest.mark.parametrize("device", DEVICES)
def test_validate_reads_each_listed_slots_scales_from_wider_rows(device):
    """validate=True gathers only the global scales of the listed slots, at slot * row stride: cold pages that are
    the leading columns of wider rows, a corrupt scale in a later pool's plane of a later slot, named exactly; an
    unlisted corrupt slot does not matter."""
    pools, specs = _geometries(torch.bfloat16, device, "per_page_pow2")["vllm_view_and_side"]
    codec = PageBlobCodec(pools, specs)
    wide = torch.zeros(4, codec.cold_page_bytes + 48, dtype=torch.uint8, device=device)
    cold = wide[:, :codec.cold_page_bytes]
    codec.encode(pools, cold, torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0]], dtype=torch.int32, device=device))
    cold[3].zero_()  # never read below: slot 3 is not listed
    outs = [p.clone() for p in pools]
    codec.decode(cold, outs, torch.tensor([[0, 2], [1, 1]], dtype=torch.int32, device=device), validate=True)
    scale = cold[1, codec.layouts[1].section_offset + 4:][:4].view(torch.float32)  # the side pool's only plane
    scale[0] = -1.0
    saved = [o.clone() for o in outs]
    with pytest.raises(ValueError, match=r"page_pairs\[1\] slot 1 holds global scale -1 for pools\[1\] plane 0"):
        codec.decode(cold, outs, torch.tensor([[0, 2], [1, 1]], dtype=torch.int32, device=device), validate=True)
    assert all(torch.equal(bytes_of(a), bytes_of(b)) for a, b in zip(outs, saved))


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_refuses_meta_mixed_with_real(device):
    x = torch.randn(4, 32, device=device)
    with pytest.raises(ValueError, match="meta"):
        kvops.nvfp4.quantize(x, torch.tensor([1.0], device="meta"))
    with pytest.raises(ValueError, match="meta"):
        torch.ops.kvops.nvfp4_quantize(x, torch.tensor([1.0], device="meta"))
    packed, scales = kvops.nvfp4.quantize(x)
    with pytest.raises(ValueError, match="meta"):
        kvops.nvfp4.dequantize(packed.to("meta"), scales)


# ---- property test: any valid spec gives an aligned, self-consistent layout the kernels accept ----------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _pool_and_spec(draw):
    dtype = draw(st.sampled_from(HOT))
    row = 16 * draw(st.integers(1, 12))
    mids = draw(st.lists(st.integers(1, 3), min_size=0, max_size=3))
    shape = (draw(st.integers(1, 3)), *mids, row)
    q0 = 16 * draw(st.integers(0, row // 16))
    ql = 16 * draw(st.integers(0, (row - q0) // 16))
    res = None
    if ql and draw(st.booleans()):
        r0 = q0 + 16 * draw(st.integers(0, ql // 16 - 1))
        res = (r0, 16 * draw(st.integers(1, (q0 + ql - r0) // 16)))
    plane_dim = draw(st.sampled_from([None] + list(range(1, len(shape) - 1))))
    policy = draw(st.sampled_from(["per_page_pow2", "per_page", "identity", 3.0]))
    return shape, dtype, RowSpec((q0, ql), res, policy, plane_dim)


@settings(max_examples=40, deadline=None)
@given(st.lists(_pool_and_spec(), min_size=1, max_size=3))
def test_layout_property(pools_specs):
    pools = [_kv(shape, dtype, "cpu", None) for shape, dtype, _ in pools_specs]
    specs = [spec for _, _, spec in pools_specs]
    codec = PageBlobCodec(pools, specs)
    end = 0
    for lay in codec.layouts:
        offs = [lay.off_codes, lay.off_rcodes, lay.off_scales, lay.off_rscales, lay.off_lossless]
        assert all(o % 16 == 0 for o in offs + [lay.section_offset, lay.plane_offset, lay.plane_bytes])
        assert offs == sorted(offs) and lay.section_offset >= end
        end = lay.section_offset + lay.section_bytes
    assert codec.cold_page_bytes >= end and codec.cold_page_bytes % 16 == 0
    n = min(p.shape[0] for p in pools)  # pools may differ in page count; a page index must exist in all
    pairs = torch.stack([torch.arange(n), torch.arange(n)], 1).int()
    cold = poison_(codec.allocate(n))
    codec.encode(pools, cold, pairs)
    expect = torch.zeros_like(cold)
    ref.encode_pages(pools, specs, expect, pairs)
    assert torch.equal(cold, expect)


# ---- every host-side check of the ops themselves (a plan or tensors the Python layer would not build) ----------

PLAN = dict(q_start=0, q_len=1, r_start=2, r_len=3, plane_dim=4, kind=5, g_bits=6, section=7, plane_off=8,
            plane_bytes=9, codes=10, rcodes=11, scales=12, rscales=13, lossless=14)  # csrc/nvfp4/codec.h


@pytest.mark.parametrize("field, value, msg", [
    ("r_start", 8, "residual range"),
    ("r_len", 48, "residual range"),
    ("kind", 7, "unknown scale kind"),
    ("g_bits", 0, "fixed global scale"),
    ("plane_dim", 4, "plane_dim"),
    ("scales", 8, "overlap or are unaligned"),
    ("lossless", 0, "overlap or are unaligned"),
    ("plane_off", 0, "does not fit"),
])
def test_bad_plans_are_rejected(field, value, msg):
    pool = _kv((4, 2, 16, 64), torch.bfloat16, "cpu", None)
    codec = PageBlobCodec([pool], [RowSpec((0, 32), residual_range=(16, 16), global_scale=2.0, plane_dim=1)])
    cold = poison_(codec.allocate(2))
    saved = cold.clone()
    plan = list(codec.plan)
    plan[PLAN[field]] = value
    with pytest.raises(ValueError, match=msg):
        torch.ops.kvops.nvfp4_encode_pages_([pool], cold, torch.tensor([[0, 1]], dtype=torch.int32), plan)
    assert torch.equal(cold, saved)


def test_bad_tensors_are_rejected():
    pool = _kv((4, 2, 16, 64), torch.bfloat16, "cpu", None)
    codec = PageBlobCodec([pool], [RowSpec.full(64, plane_dim=1)])
    cold = codec.allocate(3)
    ok = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
    enc = torch.ops.kvops.nvfp4_encode_pages_
    with pytest.raises(ValueError, match="pools is empty"):
        enc([], cold, ok, [])
    with pytest.raises(ValueError, match="rows \\(last dim\\) must be contiguous"):
        enc([pool.transpose(2, 3)], cold, ok, codec.plan)
    with pytest.raises(ValueError, match="page_pairs must be contiguous"):
        enc([pool], cold, ok.t().contiguous().t(), codec.plan)
    wide = torch.zeros(3, codec.cold_page_bytes + 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="16-byte aligned"):
        enc([pool], wide[:, :codec.cold_page_bytes], ok, codec.plan)
    with pytest.raises(ValueError, match="at most 4 dims"):
        PageBlobCodec([torch.zeros(2, 1, 1, 1, 1, 1, 64, dtype=torch.bfloat16)], [RowSpec.full(64)])
    p, s = torch.ops.kvops.nvfp4_quantize(pool.reshape(-1, 64), None)
    with pytest.raises(ValueError, match="multiple of 8"):
        torch.ops.kvops.nvfp4_dequantize(p[:, :4], s[:, :1], None, torch.bfloat16)


# ---- issue 30: bad input, second pass ----------------------------------------------------------------------

@pytest.mark.parametrize("shape, spec, dim", [
    ((4, 2, 0, 16, 64), RowSpec.full(64, plane_dim=1), 2),   # no heads: a zero-sized row dim of the radix walk
    ((4, 2, 2, 0, 64), RowSpec.full(64, plane_dim=1), 3),    # no tokens
    ((4, 0, 2, 16, 64), RowSpec.full(64, plane_dim=1), 1),   # no planes
    ((4, 2, 2, 16, 0), RowSpec.lossless(plane_dim=1), 4),    # rows of no elements
    ((4, 0, 64), RowSpec.lossless(), 1),
])
def test_empty_pool_dims_are_refused_at_construction(shape, spec, dim):
    """A pool with an empty dim other than the page dim has no rows to store (it used to reach a division by
    zero in the kernel plan and kill the process)."""
    pool = torch.empty(shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=rf"pools\[1\] \(shape .*\): dim {dim} is empty"):
        PageBlobCodec([_kv((4, 16, 64), torch.bfloat16), pool], [RowSpec.full(64), spec])


def test_the_op_refuses_empty_dims_too():
    """The op's own host check (a plan from another codec): a clear error instead of a division by zero."""
    pool = _kv((4, 2, 2, 16, 64), torch.bfloat16, "cpu", None)
    codec = PageBlobCodec([pool], [RowSpec.full(64, plane_dim=1)])
    cold = codec.allocate(2)
    for k in (2, 3):
        empty = pool.narrow(k, 0, 0)
        with pytest.raises(ValueError, match=rf"nvfp4_encode_pages_: pools\[0\] dim {k} is empty"):
            torch.ops.kvops.nvfp4_encode_pages_([empty], cold, torch.tensor([[0, 1]], dtype=torch.int32),
                                                codec.plan)


@pytest.mark.parametrize("device", DEVICES)
def test_a_pool_of_no_pages_is_a_no_op(device):
    pool = torch.empty(0, 2, 2, 16, 64, dtype=torch.bfloat16, device=device)
    codec = PageBlobCodec([pool], [RowSpec.full(64, plane_dim=1)])
    cold = poison_(codec.allocate(2, device=device))
    saved = cold.clone()
    none = torch.empty(0, 2, dtype=torch.int32, device=device)
    codec.encode([pool], cold, none)
    codec.decode(cold, [pool], none)
    assert torch.equal(cold, saved)
    with pytest.raises(ValueError, match="page 0 is out of range"):
        codec.encode([pool], cold, torch.tensor([[0, 0]], dtype=torch.int32))


def test_plan_layout_refuses_bad_shapes_and_dtypes():
    from kvops.nvfp4 import plan_layout
    with pytest.raises(ValueError, match=r"pools\[0\] \(shape \(4, -2, 16, 64\).*dim 1 is negative"):
        plan_layout([((4, -2, 16, 64), torch.bfloat16)], [RowSpec.lossless()])
    with pytest.raises(TypeError, match=r"pools\[0\].*shape must be a sequence of ints"):
        plan_layout([((4, 2.0, 64), torch.bfloat16)], [RowSpec.lossless()])
    with pytest.raises(TypeError, match=r"pools\[0\].*dtype must be a torch.dtype"):
        plan_layout([((4, 2, 64), "bfloat16")], [RowSpec.lossless()])


@pytest.mark.parametrize("device", DEVICES)
def test_written_tensors_with_internal_overlap_are_refused(device):
    """Decode writes the pools and encode writes cold_pages: a stride-0 expanded one would be written through
    its shared memory (torch refuses such in-place writes too). Refused, naming it, with nothing written."""
    pools, specs = _geometries(torch.bfloat16, device, "per_page_pow2")["split_kv"]
    codec = PageBlobCodec(pools, specs)
    cold = poison_(codec.allocate(4, device=device))
    pairs = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    codec.encode(pools, cold, pairs)
    one_page = poison_(torch.empty(1, *pools[1].shape[1:], dtype=pools[1].dtype, device=device))
    saved_page = one_page.clone()
    shared = one_page.expand(pools[1].shape)  # every page the same memory
    with pytest.raises(ValueError, match=r"nvfp4_decode_pages_: pools\[1\] has elements that share memory"):
        codec.decode(cold, [pools[0].clone(), shared], pairs.flip(1))
    assert torch.equal(bytes_of(one_page), bytes_of(saved_page))
    slot = poison_(torch.empty(1, codec.cold_page_bytes, dtype=torch.uint8, device=device))
    saved = slot.clone()
    with pytest.raises(ValueError, match="nvfp4_encode_pages_: cold_pages has elements that share memory"):
        codec.encode(pools, slot.expand(4, -1), pairs)
    assert torch.equal(slot, saved)
    with pytest.raises(ValueError, match=r"nvfp4_decode_pages_: pools\[1\] has elements that share memory"):
        torch.ops.kvops.nvfp4_decode_pages_(cold, [pools[0].clone(), shared], pairs.flip(1), codec.plan)
    with pytest.raises(ValueError, match="nvfp4_encode_pages_: cold_pages has elements that share memory"):
        torch.ops.kvops.nvfp4_encode_pages_(pools, slot.expand(4, -1), pairs, codec.plan)
    assert torch.equal(slot, saved) and torch.equal(bytes_of(one_page), bytes_of(saved_page))
    codec.encode([pools[0], shared], cold, pairs)  # encode only reads the pools
    # interleaved strides: each token row starts half a row after the last, so neighbours share elements
    D = pools[1].shape[-1]
    base = poison_(torch.empty(pools[1].numel(), dtype=pools[1].dtype, device=device))
    stride = list(pools[1].stride())
    stride[-2] = D // 2
    interleaved = base.as_strided(pools[1].shape, stride)
    with pytest.raises(ValueError, match=r"nvfp4_decode_pages_: pools\[1\] has elements that share memory"):
        codec.decode(cold, [pools[0].clone(), interleaved], pairs.flip(1))


def test_allocate_checks_num_slots():
    codec = PageBlobCodec([torch.empty(4, 16, 64, dtype=torch.bfloat16)], [RowSpec.full(64)])
    with pytest.raises(ValueError, match="PageBlobCodec.allocate: num_slots must be >= 0, got -1"):
        codec.allocate(-1)
    for bad in (2.5, True, "3", None):
        with pytest.raises(TypeError, match="PageBlobCodec.allocate: num_slots must be an int"):
            codec.allocate(bad)
    with pytest.raises(TypeError, match="pin_memory must be a bool"):
        codec.allocate(2, pin_memory="yes")
    with pytest.raises(ValueError, match="device must be a real device"):
        codec.allocate(2, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            codec.allocate(2, pin_memory=True)
    assert codec.allocate(0).shape == (0, codec.cold_page_bytes)


def test_spec_and_call_argument_types_are_named():
    pool = _kv((4, 2, 16, 64), torch.bfloat16, "cpu", None)
    for spec, match in [(RowSpec("ab", plane_dim=1), "quantized_range must be a"),
                        (RowSpec.full("64", plane_dim=1), "quantized_range must be a"),
                        (RowSpec.full(64, residual_range="ab", plane_dim=1), "residual_range must be a"),
                        (RowSpec.full(64, plane_dim=1.0), "plane_dim must be an int"),
                        (RowSpec.full(64, plane_dim=True), "plane_dim must be an int")]:
        with pytest.raises(TypeError, match=rf"pools\[0\] .*{match}"):
            PageBlobCodec([pool], [spec])
    with pytest.raises(TypeError, match="rope_range must be a"):
        RowSpec.for_rope(64, "ab")
    with pytest.raises(TypeError, match=r"PageBlobCodec: pools\[0\] must be a tensor"):
        PageBlobCodec(["pool"], [RowSpec.lossless()])
    codec = PageBlobCodec([pool], [RowSpec.full(64, plane_dim=1)])
    cold = poison_(codec.allocate(2))
    saved = cold.clone()
    pairs = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(TypeError, match="PageBlobCodec.encode: validate must be a bool"):
        codec.encode([pool], cold, pairs, validate="yes")
    assert torch.equal(cold, saved)
    with pytest.raises(TypeError, match="PageBlobCodec.decode: validate must be a bool"):
        codec.decode(cold, [pool.clone()], pairs, validate=1)
    with pytest.raises(ValueError, match="PageBlobCodec.refused: device must be a torch.device, .* got 'nodevice'"):
        codec.refused("nodevice")
    with pytest.raises(TypeError, match="PageBlobCodec.allocate: device must be"):
        codec.allocate(2, device=2.5)
    with pytest.raises(ValueError, match="global_scale 1000* is not a positive finite float32"):
        PageBlobCodec([pool], [RowSpec.full(64, plane_dim=1, global_scale=10**400)])
    # the kernels take 3 dims between page and row besides the plane dim: a pool with none has one dim fewer
    deep = torch.zeros(2, 2, 1, 3, 2, 64, dtype=torch.bfloat16)
    PageBlobCodec([deep], [RowSpec.full(64, plane_dim=1)])
    with pytest.raises(ValueError, match="at most 3 dims between page and row are supported besides the plane dim"):
        PageBlobCodec([deep], [RowSpec.full(64)])
    with pytest.raises(TypeError, match="dequantize: dtype must be a torch.dtype, got str"):
        dequantize(*quantize(pool[0, 0]), dtype="bfloat16")


def _runs_and_gaps(n, slots):
    """n distinct slots of [0, slots) in an order with runs of consecutive slots (one copy each) and jumps."""
    perm = torch.randperm(slots)[:n].sort().values
    runs = list(torch.split(perm, 3))
    order = torch.randperm(len(runs)).tolist()
    return torch.cat([runs[i] for i in order])


@requires_cuda
@pytest.mark.parametrize("dtype", HOT)
@pytest.mark.parametrize("geometry", ["hnd", "vllm_view_and_side", "mla_residual"])
def test_staged_transfers_match_the_direct_ones(dtype, geometry):
    """Staged offload and onboard (a device buffer of 4 rows: chunks of 2, so the ring turns many times) write the
    same bytes as the direct calls, into poisoned host rows (a row no pair names stays as it was) and pools."""
    pools, specs = _geometries(dtype, "cuda", "per_page_pow2", num_pages=40)[geometry]
    codec = PageBlobCodec(pools, specs, staging_rows=4)
    slots = _runs_and_gaps(23, 50)
    pairs = torch.stack([slots, torch.randperm(40)[:23]], 1).to(torch.int32).pin_memory()
    direct = poison_(codec.allocate(50, device="cpu", pin_memory=True))
    staged = direct.clone().pin_memory()
    codec.encode(pools, direct, pairs)
    codec.encode(pools, staged, pairs, staged=True)
    torch.cuda.synchronize()
    assert torch.equal(staged, direct)
    back = torch.stack([torch.randperm(40)[:23], slots], 1).to(torch.int32).pin_memory()
    outs_direct = [poison_(torch.empty_like(p)) for p in pools]
    outs_staged = [o.clone() for o in outs_direct]
    codec.decode(direct, outs_direct, back)
    codec.decode(staged, outs_staged, back, staged=True)
    torch.cuda.synchronize()
    for a, b in zip(outs_staged, outs_direct):
        assert torch.equal(bytes_of(a), bytes_of(b))


@requires_cuda
def test_staged_transfers_are_stream_ordered_and_capturable():
    """A staged offload then a staged onboard, enqueued back to back on a side stream with no sync, then the
    same captured in a CUDA graph and replayed on fresh pool data (the pairs are the captured ones)."""
    pools, specs = _geometries(torch.bfloat16, "cuda", "per_page_pow2", num_pages=16)["hnd"]
    codec = PageBlobCodec(pools, specs, staging_rows=6)
    host = codec.allocate(16, device="cpu", pin_memory=True)
    slots = _runs_and_gaps(9, 16)
    pairs = torch.stack([slots, torch.randperm(16)[:9]], 1).to(torch.int32).pin_memory()
    back = torch.stack([torch.randperm(16)[:9], slots], 1).to(torch.int32).pin_memory()
    outs = [torch.zeros_like(pools[0])]

    def cycle():
        codec.encode(pools, host, pairs, staged=True)
        codec.decode(host, outs, back, staged=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cycle()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cycle()
    for _ in range(2):
        pools[0].copy_(_kv(pools[0].shape, torch.bfloat16, "cuda", None))
        outs[0].zero_()
        graph.replay()
        torch.cuda.synchronize()
        expect = torch.zeros_like(host)
        ref.encode_pages([pools[0].cpu()], specs, expect, pairs)
        assert torch.equal(host[slots.long()], expect[slots.long()])
        exp_out = torch.zeros_like(outs[0].cpu())
        ref.decode_pages(host, [exp_out], specs, back)
        assert torch.equal(bytes_of(outs[0]), bytes_of(exp_out))


@pytest.mark.parametrize("device", DEVICES)
def test_staged_refusals_touch_nothing(device):
    """A staged call it cannot serve raises ValueError naming why, before anything is written: pools on the CPU,
    cold pages on the device, pairs on the device or in pageable memory; staging_rows below 2."""
    pools, specs = _geometries(torch.bfloat16, device, "per_page_pow2")["hnd"]
    with pytest.raises(ValueError, match="staging_rows"):
        PageBlobCodec(pools, specs, staging_rows=1)
    codec = PageBlobCodec(pools, specs, staging_rows=4)
    host = poison_(codec.allocate(8, device="cpu", pin_memory=device == "cuda"))
    pairs = _pairs(4, 8, pools[0].shape[0])
    before = host.clone()
    with pytest.raises(TypeError, match="staged"):
        codec.encode(pools, host, pairs, staged=1)
    if device == "cpu":
        with pytest.raises(ValueError, match="pools on the GPU"):
            codec.encode(pools, host, pairs, staged=True)
    else:
        with pytest.raises(ValueError, match="staging serves cold_pages in pinned host memory"):
            codec.encode(pools, codec.allocate(8, device="cuda"), pairs.pin_memory(), staged=True)
        with pytest.raises(ValueError, match="staging serves cold_pages in pinned host memory"):
            codec.encode(pools, host, pairs.cuda(), staged=True)
        with pytest.raises(ValueError, match="pageable"):
            codec.encode(pools, host, pairs, staged=True)
        assert not codec._staging  # refused before the buffer is allocated
        with pytest.raises(ValueError, match="staging shares memory with pools"):  # the op, called directly
            torch.ops.kvops.nvfp4_encode_pages_(pools, host, pairs.pin_memory(), codec.plan, False,
                                                pools[0].view(torch.uint8).view(-1)[:4 * codec.cold_page_bytes]
                                                .view(4, -1))
    assert torch.equal(host, before)


@pytest.mark.parametrize("device", DEVICES)
def test_a_blob_of_another_layout_is_refused(device):
    """Two codecs whose blobs have the same size but another layout (the RoPE dims lossless at the start of the row,
    or quantized at its end): each section carries its layout's tag, so a blob decodes only under the layout that
    wrote it: with validate a ValueError naming the slot, without it the pages left untouched and counted."""
    pools = [torch.randn(4, 2, 2, 16, 64, device=device).bfloat16() for _ in range(2)]
    writer = PageBlobCodec(pools, [RowSpec.for_rope(64, (0, 32), skip_rope_quantization=True, plane_dim=1)] * 2)
    reader = PageBlobCodec(pools, [RowSpec.for_rope(64, (32, 32), skip_rope_quantization=True, plane_dim=1)] * 2)
    assert writer.cold_page_bytes == reader.cold_page_bytes
    assert [lay.tag for lay in writer.layouts] != [lay.tag for lay in reader.layouts]
    cold = writer.allocate(3, device=device)
    writer.encode(pools, cold, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device))
    outs = [poison_(p.clone()) for p in pools]
    before = [bytes_of(o).clone() for o in outs]
    pairs = torch.tensor([[0, 2]], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"page_pairs\[0\] slot 2's section of pools\[0\] carries layout tag"):
        reader.decode(cold, outs, pairs, validate=True)
    reader.decode(cold, outs, pairs)
    assert all(torch.equal(bytes_of(o), b) for o, b in zip(outs, before))
    assert int(reader.refused(pools[0].device)) == 2 * 2  # each pool's two planes
    writer.decode(cold, outs, pairs, validate=True)  # the writer's own layout decodes
    assert torch.equal(outs[0][0, :, :, :, :32], pools[0][3, :, :, :, :32])  # the lossless RoPE dims
    kept = [p.clone() for p in outs]
    ref.decode_pages(cold, kept, [RowSpec.for_rope(64, (32, 32), skip_rope_quantization=True, plane_dim=1)] * 2,
                     pairs)
    assert all(torch.equal(bytes_of(a), bytes_of(b)) for a, b in zip(kept, outs))  # the reference refuses it too
