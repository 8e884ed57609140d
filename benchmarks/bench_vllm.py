"""kvops' vLLM offloading tier (kvops.integrations.vllm.tier.BlobTier) on vLLM's GPU cache layout.

A vLLM worker hands the tier each layer's blocks as pages [blocks, heads, 16 tokens, 2 * head_size] (LBHNC, the
FlashAttention K|V split); a job stores or loads the blocks of one request's chunk. Rows (Llama-3-8B shapes: 32
layers, 8 KV heads of 128, bf16, vLLM's GPU block of 16 tokens, 2 MiB a block):
  store / load            submit to done, host wall time (the tier's Python, the pinned pairs, the kernel on its
                          side stream, the event): what a vLLM step waits for. Bytes: the cold pages over PCIe,
                          against the pinned copy bandwidth of this run.
  store_staged / load_staged  the same through the staged path (the copy engine moves the cold pages).
  baseline: vLLM's raw tier moving the same blocks, as its batched memcpy does: every layer's pages gathered on the
  device into one buffer and copied to (from) pinned memory in one copy; speedup = its time over the row's.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvops.codecs import NVFP4ColdPageCodec
from kvops.config import NVFP4ColdPageConfig
from kvops.integrations.vllm.layouts import BlockLayout
from kvops.integrations.vllm.tier import BlobTier

from .common import Row

FAMILY = "vllm_tier"
LAYERS, HEADS, TOKENS, HEAD = 32, 8, 16, 128


def _wall_us(fn, iters=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def _pinned_gbps(nbytes=1 << 30) -> tuple[float, float]:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(dst, src):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return (nbytes / _wall_us(lambda: copy(host, dev), 5) / 1e3, nbytes / _wall_us(lambda: copy(dev, host), 5) / 1e3)


def run(quick: bool = False) -> tuple[list[Row], list[str]]:
    num_blocks = 1024 if not quick else 256
    lay = BlockLayout("gpu", HEADS, TOKENS, HEAD, torch.bfloat16)
    pages = [(torch.randn(num_blocks, lay.page_bytes // 2, device="cuda") * 0.5).to(torch.bfloat16).view(torch.int8)
             for _ in range(LAYERS)]
    d2h, h2d = _pinned_gbps()
    rows: list[Row] = []
    codec = NVFP4ColdPageCodec(NVFP4ColdPageConfig(row_size=HEAD))
    tiers = {False: BlobTier(pages, [lay] * LAYERS, codec, num_slots=num_blocks),
             True: BlobTier(pages, [lay] * LAYERS, NVFP4ColdPageCodec(NVFP4ColdPageConfig(row_size=HEAD)),
                            num_slots=num_blocks, staged=True)}
    raw_host = torch.empty(num_blocks * LAYERS * lay.page_bytes // 4, dtype=torch.int32, pin_memory=True).view(
        torch.int8)
    notes = []
    for n in ((32, 256) if not quick else (32,)):
        blocks = torch.randperm(num_blocks)[:n]
        slots = torch.randperm(num_blocks)[:n]
        blocks_dev = blocks.cuda()
        gathered = torch.empty(LAYERS, n, lay.page_bytes, dtype=torch.int8, device="cuda")
        host = raw_host[:gathered.numel()].view(gathered.shape)

        def raw_store():
            for i, p in enumerate(pages):
                torch.index_select(p, 0, blocks_dev, out=gathered[i])
            host.copy_(gathered, non_blocking=True)
            torch.cuda.synchronize()

        def raw_load():
            gathered.copy_(host, non_blocking=True)
            for i, p in enumerate(pages):
                p.index_copy_(0, blocks_dev, gathered[i])
            torch.cuda.synchronize()

        base = {"store": _wall_us(raw_store), "load": _wall_us(raw_load)}
        shape = f"{n} blocks x {LAYERS}x[{HEADS},{TOKENS},2,{HEAD}]"
        for staged, tier in tiers.items():
            tier.store(blocks.numpy(), slots.numpy()).wait()
            for what in ("store", "load"):
                def job():
                    t = tier.store(blocks.numpy(), slots.numpy()) if what == "store" else \
                        tier.load(slots.numpy(), blocks.numpy())
                    t.wait()
                us = _wall_us(job)
                cold = n * tier.cold_page_bytes
                rows.append(Row.make(FAMILY, what + ("_staged" if staged else ""), shape, torch.bfloat16, us, cold,
                                     d2h if what == "store" else h2d, f"vLLM raw tier ({base[what]:.0f} us)",
                                     base[what]))
        notes.append(f"{n} blocks: {n * tier.hot_page_bytes / 2**20:.0f} MiB hot, "
                     f"{n * tier.cold_page_bytes / 2**20:.1f} MiB cold ({tier.hot_page_bytes / tier.cold_page_bytes:.2f}x)")
    notes.append(f"pinned copy bandwidth this run: {d2h:.1f} GB/s device to host, {h2d:.1f} GB/s host to device")
    return rows, notes
