"""A TriAttention round in vLLM's own GPU cache (kvops.integrations.vllm.block_cache): the eviction connector's
round on vLLM's block pages against the same round on kvops' native pools.

vLLM's GPU backends (FlashAttention, FlashInfer, Triton, under the LBHNC layout) hand a layer's blocks as pages
``[blocks, heads, tokens, 2 (K|V), head_size]``; ``BlockCache`` gives the round a strided view of them
``[page, plane, head, token, dim]`` (plane stride head_size, token stride 2 * head_size), with no copy, where
kvops' own pools (``PagedKVCache``, HND) hold each plane's tokens contiguous. Rows (Qwen3-8B heads, 36 layers,
vLLM's GPU block of 16 tokens, prompt 1024 + budget 2048 + beta 128 per request, per_head under its default keep
policy, fill order, R due requests, from the manager's CUDA graph, each replay on the same pools, restored outside
the timed region):
  round_vllm_pages  the round on vLLM's pages; baseline: the same round on native HND pools holding the same
              tokens (bench_triattention's round_steady workload). Floor as round_steady: K read once plus what fill
              order moves, read and written, at the device copy bandwidth.
"""

from __future__ import annotations

import torch

from kvops.integrations.vllm.layouts import BlockLayout

from .bench_triattention import fill_moved_bytes, restorer, steady_round, steady_workload
from .common import Row, device_copy_gbps, time_us

FAMILY = "vllm_round"
POLICY = dict(recent_window=128, recent_layers=(0,))  # per_head's defaults at budget 2048, beta 128


def run(quick: bool = False) -> tuple[list[Row], list[str]]:
    copy_gbps = device_copy_gbps()
    rows, notes = [], []
    for R in ((8,) if quick else (8, 32)):
        w = steady_workload(R, page_size=16)
        lay = BlockLayout("gpu", w.Hkv, 16, w.D, torch.bfloat16)
        native = w.pools
        pages = []
        for pool in native:  # the same tokens in vLLM's page layout
            page = torch.empty(pool.shape[0], lay.page_bytes, dtype=torch.int8, device="cuda")
            lay.pool(page).copy_(pool.permute(0, 2, 3, 1, 4))
            pages.append(page)
        vllm_views = [lay.pool(p).permute(0, 3, 1, 2, 4) for p in pages]
        times = {}
        for name, pools in (("native", native), ("vllm", vllm_views)):
            w.pools = pools
            restore = restorer(pools)
            _, rnd = steady_round(w, "per_head", "fill", cuda_graphs=True, **POLICY)
            floor = w.L * R * (w.budget + w.beta) * w.Hkv * w.D * 2 + 2 * fill_moved_bytes(w, rnd)
            times[name] = time_us(rnd.graphs[R].replay, iters=10, before=restore)
            restore = None
        shape = f"R={R} {w.prompt}+{w.budget + w.beta} L={w.L} Hkv={w.Hkv} pages of 16"
        rows.append(Row.make(FAMILY, "round_vllm_pages", shape, "bfloat16", times["vllm"], floor, copy_gbps,
                             f"native HND pools ({times['native']:.0f} us)", times["native"]))
        notes.append(f"round R={R} on vLLM's pages: {times['vllm']:.0f} us, {times['vllm'] / times['native']:.2f}x "
                     f"the native pools' {times['native']:.0f} us; floor {floor / copy_gbps / 1e3:.0f} us")
        w = native = pages = vllm_views = None
        torch.cuda.empty_cache()
    return rows, notes
