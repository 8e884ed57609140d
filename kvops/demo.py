"""The main job: an NVFP4 cold-page round trip on a synthetic paged KV cache.

Builds Qwen3-8B-like HND pools (a few layers, 8 KV heads, head_dim 128, 32 tokens/page) with realistic
magnitudes, offloads pages through the codec into cold slots (pinned host memory on a GPU machine), brings
them back into other pages, and prints the bytes saved and the round-trip error. GPU if present, else CPU.
"""

from __future__ import annotations

import time

import torch

from .nvfp4 import ColdPageCodec, RowSpec


def synthetic_pools(layers: int, pages: int, dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    pools = []
    for _ in range(layers):
        x = torch.randn(pages, 2, 8, 32, 128, device=device)
        x = x.sign() * torch.exp(torch.randn_like(x) * 0.7)  # heavy-tailed magnitudes
        x[:, 1] *= 0.02                                        # small V
        x[:, 0, ..., :8] *= 8.0                                # K outlier channels
        pools.append(x.to(dtype))
    return pools


def run(layers: int = 4, pages: int = 64, dtype: torch.dtype = torch.bfloat16, device: str | None = None) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    pools = synthetic_pools(layers, pages, dtype, device)
    codec = ColdPageCodec(pools, [RowSpec.full(128, plane_dim=1)] * layers)
    n = pages // 2
    cold = codec.allocate(n)  # pinned host memory when a GPU is present
    order = torch.randperm(pages)
    src, dst = order[:n], order[n:2 * n]  # offload half the pages, bring them back into the other half
    slots = torch.arange(n)
    enc_pairs = torch.stack([slots, src], 1).int().to(device)
    dec_pairs = torch.stack([dst, slots], 1).int().to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    codec.encode(pools, cold, enc_pairs)   # offload: pages -> cold slots
    codec.decode(cold, pools, dec_pairs)   # onboard: cold slots -> other pages, back to the hot dtype
    sync()
    dt = time.perf_counter() - t0
    errs = {}
    for plane, name in ((0, "K"), (1, "V")):
        a = torch.cat([p[src.to(device), plane] for p in pools]).double()
        b = torch.cat([p[dst.to(device), plane] for p in pools]).double()
        errs[name] = ((a - b).pow(2).mean().sqrt() / a.pow(2).mean().sqrt()).item()
    return {"device": device, "dtype": str(dtype).replace("torch.", ""), "layers": layers, "pages": n,
            "hot_page_bytes": codec.hot_page_bytes, "cold_page_bytes": codec.cold_page_bytes,
            "seconds": dt, "rel_rms": errs, "cold_on": str(cold.device) + (" (pinned)" if cold.is_pinned() else "")}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="kvops demo", description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float8_e4m3fn"], default="bfloat16")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    a = ap.parse_args(argv)
    r = run(a.layers, a.pages, getattr(torch, a.dtype), a.device)
    hot, cold = r["hot_page_bytes"], r["cold_page_bytes"]
    print(f"kvops NVFP4 cold-page round trip on {r['device']}: {r['layers']} layers x {r['pages']} pages, {r['dtype']}, "
          f"cold pages on {r['cold_on']}")
    print(f"  page: {hot} hot bytes -> {cold} cold bytes ({hot / cold:.2f}x smaller, "
          f"{100 * (1 - cold / hot):.1f}% saved; {r['pages'] * (hot - cold) / 2**20:.1f} MiB saved in all)")
    print(f"  round-trip relative RMS error: K {r['rel_rms']['K']:.4f}, V {r['rel_rms']['V']:.4f}")
    print(f"  encode + decode of {r['pages']} pages: {1e3 * r['seconds']:.2f} ms")
    return 0
