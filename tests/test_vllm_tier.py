"""kvops.integrations.vllm's block layouts and host tier, without vLLM: pages packed here from the index formulas
of vLLM's kernels (csrc/cpu/cpu_attn*.hpp reshape_and_cache; the GPU backends' K|V split), checked against the
codec run on the same rows directly. tests/with_vllm/ checks the layouts against the caches vLLM's own kernels write."""

import pytest
import torch

from conftest import DEVICES, poison_
from kvops.codecs import LayerGroupPools, LosslessColdPageCodec, NVFP4ColdPageCodec
from kvops.config import NVFP4ColdPageConfig
from kvops.integrations.vllm.layouts import BlockLayout
from kvops.integrations.vllm.tier import STAGING_BLOCKS, BlobTier, cold_block_bytes

H, N, D = 2, 32, 64


def pack(backend: str, isa: str | None, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Pages [B, page_bytes] int8 holding K and V [B, H, N, D], element by element as vLLM's kernels place them."""
    B = k.shape[0]
    t = torch.arange(N).view(N, 1).expand(N, D)
    d = torch.arange(D).view(1, D).expand(N, D)
    if backend == "gpu":  # [B, H, N, 2D]: each token's K then V (flash_attn.py: transpose(1, 2).split(D, -1))
        page = torch.cat([k, v], dim=-1)
        return page.reshape(B, -1).view(torch.int8)
    if isa == "amx":  # VNNI pairs: K quadword (t // 16) * (16 * D / 2) + (d // 2) * 16 + t % 16, element d % 2
        k_at = ((t // 16) * (16 * D // 2) + (d // 2) * 16 + t % 16) * 2 + d % 2
        v_at = (d // 16) * N * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
    else:  # vec: K transposed [D][N], V [N][D]
        k_at, v_at = d * N + t, t * D + d
    region = torch.empty(B, H, 2, N * D, dtype=k.dtype)
    region[:, :, 0, k_at.reshape(-1)] = k.reshape(B, H, N * D)
    region[:, :, 1, v_at.reshape(-1)] = v.reshape(B, H, N * D)
    return region.reshape(B, -1).view(torch.int8)


LAYOUTS = [("gpu", None), ("cpu", "vec"), ("cpu", "amx")]


@pytest.mark.parametrize("backend,isa", LAYOUTS)
def test_layout_reads_and_writes_the_kernels_placement(backend, isa):
    B, n = 7, 5
    k, v = torch.randn(B, H, N, D, dtype=torch.bfloat16), torch.randn(B, H, N, D, dtype=torch.bfloat16)
    pages = pack(backend, isa, k, v)
    lay = BlockLayout(backend, H, N, D, torch.bfloat16, isa)
    assert lay.page_bytes == pages.shape[1]
    blocks = torch.randperm(B)[:n]
    if lay.zero_copy:
        pool = lay.pool(pages)
        assert pool.data_ptr() == pages.data_ptr() and pool.stride(-1) == 1
        assert torch.equal(pool[:, :, :, 0], k) and torch.equal(pool[:, :, :, 1], v)
        return
    planes = lay.planes(pages)
    out = poison_(torch.empty(lay.pool_shape(n), dtype=torch.bfloat16))
    lay.gather(planes, blocks, out)
    assert torch.equal(out[:, :, 0], k[blocks]) and torch.equal(out[:, :, 1], v[blocks])
    fresh = torch.randn(n, H, 2, N, D, dtype=torch.bfloat16)
    k2, v2 = k.clone(), v.clone()
    k2[blocks], v2[blocks] = fresh[:, :, 0], fresh[:, :, 1]
    expect = pack(backend, isa, k2, v2)
    lay.scatter(planes, blocks, fresh)
    assert torch.equal(pages, expect)  # the other blocks untouched, the scattered ones placed as the kernel would


def _tier_case(device, backend, isa, codec, B=40):
    k = torch.randn(B, H, N, D, dtype=torch.bfloat16) * 3
    v = torch.randn(B, H, N, D, dtype=torch.bfloat16)
    layers = 3
    ks = [k * (i + 1) for i in range(layers)]
    pages = [pack(backend, isa, ki, v).to(device) for ki in ks]
    lay = BlockLayout(backend, H, N, D, torch.bfloat16, isa)
    tier = BlobTier(pages, [lay] * layers, codec, num_slots=2 * B)
    return tier, pages, ks, v, lay


def _expected(codec_factory, ks, v, blocks, plane_dim=2):
    """The codec on canonical pools [B, H, 2, N, D] directly: encode the blocks, decode them back."""
    pools = [torch.stack([ki[blocks], v[blocks]], dim=2) for ki in ks]
    codec = codec_factory()
    assert codec.configure([LayerGroupPools(0, tuple(pools), plane_dim)])
    device = pools[0].device
    slots = torch.zeros(len(blocks), codec.cold_page_bytes(0), dtype=torch.uint8, device=device)
    pairs = torch.stack([torch.arange(len(blocks)), torch.arange(len(blocks))], 1).int().to(device)
    codec.encode(0, slots, pairs)
    for p in pools:
        poison_(p)
    codec.decode(0, slots, pairs)
    return pools


CODECS = {"lossless": LosslessColdPageCodec,
          "nvfp4": lambda: NVFP4ColdPageCodec(NVFP4ColdPageConfig(row_size=D)),
          "nvfp4-2fp4": lambda: NVFP4ColdPageCodec(NVFP4ColdPageConfig(row_size=D, rope_range=(0, D),
                                                                         residual_dim=D))}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend,isa", LAYOUTS)
@pytest.mark.parametrize("codec", list(CODECS))
def test_tier_store_then_load_equals_the_codec_on_the_rows(device, backend, isa, codec):
    if backend == "cpu" and device != "cpu":
        pytest.skip("vLLM's CPU layouts live on the CPU")
    if backend == "gpu" and device == "cpu":
        pytest.skip("the GPU layout is tested where it lives")
    tier, pages, ks, v, lay = _tier_case(device, backend, isa, CODECS[codec]())
    B = pages[0].shape[0]
    n = STAGING_BLOCKS + 5  # more than one staging round
    blocks = torch.randperm(B)[:n]
    slots = torch.randperm(tier.slots.shape[0])[:n]
    t = tier.store(blocks.numpy(), slots.numpy())
    t.wait()
    assert t.done() and t.seconds is not None and t.cold_bytes == n * tier.cold_page_bytes
    for p in pages:
        poison_(p)
    keep = [p.clone() for p in pages]
    dest = torch.randperm(B)[:n]
    tier.load(slots.numpy(), dest.numpy()).wait()
    expect = _expected(CODECS[codec], [ki.to(device) for ki in ks], v.to(device), blocks)
    for page, before, pool, ki in zip(pages, keep, expect, ks):
        if lay.zero_copy:
            got = lay.pool(page)[dest].permute(0, 1, 3, 2, 4)
        else:
            got = torch.empty(lay.pool_shape(n), dtype=torch.bfloat16)
            lay.gather(lay.planes(page), dest, got)
        assert torch.equal(got, pool)
        if codec == "lossless":
            assert torch.equal(got.cpu(), torch.stack([ki[blocks], v[blocks]], dim=2))
        rest = torch.ones(B, dtype=torch.bool)
        rest[dest] = False
        assert torch.equal(page[rest.to(device)], before[rest.to(device)])  # no other block written
    assert tier.stats == {"stored_blocks": n, "loaded_blocks": n, "stored_bytes": n * tier.cold_page_bytes,
                          "loaded_bytes": n * tier.cold_page_bytes}


def test_cold_block_bytes_is_the_tiers():
    for codec in CODECS.values():
        tier, *_, lay = _tier_case("cpu", "cpu", "vec", codec(), B=4)
        assert cold_block_bytes([lay] * 3, codec()) == tier.cold_page_bytes
        gpu = BlockLayout("gpu", H, N, D, torch.bfloat16)
        assert cold_block_bytes([gpu] * 3, codec()) == tier.cold_page_bytes  # the scheduler sizes with either
    ratio = 3 * BlockLayout("gpu", H, N, D, torch.bfloat16).page_bytes / cold_block_bytes(
        [BlockLayout("gpu", H, N, D, torch.bfloat16)] * 3, CODECS["nvfp4"]())
    assert 3.5 < ratio < 3.56


def test_tier_refuses_bad_calls_before_writing():
    tier, pages, *_ = _tier_case("cpu", "cpu", "amx", CODECS["nvfp4"](), B=8)
    slots_before = tier.slots.clone()
    pages_before = [p.clone() for p in pages]
    for blocks, slots, match in (([0, 1], [0], "2 blocks for 1 slots"), ([8], [0], r"blocks must lie in \[0, 8\)"),
                                 ([0], [16], r"slots must lie in \[0, 16\)"), ([-1], [0], "blocks must lie"),
                                 ([0, 1], [3, 3], "each slot may be written once")):
        with pytest.raises(ValueError, match=match):
            tier.store(blocks, slots)
    with pytest.raises(ValueError, match="each block may be written once"):
        tier.load([0, 1], [2, 2])
    tier.store([3, 4], [0, 1])
    slots_before = tier.slots.clone()
    with pytest.raises(ValueError, match=r"slots \[5\] hold no cold page"):  # never stored: nothing written
        tier.load([0, 1, 5], [0, 1, 2])
    with pytest.raises(TypeError, match="blocks must be integers"):
        tier.store([0.5], [2])
    assert torch.equal(tier.slots, slots_before)
    assert all(torch.equal(p, q) for p, q in zip(pages, pages_before))
    assert tier.stats["stored_blocks"] == 2 and tier.stats["loaded_blocks"] == 0


@pytest.mark.parametrize("kw,match", [
    (dict(backend="tpu"), "backend must be"), (dict(isa="neon"), "ISA 'neon'"), (dict(heads=0), "heads"),
    (dict(isa="amx", tokens=40), "multiples of 16")])
def test_layout_refuses_what_it_does_not_read(kw, match):
    args = dict(backend="cpu", heads=H, tokens=N, head_size=D, dtype=torch.bfloat16, isa="vec") | kw
    with pytest.raises(ValueError, match=match):
        BlockLayout(**args)


def test_layout_refuses_pages_of_another_shape():
    lay = BlockLayout("cpu", H, N, D, torch.bfloat16, "vec")
    with pytest.raises(ValueError, match="needs 16384 unit-stride bytes"):
        lay.planes(torch.zeros(4, 1000, dtype=torch.int8))
    with pytest.raises(ValueError, match="int8"):
        lay.planes(torch.zeros(4, lay.page_bytes // 2, dtype=torch.bfloat16))


@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA GPU")
@pytest.mark.parametrize("staged", [False, True])
def test_gpu_transfers_follow_the_current_streams_work(staged):
    """A store enqueued right after the current stream writes the blocks (behind a long kernel) encodes what was
    written; a load's blocks are what a later read on the current stream sees once the transfer is done."""
    B = 8
    k, v = torch.randn(B, H, N, D, dtype=torch.bfloat16), torch.randn(B, H, N, D, dtype=torch.bfloat16)
    pages = pack("gpu", None, k, v).cuda()
    lay = BlockLayout("gpu", H, N, D, torch.bfloat16)
    tier = BlobTier([pages], [lay], LosslessColdPageCodec(), num_slots=B, staged=staged)
    fresh = torch.randn(B, H, N, 2 * D, dtype=torch.bfloat16, device="cuda")
    torch.cuda._sleep(50_000_000)  # the write below waits behind this on the current stream
    pages.copy_(fresh.view(B, -1).view(torch.int8))
    t = tier.store(range(B), range(B))
    t.wait()
    poison_(pages)
    tier.load(range(B), range(B)).wait()
    assert torch.equal(pages, fresh.view(B, -1).view(torch.int8))
