"""The main job: a long-decoding workload on the reference paged cache with TriAttention eviction and NVFP4
cold pages.

Qwen3-8B geometry (36 layers, 32 query / 8 KV heads, head_dim 128) with the real Qwen3-8B calibration shipped in
the package ("qwen3-8b"). Prefill, decode steps with
TriAttention rounds (selection + in-place compaction), then the finished requests' pages go to the host tier
through NVFP4 and come back. Presets: `tiny` (the CPU default) and `gpu` (the CUDA default).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
import triton

from ._files import writable_target, write_whole
from .cache import PagedKVCache
from .config import NVFP4ColdPageConfig, TriAttentionConfig
from .manager import Request, create_compression_manager
from .triattention import SHIPPED

CALIBRATION = "qwen3-8b"  # shipped with kvops (kvops.triattention.SHIPPED)
MODEL = SHIPPED[CALIBRATION].model_config
L, HKV, D = MODEL["num_hidden_layers"], MODEL["num_key_value_heads"], MODEL["head_dim"]
PRESETS = {  # requests, prompt, decode steps, budget, beta, page size
    "tiny": dict(requests=2, prompt=48, steps=80, budget=32, beta=16, page_size=16),
    "gpu": dict(requests=8, prompt=1024, steps=1536, budget=1024, beta=128, page_size=32),
}


def _kv(n: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.randn(n, HKV, D, device=device)
    k = k.sign() * torch.exp(torch.randn_like(k) * 0.7)  # heavy-tailed K with outlier channels, small V
    k[..., :8] *= 8
    return k.to(dtype), (torch.randn(n, HKV, D, device=device) * 0.05).to(dtype)


def run(preset: str = "tiny", device: str | None = None, dtype: torch.dtype = torch.bfloat16, log=print) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    p = PRESETS[preset]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cal_note = f"real Qwen3-8B statistics (shipped: {CALIBRATION!r})"
    tri = TriAttentionConfig(budget=p["budget"], beta=p["beta"], calibration_path=CALIBRATION)
    nvfp4 = NVFP4ColdPageConfig(row_size=D)
    max_len = p["prompt"] + tri.budget + 2 * tri.beta + 16
    pages_per = triton.cdiv(max_len, p["page_size"])
    cache = PagedKVCache(L, HKV, D, p["page_size"], num_pages=p["requests"] * pages_per + 4,
                         host_slots=p["requests"] * pages_per, dtype=dtype, device=device,
                         codec_specs=[nvfp4.row_spec()] * L)
    manager = create_compression_manager(tri, cache, MODEL)
    log(f"kvops demo ({preset}) on {device}: Qwen3-8B geometry, {p['requests']} requests, prompt {p['prompt']}, "
        f"{p['steps']} decode steps, budget {tri.budget}, beta {tri.beta}; calibration: {cal_note}")
    rids = list(range(p["requests"]))
    for rid in rids:
        cache.add_request(rid)
        manager.on_request_init(Request(rid, p["prompt"]))
        cache.append(rid, *_kv(p["prompt"], device, dtype))
    manager.on_context_step_end([Request(r, p["prompt"]) for r in rids])
    token_bytes = L * 2 * HKV * D * dtype.itemsize
    generated, round_seconds = 0, []
    for step in range(p["steps"]):
        manager.on_generation_step_begin(rids)
        for rid in rids:
            cache.append(rid, *_kv(1, device, dtype))
        generated += len(rids)
        rounds, held = manager.rounds, [cache.length(r) for r in rids]
        sync()
        t0 = time.perf_counter()
        manager.on_generation_step_end([(rid, 1) for rid in rids])
        sync()
        if manager.rounds > rounds:
            round_seconds.append(time.perf_counter() - t0)
            log(f"  step {step + 1}: eviction round {manager.rounds}: tokens held per request {held} before, "
                f"{[cache.length(r) for r in rids]} after (the prompt's {p['prompt']} are always kept)")
    kv_without = sum(p["prompt"] for _ in rids) * token_bytes + generated * token_bytes
    kv_with = sum(cache.length(r) for r in rids) * token_bytes
    snapshot = {r: cache.read(r) for r in rids}  # in the pool dtype: float64 copies of 8 x 2k tokens need 10 GB
    sync()
    t0 = time.perf_counter()
    for rid in rids:
        cache.offload(rid)
    sync()
    offload_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for rid in rids:
        cache.onboard(rid)
    sync()
    onboard_s = time.perf_counter() - t0
    diff_sq, ref_sq = [0.0, 0.0], [0.0, 0.0]  # per plane, accumulated request by request in float64
    for rid in rids:
        after = cache.read(rid)
        for plane in (0, 1):
            a, b = snapshot[rid][:, plane].double(), after[:, plane].double()
            diff_sq[plane] += float((a - b).pow(2).sum())
            ref_sq[plane] += float(a.pow(2).sum())
    err = {name: (diff_sq[plane] / ref_sq[plane]) ** 0.5 for plane, name in ((0, "K"), (1, "V"))}
    pages = sum(triton.cdiv(cache.length(r), p["page_size"]) for r in rids)
    cache.check_invariants()
    return {
        "preset": preset, "device": device, "dtype": str(dtype).replace("torch.", ""), "calibration": cal_note,
        "kv_bytes_without_eviction": kv_without, "kv_bytes_with_eviction": kv_with,
        "eviction_rounds": manager.rounds,
        "pages_freed_by_eviction": len(rids) * triton.cdiv(p["prompt"] + p["steps"], p["page_size"]) - pages,
        "hot_page_bytes": cache.codec.hot_page_bytes, "cold_page_bytes": cache.codec.cold_page_bytes,
        "offloaded_pages": pages, "codec_rel_rms_error": err,
        # the first round also pays the process's one-time costs (Triton's kernel cache, loading kernels, capturing
        # the round's CUDA graph on the GPU; the CuTe kernels come prebuilt); the steady state is the rest
        "ms_first_eviction_round": 1e3 * round_seconds[0] if round_seconds else 0.0,
        "ms_per_eviction_round": 1e3 * statistics.mean(round_seconds[1:] or round_seconds or [0.0]),
        "ms_offload": 1e3 * offload_s, "ms_onboard": 1e3 * onboard_s,
        "kernel_path": ("CUDA: NVFP4 + compaction (CUDA C++), pack + mean phase + reduce (Triton), scorer + top-k "
                        "(CuTe DSL)" if device == "cuda"
                        else "CPU: kvops C++ kernels and torch"),
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="kvops demo", description=__doc__)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="tiny (CPU default) or gpu")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float8_e4m3fn"], default="bfloat16")
    ap.add_argument("--json", help="also write the summary to this file")
    a = ap.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is visible to torch")
    if a.json and writable_target(a.json):  # fail now, not after the run; nothing is created until the end
        ap.error(f"--json {a.json}: cannot write there: {writable_target(a.json)}")
    preset = a.preset or ("gpu" if device == "cuda" else "tiny")
    if preset == "gpu" and device == "cpu":
        print("kvops demo: the gpu preset on the CPU takes minutes (the tiny preset, the CPU's default, about 10 s)",
              file=sys.stderr, flush=True)
    r = run(preset, device, getattr(torch, a.dtype))
    hot, cold = r["hot_page_bytes"], r["cold_page_bytes"]
    rows = [
        ("KV bytes without eviction", f"{r['kv_bytes_without_eviction'] / 2**20:.1f} MiB"),
        ("KV bytes with TriAttention", f"{r['kv_bytes_with_eviction'] / 2**20:.1f} MiB "
                                       f"({r['eviction_rounds']} rounds)"),
        ("pages freed by eviction", str(r["pages_freed_by_eviction"])),
        ("cold page vs raw page", f"{cold} vs {hot} bytes ({hot / cold:.2f}x smaller)"),
        ("codec error (relative RMS)", f"K {r['codec_rel_rms_error']['K']:.4f}, V {r['codec_rel_rms_error']['V']:.4f}"),
        ("time per eviction round", f"{r['ms_per_eviction_round']:.1f} ms (the first: "
                                    f"{r['ms_first_eviction_round']:.1f} ms, one-time start-up included)"),
        ("offload / onboard", f"{r['ms_offload']:.1f} / {r['ms_onboard']:.1f} ms for {r['offloaded_pages']} pages"),
        ("kernel path", r["kernel_path"]),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows))
    if a.json:
        write_whole(a.json, lambda f: json.dump(r, f, indent=2), binary=False)
    return 0
