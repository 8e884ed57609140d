"""NVFP4 cold-page codec and primitives on the GPU, side by side with their limits and baselines.

Rows (bytes counted):
  encode_d2d / decode_d2d   hot bytes + blob bytes, vs the device copy bandwidth (read + write);
                            baseline: torch gather of the same raw pages (index_select), same bytes moved raw.
  offload / onboard         blob bytes over PCIe, vs the pinned copy_ bandwidth of this run; baseline: copy_ of the
                            same raw hot pages to/from pinned memory; speedup = hot bytes/s over the baseline's.
                            The direct path: the kernels store into (load from) mapped host memory.
  offload_staged / onboard_staged  the same through the staged path (staged=True: the kernels work on a device
                            buffer, the copy engine moves it); its SM busy time is the encode_d2d / decode_d2d time
                            of the same pages (a note gives the share of the transfer), the direct path's is the
                            whole transfer.
  gemm_during_offload       a bf16 GEMM stream (4096^3, as many as the offload lasts) on its own stream while 256
                            pages offload on another, direct and staged; baseline: the same GEMMs alone; speedup
                            below 1 is the GEMMs' slowdown.
  quantize / dequantize     input + output bytes, vs the device copy bandwidth; baseline: x.clone().
"""

from __future__ import annotations

import torch

from kvops.nvfp4 import PageBlobCodec, RowSpec, dequantize, quantize

from .common import Row, device_copy_gbps, time_us

FAMILY = "nvfp4"


def _kv_pool(shape, dtype, plane_dim=None):
    """Realistic magnitudes: heavy-tailed K (lognormal, outlier channels), small V (lognormal around 0.05)."""
    x = torch.randn(shape, device="cuda")
    x = x.sign() * torch.exp(torch.randn(shape, device="cuda") * 0.7)
    if plane_dim is not None:
        v = x.select(plane_dim, 1)
        v.mul_(0.02)  # V blocks mostly below amax 0.094, where identity scaling goes subnormal
        k = x.select(plane_dim, 0)
        k[..., :8].mul_(8.0)  # outlier channels
    else:
        x.mul_(0.5)
    if dtype == torch.float8_e4m3fn:
        x.clamp_(-448, 448)
    return x.to(dtype)


def _geometry(name, dtype, pages):
    if name == "qwen3-8b":  # 36 layers, 8 KV heads, head_dim 128, 32 tokens/page, HND
        pools = [_kv_pool((pages, 2, 8, 32, 128), dtype, plane_dim=1) for _ in range(36)]
        specs = [RowSpec.full(128, plane_dim=1)] * 36
        return pools, specs, "36x[P,2,8,32,128]"
    if name == "mla":  # DeepSeek-V3-like: 61 layers, latent 512 + RoPE 64 (lossless), 64 tokens/page
        pools = [_kv_pool((pages, 64, 576), dtype) for _ in range(61)]
        specs = [RowSpec.for_rope(576, (512, 64), skip_rope_quantization=True)] * 61
        return pools, specs, "61x[P,64,576] rope64 lossless"
    raise ValueError(name)


def _gemm_during_offload(rows, shape, codec, pools, host, pairs, host_pairs) -> list[str]:
    """A bf16 GEMM stream's time while an offload runs on another stream, direct and staged, against the same
    GEMMs alone (no L2 flush: both streams run for milliseconds)."""
    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    b, c = torch.randn_like(a), torch.empty_like(a)
    gemm_stream, offload_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def gemms_us(count, offload=None):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if offload is not None:
            with torch.cuda.stream(offload_stream):
                offload()
        with torch.cuda.stream(gemm_stream):
            start.record()
            for _ in range(count):
                torch.mm(a, b, out=c)
            end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3

    gemms_us(3)
    one = sorted(gemms_us(1) for _ in range(5))[2]
    notes = []
    for name, offload in (("direct", lambda: codec.encode(pools, host, pairs)),
                          ("staged", lambda: codec.encode(pools, host, host_pairs, staged=True))):
        with torch.cuda.stream(offload_stream):
            us = time_us(offload, 5)
        count = max(1, round(us / one))
        alone = sorted(gemms_us(count) for _ in range(5))[2]
        during = sorted(gemms_us(count, offload) for _ in range(5))[2]
        rows.append(Row.make(FAMILY, "gemm_during_offload", f"{shape}, {name}, {count} GEMMs", "bfloat16", during,
                             count * 3 * a.numel() * a.element_size(), float("nan"), "the GEMMs alone", alone))
        notes.append(f"gemm_during_offload ({name}): {count} bf16 4096^3 GEMMs take {during:.0f} us during a "
                     f"{us:.0f} us offload against {alone:.0f} us alone ({during / alone - 1:+.1%}).")
    return notes


