"""kvops' reading of vLLM's cache pages, checked against the caches vLLM's own kernels write: the CPU backend's
reshape_and_cache for each ISA this CPU runs, and the GPU backends' K|V split on a cache of vLLM's shape."""

import pytest
import torch

import vllm_env  # noqa: F401  (skips without vLLM)
from kvops.integrations.vllm.layouts import BlockLayout


def cpu_isas():
    isas = ["vec"]
    if torch.cpu._is_amx_tile_supported():
        isas.append("amx")
    return isas


@pytest.mark.parametrize("isa,head_size", [(isa, 64) for isa in cpu_isas()] + [("vec16", 80)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_pages_as_vllms_kernel_writes_them(isa, head_size, dtype):
    from vllm import _custom_ops as ops

    if isa == "amx" and dtype != torch.bfloat16:
        pytest.skip("vLLM's amx path is bf16 only")
    B, H, N, T = 6, 2, 32, 150
    # the CPU backend's per-layer cache and its K/V split (vllm/v1/attention/backends/cpu_attn.py, forward)
    cache = torch.zeros(B, H, N, 2 * head_size, dtype=dtype)
    key_cache, value_cache = cache.view(B, H, 2 * N, head_size).chunk(2, dim=2)
    k, v = torch.randn(T, H, head_size, dtype=dtype), torch.randn(T, H, head_size, dtype=dtype)
    slots = torch.randperm(B * N)[:T]
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    pages = cache.view(B, -1).view(torch.int8)

    lay = BlockLayout("cpu", H, N, head_size, dtype, isa)
    planes = lay.planes(pages)
    out = torch.empty(lay.pool_shape(B), dtype=dtype)
    lay.gather(planes, torch.arange(B), out)
    block, token = slots // N, slots % N
    assert torch.equal(out[block, :, 0, token], k) and torch.equal(out[block, :, 1, token], v)

    written = cache.clone()
    cache.zero_()
    lay.scatter(planes, torch.arange(B), out)  # back in vLLM's packing: the kernel's bytes exactly
    assert torch.equal(cache.view(torch.int16), written.view(torch.int16))


def test_gpu_pages_from_vllms_own_cache_views():
    """A GPU cache as vLLM builds it (create_kv_cache_views under the LBHNC layout the OffloadingConnector asks
    for), split as FlashAttention/FlashInfer/Triton split it (flash_attn.py: kv_cache.transpose(1, 2).split(
    head_size, dim=-1)), and handed to the offloading worker as int8 block pages (offloading/worker.py,
    register_kv_caches): kvops' pool over those pages is K and V, without a copy. Built on the CPU: no GPU vLLM
    is installable here."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    B, H, N, D, L = 6, 4, 16, 64, 3
    spec = FullAttentionSpec(block_size=N, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    tensor = KVCacheTensor(size=L * B * page, layers=[f"l{i}" for i in range(L)], layer_stride=B * page,
                           block_stride=page)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, B, KVCacheLayout.LBHNC, tensor)
    lay = BlockLayout("gpu", H, N, D, torch.bfloat16)
    assert lay.page_bytes == page
    for view in views:
        view.copy_(torch.randn(view.shape, dtype=torch.bfloat16))
        key_cache, value_cache = view.transpose(1, 2).split(D, dim=-1)  # [B, N, H, D] each
        elem = view.element_size()
        pages = torch.tensor([], dtype=torch.int8).set_(view.untyped_storage(), view.storage_offset() * elem,
                                                        (B, page), (view.stride(0) * elem, 1))
        pool = lay.pool(pages)
        assert torch.equal(pool[:, :, :, 0], key_cache.transpose(1, 2))
        assert torch.equal(pool[:, :, :, 1], value_cache.transpose(1, 2))
        assert pool.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