def bench_codec(rows, copy_gbps, quick):
    notes = []
    pages = 64 if quick else 256
    iters = 5 if quick else 20
    for geo in ("qwen3-8b", "mla"):
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            pools, specs, shape = _geometry(geo, dtype, pages)
            codec = PageBlobCodec(pools, specs)
            n = pages
            hot = n * codec.hot_page_bytes
            blob = n * codec.cold_page_bytes
            perm = torch.randperm(pages, device="cuda")[:n]
            pairs = torch.stack([torch.arange(n, device="cuda"), perm], 1).int()
            back = torch.stack([perm, torch.arange(n, device="cuda")], 1).int()
            shape = f"{shape} N={n}"
            # Device to device.
            cold = codec.allocate(n, device="cuda")
            idx = perm.long()
            gather_us = time_us(lambda: [p.index_select(0, idx) for p in pools], iters)
            us = time_us(lambda: codec.encode(pools, cold, pairs), iters)
            rows.append(Row.make(FAMILY, "encode_d2d", shape, dtype, us, hot + blob, copy_gbps, "torch gather", gather_us))
            us = time_us(lambda: codec.decode(cold, pools, back), iters)
            rows.append(Row.make(FAMILY, "decode_d2d", shape, dtype, us, hot + blob, copy_gbps, "torch gather", gather_us))
            # Offload to / onboard from pinned host memory.
            host = codec.allocate(n, device="cpu", pin_memory=True)
            raw = [torch.empty(p[:n].shape, dtype=dtype, pin_memory=True) for p in pools]
            d2h_us = time_us(lambda: [r.copy_(p[:n], non_blocking=True) for r, p in zip(raw, pools)], iters)
            h2d_us = time_us(lambda: [p[:n].copy_(r, non_blocking=True) for r, p in zip(raw, pools)], iters)
            d2h_gbps, h2d_gbps = hot / d2h_us / 1e3, hot / h2d_us / 1e3
            us = time_us(lambda: codec.encode(pools, host, pairs), iters)
            rows.append(Row.make(FAMILY, "offload", shape, dtype, us, blob, d2h_gbps, "copy_ raw to pinned", d2h_us,
                                 speedup=d2h_us / us))
            us = time_us(lambda: codec.decode(host, pools, back), iters)
            rows.append(Row.make(FAMILY, "onboard", shape, dtype, us, blob, h2d_gbps, "copy_ raw from pinned", h2d_us,
                                 speedup=h2d_us / us))
            host_pairs, host_back = pairs.cpu().pin_memory(), back.cpu().pin_memory()
            for routine, fn, base_us, gbps in (
                    ("offload_staged", lambda: codec.encode(pools, host, host_pairs, staged=True), d2h_us, d2h_gbps),
                    ("onboard_staged", lambda: codec.decode(host, pools, host_back, staged=True), h2d_us, h2d_gbps)):
                us = time_us(fn, iters)
                rows.append(Row.make(FAMILY, routine, shape, dtype, us, blob, gbps, "copy_ raw to/from pinned",
                                     base_us, speedup=base_us / us))
            if geo == "qwen3-8b" and dtype == torch.bfloat16 and not quick:
                notes += _gemm_during_offload(rows, shape, codec, pools, host, pairs, host_pairs)
            pools = cold = host = raw = None  # freed before the next case
            torch.cuda.empty_cache()
    return notes


def bench_primitives(rows, copy_gbps, quick):
    n = (64 if quick else 256) << 20
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        x = _kv_pool((n // 128, 128), dtype)
        g = torch.tensor(8.0, device="cuda")
        nbytes = x.numel() * x.element_size()
        clone_us = time_us(lambda: x.clone())
        p, s = quantize(x, g)
        out = nbytes + p.numel() + s.numel()
        us = time_us(lambda: quantize(x, g))
        rows.append(Row.make(FAMILY, "quantize", f"[{n // 128},128]", dtype, us, out, copy_gbps, "x.clone()", clone_us))
        us = time_us(lambda: dequantize(p, s, g, dtype))
        rows.append(Row.make(FAMILY, "dequantize", f"[{n // 128},128]", dtype, us, out, copy_gbps, "x.clone()", clone_us))
        x = p = s = None


def codec_errors(quick):
    """Relative RMS error of a round trip, per scale policy, K and V planes of Qwen3-8B-like pages."""
    out = []
    pages = 16 if quick else 64
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        pool = _kv_pool((pages, 2, 8, 32, 128), dtype, plane_dim=1)
        for policy in ("identity", "per_page", "per_page_pow2"):
            codec = PageBlobCodec([pool], [RowSpec.full(128, plane_dim=1, global_scale=policy)])
            cold = codec.allocate(pages, device="cuda")
            pairs = torch.stack([torch.arange(pages)] * 2, 1).int().cuda()
            back = torch.empty_like(pool)
            codec.encode([pool], cold, pairs)
            codec.decode(cold, [back], pairs)
            for plane, name in ((0, "K"), (1, "V")):
                a, b = pool[:, plane].double(), back[:, plane].double()
                err = ((a - b).pow(2).mean().sqrt() / a.pow(2).mean().sqrt()).item()
                out.append((str(dtype).replace("torch.", ""), policy, name, err))
    return out


def run(quick: bool = False) -> tuple[list[Row], list[str]]:
    copy_gbps = device_copy_gbps()
    rows: list[Row] = []
    notes = bench_codec(rows, copy_gbps, quick)
    bench_primitives(rows, copy_gbps, quick)
    by = {(r.routine, r.shape, r.dtype): r.median_us for r in rows}
    for r in rows:  # the staged path's SM busy time: its kernels' device-to-device time
        if r.routine in ("offload_staged", "onboard_staged"):
            kernels = by[("encode_d2d" if r.routine == "offload_staged" else "decode_d2d", r.shape, r.dtype)]
            notes.append(f"{r.routine} {r.shape} {r.dtype}: SM busy {kernels:.0f} us of {r.median_us:.0f} us "
                         f"({kernels / r.median_us:.0%}); the direct path's SMs are busy for the whole transfer.")
    notes += ["Round-trip relative RMS error:", "", "| dtype | global scale | plane | relative RMS error |",
              "|---|---|---|---|"]
    notes += [f"| {dt} | {pol} | {plane} | {err:.4f} |" for dt, pol, plane, err in codec_errors(quick)]
    return rows, notes
